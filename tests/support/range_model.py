"""The per-message reference model of range markers, shared by the pure and the store tests
(every store, through :func:`check_store_against_model`).

The reference is v1 itself: every range marker is, by definition (docs/protocol.md), one v1
marker per covered offset, and :func:`apply_marker` folds those message by message.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import replace

from hypothesis import strategies as st

from tracker.domain.entries import Entry, EntryKey, State, apply_marker, plan_due
from tracker.domain.policy import BackoffPolicy, ResolvedPolicy
from tracker.ids import MessageId
from tracker.protocol import AnyMarker, Marker
from tracker.protocol_v2 import RangeKind, RangeMarker
from tracker.store.port import PartitionProgress, PendingMarker, TrackerStore

GROUP, TOPIC, PARTITION, MARKERS_PARTITION = "g", "orders", 2, 5
MARKERS = "kmq-markers"
WINDOW = 24  #: offsets 0..WINDOW-1: small, so markers collide often
#: What the round in :func:`check_store_against_model` did with a claimed entry.
DONE, LOST, PUT_BACK = 0, 1, 2
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
            reference_step(entries, single, ref)
    return entries


def reference_step(entries: dict[int, Entry], single: Marker, ref: int) -> str | None:
    """Apply one v1 marker to ``entries`` (by origin offset) as v1 does; its anomaly, if any."""
    offset = single.origin_offset
    after, why = apply_marker(entries.get(offset), single, ref, MARKERS_PARTITION, policy)
    if after is None:
        entries.pop(offset, None)
    else:
        entries[offset] = after
    return why


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
#: markers that arrive while a redelivery round runs, and what the round does with each entry
during_round_strategy = st.lists(
    st.tuples(st.one_of(range_markers(), single_markers()), st.integers(0, 50)), max_size=8
)
outcomes_strategy = st.lists(st.sampled_from([DONE, LOST, PUT_BACK]), min_size=1, max_size=6)


def steps_with_times(drawn: list[tuple[AnyMarker, int]]) -> list[tuple[AnyMarker, int]]:
    """Reference times that never go back (record timestamps on one partition)."""
    now = 1_000_000
    out = []
    for marker, gap in drawn:
        now += gap
        out.append((marker, now))
    return out


#: The claim token of the redelivery round in :func:`check_store_against_model`.
TOKEN = "round-1"  # noqa: S105 - not a secret


async def _nothing() -> None:
    pass


async def check_store_against_model(
    store: TrackerStore,
    steps: Sequence[tuple[AnyMarker, int]],
    cuts: list[bool],
    due_at: int,
    *,
    during: Sequence[tuple[AnyMarker, int]] = (),
    outcomes: Sequence[int] = (DONE,),
    check: Callable[[], Awaitable[None]] = _nothing,
) -> None:
    """Apply ``steps`` to ``store`` in flushes cut where ``cuts`` says, comparing its entries
    with the per-message :func:`reference` after each flush; then claim what is due by
    ``due_at`` and compare it with what v1 entries would give; then apply the markers
    ``during`` the round (``(marker, gap)``, gaps after ``due_at``) and record the round, each
    claimed entry in turn done, lost or put back as ``outcomes`` (``DONE``, ``LOST``,
    ``PUT_BACK``) say, and compare again. ``check`` runs after each stage (the SQL store's
    counters)."""
    epoch = (await store.claim_partitions(MARKERS, [MARKERS_PARTITION], "a", 0))[
        MARKERS_PARTITION
    ].epoch
    batch: list[PendingMarker] = []
    for i, (marker, ref) in enumerate(steps):
        batch.append(PendingMarker(marker, ref, MARKERS_PARTITION, i))
        if cuts[i % len(cuts)] or i == len(steps) - 1:
            progress = {MARKERS_PARTITION: PartitionProgress(epoch, i + 1)}
            await store.apply(MARKERS, progress, batch, policy, ref)
            batch = []
            expected = reference(steps[: i + 1])
            stored = {e.origin_offset: e for e in await store.list_entries(10_000)}
            assert stored == expected, f"after marker {i}: {marker}"
    await check()

    # Redelivery: what is due by ``due_at`` is claimed, exactly as v1 entries would be.
    expected = reference(steps)
    due = {o: e for o, e in expected.items() if e.due_at_ms is not None and e.due_at_ms <= due_at}
    claim = await store.claim_due_ranges(
        MARKERS,
        epochs={MARKERS_PARTITION: epoch},
        due_by={MARKERS_PARTITION: due_at},
        now_ms=due_at,
        limit=10_000,
        lease_ms=60_000,
        token=TOKEN,
    )
    claimed, fenced = claim.expanded(), claim.fenced
    assert fenced == set()
    got: dict[int, Entry] = {e.origin_offset: e for e in claimed}
    assert got == {o: _claimed(e) for o, e in due.items()}, (
        "claimed entries differ from the per-message model"
    )
    assert {o: plan_due(e, 3) for o, e in got.items()} == {
        o: plan_due(e, 3) for o, e in due.items()
    }
    next_due = await store.next_due_ms([MARKERS_PARTITION])
    later = [e.due_at_ms for o, e in expected.items() if o not in due and e.due_at_ms]
    claimed_until = [due_at + 60_000] if due else []
    assert next_due == (min(later + claimed_until) if later or claimed_until else None)
    await check()

    # The round runs while markers arrive (a claimed range keeps its token through a settle
    # or an extension, as a v1 entry does; a START of a copy takes the offset out of it),
    # then it is recorded: the store must end where v1 entries would.
    model = dict(expected)
    for offset, entry in got.items():
        model[offset] = replace(entry, due_at_ms=due_at + 60_000)
    now = max(due_at, steps[-1][1])
    late: list[PendingMarker] = []
    for marker, gap in during:
        now += gap
        late.append(PendingMarker(marker, now, MARKERS_PARTITION, len(steps) + len(late)))
        for single in as_v1(marker):
            reference_step(model, single, now)
    if late:
        progress = {MARKERS_PARTITION: PartitionProgress(epoch, len(steps) + len(late))}
        await store.apply(MARKERS, progress, late, policy, now)
    done: list[EntryKey] = []
    lost: list[tuple[EntryKey, str]] = []
    put_back: list[tuple[EntryKey, int]] = []
    for i, offset in enumerate(sorted(got)):
        key, outcome = got[offset].key, outcomes[i % len(outcomes)]
        held = model.get(offset)
        holds = held is not None and held.claim_token == TOKEN
        if outcome == DONE:
            done.append(key)
            if holds:
                del model[offset]
        elif outcome == LOST:
            lost.append((key, "gone"))
            if held is not None and holds:
                model[offset] = replace(
                    held,
                    state=State.LOST,
                    due_at_ms=None,
                    reason="gone",
                    claim_token=None,
                    updated_ms=now,
                )
        else:
            put_back.append((key, now + 7))
            if held is not None and holds:
                model[offset] = replace(held, due_at_ms=now + 7, claim_token=None)
    await store.finish_redelivery(
        TOKEN,
        markers_topic=MARKERS,
        partitions=[MARKERS_PARTITION],
        done=done,
        dead=[],
        lost=lost,
        retry=put_back,
        now_ms=now,
    )
    stored = {e.origin_offset: e for e in await store.list_entries(10_000)}
    assert stored == model, "after the round's record"
    await check()


def _claimed(entry: Entry) -> Entry:
    """How a claim returns an entry: as it was, with the claim token."""
    return replace(entry, claim_token=TOKEN)
