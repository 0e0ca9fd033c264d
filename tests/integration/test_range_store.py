"""The range store on SQLite and PostgreSQL against the per-message reference model.

For any interleaving of v1 markers and v2 range markers (ranges with exceptions, overrides of
single offsets, late markers of old attempts, duplicates), applied in flushes of any size (a
flush boundary is also where a tracker crash and restart resumes: the store is all there is),
the store holds exactly the entries v1 would have, and an expired range redelivers exactly its
unsettled offsets, when they are due, at the attempt v1 would.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.counts import assert_counters_match
from support.databases import PostgresTestDatabase
from support.range_model import (
    GROUP,
    PARTITION,
    TOKEN,
    TOPIC,
    check_store_against_model,
    during_round_strategy,
    markers_strategy,
    outcomes_strategy,
    policy,
    steps_with_times,
)
from support.sql_stores import reset_engine_tables

from tracker.domain.actions import ActionKind, ActionOutcome, ActionRequest
from tracker.domain.entries import Entry, State
from tracker.ids import MessageId
from tracker.protocol import AnyMarker, Marker
from tracker.protocol_limits import MAX_OFFSET
from tracker.protocol_v2 import RangeMarker
from tracker.store.inspection import EntryFilter, EntryOrder, InspectionQueries
from tracker.store.manager import Store
from tracker.store.migrate import upgrade
from tracker.store.operator_actions import OperatorActions
from tracker.store.port import PartitionProgress, PendingMarker

pytestmark = [pytest.mark.integration]

MARKERS = "kmq-markers"
ROUND_2 = "round-2"


async def _fresh(url: str) -> Store:
    """A store on the test's database, emptied: Hypothesis runs every example on it."""
    store = Store.from_url(url)
    await upgrade(store.engine)
    await reset_engine_tables(store)
    return store


async def _scenario(
    url: str,
    steps: Sequence[tuple[AnyMarker, int]],
    cuts: list[bool],
    due_at: int,
    *,
    during: Sequence[tuple[AnyMarker, int]],
    outcomes: Sequence[int],
) -> None:
    store = await _fresh(url)
    try:
        await check_store_against_model(
            store,
            steps,
            cuts,
            due_at,
            during=during,
            outcomes=outcomes,
            check=lambda: assert_counters_match(store.engine),
        )
    finally:
        await store.close()


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    drawn=markers_strategy,
    cuts=st.lists(st.booleans(), min_size=1, max_size=8),
    due_gap=st.integers(0, 70_000),
    round_=st.tuples(during_round_strategy, outcomes_strategy),
)
def test_the_range_store_decides_as_the_per_message_model(
    database_url: str,
    drawn: list[tuple[AnyMarker, int]],
    cuts: list[bool],
    due_gap: int,
    round_: tuple[list[tuple[AnyMarker, int]], list[int]],
) -> None:
    steps = steps_with_times(drawn)
    if not steps:
        return
    during, outcomes = round_
    due_at = steps[-1][1] + due_gap
    asyncio.run(_scenario(database_url, steps, cuts, due_at, during=during, outcomes=outcomes))


@pytest.mark.parametrize("older", ["entry", "range"])
def test_the_oldest_in_flight_is_the_older_of_entries_and_ranges(
    database_url: str, older: str
) -> None:
    """A topic's oldest in-flight message may be an entry row or an offset of a range: the
    stats take the earlier of the two, whichever it is."""

    async def scenario() -> None:
        store = await _fresh(database_url)
        queries = InspectionQueries(store, MARKERS)
        try:
            epoch = (await store.claim_partitions(MARKERS, [0], "a", 0))[0].epoch
            single = Marker.start(GROUP, MessageId(TOPIC, PARTITION, 7))
            batch = RangeMarker.start(GROUP, TOPIC, PARTITION, 100, 199, consumer="c1")
            seen = {"entry": 500, "range": 900}
            if older == "range":
                seen = {"entry": 900, "range": 500}
            pendings = [
                PendingMarker(single, seen["entry"], 0, 0),
                PendingMarker(batch, seen["range"], 0, 1),
            ]
            await store.apply(MARKERS, {0: PartitionProgress(epoch, 2)}, pendings, policy, 1_000)
            counts = (await queries.topic_counts(since_ms=0))[TOPIC]
            assert counts.in_flight == 101
            assert counts.oldest_in_flight_first_seen_ms == 500
        finally:
            await store.close()

    asyncio.run(scenario())


def test_markers_at_the_highest_offset_are_applied_and_found(database_url: str) -> None:
    """An offset near 2**63 - 1 is valid: the range lookups' bounds must not overflow the
    64-bit columns (a refused statement would stall the markers partition for good)."""

    async def scenario() -> None:
        store = await _fresh(database_url)
        try:
            epoch = (await store.claim_partitions(MARKERS, [0], "a", 0))[0].epoch
            top = MAX_OFFSET
            steps: list[AnyMarker] = [
                RangeMarker.start(GROUP, TOPIC, PARTITION, top - 9, top - 1, consumer="c1"),
                Marker.start(GROUP, MessageId(TOPIC, PARTITION, top)),
            ]
            pendings = [PendingMarker(m, 10 + i, 0, i) for i, m in enumerate(steps)]
            await store.apply(MARKERS, {0: PartitionProgress(epoch, 2)}, pendings, policy, 20)
            for offset in (top - 9, top - 1, top):
                entry = await store.get_entry((GROUP, TOPIC, PARTITION, offset))
                assert entry is not None, offset
                assert entry.state is State.IN_FLIGHT, offset
            await assert_counters_match(store.engine)
        finally:
            await store.close()

    asyncio.run(scenario())


def test_a_batch_acked_within_one_flush_writes_no_row(database_url: str) -> None:
    async def scenario() -> None:
        store = await _fresh(database_url)
        try:
            epoch = (await store.claim_partitions(MARKERS, [0], "a", 0))[0].epoch
            start = RangeMarker.start(GROUP, TOPIC, PARTITION, 1000, 1499, consumer="c1")
            delay = Marker.delay(GROUP, MessageId(TOPIC, PARTITION, 1200), delay_ms=5_000)
            settle = RangeMarker.settle(GROUP, TOPIC, PARTITION, 1000, 1499, exceptions=1 << 200)
            result = await store.apply(
                MARKERS,
                {0: PartitionProgress(epoch, 3)},
                [
                    PendingMarker(start, 10, 0, 0),
                    PendingMarker(delay, 11, 0, 1),
                    PendingMarker(settle, 12, 0, 2),
                ],
                policy,
                12,
            )
            assert (result.upserted, result.deleted, result.anomalies) == (1, 0, [])
            assert await store.list_ranges() == []
            [entry] = await store.list_entries()
            assert (entry.origin_offset, entry.due_at_ms) == (1200, 5_011)
            await assert_counters_match(store.engine)
        finally:
            await store.close()

    asyncio.run(scenario())


def test_an_open_range_is_one_row_until_its_round_is_recorded(database_url: str) -> None:
    """A range is claimed as one row (token and lease on it) and goes when the round is
    recorded; only the offset the round put back becomes an entry of its own."""

    async def scenario() -> None:
        store = await _fresh(database_url)
        try:
            epoch = (await store.claim_partitions(MARKERS, [0], "a", 0))[0].epoch
            start = RangeMarker.start(GROUP, TOPIC, PARTITION, 0, 9_999, timeout_ms=1_000)
            await store.apply(
                MARKERS,
                {0: PartitionProgress(epoch, 1)},
                [PendingMarker(start, 0, 0, 0)],
                policy,
                0,
            )
            settle = RangeMarker.settle(GROUP, TOPIC, PARTITION, 0, 9_999, exceptions=0b101)
            await store.apply(
                MARKERS,
                {0: PartitionProgress(epoch, 2)},
                [PendingMarker(settle, 5, 0, 1)],
                policy,
                5,
            )
            [tracked_range] = await store.list_ranges()
            assert (tracked_range.base_offset, tracked_range.open_count) == (0, 2)
            assert await store.count_entries() == 2
            assert await store.next_due_ms([0]) == 1_000
            claim = await store.claim_due_ranges(
                MARKERS,
                epochs={0: epoch},
                due_by={0: 1_000},
                now_ms=1_000,
                limit=100,
                lease_ms=10_000,
                token=TOKEN,
            )
            claimed, _ = claim.expanded(), claim.fenced
            assert sorted(e.origin_offset for e in claimed) == [0, 2]
            assert {(e.claim_token, e.due_at_ms) for e in claimed} == {(TOKEN, 1_000)}
            [claimed_range] = await store.list_ranges()
            assert (claimed_range.open_bits, claimed_range.claim_token) == (0b101, TOKEN)
            assert claimed_range.due_at_ms == 11_000  # the lease: due again if the round dies
            assert await store.count_entries() == 2
            await assert_counters_match(store.engine)
            [copied, put_back] = sorted(e.key for e in claimed)
            await store.finish_redelivery(
                TOKEN,
                markers_topic=MARKERS,
                partitions=[0],
                done=[copied],
                dead=[],
                lost=[],
                retry=[(put_back, 1_500)],
                now_ms=1_200,
            )
            assert await store.list_ranges() == []
            [entry] = await store.list_entries(10)
            assert (entry.key, entry.due_at_ms, entry.claim_token) == (put_back, 1_500, None)
            assert (entry.state, entry.attempt) == (State.IN_FLIGHT, 1)
            await assert_counters_match(store.engine)
        finally:
            await store.close()

    asyncio.run(scenario())


def test_a_claim_takes_only_as_many_offsets_of_due_ranges_as_its_batch(database_url: str) -> None:
    """Ten million messages in flight are twenty thousand ranges: a claim of 1,000 takes the
    earliest 1,000 due offsets, splitting the range that crosses the batch, not every due
    range (it once took 14 s at 10M) nor a whole range of 65,536 offsets."""

    async def scenario() -> None:
        store = await _fresh(database_url)
        try:
            epoch = (await store.claim_partitions(MARKERS, [0], "a", 0))[0].epoch
            starts = [
                PendingMarker(
                    RangeMarker.start(
                        GROUP, TOPIC, PARTITION, 100 * i, 100 * i + 99, timeout_ms=1_000 + i
                    ),
                    0,
                    0,
                    i,
                )
                for i in range(5)
            ]
            await store.apply(MARKERS, {0: PartitionProgress(epoch, 5)}, starts, policy, 0)
            claim = await store.claim_due_ranges(
                MARKERS,
                epochs={0: epoch},
                due_by={0: 10_000},
                now_ms=10_000,
                limit=150,
                lease_ms=10_000,
                token=TOKEN,
            )
            claimed, _ = claim.expanded(), claim.fenced
            # The earliest due first: all of range 0, then the lowest 50 offsets of range 1,
            # split off as a claimed range of its own.
            assert sorted(e.origin_offset for e in claimed) == list(range(150))
            left = {t.base_offset: (t.open_count, t.claim_token) for t in await store.list_ranges()}
            assert left == {
                0: (100, TOKEN),
                100: (50, TOKEN),
                150: (50, None),
                200: (100, None),
                300: (100, None),
                400: (100, None),
            }
            assert await store.count_entries() == 500
            await assert_counters_match(store.engine)
            claim = await store.claim_due_ranges(
                MARKERS,
                epochs={0: epoch},
                due_by={0: 10_000},
                now_ms=10_000,
                limit=1_000,
                lease_ms=10_000,
                token=ROUND_2,
            )
            claimed, _ = claim.expanded(), claim.fenced
            assert sorted(e.origin_offset for e in claimed) == list(range(150, 500))
            await store.finish_redelivery(
                ROUND_2,
                markers_topic=MARKERS,
                partitions=[0],
                done=[e.key for e in claimed],
                dead=[],
                lost=[],
                retry=[],
                now_ms=10_100,
            )
            # Round 2's record leaves round 1's ranges alone: they carry its token.
            assert sorted(t.base_offset for t in await store.list_ranges()) == [0, 100]
            assert await store.count_entries() == 150
            await assert_counters_match(store.engine)
        finally:
            await store.close()

    asyncio.run(scenario())


def test_admin_listings_show_the_offsets_of_ranges_page_by_page(database_url: str) -> None:
    """The admin API lists every in-flight offset of a range, merged with entry rows, in key
    order and in due order, with keyset pages that neither repeat nor skip an entry."""

    async def scenario() -> None:
        store = await _fresh(database_url)
        queries = InspectionQueries(store, MARKERS)
        try:
            epoch = (await store.claim_partitions(MARKERS, [0], "a", 0))[0].epoch
            steps: list[AnyMarker] = [
                # two overlapping batches of partition 2 (a re-read), one of partition 3
                RangeMarker.start(GROUP, TOPIC, 2, 0, 39, timeout_ms=9_000, consumer="c1"),
                RangeMarker.settle(GROUP, TOPIC, 2, 0, 39, exceptions=0b1010_0000_0001 << 10),
                RangeMarker.start(GROUP, TOPIC, 2, 15, 59, timeout_ms=5_000, consumer="c2"),
                RangeMarker.start(GROUP, TOPIC, 3, 100, 120, timeout_ms=7_000, consumer="c3"),
                Marker.delay(GROUP, MessageId(TOPIC, 2, 50), delay_ms=1_000),
                Marker.start(GROUP, MessageId(TOPIC, 3, 7)),
            ]
            pendings = [PendingMarker(m, 100 + i, 0, i) for i, m in enumerate(steps)]
            await store.apply(MARKERS, {0: PartitionProgress(epoch, 6)}, pendings, policy, 200)
            everything = await store.list_entries(10_000)
            assert len(everything) > 60
            for order, sort in (
                (EntryOrder.KEY, lambda e: e.key),
                (EntryOrder.DUE, lambda e: (e.due_at_ms, *e.key)),
            ):
                expected = sorted(everything, key=sort)
                for page_size in (1, 7, 1000):
                    seen: list[Entry] = []
                    after = None
                    while True:
                        page = await queries.list_entries(
                            EntryFilter(), order=order, after=after, limit=page_size
                        )
                        seen += [view.entry for view in page]
                        if len(page) < page_size:
                            break
                        after = sort(page[-1].entry)
                    assert seen == expected, f"{order} pages of {page_size}"
            only_c3 = await queries.list_entries(
                EntryFilter(partition=3, states=(State.IN_FLIGHT,))
            )
            assert [v.entry.origin_offset for v in only_c3] == [7, *range(100, 121)]
            counts = (await queries.topic_counts(since_ms=0))[TOPIC]
            assert counts.in_flight == len([e for e in everything if e.state is State.IN_FLIGHT])
            assert counts.oldest_in_flight_first_seen_ms == 100
        finally:
            await store.close()

    asyncio.run(scenario())


#: A PostgreSQL database whose default collation is ICU's en-US, as many installations are
#: (there "ab" < "aB" < "Ac"; in byte order "Ac" < "aB" < "ab").
ICU_EN_US = (
    "TEMPLATE template0 ENCODING 'UTF8' LOCALE_PROVIDER icu ICU_LOCALE 'en-US' LOCALE 'C.UTF-8'"
)


@pytest.mark.parametrize("store", ["sqlite", "postgres-icu"])
def test_admin_listings_merge_entries_and_ranges_in_one_order_whatever_the_collation(
    store: str, sqlite_url: str
) -> None:
    """Entries and the offsets of ranges are merged into one page in the store's key order;
    on a database whose collation is not byte order (ICU en-US), the merge and the next
    page's keyset condition must still agree on it (the key columns collate as bytes), or a
    page would skip or repeat messages of some topics."""
    topics = ["ab", "aB", "Ac", "a-b", "a.b"]

    async def scenario(url: str) -> None:
        store = await _fresh(url)
        queries = InspectionQueries(store, MARKERS)
        try:
            epoch = (await store.claim_partitions(MARKERS, [0], "a", 0))[0].epoch
            steps: list[AnyMarker] = []
            for topic in topics:  # one due time for all: the due order is the key order
                steps.append(RangeMarker.start(GROUP, topic, 0, 0, 2, timeout_ms=9_000))
                steps.append(Marker.start(GROUP, MessageId(topic, 1, 5), timeout_ms=9_000))
            pendings = [PendingMarker(m, 100, 0, i) for i, m in enumerate(steps)]
            await store.apply(MARKERS, {0: PartitionProgress(epoch, 1)}, pendings, policy, 200)
            expected = sorted(
                [(t, 0, o) for t in topics for o in range(3)] + [(t, 1, 5) for t in topics]
            )
            for order, sort in (
                (EntryOrder.KEY, lambda e: e.key),
                (EntryOrder.DUE, lambda e: (e.due_at_ms, *e.key)),
            ):
                seen: list[tuple[str, int, int]] = []
                after = None
                while page := await queries.list_entries(
                    EntryFilter(), order=order, after=after, limit=2
                ):
                    seen += [(v.entry.origin_topic, *v.entry.key[2:]) for v in page]
                    after = sort(page[-1].entry)
                assert seen == expected, f"{order}"
        finally:
            await store.close()

    if store == "sqlite":
        asyncio.run(scenario(sqlite_url))
        return
    with PostgresTestDatabase(options=ICU_EN_US) as database:
        asyncio.run(scenario(database.url))


def test_an_operator_action_on_one_offset_splits_it_from_its_range(database_url: str) -> None:
    async def scenario() -> None:
        store = await _fresh(database_url)
        queries = InspectionQueries(store, MARKERS)
        try:
            epoch = (await store.claim_partitions(MARKERS, [0], "a", 0))[0].epoch
            start = RangeMarker.start(GROUP, TOPIC, 2, 0, 9, timeout_ms=5_000, consumer="c1")
            await store.apply(
                MARKERS,
                {0: PartitionProgress(epoch, 1)},
                [PendingMarker(start, 10, 0, 0)],
                policy,
                10,
            )
            view = await queries.get_entry((GROUP, TOPIC, 2, 4))
            assert view is not None
            assert (view.entry.state, view.entry.due_at_ms, view.entry.consumer) == (
                State.IN_FLIGHT,
                5_010,
                "c1",
            )
            actions = OperatorActions(store, MARKERS)
            record = await actions.apply_action(
                ActionRequest(
                    key=(GROUP, TOPIC, 2, 4),
                    action=ActionKind.EXTEND,
                    actor="ops",
                    extend_ms=60_000,
                ),
                1_000,
            )
            assert record.outcome is ActionOutcome.APPLIED
            extended = await store.get_entry((GROUP, TOPIC, 2, 4))
            assert extended is not None
            assert extended.due_at_ms == 61_000
            [tracked_range] = await store.list_ranges()
            assert sorted(tracked_range.offsets()) == [0, 1, 2, 3, 5, 6, 7, 8, 9]
            ack = ActionRequest(key=(GROUP, TOPIC, 2, 0), action=ActionKind.ACK, actor="ops")
            assert (await actions.apply_action(ack, 1_000)).outcome is ActionOutcome.APPLIED
            assert await store.get_entry((GROUP, TOPIC, 2, 0)) is None
            assert await store.count_entries() == 9
            await assert_counters_match(store.engine)
            # The batch's late SETTLE still acks the rest; the extended one is settled too.
            settle = RangeMarker.settle(GROUP, TOPIC, 2, 0, 9)
            await store.apply(
                MARKERS,
                {0: PartitionProgress(epoch, 2)},
                [PendingMarker(settle, 20, 0, 1)],
                policy,
                20,
            )
            assert await store.count_entries() == 0
            await assert_counters_match(store.engine)
        finally:
            await store.close()

    asyncio.run(scenario())
