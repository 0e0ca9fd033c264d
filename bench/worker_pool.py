"""Scenario 6: ``KmqConsumer.run``'s worker pool vs one plain aiokafka consumer per partition.

The set-up of the published Kafka share-group measurement: a topic of :data:`PARTITIONS`
partitions holding a backlog of small (:data:`MESSAGE_BYTES` B) records, produced once; a handler
that does nothing but ``await asyncio.sleep(h)``.

* **kmq**: one ``KmqConsumer`` (range markers, ``processing_timeout=30 s``) running
  ``consumer.run(handler, concurrency=c)`` for each handler time ``h`` and concurrency ``c``.
  The ideal is ``c / h`` messages per second.
* **Baseline**: what a classic consumer group can do with the same partitions: one
  ``AIOKafkaConsumer`` per partition, all in one group in this process, each handling its
  records one at a time with the same handler and committing after each batch. Its ideal is
  ``partitions / h``, whatever the number of workers one would like.
* **CPU-bound maximum**: ``run`` with a no-op handler (``await asyncio.sleep(0)``) at each
  concurrency: what one Python process gets through the client and the pool at all.
* **The event loop's own ceiling**: ``c`` tasks that do nothing but call the same handler in a
  loop, no Kafka, in this process, for each ``h`` and ``c`` (and for ``c`` = :data:`PARTITIONS`,
  what the plain consumers' four workers could reach). asyncio's default loop on Linux waits in
  ``epoll_wait``, whose timeout is rounded *up* to the millisecond, and wakes every timer that
  fell due meanwhile in one batch, so ``asyncio.sleep(h)`` lasts longer the more sleepers share
  the loop (20 ms: about 20.5 ms with 4 sleepers, 21.0 ms with 32; 1 ms: 1.16 ms alone, 1.59
  ms with 32). No client on that loop can beat this ceiling; it says how much of the ideal's
  miss is the pool's and how much the loop's.

Each measurement uses a fresh group reading the backlog from the beginning. Throughput is
handler completions per second in a window of ``max(window_s, window_handlers * h)`` that opens
``warmup_s`` after the first completion (the group join and the pipeline's start are excluded).
During the window the bench records the CPU used by this process (the client and the pool: no
thread pool, the handlers are ``async``), by the broker (when it runs on this machine and can
be found) and by the whole machine. A cell is *CPU-bound* when this process used at least
:data:`CPU_BOUND_CORES` of a core (one Python thread cannot go faster), *machine-bound* when
the machine was at least :data:`MACHINE_BOUND` busy (the broker and the client share the
cores); a bound cell is reported against the ideal but not judged (the issue's target holds
"until CPU or the broker bounds it"). The handlers' own mean wall time is recorded too: on a
busy event loop ``asyncio.sleep(h)`` takes longer than ``h``, which no pool can make up for.

The tracker does not run here: the client only writes markers (the markers topic exists).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer

from tracker.client import KmqConsumer

from . import consumer_overhead
from .common import (
    FAST_GROUP,
    Figure,
    Infra,
    ScenarioResult,
    Stopwatch,
    create_topic,
    delete_topics,
    unique,
)

PARTITIONS = 4
MESSAGE_BYTES = 100
BATCH = 500  #: KmqConsumer's default max_batch; the plain consumers fetch as many
#: A run whose process used this much of a core in the window is CPU-bound.
CPU_BOUND_CORES = 0.9
#: A run during which the machine was this busy (all cores) is bound by the machine.
MACHINE_BOUND = 0.9
#: Targets (the issue): ratio to the ideal ``c / h`` where neither CPU nor broker bounds it,
#: and ratio to plain aiokafka at 20 ms from concurrency 32 on. The ratio to the event loop's
#: own ceiling is held to the same 0.9.
IDEAL_TARGET = 0.9
PLAIN_TARGET = 8.0
PLAIN_TARGET_HANDLER_MS = 20
PLAIN_TARGET_MIN_CONCURRENCY = 32
#: How long joining, stopping and the first completion may take before the run is called hung.
JOIN_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 60.0


# -- the backlog ------------------------------------------------------------------------------


async def fill_topic(bootstrap: str, topic: str, count: int) -> float:
    """Produce ``count`` records of :data:`MESSAGE_BYTES` round-robin over the partitions (as
    scenario 1 does); returns the produce rate (records/s)."""
    return await consumer_overhead.fill_topic(
        bootstrap, topic, count, MESSAGE_BYTES, partitions=PARTITIONS
    )


# -- CPU accounting ---------------------------------------------------------------------------


def _broker_pid(bootstrap: str) -> int | None:
    """The local broker's process (tansu, ``--listener-url tcp://<bootstrap>``), if any."""
    first = bootstrap.split(",", maxsplit=1)[0].strip()
    with contextlib.suppress(OSError):
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                args = (entry / "cmdline").read_bytes().split(b"\0")
                if b"--listener-url" in args and any(first.encode() in a for a in args):
                    return int(entry.name)
    return None


def _process_ticks(pid: int | None) -> float | None:
    """user + system CPU seconds of ``pid`` (None when it cannot be read)."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_ticks() -> tuple[float, float] | None:
    """(busy, total) jiffies of the whole machine since boot."""
    try:
        values = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return sum(values) - idle, sum(values)


@dataclasses.dataclass
class _Sample:
    at: float
    count: int
    busy_s: float  #: handler wall time summed, for the mean handler time
    cpu: float
    broker: float | None
    machine: tuple[float, float] | None


@dataclasses.dataclass
class Counter:
    """Handler completions, shared by the handler and the sampler."""

    count: int = 0
    busy_s: float = 0.0
    first: asyncio.Future[float] | None = None

    def make_handler(self, handler_s: float) -> Callable[[Any], Awaitable[None]]:
        """The handler under test: ``await asyncio.sleep(handler_s)``, then count."""
        loop = asyncio.get_running_loop()
        self.first = first = loop.create_future()
        clock = time.perf_counter
        sleep = asyncio.sleep

        async def handler(_message: Any) -> None:
            started = clock()
            await sleep(handler_s)
            ended = clock()
            self.count += 1
            self.busy_s += ended - started
            if not first.done():
                first.set_result(ended)

        return handler

    def sample(self, broker_pid: int | None) -> _Sample:
        return _Sample(
            time.perf_counter(),
            self.count,
            self.busy_s,
            time.process_time(),
            _process_ticks(broker_pid),
            _machine_ticks(),
        )


async def _measure(
    counter: Counter,
    *,
    warmup_s: float,
    window_s: float,
    broker_pid: int | None,
    watch: Callable[[], None],
) -> dict[str, Any]:
    """Wait for the first completion, skip ``warmup_s``, count for ``window_s``.

    ``watch`` raises if the run under test has died (checked while waiting).
    """
    assert counter.first is not None
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while not counter.first.done():
        watch()
        if time.monotonic() > deadline:
            raise TimeoutError(f"no handler completed within {JOIN_TIMEOUT_S:.0f} s")
        await asyncio.wait({counter.first}, timeout=0.1)
    first = counter.first.result()
    await asyncio.sleep(max(0.0, first + warmup_s - time.perf_counter()))
    watch()
    start = counter.sample(broker_pid)
    await asyncio.sleep(window_s)
    end = counter.sample(broker_pid)
    watch()
    seconds = end.at - start.at
    handled = end.count - start.count
    cpu = end.cpu - start.cpu
    out: dict[str, Any] = {
        "rate": handled / seconds,
        "handled": handled,
        "seconds": seconds,
        "handled_total": end.count,
        "client_cores": cpu / seconds,
        "cpu_us_per_msg": cpu / handled * 1e6 if handled else None,
        "mean_handler_ms": (end.busy_s - start.busy_s) / handled * 1000 if handled else None,
        "broker_cores": None,
        "machine_busy": None,
    }
    if start.broker is not None and end.broker is not None:
        out["broker_cores"] = (end.broker - start.broker) / seconds
    if start.machine is not None and end.machine is not None:
        busy = end.machine[0] - start.machine[0]
        total = end.machine[1] - start.machine[1]
        out["machine_busy"] = busy / total if total else None
    return out


# -- the two consumers ------------------------------------------------------------------------


async def kmq_run(
    bootstrap: str,
    topic: str,
    markers: str,
    *,
    handler_s: float,
    concurrency: int,
    warmup_s: float,
    window_s: float,
    broker_pid: int | None,
) -> dict[str, Any]:
    """One ``KmqConsumer.run(handler, concurrency=c)`` on a fresh group."""
    consumer = KmqConsumer(
        topic,
        group_id=unique("wp-kmq"),
        bootstrap_servers=bootstrap,
        markers_topic=markers,
        processing_timeout=timedelta(seconds=30),
        consumer_config=dict(FAST_GROUP),
    )
    counter = Counter()
    handler = counter.make_handler(handler_s)
    await consumer.start()
    # The pool holds up to 2 * max(c, max_batch) messages: no point waiting for them to
    # finish (at 200 ms one at a time that would be minutes); they go back to the tracker.
    task = asyncio.create_task(
        consumer.run(handler, concurrency=concurrency, drain_timeout=timedelta(0))
    )

    def watch() -> None:
        if task.done():
            task.result()  # raises what run() raised
            raise RuntimeError("KmqConsumer.run returned before stop()")

    try:
        figures = await _measure(
            counter, warmup_s=warmup_s, window_s=window_s, broker_pid=broker_pid, watch=watch
        )
    finally:
        stopping = Stopwatch()
        try:
            await asyncio.wait_for(consumer.stop(), STOP_TIMEOUT_S)
        except TimeoutError:
            task.cancel()
            raise TimeoutError(
                f"KmqConsumer.stop() did not return within {STOP_TIMEOUT_S:.0f} s "
                f"(run task done: {task.done()})"
            ) from None
        stats = await asyncio.wait_for(task, STOP_TIMEOUT_S)
    figures["stop_s"] = stopping.seconds
    figures["stats"] = dataclasses.asdict(stats)
    return figures


async def plain_run(
    bootstrap: str,
    topic: str,
    *,
    handler_s: float,
    warmup_s: float,
    window_s: float,
    broker_pid: int | None,
) -> dict[str, Any]:
    """One plain ``AIOKafkaConsumer`` per partition, in one fresh group, in this process."""
    group = unique("wp-plain")
    consumers = [
        AIOKafkaConsumer(
            topic,
            bootstrap_servers=bootstrap,
            group_id=group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            **FAST_GROUP,
        )
        for _ in range(PARTITIONS)
    ]
    await asyncio.gather(*(c.start() for c in consumers))
    tasks: list[asyncio.Task[None]] = []
    try:
        # Handle nothing before each member owns one partition: a member that is revoked
        # mid-batch would go on with records its successor reads again (counted twice).
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while sorted(len(c.assignment()) for c in consumers) != [1] * PARTITIONS:
            if time.monotonic() > deadline:
                raise TimeoutError("the plain consumers did not get one partition each")
            await asyncio.sleep(0.05)
        assigned = [sorted(tp.partition for tp in c.assignment()) for c in consumers]
        counter = Counter()
        handler = counter.make_handler(handler_s)

        async def consume(consumer: AIOKafkaConsumer) -> None:
            while True:
                fetched = await consumer.getmany(timeout_ms=500, max_records=BATCH)
                for records in fetched.values():
                    for record in records:
                        await handler(record)
                if fetched:
                    await consumer.commit()

        tasks = [asyncio.create_task(consume(c)) for c in consumers]
        figures = await _measure(
            counter,
            warmup_s=warmup_s,
            window_s=window_s,
            broker_pid=broker_pid,
            watch=functools.partial(_raise_if_ended, tasks),
        )
        figures["rebalanced"] = assigned != [
            sorted(tp.partition for tp in c.assignment()) for c in consumers
        ]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(c.stop() for c in consumers), return_exceptions=True)
    return figures


# -- the scenario -----------------------------------------------------------------------------


async def loop_run(
    *, handler_s: float, concurrency: int, warmup_s: float, window_s: float
) -> dict[str, Any]:
    """The event loop's own ceiling: ``concurrency`` tasks calling the handler back to back.

    The same handler and the same measurement as the runs with Kafka, with nothing else on the
    loop: the most any client could get from ``concurrency`` workers on this loop.
    """
    counter = Counter()
    handler = counter.make_handler(handler_s)

    async def work() -> None:
        while True:
            await handler(None)

    tasks = [asyncio.create_task(work()) for _ in range(concurrency)]
    try:
        return await _measure(
            counter,
            warmup_s=warmup_s,
            window_s=window_s,
            broker_pid=None,
            watch=functools.partial(_raise_if_ended, tasks),
        )
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _raise_if_ended(tasks: list[asyncio.Task[None]]) -> None:
    """A ``watch`` for :func:`_measure`: raise what a task that should run forever raised."""
    for task in tasks:
        if task.done():
            task.result()


def _window(handler_s: float, window_s: float, window_handlers: float) -> float:
    return max(window_s, window_handlers * handler_s)


def _tasks(count: int) -> str:
    return "1 task" if count == 1 else f"{count} tasks"


def _bound(run: dict[str, Any]) -> str | None:
    """Why a run could not reach its ideal, if the machine says so."""
    if run["client_cores"] >= CPU_BOUND_CORES:
        return "cpu"
    busy = run.get("machine_busy")
    if busy is not None and busy >= MACHINE_BOUND:
        return "machine"
    return None


def _cpu_note(run: dict[str, Any]) -> str:
    parts = [f"client {run['client_cores']:.2f} cores"]
    if run.get("broker_cores") is not None:
        parts.append(f"broker {run['broker_cores']:.2f}")
    if run.get("machine_busy") is not None:
        parts.append(f"machine {run['machine_busy']:.0%} busy")
    if run.get("cpu_us_per_msg") is not None:
        parts.append(f"{run['cpu_us_per_msg']:.0f} us CPU/msg")
    return ", ".join(parts)


async def run(
    infra: Infra,
    *,
    handler_ms: tuple[float, ...] = (1, 20, 200),
    concurrency: tuple[int, ...] = (1, 8, 32, 128, 512),
    backlog: int = 800_000,
    warmup_s: float = 1.5,
    window_s: float = 4.0,
    window_handlers: float = 40.0,
    noop: bool = True,
    loop_ceiling: bool = True,
) -> ScenarioResult:
    result = ScenarioResult(
        "worker_pool", "6. Worker pool: KmqConsumer.run vs one aiokafka consumer per partition"
    )
    bootstrap = infra.bootstrap
    broker_pid = _broker_pid(bootstrap)
    topic = await create_topic(bootstrap, unique("bench-s6"), PARTITIONS)
    markers = await create_topic(bootstrap, unique("bench-s6-markers"), PARTITIONS)
    data: dict[str, Any] = {
        "partitions": PARTITIONS,
        "message_bytes": MESSAGE_BYTES,
        "backlog": backlog,
        "warmup_s": warmup_s,
        "broker_found": broker_pid is not None,
        "noop": {},
        "plain": {},
        "kmq": {},
        "loop": {},
    }
    result.data = data
    try:
        data["fill_rate"] = await fill_topic(bootstrap, topic, backlog)
        print(f"  backlog: {backlog:,} records at {data['fill_rate']:,.0f}/s", flush=True)
        if noop:
            for c in concurrency:
                data["noop"][str(c)] = found = await kmq_run(
                    bootstrap,
                    topic,
                    markers,
                    handler_s=0.0,
                    concurrency=c,
                    window_s=window_s,
                    warmup_s=warmup_s,
                    broker_pid=broker_pid,
                )
                print(f"  no-op x {c}: {found['rate']:,.0f}/s ({_cpu_note(found)})", flush=True)
        for h in handler_ms:
            h_s = h / 1000
            window = _window(h_s, window_s, window_handlers)
            data["plain"][f"{h:g}"] = await plain_run(
                bootstrap,
                topic,
                handler_s=h_s,
                window_s=window,
                warmup_s=warmup_s,
                broker_pid=broker_pid,
            )
            if loop_ceiling:
                loops: dict[str, Any] = {}
                data["loop"][f"{h:g}"] = loops
                for c in sorted({PARTITIONS, *concurrency}):
                    loops[str(c)] = found = await loop_run(
                        handler_s=h_s, concurrency=c, warmup_s=warmup_s, window_s=window
                    )
                    print(
                        f"  {h:g} ms x {c}, the loop alone: {found['rate']:,.0f}/s "
                        f"(handler {found['mean_handler_ms']:.3g} ms)",
                        flush=True,
                    )
            runs: dict[str, Any] = {}
            data["kmq"][f"{h:g}"] = runs
            for c in concurrency:
                runs[str(c)] = await kmq_run(
                    bootstrap,
                    topic,
                    markers,
                    handler_s=h_s,
                    concurrency=c,
                    window_s=window,
                    warmup_s=warmup_s,
                    broker_pid=broker_pid,
                )
                print(
                    f"  {h:g} ms x {c}: {runs[str(c)]['rate']:,.0f}/s "
                    f"(ideal {c / h_s:,.0f}/s; {_cpu_note(runs[str(c)])})",
                    flush=True,
                )
    finally:
        await delete_topics(bootstrap, [topic, markers])
    _figures(result, data, handler_ms, concurrency)
    return result


def _figures(
    result: ScenarioResult,
    data: dict[str, Any],
    handler_ms: tuple[float, ...],
    concurrency: tuple[int, ...],
) -> None:
    backlog = data["backlog"]
    noops = data["noop"]
    for c in concurrency:
        if str(c) in noops:
            found = noops[str(c)]
            found["bound"] = _bound(found)
            found["drained"] = found["handled_total"] >= 0.99 * backlog
            note = _cpu_note(found)
            if found["drained"]:
                note += "; BACKLOG RAN OUT: a lower bound"
            result.add(
                Figure(
                    f"no-op handler, concurrency {c}: throughput (the client's maximum)",
                    found["rate"],
                    "msg/s",
                    note=note,
                )
            )
    ceiling = max((r["rate"] for r in noops.values()), default=None)
    data["ceiling"] = ceiling
    for h in handler_ms:
        h_s = h / 1000
        plain = data["plain"][f"{h:g}"]
        plain["ideal"] = PARTITIONS / h_s
        plain["bound"] = _bound(plain)
        label = f"{h:g} ms"
        plain_notes = [f"{plain['rate']:,.1f} of {plain['ideal']:,.0f} msg/s", _cpu_note(plain)]
        if plain["mean_handler_ms"] is not None:
            plain_notes.append(f"handler {plain['mean_handler_ms']:.3g} ms")
        if plain.get("rebalanced"):
            plain_notes.append("REBALANCED during the run")
        result.add(
            Figure(
                f"{label}: plain aiokafka, {PARTITIONS} consumers: throughput / its ideal",
                plain["rate"] / plain["ideal"],
                "x",
                note="; ".join(plain_notes),
            )
        )
        for c in concurrency:
            run = data["kmq"][f"{h:g}"][str(c)]
            ideal = c / h_s
            run["ideal"] = ideal
            run["ratio_ideal"] = run["rate"] / ideal
            run["ratio_plain"] = run["rate"] / plain["rate"] if plain["rate"] else None
            run["bound"] = bound = _bound(run)
            run["drained"] = run["handled_total"] >= 0.99 * backlog
            name = f"{label}, concurrency {c}"
            notes = [_cpu_note(run)]
            if run["mean_handler_ms"] is not None:
                # The share of the slots' time spent inside the handler: what is left is
                # the pool's own latency (freeing a slot, starting the next handler).
                run["in_handler"] = run["rate"] * run["mean_handler_ms"] / 1000 / c
                notes.append(
                    f"handler {run['mean_handler_ms']:.3g} ms, "
                    f"{run['in_handler']:.0%} of the slots' time in it"
                )
            if run["drained"]:
                notes.append("BACKLOG RAN OUT: a lower bound")
            result.add(Figure(f"{name}: throughput", run["rate"], "msg/s", note="; ".join(notes)))
            if bound is None:
                ideal_note = f"ideal {ideal:,.0f} msg/s"
            else:
                what = "CPU-bound" if bound == "cpu" else "machine-bound"
                ideal_note = f"{what}, not judged: ideal {ideal:,.0f} msg/s"
                noop_c = noops.get(str(c))
                if noop_c is not None:
                    ideal_note += f"; {run['rate'] / noop_c['rate']:.2f}x of the no-op handler's"
            result.add(
                Figure(
                    f"{name}: / ideal (concurrency / handler time)",
                    run["ratio_ideal"],
                    "x",
                    IDEAL_TARGET if bound is None else None,
                    ">=",
                    note=ideal_note,
                )
            )
            loops = data.get("loop", {}).get(f"{h:g}", {})
            alone = loops.get(str(c))
            if alone is not None:
                run["ratio_loop"] = run["rate"] / alone["rate"]
                result.add(
                    Figure(
                        f"{name}: / the event loop's own ceiling ({_tasks(c)}, no Kafka)",
                        run["ratio_loop"],
                        "x",
                        IDEAL_TARGET if bound is None else None,
                        ">=",
                        note=(
                            f"the loop alone: {alone['rate']:,.0f} msg/s, "
                            f"handler {alone['mean_handler_ms']:.3g} ms"
                        ),
                    )
                )
            judged = h == PLAIN_TARGET_HANDLER_MS and c >= PLAIN_TARGET_MIN_CONCURRENCY
            plain_note = ""
            four = loops.get(str(PARTITIONS))
            if alone is not None and four is not None:
                # The most any client on this loop could show: c sleepers against 4.
                run["loop_ratio_plain"] = alone["rate"] / four["rate"]
                plain_note = (
                    f"the loop alone, {_tasks(c)} / {_tasks(PARTITIONS)}: "
                    f"{run['loop_ratio_plain']:.3g}x"
                )
            result.add(
                Figure(
                    f"{name}: / plain aiokafka ({PARTITIONS} consumers)",
                    run["ratio_plain"],
                    "x",
                    PLAIN_TARGET if judged else None,
                    ">=",
                    note=plain_note,
                )
            )
