"""Operator actions on one tracked message, and the rules that decide what each one does.

The admin API's actions (redeliver now, extend, ack, dead-letter) are decided here, on the
entry as the store holds it (:func:`decide_action`, pure); the store applies the decision in
the transaction that records it (``tracker.store.operator_actions``). The rules are those of
docs/api.md, "Actions".
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from tracker.domain.entries import OPERATOR_PREFIX, Entry, EntryKey, State


class ActionKind(enum.StrEnum):
    REDELIVER = "redeliver"
    ACK = "ack"
    EXTEND = "extend"
    DEAD_LETTER = "dead_letter"


class ActionOutcome(enum.StrEnum):
    APPLIED = "applied"  #: the entry changed
    UNCHANGED = "unchanged"  #: nothing to do: already in the requested condition
    CONFLICT = "conflict"  #: refused: the entry's state does not allow it
    NOT_FOUND = "not_found"  #: no such entry


@dataclass(frozen=True, slots=True)
class ActionRequest:
    key: EntryKey
    action: ActionKind
    actor: str
    reason: str = ""
    extend_ms: int | None = None  #: EXTEND: the new lease, counted from now
    idempotency_key: str | None = None

    def params(self) -> str:
        return json.dumps({"extend_ms": self.extend_ms} if self.extend_ms is not None else {})


@dataclass(frozen=True, slots=True)
class ActionDecision:
    """What an action does to an entry: the outcome, the new values (if any), why."""

    outcome: ActionOutcome
    detail: str
    changes: dict[str, Any] | None = None  #: column values to set; None: no update
    delete: bool = False


def decide_action(entry: Entry, request: ActionRequest, now_ms: int) -> ActionDecision:
    """The effect of ``request`` on ``entry`` (pure; the rules of docs/api.md, Actions)."""
    state = entry.state
    if entry.being_republished(now_ms):
        return ActionDecision(
            ActionOutcome.CONFLICT,
            "the tracker is republishing this message right now (a redelivery round claimed "
            "it); repeat the request in a moment",
        )
    action = request.action
    if action is ActionKind.ACK:
        return ActionDecision(
            ActionOutcome.APPLIED, f"acknowledged ({state.value} entry removed)", delete=True
        )
    if action is ActionKind.REDELIVER:
        if state is State.REJECTED:
            return ActionDecision(
                ActionOutcome.CONFLICT,
                "the message is being dead-lettered (rejected); it cannot be redelivered now: "
                "redrive it from the DLQ afterwards",
            )
        if state is State.LOST:
            return ActionDecision(
                ActionOutcome.CONFLICT,
                "the message is lost (its original record is unreadable); it cannot be "
                "redelivered: ack it to drop it",
            )
        if entry.due_at_ms is not None and entry.due_at_ms <= now_ms:
            return ActionDecision(
                ActionOutcome.UNCHANGED, "already due; the tracker republishes it shortly"
            )
        return ActionDecision(
            ActionOutcome.APPLIED,
            f"{state.value} message due now (was due at {entry.due_at_ms})",
            {"due_at_ms": now_ms, "claim_token": None, "updated_ms": now_ms},
        )
    if action is ActionKind.EXTEND:
        if state is not State.IN_FLIGHT:
            return ActionDecision(
                ActionOutcome.CONFLICT,
                f"only an in-flight message's lease can be extended; this one is {state.value}",
            )
        extend_ms = request.extend_ms or 0
        due = now_ms + extend_ms
        return ActionDecision(
            ActionOutcome.APPLIED,
            f"lease extended by {extend_ms} ms",
            {"due_at_ms": due, "claim_token": None, "updated_ms": now_ms},
        )
    # DEAD_LETTER
    if state is State.REJECTED:
        return ActionDecision(ActionOutcome.UNCHANGED, "already being dead-lettered")
    if state is State.LOST:
        return ActionDecision(
            ActionOutcome.CONFLICT,
            "the message is lost (its original record is unreadable); there is nothing to "
            "dead-letter: ack it to drop it",
        )
    why = f"{OPERATOR_PREFIX}{request.actor}"
    if request.reason:
        why += f": {request.reason}"
    return ActionDecision(
        ActionOutcome.APPLIED,
        f"{state.value} message marked for the DLQ",
        {
            "state": State.REJECTED.value,
            "due_at_ms": now_ms,
            "reason": why,
            "claim_token": None,
            "updated_ms": now_ms,
        },
    )
