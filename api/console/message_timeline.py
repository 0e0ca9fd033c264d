"""A message's history as one timeline: its markers, operator actions and dead letters.

Apart from the message pages because it is a pure function of the API's
:class:`~api.models.MessageDetail`, the same for the page and its Kafka fragment.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from .. import models


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    """One line of a message's history: a marker, an operator action, a dead letter."""

    at: datetime | None
    kind: str
    what: str
    attempt: int | None
    where: str
    detail: str


_MARKER_WHAT = {
    "start": "delivered (START)",
    "ack": "acknowledged",
    "delay": "delayed by the consumer",
    "extend": "lease extended",
    "reject": "rejected",
}


def _at(p: models.Position) -> str:
    return f"{p.topic}/{p.partition}/{p.offset}"


def timeline(detail: models.MessageDetail) -> list[TimelineEvent]:
    """Markers, operator actions and dead letters of a message, in time order."""
    events: list[TimelineEvent] = []
    for m in detail.markers.events if detail.markers else ():
        notes = []
        if m.kind == "start" and m.timeout_ms:
            notes.append(f"lease {m.timeout_ms / 1000:g} s")
        if m.kind == "delay":
            notes.append("policy backoff" if m.policy_delay else f"{m.delay_ms / 1000:g} s")
        if m.range_offsets is not None:
            notes.append(f"range {m.range_offsets[0]}..{m.range_offsets[1]}")
        if m.consumer:
            notes.append(f"by {m.consumer}")
        if m.reason:
            notes.append(m.reason)
        what = _MARKER_WHAT.get(m.kind, m.kind)
        events.append(
            TimelineEvent(m.timestamp, m.kind, what, m.attempt, _at(m.record), "; ".join(notes))
        )
    for a in detail.actions:
        what = f"{a.action.value.replace('_', ' ')} by {a.actor} ({a.outcome.value})"
        note = "; ".join(part for part in (a.reason, a.detail) if part)
        events.append(TimelineEvent(a.at, "action", what, None, "", note))
    for d in detail.dead_letters:
        events.append(
            TimelineEvent(
                d.dead_lettered_at, "dead_letter", "dead-lettered", d.attempts, _at(d.dlq), d.reason
            )
        )
        if d.redriven_at is not None:
            events.append(TimelineEvent(d.redriven_at, "redrive", "redriven", None, "", ""))
    far = datetime.max.replace(tzinfo=UTC)
    events.sort(key=lambda e: e.at or far)
    return events
