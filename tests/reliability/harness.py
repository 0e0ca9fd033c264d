"""Shared pieces of the reliability suite: sizes, figures, a fault-tolerant worker, waits.

* **Sizes**: every fault test has a CI size (real faults, short: the whole suite fits in a few
  minutes) and a soak size (``KMQ_SOAK=1``, ``make soak``: outages of tens of seconds, a
  million-marker backlog, many cycles). :func:`size` picks one.
* **Figures**: each fault test ends with :func:`report`, one line per run (lost,
  acked-then-redelivered, duplicates and their bound, recovery time, ...), printed, collected
  for the terminal summary (``conftest.py``), and appended as JSON to
  ``$KMQ_RELIABILITY_FIGURES`` when set.
* **ResilientWorker**: the crash-safety :class:`~integration.workload.Worker`, made to live
  through broker outages (fetch errors are retried) and stricter about acks: a reception
  counts as acked only once the broker acknowledged its ACK marker, so "acked, then
  redelivered" in the ledger really means the tracker redelivered something it knew was done.

The accounting itself is :class:`integration.workload.Ledger` (shared with the crash-safety
test): every produced message's fate from the queue topic (originals and the tracker's
copies) and the worker's receptions.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError
from integration.engine_support import Seen, consumer, high_watermarks
from integration.workload import Ledger, Reception, Worker, message_index
from support.broker import topic_partition_ids

from tracker.client import KmqMessage
from tracker.errors import KmqError
from tracker.ids import MessageId
from tracker.store import Store, StoreUnavailable

T = TypeVar("T")

SOAK_ENV = "KMQ_SOAK"
FIGURES_ENV = "KMQ_RELIABILITY_FIGURES"

#: ``KMQ_SOAK=1`` (``make soak``): the long versions of every fault test.
SOAK = os.environ.get(SOAK_ENV, "").strip().lower() not in ("", "0", "false", "no")
MODE = "soak" if SOAK else "ci"


def size(ci: T, soak: T) -> T:
    """The CI value, or the soak value under ``KMQ_SOAK=1``."""
    return soak if SOAK else ci


# -- figures ------------------------------------------------------------------------------------


@dataclass
class Figures:
    """What one fault run shows; ``line()`` is the one-line summary."""

    test: str
    lost: int
    acked_then_redelivered: int
    duplicates: int  #: extra copies of one (origin, attempt) made by the tracker
    duplicate_bound: int  #: what at-least-once allows for this run
    recovery_s: float | None  #: fault over -> everything applied / redelivered again
    produced: int = 0
    copies: int = 0
    duplicate_deliveries: int = 0  #: same (origin, attempt) handed to the worker twice
    seconds: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)
    mode: str = MODE

    def line(self) -> str:
        recovery = f"{self.recovery_s:.1f}s" if self.recovery_s is not None else "-"
        extra = ", ".join(f"{k} {_fmt(v)}" for k, v in self.detail.items())
        return (
            f"[{self.mode}] {self.test}: lost {self.lost}, acked-then-redelivered "
            f"{self.acked_then_redelivered}, duplicates {self.duplicates} (bound "
            f"{self.duplicate_bound}), duplicate deliveries {self.duplicate_deliveries}, "
            f"produced {self.produced}, copies {self.copies}, recovery {recovery}, "
            f"run {self.seconds:.0f}s" + (f"; {extra}" if extra else "")
        )


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


#: Every figure reported in this session (printed again in the terminal summary).
FIGURES: list[Figures] = []


def report(figures: Figures) -> Figures:
    """Print the one-line summary, keep it for the session summary, append it as JSON."""
    FIGURES.append(figures)
    print(f"\n{figures.line()}")
    target = os.environ.get(FIGURES_ENV, "").strip()
    if target:
        path = Path(target)
        path.parent.mkdir(parents=True, exist_ok=True)
        record = asdict(figures) | {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        with path.open("a") as out:
            out.write(json.dumps(record) + "\n")
    return figures


def ledger_figures(
    test: str,
    ledger: Ledger,
    worker: Worker,
    *,
    duplicate_bound: int,
    recovery_s: float | None,
    started: float,
    **detail: Any,
) -> Figures:
    """Figures of a workload run from its ledger."""
    return Figures(
        test=test,
        lost=len(ledger.never_acked()),
        acked_then_redelivered=len(ledger.acked_then_redelivered()),
        duplicates=sum(ledger.duplicates().values()),
        duplicate_bound=duplicate_bound,
        recovery_s=recovery_s,
        produced=len(ledger.sent),
        copies=sum(ledger.copies.values()),
        duplicate_deliveries=duplicate_deliveries(worker.received),
        seconds=time.monotonic() - started,
        detail=dict(detail),
    )


def duplicate_deliveries(received: Iterable[Reception]) -> int:
    """Receptions of an (origin, attempt) beyond the first (consumer-side re-reads)."""
    counts = Counter((r.origin, r.attempt) for r in received)
    return sum(n - 1 for n in counts.values() if n > 1)


def assert_accounted(ledger: Ledger, figures: Figures) -> None:
    """The suite's verdict: zero lost, zero acked-then-redelivered, duplicates in bound."""
    assert ledger.strangers() == [], f"copies of messages nobody sent: {ledger.strangers()[:10]}"
    assert ledger.never_acked() == [], f"lost (never acked): {ledger.never_acked()[:20]}"
    assert ledger.acked_then_redelivered() == [], (
        f"redelivered after an ack: {ledger.acked_then_redelivered()[:20]}"
    )
    assert figures.duplicates <= figures.duplicate_bound, (
        f"{figures.duplicates} duplicate copies, more than at-least-once allows here "
        f"({figures.duplicate_bound}): {sorted(ledger.duplicates().items())[:20]}"
    )


# -- waiting ------------------------------------------------------------------------------------


async def wait_until(
    check: Callable[[], Awaitable[bool] | bool],
    *,
    within: float,
    what: str,
    explain: Callable[[], Awaitable[str] | str] | None = None,
    every: float = 0.1,
) -> float:
    """Poll ``check`` until it holds; returns the seconds it took, fails after ``within``."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return loop.time() - started
        if loop.time() - started > within:
            details = ""
            if explain is not None:
                text = explain()
                details = "\n" + (text if isinstance(text, str) else await text)
            raise AssertionError(f"timed out after {within:.0f}s waiting for {what}{details}")
        await asyncio.sleep(every)


async def store_offsets(store: Store, markers: str) -> dict[int, int]:
    """``{markers partition: first offset not applied}`` from the store ({} if unreachable)."""
    try:
        offsets = await store.partition_offsets(markers)
    except StoreUnavailable:
        return {}
    return {p: next_offset for p, (_, next_offset) in offsets.items()}


async def all_markers_applied(store: Store, bootstrap: str, markers: str) -> bool:
    """Whether the store has applied every marker the markers topic holds right now."""
    ends = await high_watermarks(bootstrap, markers)
    applied = await store_offsets(store, markers)
    return all(applied.get(p, -1) >= end for p, end in ends.items() if end)


async def group_entries(store: Store, group: str) -> list[Any]:
    """The tracked entries of consumer group ``group`` ([] while the store is unreachable)."""
    try:
        entries = await store.list_entries(limit=1_000_000, group=group)
    except StoreUnavailable:
        return [None]  # unknown counts as "not empty"
    return list(entries)


async def wait_settled(
    *,
    store: Store,
    worker: Worker,
    sent: dict[MessageId, int],
    group: str,
    bootstrap: str,
    markers: str,
    within: float,
    alive: Callable[[], None] = lambda: None,
    explain: Callable[[], Awaitable[str] | str] | None = None,
) -> float:
    """Every sent message acked, every marker applied, nothing tracked for ``group``.

    ``alive()`` is called on every poll and raises if a process under test died.
    """

    def acked_all() -> bool:
        alive()
        worker.check_alive()
        acked = worker.acked_attempts()
        return all(acked.get(origin) for origin in sent)

    async def quiet() -> bool:
        alive()
        if not await all_markers_applied(store, bootstrap, markers):
            return False
        return await group_entries(store, group) == []

    async def status() -> str:
        acked = worker.acked_attempts()
        missing = [o for o in sent if not acked.get(o)]
        entries = await group_entries(store, group)
        text = (
            f"{len(missing)} of {len(sent)} not acked yet (e.g. {missing[:5]}); "
            f"{len(entries)} entries tracked (e.g. {entries[:3]}); "
            f"store offsets {await store_offsets(store, markers)}; "
            f"markers end {await high_watermarks(bootstrap, markers)}"
        )
        if explain is not None:
            more = explain()
            text += "\n" + (more if isinstance(more, str) else await more)
        return text

    loop = asyncio.get_running_loop()
    started = loop.time()
    await wait_until(acked_all, within=within, what="every message acked", explain=status)
    left = max(5.0, within - (loop.time() - started))
    await wait_until(
        quiet, within=left, what="every marker applied, no entry left", explain=status, every=0.3
    )
    return loop.time() - started


async def read_topic(bootstrap: str, topic: str, within: float = 60.0) -> list[Seen]:
    """Every record of ``topic``, read from the beginning to the high watermarks."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        partitions = await topic_partition_ids(bootstrap, topic, within=within)
        tps = [TopicPartition(topic, p) for p in partitions]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        out: list[Seen] = []
        while True:
            batch = await consumer.getmany(timeout_ms=300, max_records=50_000)
            for records in batch.values():
                out.extend(
                    Seen(
                        r.topic,
                        r.partition,
                        r.offset,
                        r.timestamp,
                        r.key,
                        r.value,
                        tuple(r.headers),
                    )
                    for r in records
                )
            marks = [consumer.highwater(tp) for tp in tps]
            positions = [await consumer.position(tp) for tp in tps]
            if None not in marks and positions == marks:
                return out
            assert loop.time() < deadline, f"could not read {topic} to its end"
    finally:
        await consumer.stop()


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One record for :func:`produce_bulk`."""

    topic: str
    value: bytes | None
    key: bytes | None = None
    partition: int | None = None
    timestamp_ms: int | None = None


async def produce_bulk(
    bootstrap: str, records: Iterable[Outgoing], *, chunk: int = 20_000
) -> list[tuple[int, int]]:
    """Produce many records fast (``acks=all``); returns each one's (partition, offset)."""
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        acks="all",
        linger_ms=20,
        max_batch_size=1_048_576,
        request_timeout_ms=120_000,
    )
    await producer.start()
    out: list[tuple[int, int]] = []
    try:
        pending: list[asyncio.Future[Any]] = []

        async def settle() -> None:
            for future in pending:
                metadata = await future
                out.append((metadata.partition, metadata.offset))
            pending.clear()

        for r in records:
            pending.append(
                await producer.send(
                    r.topic,
                    value=r.value,
                    key=r.key,
                    partition=r.partition,
                    timestamp_ms=r.timestamp_ms,
                )
            )
            if len(pending) >= chunk:
                await settle()
        await settle()
    finally:
        await producer.stop()
    return out


def metric(registry_owner: Any, name: str, labels: dict[str, str] | None = None) -> float:
    """A sample of a tracker's Prometheus registry (0 when absent)."""
    value = registry_owner.metrics.registry.get_sample_value(name, labels or {})
    return float(value or 0.0)


# -- the worker ---------------------------------------------------------------------------------


class ResilientWorker(Worker):
    """A :class:`Worker` that survives broker outages and counts only confirmed acks.

    * A failed fetch (markers not acknowledged, broker unreachable) is retried: the client
      already rewound, so the batch is read again;
    * acks are sent with ``wait=True`` (all of a batch at once): a reception is recorded as
      acked only if the broker acknowledged the ACK marker. An ACK that failed leaves the
      message to the tracker, which must redeliver it: that is at-least-once, not a bug.
    """

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        group: str,
        markers: str,
        should_ack: Callable[[KmqMessage], bool],
        *,
        processing_timeout: timedelta | None = None,
        consumer_config: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(
            bootstrap, topic, group, markers, should_ack, processing_timeout=processing_timeout
        )
        self._consumer_config = consumer_config
        self.fetch_errors = 0
        self.ack_errors = 0
        self.last_error: str | None = None

    async def _run(self) -> None:
        bootstrap, topic, group, markers = self._args
        kw: dict[str, Any] = {"processing_timeout": self._timeout}
        if self._consumer_config is not None:
            kw["consumer_config"] = dict(self._consumer_config)
        async with consumer(bootstrap, topic, group, markers, **kw) as c:
            self._joined.set()
            while not self._stop.is_set():
                try:
                    messages = await c.getmany(timedelta(milliseconds=200))
                except (KmqError, KafkaError) as exc:
                    self.fetch_errors += 1
                    self.last_error = repr(exc)
                    await asyncio.sleep(0.2)
                    continue
                await self._settle(messages)
            try:
                await c.flush()
            except (KmqError, KafkaError) as exc:
                self.last_error = repr(exc)

    async def _settle(self, messages: Sequence[KmqMessage]) -> None:
        decided = [(m, self._should_ack(m)) for m in messages]
        to_ack = [m for m, ack in decided if ack]
        results = await asyncio.gather(*(m.ack(wait=True) for m in to_ack), return_exceptions=True)
        failed = {
            id(m) for m, r in zip(to_ack, results, strict=True) if isinstance(r, BaseException)
        }
        self.ack_errors += len(failed)
        now = time.time()
        for m, ack in decided:
            self.received.append(
                Reception(
                    m.id, m.origin, m.attempt, message_index(m), ack and id(m) not in failed, now
                )
            )


def copies_by_origin(ledger: Ledger) -> dict[MessageId, list[int]]:
    """``origin -> attempts of its copies`` (sorted), for assertions and explanations."""
    out: dict[MessageId, list[int]] = {}
    for (origin, attempt), n in ledger.copies.items():
        out.setdefault(origin, []).extend([attempt] * n)
    return {k: sorted(v) for k, v in out.items()}
