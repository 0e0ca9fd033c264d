"""The store contract: what every :class:`~tracker.store.port.TrackerStore` must do.

Each test runs on the three backends: the in-memory store shipped in the package
(``tracker.store.memory``), a fresh SQLite file and a fresh PostgreSQL database. The
engine's behaviour rests on these rules (fencing, folding, claims, a round's record), so a
store that passes them can stand in for another; the SQL store's own concerns (its counters,
SQLite's locking, query plans) are tested in ``tests/integration/test_store.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import select
from support.counts import assert_counters_match
from support.range_model import (
    check_store_against_model,
    during_round_strategy,
    markers_strategy,
    outcomes_strategy,
    steps_with_times,
)
from support.sql_stores import empty_sql_store
from support.store_steps import (
    FIXED_TOPIC,
    GROUP,
    KEEP_PAYLOAD_AFTER_MS,
    MARKERS,
    T0,
    TIMEOUT_MS,
    TOPIC,
    apply,
    claim,
    claim_due,
    key,
    msg,
    pending,
    policy_for,
    start,
)

from tracker.domain.entries import Entry, EntryKey, State
from tracker.protocol import AnyMarker, Marker
from tracker.protocol_v2 import RangeMarker
from tracker.store.manager import Store
from tracker.store.memory import InMemoryStore
from tracker.store.port import (
    Claim,
    DeadLetterRecord,
    PartitionProgress,
    StoredPayload,
    TrackerStore,
)
from tracker.store.store_errors import Fenced
from tracker.store.tables import (
    partitions_table,
)

pytestmark = [pytest.mark.integration]

BACKENDS = ["memory", "sqlite", "postgres"]


@pytest.fixture(params=BACKENDS, ids=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """``memory``, or the URL of a fresh SQLite file or of a fresh PostgreSQL database."""
    if request.param == "memory":
        return "memory"
    url = request.getfixturevalue(f"{request.param}_url")
    assert isinstance(url, str)
    return url


@pytest.fixture
async def store(backend: str) -> AsyncIterator[TrackerStore]:
    if backend == "memory":
        yield InMemoryStore()
        return
    async with empty_sql_store(backend) as sql:
        yield sql


@pytest.fixture
async def replica_b(store: TrackerStore, backend: str) -> AsyncIterator[TrackerStore]:
    """A second store on the same database: another tracker replica."""
    if isinstance(store, InMemoryStore):
        yield InMemoryStore(store.database)
        return
    other = Store.from_url(backend)
    try:
        yield other
    finally:
        await other.close()


async def owner_of(store: TrackerStore, partition: int) -> str | None:
    """Who owns a markers partition, as the database records it."""
    if isinstance(store, InMemoryStore):
        return store.database.partitions[(MARKERS, partition)].owner
    assert isinstance(store, Store)
    async with store.engine.connect() as conn:
        owner = await conn.scalar(
            select(partitions_table.c.owner).where(
                partitions_table.c.markers_topic == MARKERS,
                partitions_table.c.partition == partition,
            )
        )
    return None if owner is None else str(owner)


# -- ownership ---------------------------------------------------------------------------


async def test_claim_partitions_bumps_the_epoch_and_reports_progress_once_recorded(
    store: TrackerStore,
) -> None:
    first = await store.claim_partitions(MARKERS, [1, 0, 1], "a", T0)
    assert first == {0: Claim(1, None), 1: Claim(1, None)}
    second = await store.claim_partitions(MARKERS, [0, 1], "b", T0 + 1)
    assert second == {0: Claim(2, None), 1: Claim(2, None)}
    # another markers topic has its own epochs
    assert await store.claim_partitions("other-markers", [0], "a", T0) == {0: Claim(1, None)}

    await store.apply(MARKERS, {0: PartitionProgress(2, 17)}, [], policy_for, T0 + 2)
    third = await store.claim_partitions(MARKERS, [0, 1], "a", T0 + 3)
    assert third == {0: Claim(3, 17), 1: Claim(3, None)}
    assert await store.partition_offsets(MARKERS) == {0: (3, 17), 1: (3, -1)}

    # progress at offset 0 is progress too (not "nothing applied")
    await store.apply(MARKERS, {1: PartitionProgress(3, 0)}, [], policy_for, T0 + 4)
    assert (await store.claim_partitions(MARKERS, [1], "a", T0 + 5))[1] == Claim(4, 0)


async def test_apply_with_a_stale_epoch_is_fenced_and_changes_nothing(store: TrackerStore) -> None:
    epochs = await claim(store, [0, 1])
    await apply(
        store,
        epochs,
        [
            pending(Marker.start(GROUP, msg(1), timeout_ms=5_000), T0, 0, markers_partition=0),
            pending(Marker.start(GROUP, msg(2), timeout_ms=5_000), T0, 0, markers_partition=1),
        ],
    )
    before_entries = await store.list_entries()
    before_offsets = await store.partition_offsets(MARKERS)
    assert before_offsets == {0: (1, 1), 1: (1, 1)}

    await store.claim_partitions(MARKERS, [1], "b", T0 + 1)  # partition 1 moves on

    with pytest.raises(Fenced) as raised:
        await store.apply(
            MARKERS,
            {0: PartitionProgress(1, 3), 1: PartitionProgress(1, 3)},
            [
                pending(Marker.ack(GROUP, msg(1)), T0 + 10, 1, markers_partition=0),
                pending(Marker.start(GROUP, msg(3)), T0 + 10, 2, markers_partition=0),
                pending(Marker.ack(GROUP, msg(2)), T0 + 10, 1, markers_partition=1),
            ],
            policy_for,
            T0 + 10,
        )
    assert raised.value.partitions == {1}
    assert await store.list_entries() == before_entries
    # partition 0's progress (written before partition 1 was found fenced) was rolled back
    assert await store.partition_offsets(MARKERS) == {0: (1, 1), 1: (2, 1)}

    with pytest.raises(Fenced) as raised_all:
        await store.apply(
            MARKERS,
            {0: PartitionProgress(7, 3), 1: PartitionProgress(1, 3)},
            [],
            policy_for,
            T0 + 11,
        )
    assert raised_all.value.partitions == {0, 1}


# -- apply semantics ---------------------------------------------------------------------


async def test_start_creates_an_in_flight_entry_due_at_the_lease(store: TrackerStore) -> None:
    epochs = await claim(store)
    marker = Marker.start(GROUP, msg(5), timeout_ms=5_000, consumer="consumer-7")
    result = await apply(store, epochs, [pending(marker, T0, 40)])
    assert result.anomalies == []
    assert (result.upserted, result.deleted, result.earliest_due_ms) == (1, 0, T0 + 5_000)

    entry = await store.get_entry(key(5))
    assert entry == Entry(
        group_id=GROUP,
        origin_topic=TOPIC,
        origin_partition=0,
        origin_offset=5,
        markers_partition=0,
        state=State.IN_FLIGHT,
        attempt=1,
        copy_topic=TOPIC,
        copy_partition=0,
        copy_offset=5,
        due_at_ms=T0 + 5_000,
        first_seen_ms=T0,
        updated_ms=T0,
        consumer="consumer-7",
    )
    assert await store.count_entries() == 1
    assert await store.count_entries(State.IN_FLIGHT) == 1
    assert await store.count_entries(State.DELAYED) == 0
    assert await store.partition_offsets(MARKERS) == {0: (epochs[0], 41)}


async def test_start_without_timeout_uses_the_policy_processing_timeout(
    store: TrackerStore,
) -> None:
    epochs = await claim(store)
    entry = await start(store, epochs, 6, timeout_ms=0)
    assert entry.due_at_ms == T0 + TIMEOUT_MS


async def test_start_and_ack_in_one_apply_write_no_entry(store: TrackerStore) -> None:
    epochs = await claim(store)
    result = await apply(
        store,
        epochs,
        [
            pending(Marker.start(GROUP, msg(7), timeout_ms=5_000), T0, 10),
            pending(Marker.ack(GROUP, msg(7)), T0 + 50, 11),
        ],
    )
    assert result.anomalies == []
    assert (result.upserted, result.deleted, result.earliest_due_ms) == (0, 0, None)
    assert await store.count_entries() == 0
    assert await store.partition_offsets(MARKERS) == {0: (epochs[0], 12)}


async def test_ack_in_a_later_apply_deletes_the_entry(store: TrackerStore) -> None:
    epochs = await claim(store)
    await start(store, epochs, 8)
    result = await apply(store, epochs, [pending(Marker.ack(GROUP, msg(8)), T0 + 100, 1)])
    assert result.anomalies == []
    assert (result.upserted, result.deleted) == (0, 1)
    assert await store.get_entry(key(8)) is None
    assert await store.count_entries() == 0


async def test_ack_without_start_is_an_anomaly_and_writes_nothing(store: TrackerStore) -> None:
    epochs = await claim(store)
    ack = pending(Marker.ack(GROUP, msg(9)), T0, 3)
    result = await apply(store, epochs, [ack])
    assert [p for p, _ in result.anomalies] == [ack]
    assert "ACK without START" in result.anomalies[0][1]
    assert (result.upserted, result.deleted) == (0, 0)
    assert await store.count_entries() == 0
    assert await store.partition_offsets(MARKERS) == {0: (epochs[0], 4)}


async def test_a_stale_marker_is_an_anomaly_and_leaves_the_entry_unchanged(
    store: TrackerStore,
) -> None:
    epochs = await claim(store)
    copy = msg(900)  # the second delivery of orders/0/10
    second = Marker.start(GROUP, copy, attempt=2, origin=msg(10), timeout_ms=5_000)
    await apply(store, epochs, [pending(second, T0, 0)])
    before = await store.get_entry(key(10))
    assert before is not None
    assert (before.attempt, before.copy_offset, before.origin_offset) == (2, 900, 10)

    stale = [
        pending(Marker.ack(GROUP, msg(10)), T0 + 10, 1),
        pending(Marker.delay(GROUP, msg(10), delay_ms=1_000), T0 + 11, 2),
        pending(Marker.reject(GROUP, msg(10), reason="late"), T0 + 12, 3),
    ]
    result = await apply(store, epochs, stale, now_ms=T0 + 20)
    assert [p for p, _ in result.anomalies] == stale
    assert all("stale" in why for _, why in result.anomalies)
    assert (result.upserted, result.deleted) == (0, 0)
    assert await store.get_entry(key(10)) == before


async def test_extend_moves_the_deadline(store: TrackerStore) -> None:
    epochs = await claim(store)
    await start(store, epochs, 11, timeout_ms=5_000)
    extend = Marker.extend(GROUP, msg(11), timeout_ms=60_000)
    result = await apply(store, epochs, [pending(extend, T0 + 3_000, 1)])
    assert result.anomalies == []
    entry = await store.get_entry(key(11))
    assert entry is not None
    assert (entry.state, entry.due_at_ms, entry.updated_ms) == (
        State.IN_FLIGHT,
        T0 + 63_000,
        T0 + 3_000,
    )
    assert entry.first_seen_ms == T0


async def test_delay_with_an_explicit_delay(store: TrackerStore) -> None:
    epochs = await claim(store)
    await start(store, epochs, 12)
    delay = Marker.delay(GROUP, msg(12), delay_ms=10_000, reason="db down")
    result = await apply(store, epochs, [pending(delay, T0 + 1_000, 1)])
    assert result.anomalies == []
    entry = await store.get_entry(key(12))
    assert entry is not None
    assert (entry.state, entry.due_at_ms, entry.reason) == (State.DELAYED, T0 + 11_000, "db down")
    assert entry.keep_payload is False
    assert await store.count_entries(State.DELAYED) == 1


async def test_delay_without_a_delay_uses_the_backoff_policy(store: TrackerStore) -> None:
    epochs = await claim(store)
    # fixed backoff (2 s, x3, no jitter): after attempt 1 -> 2 s, after attempt 3 -> 18 s
    await start(store, epochs, 13, topic=FIXED_TOPIC)
    await apply(store, epochs, [pending(Marker.delay(GROUP, msg(13, FIXED_TOPIC)), T0 + 500, 1)])
    first = await store.get_entry(key(13, FIXED_TOPIC))
    assert first is not None
    assert (first.state, first.due_at_ms) == (State.DELAYED, T0 + 500 + 2_000)

    third = Marker.delay(GROUP, msg(950, FIXED_TOPIC), attempt=3, origin=msg(14, FIXED_TOPIC))
    await apply(store, epochs, [pending(third, T0, 2)])
    entry = await store.get_entry(key(14, FIXED_TOPIC))
    assert entry is not None
    assert (entry.state, entry.attempt, entry.due_at_ms) == (State.DELAYED, 3, T0 + 18_000)

    # the default policy: 1 s +/- 20 % jitter after the first attempt
    await start(store, epochs, 15)
    await apply(store, epochs, [pending(Marker.delay(GROUP, msg(15)), T0 + 1_000, 3)])
    jittered = await store.get_entry(key(15))
    assert jittered is not None
    assert jittered.due_at_ms is not None
    assert T0 + 1_000 + 800 <= jittered.due_at_ms <= T0 + 1_000 + 1_200


async def test_a_delay_longer_than_keep_payload_after_keeps_the_payload(
    store: TrackerStore,
) -> None:
    epochs = await claim(store)
    long = Marker.delay(GROUP, msg(16), delay_ms=KEEP_PAYLOAD_AFTER_MS + 1, deferred=True)
    await apply(store, epochs, [pending(long, T0, 0)])
    entry = await store.get_entry(key(16))
    assert entry is not None
    assert (entry.state, entry.deferred, entry.keep_payload) == (State.DELAYED, True, True)
    assert entry.due_at_ms == T0 + KEEP_PAYLOAD_AFTER_MS + 1


async def test_reject_makes_the_entry_rejected_and_due_now(store: TrackerStore) -> None:
    epochs = await claim(store)
    await start(store, epochs, 17)
    reject = Marker.reject(GROUP, msg(17), reason="cannot parse")
    await apply(store, epochs, [pending(reject, T0 + 2_000, 1)])
    entry = await store.get_entry(key(17))
    assert entry is not None
    assert (entry.state, entry.due_at_ms, entry.reason) == (
        State.REJECTED,
        T0 + 2_000,
        "cannot parse",
    )
    assert await store.count_entries(State.REJECTED) == 1


async def test_replaying_applied_markers_does_not_resurrect_an_acked_message(
    store: TrackerStore,
) -> None:
    epochs = await claim(store)
    start_18 = pending(Marker.start(GROUP, msg(18), timeout_ms=5_000), T0, 0)
    ack_18 = pending(Marker.ack(GROUP, msg(18)), T0 + 10, 1)
    await apply(store, epochs, [start_18, ack_18])
    assert await store.count_entries() == 0

    # the same window again (e.g. re-read after a crash before the offsets were committed)
    replay = await apply(store, epochs, [start_18, ack_18])
    assert replay.anomalies == []
    assert await store.count_entries() == 0

    # only the ACK replayed
    ack_only = await apply(store, epochs, [ack_18])
    assert [p for p, _ in ack_only.anomalies] == [ack_18]
    assert await store.count_entries() == 0
    assert await store.get_entry(key(18)) is None
    assert await store.partition_offsets(MARKERS) == {0: (epochs[0], 2)}


# -- two replicas --------------------------------------------------------------------------


async def test_a_replica_taking_over_fences_the_previous_owner(
    store: TrackerStore, replica_b: TrackerStore
) -> None:
    replica_a = store
    epoch_a = await claim(replica_a, [0], owner="a")
    assert epoch_a == {0: 1}
    await start(replica_a, epoch_a, 20, timeout_ms=1_000)

    epoch_b = await claim(replica_b, [0], owner="b")
    assert epoch_b == {0: 2}

    with pytest.raises(Fenced) as raised:
        await apply(replica_a, epoch_a, [pending(Marker.ack(GROUP, msg(20)), T0 + 10, 1)])
    assert raised.value.partitions == {0}
    assert await replica_a.get_entry(key(20)) is not None

    claimed, fenced = await claim_due(replica_a, epoch_a, T0 + 5_000, "a-1", lease_ms=1_000)
    assert (claimed, fenced) == ([], {0})
    # A's release does not touch the partition B owns now
    await replica_a.release_partitions(MARKERS, epoch_a)
    assert await owner_of(replica_b, 0) == "b"

    claimed, fenced = await claim_due(replica_b, epoch_b, T0 + 5_000, "b-1", lease_ms=1_000)
    assert fenced == set()
    assert [e.key for e in claimed] == [key(20)]
    result = await apply(replica_b, epoch_b, [pending(Marker.ack(GROUP, msg(20)), T0 + 10, 1)])
    assert result.deleted == 1
    assert await replica_a.count_entries() == 0
    assert await replica_b.partition_offsets(MARKERS) == {0: (2, 2)}


# -- redelivery ----------------------------------------------------------------------------


async def test_next_due_ms_is_the_minimum_of_the_given_partitions_ignoring_lost(
    store: TrackerStore,
) -> None:
    epochs = await claim(store, [0, 1, 2])
    await start(store, epochs, 30, timeout_ms=900, markers_partition=0)  # lost below
    await start(store, epochs, 31, timeout_ms=3_000, markers_partition=0)
    await start(store, epochs, 32, timeout_ms=2_000, markers_partition=1)
    await start(store, epochs, 33, timeout_ms=100, markers_partition=2)  # not asked for

    assert await store.next_due_ms([0, 1]) == T0 + 900
    await store.mark_lost([(key(30), "retention")], T0 + 1_000)
    lost = await store.get_entry(key(30))
    assert lost is not None
    assert (lost.state, lost.due_at_ms, lost.reason) == (State.LOST, None, "retention")

    assert await store.next_due_ms([0, 1]) == T0 + 2_000
    assert await store.next_due_ms([0]) == T0 + 3_000
    assert await store.next_due_ms([2, 0]) == T0 + 100
    assert await store.next_due_ms([]) is None
    assert await store.next_due_ms([5]) is None


async def test_claim_due_claims_due_entries_of_owned_partitions_in_due_order(
    store: TrackerStore,
) -> None:
    epochs = await claim(store, [0, 1])
    for offset, timeout in ((40, 300), (41, 100), (42, 200), (43, 10_000)):
        await start(store, epochs, offset, timeout_ms=timeout, markers_partition=0)
    await start(store, epochs, 44, timeout_ms=50, markers_partition=1)  # due, other partition
    await start(store, epochs, 45, timeout_ms=10, markers_partition=0)
    await store.mark_lost([(key(45), "gone")], T0)  # lost: never due

    now = T0 + 1_000
    only_p0 = {0: epochs[0]}
    claimed, fenced = await claim_due(store, only_p0, now, "t1", limit=2)
    assert fenced == set()
    assert [e.key for e in claimed] == [key(41), key(42)]
    assert {e.claim_token for e in claimed} == {"t1"}
    for k in (key(41), key(42)):
        entry = await store.get_entry(k)
        assert entry is not None
        assert (entry.claim_token, entry.due_at_ms) == ("t1", now + 5_000)

    claimed, _ = await claim_due(store, only_p0, now, "t2")
    assert [e.key for e in claimed] == [key(40)]
    # everything due is claimed: nothing more right away, nor just before the lease ends
    for at in (now, now + 4_999):
        claimed, _ = await claim_due(store, only_p0, at, "t3")
        assert claimed == []
    # the lease ran out (the claimer died?): due again for the owner
    claimed, _ = await claim_due(store, only_p0, now + 5_000, "t4")
    assert sorted(e.key for e in claimed) == [key(40), key(41), key(42)]
    assert {e.claim_token for e in claimed} == {"t4"}

    # partition 1's entry only for whoever claims with partition 1
    claimed, _ = await claim_due(store, {1: epochs[1]}, now, "t5")
    assert [e.key for e in claimed] == [key(44)]
    not_due = await store.get_entry(key(43))
    assert not_due is not None
    assert (not_due.claim_token, not_due.due_at_ms) == (None, T0 + 10_000)


async def test_claim_due_takes_the_earliest_entries_across_partitions(store: TrackerStore) -> None:
    """The limit applies to all searched partitions together: the earliest due win, wherever
    they are, in due order (then key order); each partition's later entries wait."""
    epochs = await claim(store, [0, 1, 2])
    timeouts = {0: (500, 100, 900), 1: (300, 100, 700), 2: (200, 800, 600)}
    offset = 200
    for partition, per_partition in timeouts.items():
        for timeout in per_partition:
            await start(store, epochs, offset, timeout_ms=timeout, markers_partition=partition)
            offset += 1
    # offsets: p0 200 (500), 201 (100), 202 (900); p1 203 (300), 204 (100), 205 (700);
    # p2 206 (200), 207 (800), 208 (600)
    claimed, _ = await claim_due(store, epochs, T0 + 10_000, "across", limit=4)
    assert [e.key for e in claimed] == [key(201), key(204), key(206), key(203)]
    assert [e.due_at_ms for e in claimed] == [T0 + 100, T0 + 100, T0 + 200, T0 + 300]
    assert {e.claim_token for e in claimed} == {"across"}
    claimed, _ = await claim_due(store, epochs, T0 + 10_000, "rest", limit=100)
    assert [e.key for e in claimed] == [key(200), key(208), key(205), key(207), key(202)]


async def test_claim_due_merges_many_partitions(store: TrackerStore) -> None:
    """A replica owning more markers partitions than one claim query takes (SQLite allows 500
    terms in a compound SELECT): still the earliest entries of all of them."""
    partitions = list(range(130))
    epochs = await claim(store, partitions)
    for p in partitions:  # the later the partition, the earlier its entry is due
        await start(store, epochs, 1_000 + p, timeout_ms=10_000 - 10 * p, markers_partition=p)
    claimed, _ = await claim_due(store, epochs, T0 + 20_000, "many", limit=5)
    assert [e.markers_partition for e in claimed] == [129, 128, 127, 126, 125]
    claimed, _ = await claim_due(store, epochs, T0 + 20_000, "rest", limit=1_000)
    assert len(claimed) == 125


async def test_claim_due_skips_fenced_partitions(store: TrackerStore) -> None:
    epochs = await claim(store, [0, 1])
    await start(store, epochs, 46, timeout_ms=10, markers_partition=0)
    await start(store, epochs, 47, timeout_ms=10, markers_partition=1)
    await store.claim_partitions(MARKERS, [1], "b", T0)
    claimed, fenced = await claim_due(store, epochs, T0 + 1_000, "t")
    assert fenced == {1}
    assert [e.key for e in claimed] == [key(46)]
    untouched = await store.get_entry(key(47))
    assert untouched is not None
    assert (untouched.claim_token, untouched.due_at_ms) == (None, T0 + 10)


async def test_a_replica_owning_thousands_of_markers_partitions_is_fenced_per_partition(
    store: TrackerStore,
) -> None:
    """Every claim fences all the partitions the replica owns in one statement: it must hold
    for more partitions than SQLite allows terms in an expression (1,000)."""
    partitions = list(range(1_200))
    epochs = await claim(store, partitions)
    await start(store, epochs, 48, timeout_ms=10, markers_partition=1_150)
    await store.claim_partitions(MARKERS, [7, 1_199], "b", T0)
    claimed, fenced = await claim_due(store, epochs, T0 + 1_000, "t")
    assert fenced == {7, 1_199}
    assert [e.key for e in claimed] == [key(48)]


async def test_claim_due_searches_each_partition_only_up_to_its_due_by(store: TrackerStore) -> None:
    epochs = await claim(store, [0, 1, 2])
    await start(store, epochs, 70, timeout_ms=100, markers_partition=0)
    await start(store, epochs, 71, timeout_ms=500, markers_partition=0)  # after due_by[0]
    await start(store, epochs, 72, timeout_ms=100, markers_partition=1)  # 1 not searched
    await start(store, epochs, 73, timeout_ms=100, markers_partition=2)
    await store.claim_partitions(MARKERS, [2], "b", T0)  # 2 belongs to another replica now

    now = T0 + 1_000
    claimed, fenced = await claim_due(
        store,
        {0: epochs[0], 1: epochs[1]},
        now,
        "t",
        due_by={0: T0 + 300, 2: now},  # 2: not ours, must not be searched
    )
    assert fenced == set()
    assert [e.key for e in claimed] == [key(70)]
    assert [e.due_at_ms for e in claimed] == [T0 + 100]  # as it was before the claim
    for k, due, token in (
        (key(70), now + 5_000, "t"),
        (key(71), T0 + 500, None),
        (key(72), T0 + 100, None),
        (key(73), T0 + 100, None),
    ):
        entry = await store.get_entry(k)
        assert entry is not None
        assert (entry.due_at_ms, entry.claim_token) == (due, token), k


async def test_finish_redelivery_done_deletes_only_entries_still_claimed(
    store: TrackerStore,
) -> None:
    epochs = await claim(store)
    await start(store, epochs, 50, timeout_ms=10)
    await start(store, epochs, 51, timeout_ms=10)
    claimed, _ = await claim_due(store, epochs, T0 + 100, "tok")
    assert sorted(e.key for e in claimed) == [key(50), key(51)]

    # meanwhile the consumer's START for a copy of 51 arrives: ingest replaces the entry
    restart = Marker.start(GROUP, msg(960), attempt=2, origin=msg(51), timeout_ms=5_000)
    await apply(store, epochs, [pending(restart, T0 + 200, 1)])
    restarted = await store.get_entry(key(51))
    assert restarted is not None
    assert (restarted.claim_token, restarted.attempt) == (None, 2)

    await store.finish_redelivery(
        "tok",
        markers_topic=MARKERS,
        partitions=[0],
        done=[key(50), key(51)],
        dead=[],
        lost=[],
        retry=[],
        now_ms=T0 + 300,
    )
    assert await store.get_entry(key(50)) is None
    assert await store.get_entry(key(51)) == restarted


async def test_finish_redelivery_dead_records_the_dead_letter(store: TrackerStore) -> None:
    epochs = await claim(store)
    copy = Marker.start(GROUP, msg(970), attempt=3, origin=msg(52), timeout_ms=5_000)
    reject = Marker.reject(GROUP, msg(970), attempt=3, origin=msg(52), reason="bad json")
    await apply(store, epochs, [pending(copy, T0, 0)])
    await apply(store, epochs, [pending(reject, T0 + 100, 1)])
    claimed, _ = await claim_due(store, epochs, T0 + 200, "tok")
    [entry] = claimed
    record = DeadLetterRecord(
        entry=entry,
        dlq_topic="orders.dlq",
        dlq_partition=2,
        dlq_offset=77,
        reason="rejected by the consumer",
        dead_lettered_ms=T0 + 300,
        message_key=b"\x00key\xff",
    )
    await store.finish_redelivery(
        "tok",
        markers_topic=MARKERS,
        partitions=[0],
        done=[],
        dead=[record],
        lost=[],
        retry=[],
        now_ms=T0,
    )
    assert await store.get_entry(key(52)) is None

    [row] = await store.list_dead_letters()
    assert isinstance(row.pop("id"), int)
    assert row == {
        "group_id": GROUP,
        "origin_topic": TOPIC,
        "origin_partition": 0,
        "origin_offset": 52,
        "source_topic": TOPIC,
        "source_partition": 0,
        "source_offset": 970,
        "dlq_topic": "orders.dlq",
        "dlq_partition": 2,
        "dlq_offset": 77,
        "reason": "rejected by the consumer",
        "last_error": "bad json",
        "attempts": 3,
        "first_seen_ms": T0,
        "dead_lettered_ms": T0 + 300,
        "message_key": b"\x00key\xff",
        "redriven_ms": None,
    }


async def test_finish_redelivery_lost_and_retry(store: TrackerStore) -> None:
    epochs = await claim(store)
    for offset in (53, 54, 55):
        await start(store, epochs, offset, timeout_ms=10)
    claimed, _ = await claim_due(store, epochs, T0 + 100, "tok")
    assert len(claimed) == 3

    await store.finish_redelivery(
        "tok",
        markers_topic=MARKERS,
        partitions=[0],
        done=[],
        dead=[],
        lost=[(key(53), "offset 53 is below the log start")],
        retry=[(key(54), T0 + 60_000)],
        now_ms=T0 + 500,
    )
    lost = await store.get_entry(key(53))
    assert lost is not None
    assert (lost.state, lost.due_at_ms, lost.claim_token, lost.reason, lost.updated_ms) == (
        State.LOST,
        None,
        None,
        "offset 53 is below the log start",
        T0 + 500,
    )
    assert await store.count_entries(State.LOST) == 1
    retried = await store.get_entry(key(54))
    assert retried is not None
    assert (retried.state, retried.due_at_ms, retried.claim_token) == (
        State.IN_FLIGHT,
        T0 + 60_000,
        None,
    )
    untouched = await store.get_entry(key(55))
    assert untouched is not None
    assert (untouched.claim_token, untouched.due_at_ms) == ("tok", T0 + 5_100)

    # another token's outcome does not touch entries claimed with "tok"
    await store.finish_redelivery(
        "other",
        markers_topic=MARKERS,
        partitions=[0],
        done=[key(55)],
        dead=[],
        lost=[(key(55), "no")],
        retry=[(key(55), T0)],
        now_ms=T0 + 600,
    )
    assert await store.get_entry(key(55)) == untouched


async def test_copies_falling_due_name_the_records_redelivery_will_read(
    store: TrackerStore,
) -> None:
    """What redelivery reads ahead (``tracker.engine.read_ahead``): the positions of the
    records that entries and ranges due in a window will copy, earliest first, only the
    owned partitions', never what the store keeps a payload for; and the query claims
    nothing."""
    epochs = await claim(store, [0, 1])
    long_ms = KEEP_PAYLOAD_AFTER_MS + 1_000
    copy = Marker.start(GROUP, msg(200), attempt=2, origin=msg(20), timeout_ms=3_000)
    markers = [
        pending(Marker.start(GROUP, msg(10), timeout_ms=1_000), T0, 0),
        pending(copy, T0, 1),  # a copy's entry reads the copy's record
        pending(RangeMarker.start(GROUP, TOPIC, 0, 30, 33, timeout_ms=2_000), T0, 2),
        pending(RangeMarker.settle(GROUP, TOPIC, 0, 31, 31), T0, 3),
        pending(Marker.delay(GROUP, msg(40), delay_ms=long_ms), T0, 4),  # payload kept below
        pending(Marker.delay(GROUP, msg(41), delay_ms=long_ms), T0, 5),  # not kept yet
        pending(Marker.start(GROUP, msg(50), timeout_ms=1_000), T0, 0, markers_partition=1),
    ]
    await apply(store, epochs, markers)
    await store.store_payloads([(key(40), StoredPayload(None, b"kept", (), T0))])

    found = await store.copies_falling_due([0], T0, T0 + 3_000, limit=100)
    assert found == [
        (T0 + 1_000, msg(10)),
        (T0 + 2_000, msg(30)),
        (T0 + 2_000, msg(32)),
        (T0 + 2_000, msg(33)),
        (T0 + 3_000, msg(200)),
    ]
    # the window is (after, until]: due at ``after`` was read by the look before
    assert await store.copies_falling_due([0], T0 + 1_000, T0 + 2_000, 100) == found[1:4]
    assert await store.copies_falling_due([0], T0, T0 + 3_000, limit=2) == found[:2]
    assert await store.copies_falling_due([1], T0, T0 + 3_000, 100) == [(T0 + 1_000, msg(50))]
    assert await store.copies_falling_due([0, 1], T0, T0 + 999, 100) == []
    assert await store.copies_falling_due([], T0, T0 + 3_000, 100) == []
    late = T0 + long_ms
    assert await store.copies_falling_due([0], late - 1, late, 100) == [(late, msg(41))]
    # reading ahead claims nothing: the round still finds every entry due
    claimed, _ = await claim_due(store, epochs, T0 + 3_000, "r1", due_by={0: T0 + 3_000})
    assert sorted(e.origin_offset for e in claimed) == [10, 20, 30, 32, 33]


# -- payloads ------------------------------------------------------------------------------


async def test_payloads_of_long_delays_are_kept_and_read_back_exactly(store: TrackerStore) -> None:
    epochs = await claim(store, [0, 1])
    long_ms = KEEP_PAYLOAD_AFTER_MS + 1_000
    markers = [
        pending(Marker.delay(GROUP, msg(60), delay_ms=long_ms, deferred=True), T0, 0),
        pending(Marker.delay(GROUP, msg(61), delay_ms=long_ms, deferred=True), T0, 1),
        pending(Marker.delay(GROUP, msg(62), delay_ms=1_000), T0, 2),  # short: no copy
        pending(Marker.delay(GROUP, msg(63), delay_ms=long_ms), T0, 0, markers_partition=1),
    ]
    await apply(store, epochs, markers)

    needing = await store.entries_needing_payload([0], limit=10)
    assert sorted(e.key for e in needing) == [key(60), key(61)]
    assert [e.key for e in await store.entries_needing_payload([1], limit=10)] == [key(63)]
    assert len(await store.entries_needing_payload([0, 1], limit=2)) == 2
    assert await store.entries_needing_payload([], limit=10) == []

    headers = (
        ("kmq-attempt", b"1"),
        ("empty", b""),
        ("binary", bytes(range(256))),
        ("empty", b"again, same name"),
        ("ünïcode", "välue".encode()),
    )
    payload_60 = StoredPayload(b"\x00k\xff", b"\x00\x01value\xfe" * 1000, headers, T0 - 5)
    payload_61 = StoredPayload(None, None, (), T0 - 6)  # no key, tombstone, no headers
    await store.store_payloads([(key(60), payload_60), (key(61), payload_61)])

    assert await store.entries_needing_payload([0], limit=10) == []
    loaded = await store.load_payloads([key(60), key(61), key(62), key(99)])
    assert loaded == {key(60): payload_60, key(61): payload_61}
    assert loaded[key(60)].headers == headers


# -- volume --------------------------------------------------------------------------------


@pytest.mark.slow
async def test_twenty_thousand_starts_in_one_apply(store: TrackerStore) -> None:
    epochs = await claim(store, [0, 1])
    count = 20_000
    markers = [
        pending(
            Marker.start(GROUP, msg(offset, partition=offset % 3), timeout_ms=1_000 + offset),
            T0,
            offset // 2,
            markers_partition=offset % 2,
        )
        for offset in range(count)
    ]
    result = await apply(store, epochs, markers)
    assert result.anomalies == []
    assert (result.upserted, result.earliest_due_ms) == (count, T0 + 1_000)
    assert await store.count_entries() == count
    assert await store.count_entries(State.IN_FLIGHT) == count
    assert await store.next_due_ms([1]) == T0 + 1_001
    assert await store.partition_offsets(MARKERS) == {0: (1, count // 2), 1: (1, count // 2)}

    # and all of them acknowledged in one apply
    acks = [
        pending(Marker.ack(GROUP, msg(offset, partition=offset % 3)), T0 + 1, 0)
        for offset in range(count)
    ]
    result = await store.apply(MARKERS, {0: PartitionProgress(1, count)}, acks, policy_for, T0 + 1)
    assert (result.deleted, result.anomalies) == (count, [])
    assert await store.count_entries() == 0


# -- topic counters (migration 0003) -------------------------------------------------------


async def test_large_flushes_insert_and_then_update_every_entry(store: TrackerStore) -> None:
    """Thousands of entries per flush (PostgreSQL writes them through COPY), then the same
    keys again (the conflict path): every entry is exactly as the last marker left it."""
    epochs = await claim(store)
    n = 3_000
    delays = [
        pending(Marker.delay(GROUP, msg(o), delay_ms=60_000, reason="first"), T0, o)
        for o in range(n)
    ]
    await apply(store, epochs, delays)
    again = [
        pending(Marker.delay(GROUP, msg(o), delay_ms=o, reason=f"second {o}"), T0 + 5, n + o)
        for o in range(0, n, 2)
    ]
    await apply(store, epochs, again)
    entries = {e.origin_offset: e for e in await store.list_entries(10 * n)}
    assert len(entries) == n
    for o, entry in entries.items():
        if o % 2:
            assert (entry.due_at_ms, entry.reason) == (T0 + 60_000, "first")
        else:
            assert (entry.due_at_ms, entry.reason, entry.updated_ms) == (
                T0 + 5 + o,
                f"second {o}",
                T0 + 5,
            )
    assert await store.count_entries(State.DELAYED) == n


# -- range markers against the per-message model -------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    drawn=markers_strategy,
    cuts=st.lists(st.booleans(), min_size=1, max_size=8),
    due_gap=st.integers(0, 70_000),
    during=during_round_strategy,
    outcomes=outcomes_strategy,
)
def test_the_memory_store_decides_as_the_per_message_model(
    drawn: list[tuple[AnyMarker, int]],
    cuts: list[bool],
    due_gap: int,
    during: list[tuple[AnyMarker, int]],
    outcomes: list[int],
) -> None:
    """The in-memory side of the range property test that the SQL stores pass in
    ``tests/integration/test_range_store.py`` (same scenario, same reference): many more
    examples, since each costs microseconds."""
    steps = steps_with_times(drawn)
    if steps:
        asyncio.run(
            check_store_against_model(
                InMemoryStore(),
                steps,
                cuts,
                steps[-1][1] + due_gap,
                during=during,
                outcomes=outcomes,
            )
        )


async def test_a_claimed_range_follows_the_markers_of_its_round_as_v1_entries_would(
    store: TrackerStore,
) -> None:
    """A due range is claimed as a range (one row, token and lease); markers that arrive
    while its round runs act on it as on the claimed v1 entries it stands for, and the
    round's record then goes by what each offset became: a settle removes it, an extension
    keeps the round's claim (the copy is out), a START of the copy takes it out of the
    round, and only offsets the round did not finish become entries of their own."""
    epochs = await claim(store)
    batch = RangeMarker.start(GROUP, TOPIC, 0, 0, 9, timeout_ms=1_000, consumer="c-1")
    await apply(store, epochs, [pending(batch, T0, 0)])
    claimed, _ = await claim_due(store, epochs, T0 + 1_000, "r1", limit=100)
    assert sorted(e.origin_offset for e in claimed) == list(range(10))
    assert {(e.claim_token, e.due_at_ms, e.attempt) for e in claimed} == {("r1", T0 + 1_000, 1)}

    during = T0 + 1_100
    copy_start = Marker.start(GROUP, msg(100), attempt=2, origin=msg(5), consumer="c-2")
    await apply(
        store,
        epochs,
        [
            pending(RangeMarker.settle(GROUP, TOPIC, 0, 0, 1), during, 1),
            pending(RangeMarker.extend(GROUP, TOPIC, 0, 2, 4, timeout_ms=60_000), during, 2),
            pending(copy_start, during, 3),
            pending(Marker.extend(GROUP, msg(6), timeout_ms=60_000), during, 4),
        ],
    )
    await store.finish_redelivery(
        "r1",
        markers_topic=MARKERS,
        partitions=[0],
        done=[key(o) for o in range(8)],
        dead=[],
        lost=[(key(8), "gone")],
        retry=[(key(9), T0 + 2_000)],
        now_ms=T0 + 1_500,
    )
    left = {e.origin_offset: e for e in await store.list_entries(100)}
    assert sorted(left) == [5, 8, 9]
    copy = left[5]
    assert (copy.attempt, copy.state, copy.claim_token, copy.copy_offset) == (
        2,
        State.IN_FLIGHT,
        None,
        100,
    )
    assert (left[8].state, left[8].reason, left[8].claim_token) == (State.LOST, "gone", None)
    put_back = left[9]
    assert (put_back.state, put_back.attempt, put_back.due_at_ms, put_back.claim_token) == (
        State.IN_FLIGHT,
        1,
        T0 + 2_000,
        None,
    )
    assert await store.list_ranges() == []
    if isinstance(store, Store):
        await assert_counters_match(store.engine)


async def test_a_batch_of_v1_starts_is_stored_claimed_and_marked_as_a_range(
    store: TrackerStore,
) -> None:
    """v1 STARTs of one batch (same timestamp, lease, consumer) are kept as one range: one row
    for the store, one claim for redelivery; every message reads as the entry its START
    made, and a message marked lost leaves the range for an entry of its own."""
    epochs = await claim(store)
    starts = [
        pending(Marker.start(GROUP, msg(o), timeout_ms=1_000, consumer="c-1"), T0, o)
        for o in range(100, 150)
    ]
    await apply(store, epochs, starts)
    [run] = await store.list_ranges()
    assert (run.base_offset, run.last_offset, run.open_count, run.due_at_ms) == (
        100,
        149,
        50,
        T0 + 1_000,
    )
    assert await store.count_entries(State.IN_FLIGHT) == 50
    entry = await store.get_entry(key(120))
    assert entry is not None
    assert (entry.attempt, entry.consumer, entry.due_at_ms, entry.copy_offset) == (
        1,
        "c-1",
        T0 + 1_000,
        120,
    )

    await store.mark_lost([(key(120), "retention")], T0 + 10)
    lost = await store.get_entry(key(120))
    assert lost is not None
    assert (lost.state, lost.reason) == (State.LOST, "retention")
    assert sum(t.open_count for t in await store.list_ranges()) == 49
    assert await store.count_entries(State.IN_FLIGHT) == 49

    claimed, _ = await claim_due(store, epochs, T0 + 1_000, "round", limit=100)
    assert [e.origin_offset for e in claimed] == [o for o in range(100, 150) if o != 120]
    if isinstance(store, Store):
        await assert_counters_match(store.engine)


async def test_a_due_range_is_claimed_as_a_range_not_an_entry_per_offset(
    store: TrackerStore,
) -> None:
    """``claim_due_ranges`` hands a round the due ranges as ranges (as they were, with the
    token) and the due entries apart; the range that crosses the batch is split, its lowest
    offsets claimed and the rest left due for the next claim."""
    epochs = await claim(store)
    await start(store, epochs, 40, timeout_ms=1_000)
    # Extended on its own: a diverged offset, kept as a per-message entry.
    await apply(store, epochs, [pending(Marker.extend(GROUP, msg(40), timeout_ms=1_000), T0, 41)])
    batch = RangeMarker.start(GROUP, TOPIC, 0, 0, 9, exceptions=0b100, timeout_ms=2_000)
    await apply(store, epochs, [pending(batch, T0, 5)])
    taken = await store.claim_due_ranges(
        MARKERS,
        epochs=epochs,
        due_by=dict.fromkeys(epochs, T0 + 5_000),
        now_ms=T0 + 5_000,
        limit=5,
        lease_ms=5_000,
        token="r1",  # noqa: S106 - a round id
    )
    assert taken.fenced == set()
    assert [(e.origin_offset, e.claim_token) for e in taken.entries] == [(40, "r1")]
    [claimed] = taken.ranges
    assert (claimed.base_offset, list(claimed.offsets())) == (0, [0, 1, 3, 4])
    assert (claimed.claim_token, claimed.due_at_ms, claimed.group_id) == ("r1", T0 + 2_000, GROUP)
    assert [e.origin_offset for e in taken.expanded()] == [0, 1, 3, 4, 40]
    rest = [t for t in await store.list_ranges() if t.claim_token is None]
    assert [(list(t.offsets()), t.due_at_ms) for t in rest] == [([5, 6, 7, 8, 9], T0 + 2_000)]


async def test_a_range_claim_that_outlived_its_lease_is_recorded_by_its_new_round_only(
    store: TrackerStore,
) -> None:
    """A round that stalls past its lease loses the range to the next claim; its late record
    must then change nothing (the new round's copies are what count), as for v1 entries."""
    epochs = await claim(store)
    batch = RangeMarker.start(GROUP, TOPIC, 0, 0, 3, timeout_ms=1_000)
    await apply(store, epochs, [pending(batch, T0, 0)])
    first, _ = await claim_due(store, epochs, T0 + 1_000, "r1", lease_ms=1_000)
    again, _ = await claim_due(store, epochs, T0 + 2_000, "r2", lease_ms=1_000)
    assert [e.key for e in again] == [e.key for e in first] == [key(o) for o in range(4)]

    async def record(token: str, done: list[EntryKey], now_ms: int) -> None:
        await store.finish_redelivery(
            token, markers_topic=MARKERS, partitions=[0], done=done, dead=[], lost=[], retry=[],
            now_ms=now_ms,
        )  # fmt: skip

    await record("r1", [key(0)], T0 + 2_100)
    assert await store.count_entries() == 4
    await record("r2", [key(0), key(1)], T0 + 2_200)
    assert sorted(e.origin_offset for e in await store.list_entries(10)) == [2, 3]
    assert await store.list_ranges() == []


async def test_due_ranges_and_due_entries_share_a_claim_in_due_order(
    store: TrackerStore,
) -> None:
    """A batch takes the earliest due messages whether they are entries or offsets of
    ranges: a mass expiry of ranges does not hold back an entry due before it, nor the reverse
    (the range crossing the batch is split)."""
    epochs = await claim(store)
    await start(store, epochs, 40, timeout_ms=1_000)  # due T0 + 1,000
    await start(store, epochs, 41, timeout_ms=3_000)  # due T0 + 3,000
    batch = RangeMarker.start(GROUP, TOPIC, 0, 0, 9, timeout_ms=2_000)
    await apply(store, epochs, [pending(batch, T0, 5)])
    first, _ = await claim_due(store, epochs, T0 + 5_000, "r1", limit=5)
    assert sorted(e.origin_offset for e in first) == [0, 1, 2, 3, 40]
    second, _ = await claim_due(store, epochs, T0 + 5_000, "r2", limit=10)
    assert sorted(e.origin_offset for e in second) == [4, 5, 6, 7, 8, 9, 41]
    assert {e.claim_token for e in second} == {"r2"}
