"""Running the ledger job again and again in one Spark session: ``ledger --every``.

A scheduled job started afresh each time (cron, a Kubernetes CronJob) pays for a new JVM and
runs its plan cold: Spark's generated code and the JIT-compiled aggregations start from
nothing (the whole job measured 1.5 times slower cold than the same job again in the same
session, docs/pipeline.md). Kept running, the driver pays that once; each run is still the
same incremental, committed-by-its-record run, so stopping between runs or being killed
during one loses nothing (the next run reads the same offsets again).

Stopping: the first SIGTERM or SIGINT ends the loop after the run in progress (or at once
while it waits); a second one interrupts the run (``KeyboardInterrupt``, after PySpark's own
SIGINT handler, which cancels the running Spark jobs, where that is the handler it replaces),
which is safe for the same reason. A run that fails (Kafka or the storage unreachable) is
reported and the loop goes on at the next tick; after ``max_failures`` failed runs in a row it
gives up, so that an orchestrator sees the job fail rather than a loop that does nothing.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType


class LoopPolicyError(ValueError):
    """A ``LoopPolicy`` field that cannot run: ``field`` names it, so that a caller can say
    which of its own options it came from (the CLI names its flag)."""

    def __init__(self, field: str, requirement: str) -> None:
        super().__init__(f"{field} {requirement}")
        self.field = field
        self.requirement = requirement


@dataclass(frozen=True, slots=True)
class LoopPolicy:
    """How often a run starts, how many there are, how many failures in a row end the loop."""

    every_s: float  #: from one run's start to the next (at once if a run took longer)
    runs: int | None = None  #: stop after this many runs (None: until stopped)
    max_failures: int = 3

    def __post_init__(self) -> None:
        if self.every_s <= 0:
            raise LoopPolicyError("every_s", "must be a positive interval")
        if self.runs is not None and self.runs < 1:
            raise LoopPolicyError("runs", "must be at least 1")
        if self.max_failures < 1:
            raise LoopPolicyError("max_failures", "must be at least 1")


@dataclass(slots=True)
class LoopOutcome:
    """What the loop did."""

    runs: int = 0  #: runs that completed
    failures: int = 0  #: runs that failed, in all
    gave_up: bool = False  #: ended by ``max_failures`` failures in a row
    stopped: bool = False  #: ended by a stop request (a signal)


def run_every(
    run_once: Callable[[], None],
    policy: LoopPolicy,
    stop: threading.Event,
    *,
    on_failure: Callable[[BaseException, int], None],
    clock: Callable[[], float] = time.monotonic,
) -> LoopOutcome:
    """Call ``run_once`` every ``policy.every_s`` seconds until ``stop`` is set, ``policy.runs``
    runs completed, or ``policy.max_failures`` runs in a row raised.

    ``on_failure(error, failures_in_a_row)`` is told of each failed run. ``Exception`` only:
    ``KeyboardInterrupt`` and ``SystemExit`` end the loop as they would any program.
    """
    outcome = LoopOutcome()
    in_a_row = 0
    while not stop.is_set():
        began = clock()
        try:
            run_once()
        except Exception as exc:  # any run failure is reported, then retried
            in_a_row += 1
            outcome.failures += 1
            on_failure(exc, in_a_row)
            if in_a_row >= policy.max_failures:
                outcome.gave_up = True
                return outcome
        else:
            in_a_row = 0
            outcome.runs += 1
            if policy.runs is not None and outcome.runs >= policy.runs:
                return outcome
        stop.wait(max(0.0, policy.every_s - (clock() - began)))
    outcome.stopped = True
    return outcome


@contextlib.contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """While inside: the first SIGTERM/SIGINT sets ``stop``, a second raises
    ``KeyboardInterrupt`` (after calling the handler it replaced, if that is a function). The
    previous handlers are back afterwards.

    Outside the main thread (where Python cannot install handlers) it only yields.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    names = (signal.SIGTERM, signal.SIGINT)
    previous = {number: signal.getsignal(number) for number in names}
    asked = False

    def handle(number: int, frame: FrameType | None) -> None:
        nonlocal asked
        if asked:
            before = previous.get(signal.Signals(number))
            if callable(before):
                before(number, frame)  # PySpark's SIGINT handler: cancel the jobs, then raise
            raise KeyboardInterrupt
        asked = True
        # Not stop.set() here: the handler runs on the main thread, which may hold the
        # event's (non-reentrant) lock at that moment, inside stop.wait().
        threading.Thread(target=stop.set, name="kmq-ledger-stop", daemon=True).start()

    for number in names:
        signal.signal(number, handle)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
