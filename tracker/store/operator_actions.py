"""Operator actions on tracked messages, applied and recorded in one transaction.

Actions and the engine: ingest applies markers in transactions that first update the entry's
``markers_partitions`` row (epoch fencing; on PostgreSQL a row lock). An action does the same
before it reads the entry again and changes it, so an action and a marker flush for the same
partition serialize instead of overwriting each other. An entry that a redelivery round has
claimed (it is being republished right now) is not touched: the action is refused with a
conflict and can be repeated a moment later. What an action does is decided by
:func:`tracker.domain.actions.decide_action`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import (
    delete,
    select,
    tuple_,
    update,
)
from sqlalchemy.ext.asyncio import AsyncConnection

from tracker.domain.actions import (
    ActionDecision,
    ActionKind,
    ActionOutcome,
    ActionRequest,
    decide_action,
)
from tracker.domain.entries import EntryKey, State

from .admin_reads import AdminQueries, actions_table
from .counts import CountChanges
from .store_errors import IdempotencyConflict
from .tables import KEY_COLUMNS, partitions_table, tracked, tracked_counts


@dataclass(frozen=True, slots=True)
class ActionRecord:
    """One row of the audit trail, which is also the answer to the request it records."""

    id: int
    key: EntryKey
    action: ActionKind
    actor: str
    reason: str
    params: dict[str, Any]
    outcome: ActionOutcome
    detail: str
    state_before: str | None
    state_after: str | None
    due_at_ms: int | None
    created_ms: int
    idempotency_key: str | None
    replayed: bool = False  #: answered from an earlier request with the same Idempotency-Key


def action_record(row: Any, *, replayed: bool = False) -> ActionRecord:
    m = row._mapping
    try:
        params = json.loads(m["params"] or "{}")
    except ValueError:
        params = {}
    return ActionRecord(
        id=m["id"],
        key=(m["group_id"], m["origin_topic"], m["origin_partition"], m["origin_offset"]),
        action=ActionKind(m["action"]),
        actor=m["actor"],
        reason=m["reason"],
        params=params,
        outcome=ActionOutcome(m["outcome"]),
        detail=m["detail"],
        state_before=m["state_before"],
        state_after=m["state_after"],
        due_at_ms=m["due_at_ms"],
        created_ms=m["created_ms"],
        idempotency_key=m["idempotency_key"],
        replayed=replayed,
    )


class OperatorActions(AdminQueries):
    """Apply an operator's action to one entry, with its audit row."""

    async def apply_action(self, request: ActionRequest, now_ms: int) -> ActionRecord:
        """Apply an operator action to one entry and record it, atomically.

        With an idempotency key seen before: the recorded answer when it was the same request,
        :class:`IdempotencyConflict` when it was another. Every answer is recorded (including
        refusals) so the audit trail shows who asked for what.
        """
        return await self._once(
            request.idempotency_key,
            lambda: self._apply_action(request, now_ms),
            lambda conn: self._idempotent_action(conn, request),
        )

    async def _idempotent_action(
        self, conn: AsyncConnection, request: ActionRequest
    ) -> ActionRecord | None:
        if request.idempotency_key is None:
            return None
        row = (
            await conn.execute(
                select(actions_table).where(
                    actions_table.c.idempotency_key == request.idempotency_key
                )
            )
        ).first()
        if row is None:
            return None
        found = action_record(row, replayed=True)
        if (
            found.key != request.key
            or found.action is not request.action
            or found.reason != request.reason
            or row._mapping["params"] != request.params()
        ):
            raise IdempotencyConflict(
                f"Idempotency-Key {request.idempotency_key!r} was already used for another "
                f"request ({found.action.value} of {'/'.join(map(str, found.key))})"
            )
        return found

    async def _apply_action(self, request: ActionRequest, now_ms: int) -> ActionRecord:
        async with self._transaction() as conn:
            if request.idempotency_key is not None:
                replay = await self._idempotent_action(conn, request)
                if replay is not None:
                    return replay
            view = await self._entry_view_at(conn, request.key)
            if view is not None:
                # Serialize with marker ingest of this partition (see the module docstring),
                # then look again: a flush may have changed the entry meanwhile.
                await conn.execute(
                    update(partitions_table)
                    .where(
                        partitions_table.c.markers_topic == self.markers_topic,
                        partitions_table.c.partition == view.entry.markers_partition,
                    )
                    .values(updated_ms=partitions_table.c.updated_ms)
                )
                view = await self._entry_view_at(conn, request.key)
                if view is not None and view.entry.claim_token is None:
                    # An action changes one message: if a tracked range holds it, it leaves
                    # the range for an entry row of its own first (the rest stay together).
                    await self.store.split_from_range(conn, request.key)
            state_before: str | None = None
            state_after: str | None = None
            due_after: int | None = None
            if view is None:
                decision = await self._absent(conn, request)
            else:
                entry = view.entry
                state_before = entry.state.value
                decision = decide_action(entry, request, now_ms)
                where = tuple_(*KEY_COLUMNS) == request.key
                counts = CountChanges()
                if decision.delete:
                    await conn.execute(delete(tracked).where(where))
                    counts.change(entry, None)
                elif decision.changes is not None:
                    await conn.execute(update(tracked).where(where).values(**decision.changes))
                    if "state" in decision.changes:
                        counts.change(entry, replace(entry, state=State(decision.changes["state"])))
                await counts.write(conn, tracked_counts)
                if not decision.delete:
                    changes = decision.changes or {}
                    state_after = changes.get("state", entry.state.value)
                    due_after = changes.get("due_at_ms", entry.due_at_ms)
            values = {
                "group_id": request.key[0],
                "origin_topic": request.key[1],
                "origin_partition": request.key[2],
                "origin_offset": request.key[3],
                "action": request.action.value,
                "actor": request.actor,
                "reason": request.reason,
                "params": request.params(),
                "outcome": decision.outcome.value,
                "detail": decision.detail,
                "state_before": state_before,
                "state_after": state_after,
                "due_at_ms": due_after,
                "created_ms": now_ms,
                "idempotency_key": request.idempotency_key,
            }
            result = await conn.execute(actions_table.insert().values(**values))
            (row_id,) = result.inserted_primary_key or (0,)
        return ActionRecord(
            id=int(row_id),
            key=request.key,
            action=request.action,
            actor=request.actor,
            reason=request.reason,
            params=json.loads(request.params()),
            outcome=decision.outcome,
            detail=decision.detail,
            state_before=state_before,
            state_after=state_after,
            due_at_ms=due_after,
            created_ms=now_ms,
            idempotency_key=request.idempotency_key,
        )

    async def _absent(self, conn: AsyncConnection, request: ActionRequest) -> ActionDecision:
        """The decision for an entry that does not exist: acked before, or unknown."""
        if request.action is ActionKind.ACK:
            a = actions_table.c
            row = (
                await conn.execute(
                    select(a.actor, a.created_ms)
                    .where(
                        tuple_(a.group_id, a.origin_topic, a.origin_partition, a.origin_offset)
                        == request.key,
                        a.action == ActionKind.ACK.value,
                        a.outcome == ActionOutcome.APPLIED.value,
                    )
                    .order_by(a.id.desc())
                    .limit(1)
                )
            ).first()
            if row is not None:
                return ActionDecision(
                    ActionOutcome.UNCHANGED,
                    f"already acknowledged through the API by {row.actor} at {row.created_ms} "
                    "(ms since the epoch)",
                )
        return ActionDecision(
            ActionOutcome.NOT_FOUND,
            "no tracked message with this id (never seen, acknowledged by its consumer, "
            "redelivered as a new attempt that is not started yet, or dead-lettered)",
        )
