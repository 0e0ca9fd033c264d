"""Offset ranges: what a job reads, resolved once on the driver.

A job reads a *snapshot*: for every Kafka partition a half-open range ``[start, end)`` fixed
before any executor starts. That is what makes a run reproducible (a DataFrame reused by two
actions reads the same records), lets an incremental run resume exactly where the previous
one ended, and lets the reader split one partition into slices without ever reading a record
twice or skipping one.

Bounds come from offsets (``earliest``, ``latest``, one offset for every partition, or
``partition:offset`` pairs) or from timestamps, which are turned into offsets here with
``offsets_for_times`` (the first record at or after the time). The end of a partition is a
fetch response's high watermark, through :class:`tracker.kafka.scan.PartitionScanner`:
ListOffsets cannot be trusted on every broker (tansu answers short after batched produces).
Brokers disagree on "no record at or after this time" (Kafka: ``None``; tansu: offset 0 with
timestamp -1); both mean "the end".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from tracker.clock import to_millis
from tracker.kafka.originals import RESERVED_CLIENT_KEYS
from tracker.kafka.scan import PartitionScanner

T = TypeVar("T")


class OffsetsError(Exception):
    """A bound cannot be resolved (unknown topic, broker unreachable, bad syntax)."""


@dataclass(frozen=True, slots=True, order=True)
class OffsetRange:
    """Records ``start <= offset < end`` of one Kafka partition."""

    topic: str
    partition: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return max(0, self.end - self.start)

    def to_json(self) -> list[Any]:
        return [self.topic, self.partition, self.start, self.end]

    @classmethod
    def from_json(cls, item: Sequence[Any]) -> OffsetRange:
        topic, partition, start, end = item
        return cls(str(topic), int(partition), int(start), int(end))


def ranges_to_json(ranges: Iterable[OffsetRange]) -> str:
    return json.dumps([r.to_json() for r in ranges])


def ranges_from_json(text: str) -> list[OffsetRange]:
    return [OffsetRange.from_json(item) for item in json.loads(text)]


def split_ranges(ranges: Iterable[OffsetRange], chunk: int) -> list[OffsetRange]:
    """Cut every range into consecutive slices of at most ``chunk`` offsets.

    The slices of one range tile it exactly (each starts where the previous ended), so no
    offset is in two slices and none is in none. Empty ranges produce no slice.
    """
    if chunk <= 0:
        raise ValueError("chunk must be positive")
    out: list[OffsetRange] = []
    for r in ranges:
        start = r.start
        while start < r.end:
            end = min(r.end, start + chunk)
            out.append(OffsetRange(r.topic, r.partition, start, end))
            start = end
    return out


@dataclass(frozen=True, slots=True)
class Bound:
    """One side of a read: ``earliest``/``latest``, offsets, or a time.

    ``offsets`` maps a partition to an offset; ``default`` applies to partitions not in it.
    """

    kind: str  # "earliest" | "latest" | "offsets" | "time"
    offsets: Mapping[int, int] | None = None
    default: int | None = None
    time: datetime | None = None

    @classmethod
    def earliest(cls) -> Bound:
        return cls("earliest")

    @classmethod
    def latest(cls) -> Bound:
        return cls("latest")

    @classmethod
    def at_time(cls, when: datetime) -> Bound:
        if when.tzinfo is None or when.utcoffset() is None:
            raise OffsetsError(f"{when.isoformat()} has no time zone")
        return cls("time", time=when)

    @classmethod
    def at_offsets(
        cls, offsets: Mapping[int, int] | None = None, default: int | None = None
    ) -> Bound:
        return cls("offsets", offsets=dict(offsets or {}), default=default)

    @classmethod
    def parse(cls, text: str) -> Bound:
        """``earliest``, ``latest``, ``1234`` (every partition), ``0:10,3:99`` or an ISO time.

        Partitions not named in a ``partition:offset`` list are read from the earliest
        offset (as a start) or to the end (as an end).
        """
        text = text.strip()
        if text in {"earliest", "latest"}:
            return cls(text)
        if re.fullmatch(r"\d+", text):
            return cls.at_offsets(default=int(text))
        if re.fullmatch(r"\d+:\d+(,\d+:\d+)*", text):
            pairs = (item.split(":") for item in text.split(","))
            return cls.at_offsets({int(p): int(o) for p, o in pairs})
        try:
            when = datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            raise OffsetsError(
                f"{text!r} is not earliest, latest, an offset, partition:offset pairs "
                "or an ISO 8601 time"
            ) from None
        return cls.at_time(when)


def run_coroutine(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine from synchronous code, even when the caller runs an event loop.

    The driver-side jobs are synchronous (Spark is), but they are also called from async
    code (tests, the tracker's own CLI); ``asyncio.run`` refuses a running loop, so the
    coroutine then gets its own loop in a worker thread.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(factory())
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(factory())).result()


def client_options(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """aiokafka keyword arguments from user config, without the ones the reader sets."""
    return {k: v for k, v in (config or {}).items() if k not in RESERVED_CLIENT_KEYS}


async def _times_to_offsets(
    bootstrap: str,
    config: Mapping[str, Any],
    targets: Mapping[TopicPartition, int],
    ends: Mapping[TopicPartition, int],
    within: float,
) -> dict[TopicPartition, int]:
    if not targets:
        return {}
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False, **config
    )
    try:
        async with asyncio.timeout(within):
            await consumer.start()
            found = await consumer.offsets_for_times(dict(targets))
    finally:
        await consumer.stop()
    out: dict[TopicPartition, int] = {}
    for tp in targets:
        hit = found.get(tp)
        # Kafka: None when no record is at or after the time; tansu: (0, -1).
        out[tp] = ends[tp] if hit is None or hit.timestamp < 0 else min(hit.offset, ends[tp])
    return out


def _offset_for(bound: Bound, tp: TopicPartition, begin: int, end: int, *, is_start: bool) -> int:
    if bound.kind == "earliest":
        return begin
    if bound.kind == "latest":
        return end
    offsets = bound.offsets or {}
    value = offsets.get(tp.partition, bound.default)
    if value is None:
        return begin if is_start else end
    return value


async def resolve_ranges_async(
    bootstrap: str,
    topics: Sequence[str],
    *,
    start: Bound | None = None,
    end: Bound | None = None,
    resume: Mapping[tuple[str, int], int] | None = None,
    partitions: Iterable[int] | None = None,
    client_config: Mapping[str, Any] | None = None,
    missing_ok: bool = False,
    within: float = 30.0,
) -> list[OffsetRange]:
    """The ``[start, end)`` of every partition of ``topics`` (see the module docstring).

    ``resume`` (``(topic, partition) -> next offset``, from a previous run) overrides
    ``start`` where present. Offsets are clamped into ``[log start, high watermark]`` so a
    range never asks for records that are gone or do not exist yet. A topic that does not
    exist raises :class:`OffsetsError`, or is skipped with ``missing_ok``; it is never created.
    """
    start = start or Bound.earliest()
    end = end or Bound.latest()
    config = client_options(client_config)
    scanner = PartitionScanner(bootstrap, client_config=config, timeout=within)
    try:
        try:
            counts = await scanner.partition_counts(topics)
        except Exception as exc:
            raise OffsetsError(f"cannot read the metadata of {list(topics)}: {exc}") from exc
        wanted = set(partitions) if partitions is not None else None
        tps: list[TopicPartition] = []
        for topic in topics:
            count = counts.get(topic)
            if count is None:
                if missing_ok:
                    continue
                raise OffsetsError(f"topic {topic!r} does not exist")
            tps += [TopicPartition(topic, p) for p in range(count) if wanted is None or p in wanted]
        if not tps:
            return []
        try:
            bounds = await scanner.bounds(tps)
        except Exception as exc:
            raise OffsetsError(f"cannot read the end offsets of {list(topics)}: {exc}") from exc
    finally:
        await scanner.stop()
    begins = {tp: b for tp, (b, _) in bounds.items()}
    ends = {tp: e for tp, (_, e) in bounds.items()}
    try:
        start_times = (
            await _times_to_offsets(
                bootstrap, config, dict.fromkeys(tps, to_millis(start.time)), ends, within
            )
            if start.kind == "time" and start.time is not None
            else {}
        )
        end_times = (
            await _times_to_offsets(
                bootstrap, config, dict.fromkeys(tps, to_millis(end.time)), ends, within
            )
            if end.kind == "time" and end.time is not None
            else {}
        )
    except (KafkaError, TimeoutError, OSError) as exc:
        raise OffsetsError(f"cannot look up offsets by time in {list(topics)}: {exc!r}") from exc
    out: list[OffsetRange] = []
    for tp in tps:
        begin, high = begins[tp], ends[tp]
        if resume is not None and (tp.topic, tp.partition) in resume:
            lo = resume[(tp.topic, tp.partition)]
        elif tp in start_times:
            lo = start_times[tp]
        else:
            lo = _offset_for(start, tp, begin, high, is_start=True)
        hi = end_times[tp] if tp in end_times else _offset_for(end, tp, begin, high, is_start=False)
        lo = min(max(lo, begin), high)
        hi = min(max(hi, lo), high)
        out.append(OffsetRange(tp.topic, tp.partition, lo, hi))
    return sorted(out)


def resolve_ranges(bootstrap: str, topics: Sequence[str], **kwargs: Any) -> list[OffsetRange]:
    """Synchronous :func:`resolve_ranges_async` (for the driver and the data source planner)."""
    return run_coroutine(lambda: resolve_ranges_async(bootstrap, topics, **kwargs))


async def _existing_topics(
    bootstrap: str, topics: Sequence[str], config: Mapping[str, Any], within: float
) -> dict[str, int | None]:
    scanner = PartitionScanner(bootstrap, client_config=config, timeout=within)
    try:
        return await scanner.partition_counts(topics)
    finally:
        await scanner.stop()


def existing_topics(
    bootstrap: str,
    topics: Sequence[str],
    client_config: Mapping[str, Any] | None = None,
    timeout: float = 30.0,
) -> list[str]:
    """Those of ``topics`` that exist (asked without creating any), in the given order."""
    if not topics:
        return []
    config = client_options(client_config)
    try:
        counts = run_coroutine(lambda: _existing_topics(bootstrap, topics, config, timeout))
    except Exception as exc:
        raise OffsetsError(f"cannot read the cluster metadata: {exc}") from exc
    return [t for t in topics if counts.get(t)]
