"""Store records to API models (one place for the ms -> datetime and id conventions)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from tracker.clock import from_millis
from tracker.store.admin_reads import EntryView
from tracker.store.operator_actions import ActionRecord
from tracker.store.redrive_jobs import RedriveJobRecord

from . import models
from .message_ids import format_message_id
from .previews import bytes_preview

KEY_PREVIEW_BYTES = 256


def when(ms: int | None) -> datetime | None:
    return from_millis(ms) if ms is not None else None


def position(topic: str, partition: int, offset: int) -> models.Position:
    return models.Position(topic=topic, partition=partition, offset=offset)


def message_summary(view: EntryView, now_ms: int) -> models.MessageSummary:
    return models.MessageSummary.model_validate(message_summary_data(view, now_ms))


def message_summary_data(view: EntryView, now_ms: int) -> dict[str, Any]:
    """A :class:`models.MessageSummary` as plain data, for validating a page of them at once
    (validating nested dicts is cheaper than building each model)."""
    e = view.entry
    return {
        "id": format_message_id(e.key),
        "group": e.group_id,
        "origin": {
            "topic": e.origin_topic,
            "partition": e.origin_partition,
            "offset": e.origin_offset,
        },
        "state": e.state.value,
        "attempt": e.attempt,
        "latest_copy": {
            "topic": e.copy_topic,
            "partition": e.copy_partition,
            "offset": e.copy_offset,
        },
        "due_at": when(e.due_at_ms),
        "first_seen_at": from_millis(e.first_seen_ms),
        "updated_at": from_millis(e.updated_ms),
        "deferred": e.deferred,
        "consumer": e.consumer,
        "reason": e.reason,
        "markers_partition": e.markers_partition,
        "payload_kept": view.payload_stored,
        "being_republished": e.being_republished(now_ms),
    }


def action_view(record: ActionRecord) -> models.ActionView:
    return models.ActionView(
        id=record.id,
        action=record.action,
        actor=record.actor,
        reason=record.reason,
        at=from_millis(record.created_ms),
        outcome=record.outcome,
        detail=record.detail,
        state_before=record.state_before,
        state_after=record.state_after,
        due_at=when(record.due_at_ms),
        params={k: int(v) for k, v in record.params.items() if isinstance(v, int)},
        idempotency_key=record.idempotency_key,
    )


def dead_letter_view(row: dict[str, Any]) -> models.DeadLetterView:
    key = (row["group_id"], row["origin_topic"], row["origin_partition"], row["origin_offset"])
    return models.DeadLetterView(
        id=row["id"],
        message_id=format_message_id(key),
        group=row["group_id"],
        origin=position(row["origin_topic"], row["origin_partition"], row["origin_offset"]),
        source=position(row["source_topic"], row["source_partition"], row["source_offset"]),
        dlq=position(row["dlq_topic"], row["dlq_partition"], row["dlq_offset"]),
        reason=row["reason"],
        last_error=row["last_error"],
        attempts=row["attempts"],
        first_seen_at=from_millis(row["first_seen_ms"]),
        dead_lettered_at=from_millis(row["dead_lettered_ms"]),
        redriven_at=when(row["redriven_ms"]),
        key=bytes_preview(row["message_key"], KEY_PREVIEW_BYTES),
    )


def job_view(job: RedriveJobRecord) -> models.RedriveJobView:
    finished = job.done + job.skipped
    progress = 1.0 if job.total == 0 else min(1.0, finished / job.total)
    if job.dry_run:
        progress = 1.0
    eta = job.pending / job.rate if job.state.value in ("pending", "running") else None
    return models.RedriveJobView(
        id=job.id,
        state=job.state,
        selection=job.selection,
        target_topic=job.target_topic,
        rate=job.rate,
        dry_run=job.dry_run,
        total=job.total,
        done=job.done,
        skipped=job.skipped,
        pending=0 if job.dry_run else job.pending,
        progress=progress,
        eta_seconds=eta,
        created_by=job.created_by,
        reason=job.reason,
        created_at=from_millis(job.created_ms),
        updated_at=from_millis(job.updated_ms),
        started_at=when(job.started_ms),
        finished_at=when(job.finished_ms),
        cancel_requested=job.cancel_requested,
        owner=job.owner,
        last_error=job.last_error,
        replayed=job.replayed,
    )
