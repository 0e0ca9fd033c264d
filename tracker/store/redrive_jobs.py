"""Redrive jobs in the store: created by the API, run by a runner that holds a lease.

Redrive jobs never republish a dead letter twice:

* A dead letter is *reserved* for a job (``dead_letters.redriven_ms`` set where it was NULL)
  before it is produced, so two jobs can never both send it.
* An item is marked done in the same moment its produce is acknowledged (one transaction per
  batch), fenced by the job's lease token: a replica that lost its lease writes nothing.
* A replica that takes a job over scans the target partitions from the offsets recorded when
  the previous lease began (``scan_offsets``) for records carrying the job's header, and marks
  what it finds done before sending anything (see :mod:`tracker.engine.redrive_runner`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    BigInteger,
    String,
    func,
    literal,
    select,
    update,
)
from sqlalchemy.ext.asyncio import AsyncConnection

from tracker.domain.jobs import ItemState, JobState

from .admin_reads import (
    CHUNK,
    AdminQueries,
    DeadLetterFilter,
    dead_letter_where,
    items_table,
    jobs_table,
)
from .store_errors import IdempotencyConflict, JobNotCancellable, UnknownDeadLetters
from .tables import dead_letters


@dataclass(frozen=True, slots=True)
class RedriveSpec:
    """What a new redrive job is asked to do."""

    selection: DeadLetterFilter | tuple[int, ...]
    target_topic: str | None
    rate: float
    dry_run: bool
    actor: str
    reason: str = ""
    idempotency_key: str | None = None

    def selection_json(self) -> str:
        if isinstance(self.selection, DeadLetterFilter):
            return json.dumps({"filter": self.selection.to_json()}, sort_keys=True)
        return json.dumps({"ids": list(self.selection)})

    def fingerprint(self) -> tuple[Any, ...]:
        return (self.selection_json(), self.target_topic, float(self.rate), self.dry_run)


@dataclass(frozen=True, slots=True)
class RedriveJobRecord:
    id: int
    state: JobState
    selection: dict[str, Any]
    target_topic: str | None
    rate: float
    dry_run: bool
    total: int
    done: int
    skipped: int
    created_by: str
    reason: str
    created_ms: int
    updated_ms: int
    started_ms: int | None
    finished_ms: int | None
    cancel_requested: bool
    owner: str | None
    lease_token: str | None
    lease_until_ms: int | None
    scan_offsets: dict[str, dict[int, int]] | None
    last_error: str
    idempotency_key: str | None
    replayed: bool = False

    @property
    def pending(self) -> int:
        return max(0, self.total - self.done - self.skipped)


def job_record(row: Any, *, replayed: bool = False) -> RedriveJobRecord:
    m = row._mapping
    offsets: dict[str, dict[int, int]] | None = None
    if m["scan_offsets"]:
        raw = json.loads(m["scan_offsets"])
        offsets = {t: {int(p): int(o) for p, o in ps.items()} for t, ps in raw.items()}
    try:
        selection = json.loads(m["selection"])
    except ValueError:
        selection = {}
    return RedriveJobRecord(
        id=m["id"],
        state=JobState(m["state"]),
        selection=selection,
        target_topic=m["target_topic"],
        rate=float(m["rate"]),
        dry_run=bool(m["dry_run"]),
        total=int(m["total_count"]),
        done=int(m["done_count"]),
        skipped=int(m["skipped_count"]),
        created_by=m["created_by"],
        reason=m["reason"],
        created_ms=m["created_ms"],
        updated_ms=m["updated_ms"],
        started_ms=m["started_ms"],
        finished_ms=m["finished_ms"],
        cancel_requested=bool(m["cancel_requested"]),
        owner=m["owner"],
        lease_token=m["lease_token"],
        lease_until_ms=m["lease_until_ms"],
        scan_offsets=offsets,
        last_error=m["last_error"],
        idempotency_key=m["idempotency_key"],
        replayed=replayed,
    )


class RedriveJobStore(AdminQueries):
    """Redrive jobs as the API sees them: created, listed, read, cancelled (the runner's side
    is :class:`tracker.store.redrive_leases.RedriveLeaseStore`)."""

    async def create_redrive_job(self, spec: RedriveSpec, now_ms: int) -> RedriveJobRecord:
        """Create a job and snapshot its items (the matching dead letters not yet redriven).

        A dry run only counts: the job is created finished, with ``total`` the number of dead
        letters it would republish and ``skipped`` those already redriven (explicit ids).
        Raises :class:`UnknownDeadLetters` for explicit ids that do not exist and
        :class:`IdempotencyConflict` for a reused idempotency key with another request.
        """
        return await self._once(
            spec.idempotency_key,
            lambda: self._create_redrive_job(spec, now_ms),
            lambda conn: self._idempotent_job(conn, spec),
        )

    async def _idempotent_job(
        self, conn: AsyncConnection, spec: RedriveSpec
    ) -> RedriveJobRecord | None:
        row = (
            await conn.execute(
                select(jobs_table).where(jobs_table.c.idempotency_key == spec.idempotency_key)
            )
        ).first()
        if row is None:
            return None
        m = row._mapping
        if (m["selection"], m["target_topic"], float(m["rate"]), bool(m["dry_run"])) != (
            spec.fingerprint()
        ):
            raise IdempotencyConflict(
                f"Idempotency-Key {spec.idempotency_key!r} was already used for another "
                f"request (redrive job {m['id']})"
            )
        return job_record(row, replayed=True)

    async def _create_redrive_job(self, spec: RedriveSpec, now_ms: int) -> RedriveJobRecord:
        d = dead_letters.c
        async with self._transaction() as conn:
            if spec.idempotency_key is not None:
                replay = await self._idempotent_job(conn, spec)
                if replay is not None:
                    return replay
            already: list[int] = []
            if isinstance(spec.selection, DeadLetterFilter):
                matching = dead_letter_where(select(d.id), spec.selection).where(
                    d.redriven_ms.is_(None)
                )
            else:
                wanted = sorted(set(spec.selection))
                found: dict[int, bool] = {}
                for start in range(0, len(wanted), CHUNK):
                    chunk = wanted[start : start + CHUNK]
                    rows = await conn.execute(
                        select(d.id, d.redriven_ms.is_not(None)).where(d.id.in_(chunk))
                    )
                    found.update({int(i): bool(r) for i, r in rows})
                missing = [i for i in wanted if i not in found]
                if missing:
                    raise UnknownDeadLetters(missing)
                already = [i for i in wanted if found[i]]
                matching = select(d.id).where(
                    d.id.in_([i for i in wanted if not found[i]]), d.redriven_ms.is_(None)
                )
            count = int(
                await conn.scalar(select(func.count()).select_from(matching.subquery())) or 0
            )
            finished = spec.dry_run
            values: dict[str, Any] = {
                "state": (JobState.DONE if finished else JobState.PENDING).value,
                "selection": spec.selection_json(),
                "target_topic": spec.target_topic,
                "rate": float(spec.rate),
                "dry_run": spec.dry_run,
                "total_count": count + len(already),
                "done_count": 0,
                "skipped_count": len(already),
                "created_by": spec.actor,
                "reason": spec.reason,
                "created_ms": now_ms,
                "updated_ms": now_ms,
                "finished_ms": now_ms if finished else None,
                "idempotency_key": spec.idempotency_key,
            }
            result = await conn.execute(jobs_table.insert().values(**values))
            (job_id,) = result.inserted_primary_key or (0,)
            if not spec.dry_run:
                await conn.execute(
                    items_table.insert().from_select(
                        ["job_id", "dead_letter_id", "state", "updated_ms"],
                        select(
                            literal(job_id, BigInteger()),
                            matching.subquery().c.id,
                            literal(ItemState.PENDING.value, String()),
                            literal(now_ms, BigInteger()),
                        ),
                    )
                )
                if already:
                    await conn.execute(
                        items_table.insert(),
                        [
                            {
                                "job_id": job_id,
                                "dead_letter_id": i,
                                "state": ItemState.SKIPPED.value,
                                "detail": "already redriven",
                                "updated_ms": now_ms,
                            }
                            for i in already
                        ],
                    )
                if count == 0:
                    await conn.execute(
                        update(jobs_table)
                        .where(jobs_table.c.id == job_id)
                        .values(state=JobState.DONE.value, finished_ms=now_ms)
                    )
            row = (await conn.execute(select(jobs_table).where(jobs_table.c.id == job_id))).one()
            return job_record(row)

    async def get_job(self, job_id: int) -> RedriveJobRecord | None:
        async with self._transaction(read_only=True) as conn:
            row = (await conn.execute(select(jobs_table).where(jobs_table.c.id == job_id))).first()
        return job_record(row) if row is not None else None

    async def list_jobs(
        self,
        *,
        states: Iterable[JobState] = (),
        before_id: int | None = None,
        limit: int = 100,
    ) -> list[RedriveJobRecord]:
        """One page of jobs, newest first, with ids below ``before_id``."""
        query = select(jobs_table)
        wanted = [s.value for s in states]
        if wanted:
            query = query.where(jobs_table.c.state.in_(wanted))
        if before_id is not None:
            query = query.where(jobs_table.c.id < before_id)
        query = query.order_by(jobs_table.c.id.desc()).limit(limit)
        async with self._transaction(read_only=True) as conn:
            return [job_record(row) for row in await conn.execute(query)]

    async def job_items(
        self,
        job_id: int,
        *,
        state: ItemState | None = None,
        after_id: int | None = None,
        limit: int,
    ) -> list[dict[str, Any]]:
        query = select(items_table).where(items_table.c.job_id == job_id)
        if state is not None:
            query = query.where(items_table.c.state == state.value)
        if after_id is not None:
            query = query.where(items_table.c.dead_letter_id > after_id)
        query = query.order_by(items_table.c.dead_letter_id).limit(limit)
        async with self._transaction(read_only=True) as conn:
            return [dict(row._mapping) for row in await conn.execute(query)]

    async def cancel_job(self, job_id: int, now_ms: int) -> RedriveJobRecord | None:
        """Cancel a job: at once if it has not started, else ask its runner to stop.

        Idempotent for a cancelled job; :class:`JobNotCancellable` for a done or failed one.
        None for an unknown job.
        """
        j = jobs_table.c
        async with self._transaction() as conn:
            row = (await conn.execute(select(jobs_table).where(j.id == job_id))).first()
            if row is None:
                return None
            state = JobState(row._mapping["state"])
            if state in (JobState.DONE, JobState.FAILED):
                raise JobNotCancellable(f"redrive job {job_id} already finished ({state.value})")
            if state is JobState.PENDING:
                changed = await conn.execute(
                    update(jobs_table)
                    .where(j.id == job_id, j.state == JobState.PENDING.value)
                    .values(
                        state=JobState.CANCELLED.value,
                        cancel_requested=True,
                        finished_ms=now_ms,
                        updated_ms=now_ms,
                    )
                )
                if changed.rowcount == 1:
                    await conn.execute(
                        update(items_table)
                        .where(
                            items_table.c.job_id == job_id,
                            items_table.c.state == ItemState.PENDING.value,
                        )
                        .values(state=ItemState.CANCELLED.value, updated_ms=now_ms)
                    )
                else:  # a runner took it just now: ask it to stop
                    state = JobState.RUNNING
            if state is JobState.RUNNING:
                await conn.execute(
                    update(jobs_table)
                    .where(j.id == job_id, j.state == JobState.RUNNING.value)
                    .values(cancel_requested=True, updated_ms=now_ms)
                )
            row = (await conn.execute(select(jobs_table).where(j.id == job_id))).one()
            return job_record(row)
