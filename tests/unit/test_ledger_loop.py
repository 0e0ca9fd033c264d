"""``ledger --every``'s loop (pipeline.ledger_loop): when runs start, how failures and stop
requests end it. No Spark: the run is a function of the test's."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

import pytest

from pipeline.ledger_loop import LoopPolicy, LoopPolicyError, run_every, stop_on_signals


class RecordedStop(threading.Event):
    """A stop event whose waits return at once and are recorded (the test's own clock moves)."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.waits: list[float] = []
        self._clock = clock

    def wait(self, timeout: float | None = None) -> bool:
        assert timeout is not None
        self.waits.append(timeout)
        self._clock.now += timeout
        return self.is_set()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class CountedRun:
    """A run that counts its calls and then does ``then(call_number)``."""

    def __init__(self, then: Callable[[int], None]) -> None:
        self.calls = 0
        self._then = then

    def __call__(self) -> None:
        self.calls += 1
        self._then(self.calls)


def _never_fails(error: BaseException, in_a_row: int) -> None:
    raise AssertionError(f"no run should fail here: {error!r}")


def test_runs_start_every_interval_counted_from_each_start() -> None:
    clock = FakeClock()
    stop = RecordedStop(clock)
    durations = iter([2.0, 7.5, 12.0, 1.0])

    def run() -> None:
        clock.now += next(durations)

    outcome = run_every(run, LoopPolicy(10.0, runs=4), stop, on_failure=_never_fails, clock=clock)
    assert (outcome.runs, outcome.failures) == (4, 0)
    assert (outcome.gave_up, outcome.stopped) == (False, False)
    # The wait makes up the interval; a run longer than it is followed by the next at once;
    # after the last run there is no wait.
    assert stop.waits == [8.0, 2.5, 0.0]


def test_a_failed_run_is_reported_and_the_loop_goes_on() -> None:
    clock = FakeClock()
    stop = RecordedStop(clock)
    results = iter([OSError("broker away"), None, OSError("again"), OSError("and again"), None])
    reports: list[tuple[str, int]] = []

    def run() -> None:
        error = next(results)
        if error is not None:
            raise error

    def failed(error: BaseException, in_a_row: int) -> None:
        reports.append((str(error), in_a_row))

    outcome = run_every(run, LoopPolicy(1.0, runs=2), stop, on_failure=failed, clock=clock)
    assert reports == [("broker away", 1), ("again", 1), ("and again", 2)], "counts reset"
    assert (outcome.runs, outcome.failures, outcome.gave_up) == (2, 3, False)


def test_it_gives_up_after_max_failures_in_a_row() -> None:
    clock = FakeClock()
    stop = RecordedStop(clock)

    def unreachable(call: int) -> None:
        raise RuntimeError("storage unreachable")

    run = CountedRun(unreachable)
    outcome = run_every(
        run, LoopPolicy(5.0, max_failures=3), stop, on_failure=lambda e, n: None, clock=clock
    )
    assert (run.calls, outcome.runs, outcome.failures, outcome.gave_up) == (3, 0, 3, True)
    assert len(stop.waits) == 2, "no wait after the last failure"


def test_a_stop_during_a_run_ends_the_loop_after_it() -> None:
    clock = FakeClock()
    stop = RecordedStop(clock)

    def stop_at_the_second(call: int) -> None:
        if call == 2:
            stop.set()

    run = CountedRun(stop_at_the_second)
    outcome = run_every(run, LoopPolicy(3.0), stop, on_failure=_never_fails, clock=clock)
    assert (run.calls, outcome.runs, outcome.stopped) == (2, 2, True)


def test_keyboard_interrupt_is_not_a_failed_run() -> None:
    clock = FakeClock()
    stop = RecordedStop(clock)

    def run() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_every(run, LoopPolicy(1.0), stop, on_failure=_never_fails, clock=clock)


@pytest.mark.parametrize(
    ("every_s", "runs", "max_failures", "message"),
    [
        (0.0, None, 3, "every_s must be a positive interval"),
        (-1.0, None, 3, "every_s must be a positive interval"),
        (1.0, 0, 3, "runs must be at least 1"),
        (1.0, None, 0, "max_failures must be at least 1"),
    ],
)
def test_a_policy_that_cannot_run_is_refused(
    every_s: float, runs: int | None, max_failures: int, message: str
) -> None:
    """The error names the field (the CLI turns it into its flag: the end-to-end tests)."""
    with pytest.raises(LoopPolicyError, match=message) as refused:
        LoopPolicy(every_s, runs, max_failures)
    assert refused.value.field == message.split(maxsplit=1)[0]


def _signal_and_wait(number: signal.Signals) -> None:
    os.kill(os.getpid(), number)
    # The handler runs between bytecodes of the main thread (and interrupts a wait).
    threading.Event().wait(5)


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGINT])
def test_the_first_signal_asks_for_a_stop_the_second_interrupts(number: signal.Signals) -> None:
    before = {n: signal.getsignal(n) for n in (signal.SIGTERM, signal.SIGINT)}
    stop = threading.Event()
    with stop_on_signals(stop):
        os.kill(os.getpid(), number)
        assert stop.wait(5), "the first signal sets the stop event"
        with pytest.raises(KeyboardInterrupt):
            _signal_and_wait(number)
    assert {n: signal.getsignal(n) for n in before} == before, "the old handlers are back"


def test_off_the_main_thread_no_handler_is_installed() -> None:
    before = signal.getsignal(signal.SIGTERM)
    seen: list[object] = []

    def inside() -> None:
        with stop_on_signals(threading.Event()):
            seen.append(signal.getsignal(signal.SIGTERM))

    worker = threading.Thread(target=inside)
    worker.start()
    worker.join(5)
    assert seen == [before]


def test_a_signal_while_it_waits_ends_the_loop_at_once() -> None:
    stop = threading.Event()

    def signal_soon(call: int) -> None:
        # Sent from another thread, delivered to the main one while it waits for the next run.
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()

    run = CountedRun(signal_soon)
    started = time.monotonic()
    with stop_on_signals(stop):
        outcome = run_every(run, LoopPolicy(60.0), stop, on_failure=_never_fails)
    assert (run.calls, outcome.runs, outcome.stopped) == (1, 1, True)
    assert time.monotonic() - started < 10, "not the 60 s interval"


def test_the_second_signal_runs_the_handler_it_replaced_before_interrupting() -> None:
    called: list[int] = []

    def cancel_jobs(number: int, frame: FrameType | None) -> None:
        called.append(number)

    before = signal.signal(signal.SIGINT, cancel_jobs)
    try:
        stop = threading.Event()
        with stop_on_signals(stop):
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.wait(5)
            assert called == [], "the first signal only asks for a stop"
            with pytest.raises(KeyboardInterrupt):
                _signal_and_wait(signal.SIGINT)
        assert called == [signal.SIGINT]
        assert signal.getsignal(signal.SIGINT) is cancel_jobs
    finally:
        signal.signal(signal.SIGINT, before)
