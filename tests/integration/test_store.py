"""The SQL store's own concerns (``tracker.store.manager.Store``) on SQLite and Postgres: its
counters, SQLite's locking and query plans. What every store must do is in the contract suite
(``tests/contract/test_store_contract.py``).

Every test runs on both databases (``database_url``), each a database of the test's own.
All times are explicit milliseconds; nothing here reads the wall clock.
"""

from __future__ import annotations

import asyncio
import socket
import sqlite3
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import delete, func, select, update
from support.counts import counters_and_recount
from support.databases import sqlite_url
from support.sql_stores import empty_sql_store
from support.store_steps import (
    GROUP,
    MARKERS,
    T0,
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

from tracker.domain.actions import ActionKind, ActionRequest
from tracker.domain.entries import Entry, State
from tracker.protocol import Marker
from tracker.store import StoreUnavailable
from tracker.store.admin_reads import DeadLetterFilter
from tracker.store.dialects import (
    COPY_UPSERT_ROWS,
    driver_rows,
    keys_in,
    start_upsert,
    upsert_rows,
)
from tracker.store.folded_writes import CHUNK_ROWS
from tracker.store.inspection import EntryFilter, InspectionQueries
from tracker.store.manager import Store, payload_wanted
from tracker.store.migrate import upgrade
from tracker.store.operator_actions import OperatorActions
from tracker.store.ownership import fence_touch
from tracker.store.port import (
    DeadLetterRecord,
    PartitionProgress,
)
from tracker.store.redrive_jobs import RedriveJobStore, RedriveSpec
from tracker.store.tables import (
    ENTRY_COLUMN_NAMES,
    ENTRY_UPDATE_COLUMNS,
    KEY_COLUMNS,
    partitions_table,
    row_from_entry,
    tracked,
    tracked_counts,
)

pytestmark = [pytest.mark.integration]


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[Store]:
    async with empty_sql_store(database_url) as store:
        yield store


@pytest.fixture
async def replica_b(store: Store, database_url: str) -> AsyncIterator[Store]:
    """A second Store on the same database: another tracker replica."""
    other = Store.from_url(database_url)
    try:
        yield other
    finally:
        await other.close()


async def test_sqlite_reads_do_not_wait_for_a_writer(tmp_path: Path) -> None:
    """While another connection holds SQLite's write lock (a long flush, a seeding job), the
    admin API's reads and the redelivery's due-scan answer at once from the last commit;
    writes queue behind the lock."""
    path = tmp_path / "kmq.sqlite3"
    store = Store.from_url(sqlite_url(path))
    await upgrade(store.engine)
    try:
        await _reads_while_locked(store, str(path))
    finally:
        await store.close()


async def _reads_while_locked(store: Store, path: str) -> None:
    epochs = await claim(store)
    await start(store, epochs, 60)
    queries = InspectionQueries(store, MARKERS)
    writer = await asyncio.to_thread(
        sqlite3.connect, path, timeout=60, isolation_level=None, check_same_thread=False
    )
    try:
        await asyncio.to_thread(writer.execute, "BEGIN IMMEDIATE")
        entries = await asyncio.wait_for(queries.list_entries(EntryFilter(topic=TOPIC)), 5)
        assert [v.entry.origin_offset for v in entries] == [60]
        assert await asyncio.wait_for(queries.get_entry(key(60)), 5) is not None
        assert await asyncio.wait_for(store.next_due_ms([0]), 5) == T0 + 5_000
        write = asyncio.ensure_future(start(store, epochs, 61))
        done, _ = await asyncio.wait({write}, timeout=0.5)
        assert not done, "a write went through while another connection held the lock"
    finally:
        await asyncio.to_thread(writer.execute, "ROLLBACK")
        await asyncio.to_thread(writer.close)
    await asyncio.wait_for(write, 30)
    assert await store.get_entry(key(61)) is not None


async def test_sqlite_key_lookups_search_the_primary_key(tmp_path: Path) -> None:
    """Loading, claiming and deleting entries by key must not scan the table: at 1M tracked
    entries a scan per flush made ingest 17x slower than at 10k."""
    store = Store.from_url(sqlite_url(tmp_path / "kmq.sqlite3"))
    await upgrade(store.engine)
    try:
        keys = [key(offset) for offset in range(3)] + [key(9, partition=1)]
        query = select(tracked.c.origin_offset).where(keys_in(store.engine, KEY_COLUMNS, keys))
        async with store.engine.connect() as conn:
            compiled = query.compile(conn.sync_connection, compile_kwargs={"literal_binds": True})
            plan = (await conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {compiled}")).all()
        details = [row[-1] for row in plan]
        assert not any(d.startswith("SCAN tracked_messages") for d in details), details
        assert any("SEARCH tracked_messages USING" in d for d in details), details
        with pytest.raises(ValueError, match="chunk"):
            keys_in(
                store.engine,
                [tracked.c.origin_partition, tracked.c.origin_offset],
                [(i, 0) for i in range(501)],
            )
    finally:
        await store.close()


async def _reads_are_unavailable(queries: InspectionQueries) -> None:
    """A listing and the topic statistics both fail with the store's own error."""
    with pytest.raises(StoreUnavailable, match="database error"):
        await queries.list_entries(EntryFilter())
    with pytest.raises(StoreUnavailable, match="database error"):
        await queries.topic_counts(since_ms=T0)


async def test_reads_of_a_sqlite_file_that_is_not_a_database_fail_cleanly_then_recover(
    tmp_path: Path,
) -> None:
    """Admin reads on SQLite run on an engine of their own (``SqlDatabase.read``): a file
    that is no database gives the store's own error, not a driver's, and once the file is a
    database again the same store reads it."""
    path = tmp_path / "kmq.sqlite3"
    path.write_bytes(b"this is not a database" * 400)
    store = Store.from_url(sqlite_url(path))
    queries = InspectionQueries(store, MARKERS)
    try:
        await _reads_are_unavailable(queries)
        path.unlink()
        healthy = Store.from_url(sqlite_url(path))
        try:
            await upgrade(healthy.engine)
            epochs = await claim(healthy)
            await start(healthy, epochs, 7)
        finally:
            await healthy.close()
        assert [v.entry.key for v in await queries.list_entries(EntryFilter())] == [key(7)]
        assert (await queries.topic_counts(since_ms=T0))[TOPIC].in_flight == 1
    finally:
        await store.close()


async def test_reads_of_a_postgres_server_that_does_not_answer_fail_cleanly() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = Store.from_url(f"postgresql+asyncpg://postgres@127.0.0.1:{port}/test")
    queries = InspectionQueries(store, MARKERS)
    try:
        await _reads_are_unavailable(queries)
    finally:
        await store.close()


async def test_the_payload_keepers_question_reads_its_partial_index(store: Store) -> None:
    """The payload keeper asks every few seconds which entries still want their payload
    copied; at 1M tracked entries a scan for them took 200 ms (on SQLite under the writer's
    lock). The question must read ``ix_tracked_payload_wanted``, which holds only those."""
    query = payload_wanted([0, 1, 2], 500)
    async with store.engine.begin() as conn:
        compiled = query.compile(conn.sync_connection, compile_kwargs={"literal_binds": True})
        if store.is_sqlite:
            plan = (await conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {compiled}")).all()
        else:  # an empty table: tell the planner that reading all of it is not an option
            await conn.exec_driver_sql("SET LOCAL enable_seqscan = off")
            plan = (await conn.exec_driver_sql(f"EXPLAIN {compiled}")).all()
    details = " | ".join(str(row[-1]) for row in plan)
    assert "ix_tracked_payload_wanted" in details, details


async def test_topic_counts_follow_ingest_claims_and_rounds(store: Store) -> None:
    queries = InspectionQueries(store, MARKERS)
    epochs = await claim(store, [0, 1])
    for offset in (1, 2, 3, 4):
        await start(store, epochs, offset, ref_ms=T0 + offset, timeout_ms=60_000)
    await start(store, epochs, 9, topic="audit", markers_partition=1, timeout_ms=10)
    await apply(
        store,
        epochs,
        [
            pending(Marker.delay(GROUP, msg(2), delay_ms=5_000), T0 + 10, 10),
            pending(Marker.delay(GROUP, msg(3), delay_ms=2_000), T0 + 10, 11),
            pending(Marker.reject(GROUP, msg(4), reason="bad"), T0 + 10, 12),
            pending(Marker.ack(GROUP, msg(1)), T0 + 10, 13),
        ],
    )
    counts = await queries.topic_counts(since_ms=T0)
    assert set(counts) == {TOPIC, "audit"}
    orders = counts[TOPIC]
    assert (orders.in_flight, orders.delayed, orders.rejected, orders.lost) == (0, 2, 1, 0)
    assert orders.oldest_in_flight_first_seen_ms is None
    assert orders.next_delayed_due_ms == T0 + 10 + 2_000
    audit = counts["audit"]
    assert (audit.in_flight, audit.oldest_in_flight_first_seen_ms) == (1, T0)

    # A round: the rejected entry is dead-lettered, the audit entry's original is lost.
    claimed, _ = await claim_due(store, epochs, T0 + 1_000, "tok")
    by_key = {e.key: e for e in claimed}
    assert set(by_key) == {key(4), key(9, "audit")}
    await store.finish_redelivery(
        "tok",
        markers_topic=MARKERS,
        partitions=[0, 1],
        done=[],
        dead=[
            DeadLetterRecord(
                entry=by_key[key(4)],
                dlq_topic="orders.dlq",
                dlq_partition=0,
                dlq_offset=0,
                reason="rejected",
                dead_lettered_ms=T0 + 1_000,
                message_key=None,
            )
        ],
        lost=[(key(9, "audit"), "gone")],
        retry=[],
        now_ms=T0 + 1_000,
    )
    counts = await queries.topic_counts(since_ms=T0 + 500)
    orders, audit = counts[TOPIC], counts["audit"]
    assert (orders.delayed, orders.rejected, orders.dead_lettered) == (2, 0, 1)
    assert (orders.dead_letters_waiting, orders.dead_lettered_recently) == (1, 1)
    assert (audit.in_flight, audit.lost) == (0, 1)
    assert (await queries.topic_counts(since_ms=T0 + 2_000))[TOPIC].dead_lettered_recently == 0
    # One topic asked for: only its figures.
    assert set(await queries.topic_counts(since_ms=T0, topic="audit")) == {"audit"}

    kept, recount = await counters_and_recount(store.engine)
    assert kept == recount
    assert kept[0] == {(0, TOPIC, GROUP, "delayed"): 2, (1, "audit", GROUP, "lost"): 1}


async def test_a_flush_of_many_write_chunks_is_written_whole_or_not_at_all(store: Store) -> None:
    """A flush's rows go out in chunks while later lanes still fold (FoldedWrites): every
    chunk lands, in one transaction with the offsets; a failure after some chunks went out
    applies none of them."""
    epochs = await claim(store, [0, 1])
    lanes = 3
    per_lane = CHUNK_ROWS // 2  # the 3 lanes of the second flush need at least 2 chunks
    await apply(
        store,
        epochs,
        [pending(Marker.start(GROUP, msg(o), timeout_ms=60_000), T0, o) for o in range(per_lane)],
    )
    # Deletes (acks), updates (the started messages delayed) and new rows, across lanes.
    flush = [pending(Marker.ack(GROUP, msg(o)), T0 + 1, o) for o in range(per_lane // 2)]
    flush += [
        pending(Marker.delay(GROUP, msg(o), delay_ms=60_000), T0 + 1, o)
        for o in range(per_lane // 2, per_lane)
    ]
    flush += [
        pending(Marker.delay(GROUP, msg(o, partition=lane), delay_ms=60_000), T0 + 1, o, 1)
        for lane in range(1, lanes)
        for o in range(per_lane)
    ]
    next_offsets = {0: per_lane, 1: per_lane}
    result = await store.apply(
        MARKERS,
        {p: PartitionProgress(e, next_offsets[p]) for p, e in epochs.items()},
        flush,
        policy_for,
        T0 + 1,
    )
    assert not result.anomalies
    async with store.engine.connect() as conn:
        counted = await conn.execute(
            select(tracked.c.state, func.count()).group_by(tracked.c.state)
        )
        states: dict[str, int] = {row[0]: row[1] for row in counted}
    assert states == {"delayed": per_lane // 2 + (lanes - 1) * per_lane}
    kept, recount = await counters_and_recount(store.engine)
    assert kept == recount

    async def snapshot() -> list[Any]:
        async with store.engine.connect() as conn:
            rows = list(await conn.execute(select(tracked).order_by(*KEY_COLUMNS)))
            rows += list(await conn.execute(select(partitions_table)))
        return rows

    before = await snapshot()

    def broken_policy(topic: str) -> Any:
        if topic == "zz-last":
            raise RuntimeError("no policy for zz-last")
        return policy_for(topic)

    # Lanes fold in key order: the "orders" lanes' new rows are sent (on PostgreSQL their
    # upsert is still in flight) before the lane that fails folds.
    failing = [
        pending(
            Marker.delay(GROUP, msg(per_lane + o, partition=lane), delay_ms=60_000),
            T0 + 2,
            per_lane + o,
            1,
        )
        for lane in range(1, lanes)
        for o in range(per_lane)
    ]
    failing.append(pending(Marker.start(GROUP, msg(0, topic="zz-last")), T0 + 2, per_lane * 3, 1))
    with pytest.raises(RuntimeError, match="no policy"):
        await store.apply(
            MARKERS,
            {1: PartitionProgress(epochs[1], per_lane * 3 + 1)},
            failing,
            broken_policy,
            T0 + 2,
        )
    assert await snapshot() == before


async def test_an_upsert_cancelled_as_it_is_sent_ends_before_the_rollback(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL's upsert returns with its statement in flight (start_upsert); cancelled in
    the one loop turn that sends it, it waits for the statement, so the transaction rolls
    back cleanly instead of failing on a busy connection."""
    rows = [
        row_from_entry(Entry(GROUP, TOPIC, 0, o, 0, State.DELAYED, 1, TOPIC, 0, o, T0, T0, T0))
        for o in range(COPY_UPSERT_ROWS)
    ]
    real_sleep = asyncio.sleep
    cancelled: list[float] = []

    async def cancelled_once(delay: float, *args: Any) -> Any:
        if delay == 0 and not cancelled:
            cancelled.append(delay)
            await real_sleep(0)  # the turn: the statement goes out
            raise asyncio.CancelledError  # and the caller is cancelled in it
        return await real_sleep(delay, *args)

    async with empty_sql_store(postgres_url) as store:
        monkeypatch.setattr(asyncio, "sleep", cancelled_once)  # start_upsert's one turn
        with pytest.raises(asyncio.CancelledError):
            async with store.transaction() as conn:
                await start_upsert(conn, tracked, ENTRY_COLUMN_NAMES, ENTRY_UPDATE_COLUMNS, rows)
        monkeypatch.undo()
        assert cancelled
        async with store.engine.connect() as conn:
            assert (await conn.execute(select(func.count()).select_from(tracked))).scalar() == 0


async def test_a_second_upsert_in_a_transaction_does_not_apply_the_first_one_again(
    store: Store,
) -> None:
    """Chunked upserts share PostgreSQL's COPY staging table within a transaction: each must
    apply its own rows only, or rows changed between two chunks are written back as they
    were."""

    def rows(first: int) -> list[tuple[Any, ...]]:
        return [
            row_from_entry(Entry(GROUP, TOPIC, 0, o, 0, State.DELAYED, 1, TOPIC, 0, o, T0, T0, T0))
            for o in range(first, first + COPY_UPSERT_ROWS)
        ]

    async with store.transaction() as conn:
        await upsert_rows(conn, tracked, ENTRY_COLUMN_NAMES, ENTRY_UPDATE_COLUMNS, rows(0))
        await conn.execute(update(tracked).values(state=State.LOST.value, due_at_ms=None))
        await upsert_rows(
            conn, tracked, ENTRY_COLUMN_NAMES, ENTRY_UPDATE_COLUMNS, rows(COPY_UPSERT_ROWS)
        )
    async with store.engine.connect() as conn:
        counted = await conn.execute(
            select(tracked.c.state, func.count()).group_by(tracked.c.state)
        )
        states: dict[str, int] = {row[0]: row[1] for row in counted}
    assert states == {State.LOST.value: COPY_UPSERT_ROWS, State.DELAYED.value: COPY_UPSERT_ROWS}
    async with store.transaction() as conn:  # written around the counters: gone again
        await conn.execute(delete(tracked))


def _varied_rows(count: int, attempt: int = 1) -> list[tuple[Any, ...]]:
    """Entry rows whose text, null and boolean columns vary (what a driver must carry as
    they are)."""
    texts = ["", "plain", "quote ' and \" and \\", "tab\tand\nnewline", "é 中文 😀", "x" * 3000]
    return [
        row_from_entry(
            Entry(
                GROUP,
                TOPIC,
                o % 3,
                o,
                o % 8,
                State.DELAYED if o % 2 else State.IN_FLIGHT,
                attempt,
                TOPIC,
                o % 3,
                o + 10**12,
                None if o % 7 == 0 else T0 + o,
                T0,
                T0 + attempt,
                deferred=o % 5 == 0,
                consumer=texts[o % len(texts)][:255],
                reason=texts[(o + attempt) % len(texts)],
                keep_payload=o % 4 == 0,
                claim_token=None if o % 3 else f"token-{o}",
            )
        )
        for o in range(count)
    ]


@pytest.mark.parametrize("count", [1, 3, 255, 256, 1023, 1024, 1025, 2600])
async def test_an_upsert_writes_exactly_its_rows_whatever_their_number(
    store: Store, count: int
) -> None:
    """Rows go to the database in statements of several sizes (SQLite: multi-row statements
    of up to 1,024 rows, one of them left in flight; PostgreSQL: arrays or COPY): whatever
    the count, every row is inserted, then updated, with its values as they were."""
    columns = ", ".join(ENTRY_COLUMN_NAMES)
    order = "origin_topic, origin_partition, origin_offset"

    async def stored() -> list[tuple[Any, ...]]:
        async with store.engine.connect() as conn:
            found = await conn.exec_driver_sql(
                f"SELECT {columns} FROM tracked_messages ORDER BY {order}"  # noqa: S608
            )
            return [
                tuple(bool(v) if i in (13, 16) else v for i, v in enumerate(row)) for row in found
            ]

    def expected(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        return sorted(rows, key=lambda row: (row[1], row[2], row[3]))

    first = _varied_rows(count)
    async with store.transaction() as conn:
        await upsert_rows(conn, tracked, ENTRY_COLUMN_NAMES, ENTRY_UPDATE_COLUMNS, first)
    assert await stored() == expected(first)
    later = _varied_rows(count, attempt=2)
    async with store.transaction() as conn:
        await upsert_rows(conn, tracked, ENTRY_COLUMN_NAMES, ENTRY_UPDATE_COLUMNS, later)
    assert await stored() == expected(later)
    async with store.transaction() as conn:  # written around the counters: gone again
        await conn.execute(delete(tracked))


@pytest.mark.parametrize("count", [3, 256])
async def test_a_refused_upsert_fails_its_transaction_and_writes_nothing(
    store: Store, count: int
) -> None:
    """A row the database refuses (a NULL state) fails the upsert, inline or in flight, as
    the store's own error, and nothing of the transaction is written."""
    rows = _varied_rows(count)
    rows[-1] = (*rows[-1][:5], None, *rows[-1][6:])

    async def write() -> None:
        async with store.transaction() as conn:
            await conn.execute(delete(partitions_table))
            await upsert_rows(conn, tracked, ENTRY_COLUMN_NAMES, ENTRY_UPDATE_COLUMNS, rows)

    await claim(store)
    with pytest.raises(StoreUnavailable):
        await write()
    async with store.engine.connect() as conn:
        assert (await conn.execute(select(func.count()).select_from(partitions_table))).scalar()
    async with store.engine.connect() as conn:
        assert (await conn.execute(select(func.count()).select_from(tracked))).scalar() == 0


async def test_the_next_delayed_message_of_a_topic_behind_many_of_another(store: Store) -> None:
    """The next-due probe walks the due index past other topics' delayed entries."""
    queries = InspectionQueries(store, MARKERS)
    epochs = await claim(store)
    markers = [
        pending(Marker.delay(GROUP, msg(i, "busy"), delay_ms=1_000 + i), T0, i) for i in range(300)
    ]
    markers.append(pending(Marker.delay(GROUP, msg(7, "quiet"), delay_ms=9_000), T0, 300))
    await apply(store, epochs, markers)
    counts = await queries.topic_counts(since_ms=T0)
    assert (counts["busy"].delayed, counts["busy"].next_delayed_due_ms) == (300, T0 + 1_000)
    assert (counts["quiet"].delayed, counts["quiet"].next_delayed_due_ms) == (1, T0 + 9_000)


async def older_owner_takes_over(store: Store, partitions: list[int]) -> None:
    """What a replica of a version before 0010 does at a takeover: bump the epoch, nothing
    about the counters (it keeps them, or, before 0003, it does not)."""
    async with store.engine.begin() as conn:
        await conn.execute(
            update(partitions_table)
            .where(partitions_table.c.partition.in_(partitions))
            .values(epoch=partitions_table.c.epoch + 1, owner="older")
        )


async def spoil_counters(store: Store) -> None:
    """Counters an owner did not keep: none of the real ones, a made-up one."""
    async with store.engine.begin() as conn:
        await conn.execute(delete(tracked_counts))
        await conn.execute(
            tracked_counts.insert().values(
                markers_partition=0, origin_topic=TOPIC, group_id=GROUP, state="lost", entries=7
            )
        )


async def test_taking_partitions_over_recounts_counters_an_older_owner_left(store: Store) -> None:
    """Counters an owner of an older version may not have kept are exact again once a
    replica takes the partition over; a partition it did not take keeps what it had."""
    epochs = await claim(store, [0, 1])
    for offset in (1, 2):
        await start(store, epochs, offset)
    await start(store, epochs, 3, topic="audit", markers_partition=1)
    await older_owner_takes_over(store, [0, 1])
    await spoil_counters(store)
    kept, recount = await counters_and_recount(store.engine)
    assert kept != recount

    await claim(store, [0], owner="b")
    kept, _ = await counters_and_recount(store.engine)
    assert kept[0] == {(0, TOPIC, GROUP, "in_flight"): 2}  # partition 1 not taken over: as it was
    await claim(store, [1], owner="b")
    kept, recount = await counters_and_recount(store.engine)
    assert kept == recount
    assert kept[0] == {(0, TOPIC, GROUP, "in_flight"): 2, (1, "audit", GROUP, "in_flight"): 1}


async def test_taking_over_from_a_counting_owner_trusts_its_counters(store: Store) -> None:
    """A takeover from an owner that kept the counters does not scan the partition's rows
    again (a scan is linear in them: seconds of a rebalance at 10M tracked). Proven by
    counters spoiled behind the owners' backs, which the takeover leaves as they are, until
    the operator's documented reset (``counted_epoch = NULL``) makes the next one recount."""
    epochs = await claim(store, [0])
    for offset in (1, 2):
        await start(store, epochs, offset)
    await spoil_counters(store)

    await claim(store, [0], owner="b")
    kept, recount = await counters_and_recount(store.engine)
    assert kept[0] == {(0, TOPIC, GROUP, "lost"): 7}
    assert recount[0] == {(0, TOPIC, GROUP, "in_flight"): 2}

    async with store.engine.begin() as conn:
        await conn.execute(update(partitions_table).values(counted_epoch=None))
    await claim(store, [0], owner="c")
    kept, recount = await counters_and_recount(store.engine)
    assert kept == recount
    assert kept[0] == {(0, TOPIC, GROUP, "in_flight"): 2}


async def test_requests_racing_with_one_idempotency_key_get_one_answer(store: Store) -> None:
    """Concurrent requests with the same Idempotency-Key: one is carried out, the others get
    its recorded answer. On PostgreSQL the losers' inserts hit the unique index and replay
    the winner's row; on SQLite the writers queue and find it first."""
    actions, jobs = OperatorActions(store, MARKERS), RedriveJobStore(store, MARKERS)
    token = f"race-{uuid.uuid4().hex}"
    ack = ActionRequest(key(1), ActionKind.ACK, "ops", idempotency_key=token)
    records = await asyncio.gather(*(actions.apply_action(ack, T0) for _ in range(5)))
    assert len({r.id for r in records}) == 1
    assert sorted(r.replayed for r in records) == [False, True, True, True, True]

    spec = RedriveSpec(
        DeadLetterFilter(topic=TOPIC), None, 10.0, False, "ops", idempotency_key=token
    )
    created = await asyncio.gather(*(jobs.create_redrive_job(spec, T0) for _ in range(5)))
    assert len({j.id for j in created}) == 1
    assert sorted(j.replayed for j in created) == [False, True, True, True, True]


async def test_a_statement_run_on_the_driver_is_part_of_its_transaction(store: Store) -> None:
    """The hot paths hand their statements to the driver itself (``driver_rows``). The
    first statement of a transaction, too, must be part of it: a fence or a partition lock
    that ran on its own would release its row lock at once, and an ingest flush and a
    round's record would then lock entries in different orders (PostgreSQL deadlocks)."""
    epochs = await claim(store, [0])
    touch = fence_touch(1)
    fenced = {"markers_topic": MARKERS, "now_ms": T0 + 5, "p0": 0, "e0": epochs[0]}
    touched: list[tuple[object, ...]] = []

    async def touch_then_roll_back() -> None:
        async with store.transaction() as conn:
            touched.extend(tuple(row) for row in await driver_rows(conn, touch, fenced))
            raise RuntimeError("rolled back")

    with pytest.raises(RuntimeError, match="rolled back"):
        await touch_then_roll_back()
    assert touched == [(0,)]
    async with store.transaction() as conn:
        updated = (await conn.execute(select(partitions_table.c.updated_ms))).scalar_one()
    assert updated == T0
