"""Redrive jobs as a runner works them: a lease per job, items reserved before they are sent
and marked done in the moment their produce is acknowledged, fenced by the lease's token (see
:mod:`tracker.store.redrive_jobs` for how this keeps a dead letter from going out twice)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sqlalchemy import (
    and_,
    bindparam,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.ext.asyncio import AsyncConnection

from tracker.domain.jobs import ItemState, JobState
from tracker.domain.value_records import value_record

from .admin_reads import (
    CHUNK,
    items_table,
    jobs_table,
)
from .redrive_jobs import RedriveJobRecord, RedriveJobStore, job_record
from .store_errors import LeaseLost
from .tables import dead_letters

#: Where each item of a batch was produced (executemany; bind names differ from columns).
_SET_PRODUCED = (
    update(items_table)
    .where(
        items_table.c.job_id == bindparam("b_job"),
        items_table.c.dead_letter_id == bindparam("b_item"),
    )
    .values(
        target_topic=bindparam("b_topic"),
        produced_partition=bindparam("b_partition"),
        produced_offset=bindparam("b_offset"),
    )
)


@dataclass(frozen=True, slots=True)
class RedriveWork:
    """An unfinished item with what is needed to republish its dead letter."""

    dead_letter_id: int
    state: ItemState
    origin_topic: str
    dlq_topic: str
    dlq_partition: int
    dlq_offset: int


@value_record
class ProducedItem:
    dead_letter_id: int
    topic: str
    partition: int
    offset: int


@dataclass(slots=True)
class ReserveResult:
    reserved: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)


class RedriveLeaseStore(RedriveJobStore):
    """The runner's side of the job store: what the API side reads, plus leases and the
    bookkeeping of items."""

    async def claim_job(
        self, owner: str, token: str, now_ms: int, lease_ms: int
    ) -> RedriveJobRecord | None:
        """Take the oldest pending job, or a running one whose lease ran out (its runner died)."""
        j = jobs_table.c
        claimable = or_(
            j.state == JobState.PENDING.value,
            and_(j.state == JobState.RUNNING.value, j.lease_until_ms < now_ms),
        )
        async with self._transaction() as conn:
            candidates = list(
                await conn.execute(select(j.id).where(claimable).order_by(j.id).limit(5))
            )
            for (job_id,) in candidates:
                changed = await conn.execute(
                    update(jobs_table)
                    .where(j.id == job_id, claimable)
                    .values(
                        state=JobState.RUNNING.value,
                        owner=owner,
                        lease_token=token,
                        lease_until_ms=now_ms + lease_ms,
                        started_ms=func.coalesce(j.started_ms, now_ms),
                        updated_ms=now_ms,
                    )
                )
                if changed.rowcount == 1:
                    row = (await conn.execute(select(jobs_table).where(j.id == job_id))).one()
                    return job_record(row)
        return None

    async def _fence(self, conn: AsyncConnection, job_id: int, token: str, now_ms: int) -> bool:
        """Touch the job where our lease token still holds; returns cancel_requested."""
        j = jobs_table.c
        result = await conn.execute(
            update(jobs_table)
            .where(j.id == job_id, j.lease_token == token, j.state == JobState.RUNNING.value)
            .values(updated_ms=now_ms)
            .returning(j.cancel_requested)
        )
        row = result.first()
        if row is None:
            raise LeaseLost(f"lost the lease of redrive job {job_id}")
        return bool(row[0])

    async def renew_lease(self, job_id: int, token: str, now_ms: int, lease_ms: int) -> bool:
        """Extend our lease; returns whether a cancel was requested. :class:`LeaseLost` if gone."""
        async with self._transaction() as conn:
            cancel = await self._fence(conn, job_id, token, now_ms)
            await conn.execute(
                update(jobs_table)
                .where(jobs_table.c.id == job_id)
                .values(lease_until_ms=now_ms + lease_ms)
            )
            return cancel

    async def release_lease(self, job_id: int, token: str, now_ms: int) -> None:
        """Give a running job up (graceful stop): any replica may continue it right away."""
        async with self._transaction() as conn:
            await conn.execute(
                update(jobs_table)
                .where(jobs_table.c.id == job_id, jobs_table.c.lease_token == token)
                .values(lease_until_ms=now_ms - 1, updated_ms=now_ms)
            )

    async def job_targets(self, job: RedriveJobRecord) -> set[str]:
        """The topics the job's unfinished items go to."""
        if job.target_topic is not None:
            return {job.target_topic}
        i, d = items_table.c, dead_letters.c
        query = (
            select(d.origin_topic)
            .distinct()
            .select_from(items_table.join(dead_letters, d.id == i.dead_letter_id))
            .where(
                i.job_id == job.id,
                i.state.in_([ItemState.PENDING.value, ItemState.SENDING.value]),
            )
        )
        async with self._transaction() as conn:
            return {row[0] for row in await conn.execute(query)}

    async def sending_items(self, job_id: int) -> set[int]:
        """Dead letter ids of the job's reserved items (produced or not: unknown)."""
        async with self._transaction() as conn:
            rows = await conn.execute(
                select(items_table.c.dead_letter_id).where(
                    items_table.c.job_id == job_id,
                    items_table.c.state == ItemState.SENDING.value,
                )
            )
            return {int(row[0]) for row in rows}

    async def set_scan_offsets(
        self, job_id: int, token: str, offsets: Mapping[str, Mapping[int, int]], now_ms: int
    ) -> None:
        raw = {t: {str(p): o for p, o in ps.items()} for t, ps in offsets.items()}
        async with self._transaction() as conn:
            await self._fence(conn, job_id, token, now_ms)
            await conn.execute(
                update(jobs_table)
                .where(jobs_table.c.id == job_id)
                .values(scan_offsets=json.dumps(raw, sort_keys=True))
            )

    async def next_work(self, job_id: int, limit: int) -> list[RedriveWork]:
        """The next unfinished items in order (``sending`` ones first in id order too)."""
        i, d = items_table.c, dead_letters.c
        query = (
            select(
                i.dead_letter_id,
                i.state,
                d.origin_topic,
                d.dlq_topic,
                d.dlq_partition,
                d.dlq_offset,
            )
            .select_from(items_table.outerjoin(dead_letters, d.id == i.dead_letter_id))
            .where(
                i.job_id == job_id,
                i.state.in_([ItemState.PENDING.value, ItemState.SENDING.value]),
            )
            .order_by(i.dead_letter_id)
            .limit(limit)
        )
        async with self._transaction() as conn:
            rows = list(await conn.execute(query))
        out: list[RedriveWork] = []
        for row in rows:
            m = row._mapping
            out.append(
                RedriveWork(
                    dead_letter_id=int(m["dead_letter_id"]),
                    state=ItemState(m["state"]),
                    origin_topic=m["origin_topic"] or "",
                    dlq_topic=m["dlq_topic"] or "",
                    dlq_partition=int(m["dlq_partition"] if m["dlq_partition"] is not None else -1),
                    dlq_offset=int(m["dlq_offset"] if m["dlq_offset"] is not None else -1),
                )
            )
        return out

    async def reserve(
        self, job_id: int, token: str, dead_letter_ids: Sequence[int], now_ms: int
    ) -> ReserveResult:
        """Reserve pending items' dead letters for this job (``redriven_ms`` where NULL).

        Items whose dead letter was redriven meanwhile (another job) or deleted are skipped.
        """
        result = ReserveResult()
        if not dead_letter_ids:
            return result
        d, i = dead_letters.c, items_table.c
        async with self._transaction() as conn:
            await self._fence(conn, job_id, token, now_ms)
            for start in range(0, len(dead_letter_ids), CHUNK):
                chunk = list(dead_letter_ids[start : start + CHUNK])
                # Lock in id order first: two jobs reserving overlapping sets then queue on
                # PostgreSQL instead of deadlocking (SQLite has one writer anyway).
                await conn.execute(
                    select(d.id).where(d.id.in_(chunk)).order_by(d.id).with_for_update()
                )
                rows = await conn.execute(
                    update(dead_letters)
                    .where(d.id.in_(chunk), d.redriven_ms.is_(None))
                    .values(redriven_ms=now_ms)
                    .returning(d.id)
                )
                got = {int(r[0]) for r in rows}
                result.reserved += [x for x in chunk if x in got]
                result.skipped += [x for x in chunk if x not in got]
            if result.reserved:
                for start in range(0, len(result.reserved), CHUNK):
                    chunk = result.reserved[start : start + CHUNK]
                    await conn.execute(
                        update(items_table)
                        .where(i.job_id == job_id, i.dead_letter_id.in_(chunk))
                        .values(state=ItemState.SENDING.value, updated_ms=now_ms)
                    )
            if result.skipped:
                await self._skip(
                    conn,
                    job_id,
                    [(x, "already redriven by another job, or deleted") for x in result.skipped],
                    now_ms,
                )
        return result

    async def _skip(
        self, conn: AsyncConnection, job_id: int, items: Sequence[tuple[int, str]], now_ms: int
    ) -> None:
        i = items_table.c
        for dead_letter_id, detail in items:
            await conn.execute(
                update(items_table)
                .where(i.job_id == job_id, i.dead_letter_id == dead_letter_id)
                .values(state=ItemState.SKIPPED.value, detail=detail, updated_ms=now_ms)
            )
        await conn.execute(
            update(jobs_table)
            .where(jobs_table.c.id == job_id)
            .values(skipped_count=jobs_table.c.skipped_count + len(items))
        )

    async def skip_reserved(
        self, job_id: int, token: str, items: Sequence[tuple[int, str]], now_ms: int
    ) -> None:
        """Give up reserved items that cannot be sent (their DLQ record is gone): unreserve."""
        if not items:
            return
        async with self._transaction() as conn:
            await self._fence(conn, job_id, token, now_ms)
            ids = [x for x, _ in items]
            await conn.execute(
                update(dead_letters).where(dead_letters.c.id.in_(ids)).values(redriven_ms=None)
            )
            await self._skip(conn, job_id, items, now_ms)

    async def mark_done(
        self, job_id: int, token: str, produced: Sequence[ProducedItem], now_ms: int
    ) -> bool:
        """Record produced items (fenced by the lease); returns whether a cancel was requested.

        Two statements whatever the batch size (the runner's rate depends on this being
        quick): the state change with an exact count, then the positions (executemany).
        """
        i = items_table.c
        async with self._transaction() as conn:
            cancel = await self._fence(conn, job_id, token, now_ms)
            if not produced:
                return cancel
            count = 0
            ids = [p.dead_letter_id for p in produced]
            for start in range(0, len(ids), CHUNK):
                changed = await conn.execute(
                    update(items_table)
                    .where(
                        i.job_id == job_id,
                        i.dead_letter_id.in_(ids[start : start + CHUNK]),
                        i.state == ItemState.SENDING.value,
                    )
                    .values(state=ItemState.DONE.value, updated_ms=now_ms)
                )
                count += changed.rowcount
            await conn.execute(
                _SET_PRODUCED,
                [
                    {
                        "b_job": job_id,
                        "b_item": p.dead_letter_id,
                        "b_topic": p.topic,
                        "b_partition": p.partition,
                        "b_offset": p.offset,
                    }
                    for p in produced
                ],
            )
            if count:
                await conn.execute(
                    update(jobs_table)
                    .where(jobs_table.c.id == job_id)
                    .values(done_count=jobs_table.c.done_count + count)
                )
            return cancel

    async def set_error(self, job_id: int, token: str, error: str, now_ms: int) -> None:
        async with self._transaction() as conn:
            await self._fence(conn, job_id, token, now_ms)
            await conn.execute(
                update(jobs_table).where(jobs_table.c.id == job_id).values(last_error=error)
            )

    async def finish_job(self, job_id: int, token: str, state: JobState, now_ms: int) -> None:
        """End the job. Cancelled or failed: unfinished items are cancelled, reservations undone.

        Only call with no produce in flight whose outcome is unknown (the runner resolves
        ``sending`` items by scanning first), so an unreserved dead letter was never sent.
        """
        i, j = items_table.c, jobs_table.c
        async with self._transaction() as conn:
            await self._fence(conn, job_id, token, now_ms)
            if state is not JobState.DONE:
                sending = select(i.dead_letter_id).where(
                    i.job_id == job_id, i.state == ItemState.SENDING.value
                )
                await conn.execute(
                    update(dead_letters)
                    .where(dead_letters.c.id.in_(sending))
                    .values(redriven_ms=None)
                )
                await conn.execute(
                    update(items_table)
                    .where(
                        i.job_id == job_id,
                        i.state.in_([ItemState.PENDING.value, ItemState.SENDING.value]),
                    )
                    .values(state=ItemState.CANCELLED.value, updated_ms=now_ms)
                )
            await conn.execute(
                update(jobs_table)
                .where(j.id == job_id)
                .values(
                    state=state.value,
                    finished_ms=now_ms,
                    updated_ms=now_ms,
                    lease_token=None,
                    lease_until_ms=None,
                )
            )
