"""The per-message reference model of range markers, shared by the pure and the store tests.

The reference is v1 itself: every range marker is, by definition (docs/protocol.md), one v1
marker per covered offset, and :func:`apply_marker` folds those message by message.
"""

from __future__ import annotations

from collections.abc import Iterable

from hypothesis import strategies as st

from tracker.domain.entries import Entry, apply_marker
from tracker.domain.policy import BackoffPolicy, ResolvedPolicy
from tracker.ids import MessageId
from tracker.protocol import AnyMarker, Marker
from tracker.protocol_v2 import RangeKind, RangeMarker

GROUP, TOPIC, PARTITION, MARKERS_PARTITION = "g", "orders", 2, 5
WINDOW = 24  #: offsets 0..WINDOW-1: small, so markers collide often
POLICY = ResolvedPolicy(
    processing_timeout_ms=30_000,
    backoff=BackoffPolicy(initial=1, multiplier=2, max=60, jitter=0),
    keep_payload_after_ms=3_600_000,
)


def policy(_: str) -> ResolvedPolicy:
    return POLICY


def as_v1(marker: AnyMarker) -> list[Marker]:
    """The v1 markers a marker stands for (docs/protocol.md, version 2 semantics)."""
    if isinstance(marker, Marker):
        return [marker]
    out = []
    for message in marker.messages():
        if marker.kind is RangeKind.RANGE_START:
            out.append(
                Marker.start(
                    marker.group, message, timeout_ms=marker.timeout_ms, consumer=marker.consumer
                )
            )
        elif marker.kind is RangeKind.RANGE_SETTLE:
            out.append(Marker.ack(marker.group, message))
        else:
            out.append(Marker.extend(marker.group, message, timeout_ms=marker.timeout_ms))
    return out


def reference(steps: Iterable[tuple[AnyMarker, int]]) -> dict[int, Entry]:
    entries: dict[int, Entry] = {}
    for marker, ref in steps:
        for single in as_v1(marker):
            offset = single.origin_offset
            after, _ = apply_marker(entries.get(offset), single, ref, MARKERS_PARTITION, policy)
            if after is None:
                entries.pop(offset, None)
            else:
                entries[offset] = after
    return entries


@st.composite
def range_markers(draw: st.DrawFn) -> RangeMarker:
    first = draw(st.integers(0, WINDOW - 1))
    last = draw(st.integers(first, min(WINDOW - 1, first + 15)))
    width = last - first + 1
    exceptions = draw(st.integers(0, (1 << width) - 2)) if draw(st.booleans()) else 0
    kind = draw(st.sampled_from(RangeKind))
    timeout = draw(st.sampled_from([0, 1_000, 5_000])) if kind is RangeKind.RANGE_START else 0
    if kind is RangeKind.RANGE_EXTEND:
        timeout = draw(st.sampled_from([1_000, 60_000]))
    consumer = draw(st.sampled_from(["c1", "c2"])) if kind is RangeKind.RANGE_START else ""
    return RangeMarker(kind, GROUP, TOPIC, PARTITION, first, last, exceptions, timeout, consumer)


@st.composite
def single_markers(draw: st.DrawFn) -> Marker:
    offset = draw(st.integers(0, WINDOW - 1))
    origin = MessageId(TOPIC, PARTITION, offset)
    attempt = draw(st.sampled_from([1, 1, 2, 3]))
    message = origin if attempt == 1 else MessageId(TOPIC, 0, 1000 + offset * 10 + attempt)
    named = None if attempt == 1 else origin
    kind = draw(st.sampled_from(["start", "ack", "delay", "extend", "reject"]))
    if kind == "start":
        return Marker.start(
            GROUP,
            message,
            attempt=attempt,
            origin=named,
            timeout_ms=draw(st.sampled_from([0, 2_000])),
        )
    if kind == "ack":
        return Marker.ack(GROUP, message, attempt=attempt, origin=named)
    if kind == "delay":
        return Marker.delay(
            GROUP,
            message,
            attempt=attempt,
            origin=named,
            delay_ms=draw(st.sampled_from([None, 0, 500])),
            reason="boom",
        )
    if kind == "extend":
        return Marker.extend(GROUP, message, attempt=attempt, origin=named, timeout_ms=9_000)
    return Marker.reject(GROUP, message, attempt=attempt, origin=named, reason="poison")


markers_strategy = st.lists(
    st.tuples(st.one_of(range_markers(), range_markers(), single_markers()), st.integers(0, 50)),
    max_size=40,
)


def steps_with_times(drawn: list[tuple[AnyMarker, int]]) -> list[tuple[AnyMarker, int]]:
    """Reference times that never go back (record timestamps on one partition)."""
    now = 1_000_000
    out = []
    for marker, gap in drawn:
        now += gap
        out.append((marker, now))
    return out
