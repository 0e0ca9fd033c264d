"""Per-topic statistics and the effective policy.

Counts come from the store (all replicas; all consumer groups, then each). The dead-letter rate is
counted from the store too; the redelivery rate from this process's counter history
(:mod:`api.rates`), since redeliveries leave no row behind: with several replicas each one
reports its own (sum them in Prometheus, ``kmq_redeliveries_total``).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query

from tracker.domain.policy import TopicPolicy
from tracker.store.topic_statistics import TopicCounts

from ..context import ApiContext
from ..deps import Context, Reader
from ..models import (
    TOPIC_PATTERN,
    BackoffView,
    GroupStats,
    PolicyView,
    TopicList,
    TopicStats,
)
from ..views import when
from . import READ_ERRORS, errors

router = APIRouter(prefix="/v1/topics", tags=["topics"])

Window = Annotated[int, Query(ge=1, le=60, description="Minutes over which rates are computed.")]


def policy_view(topic: str, policy: TopicPolicy) -> PolicyView:
    keep = policy.keep_payload_after
    return PolicyView(
        processing_timeout_seconds=policy.processing_timeout.total_seconds(),
        max_attempts=policy.max_attempts,
        backoff=BackoffView(
            initial_seconds=policy.backoff.initial.total_seconds(),
            multiplier=policy.backoff.multiplier,
            max_seconds=policy.backoff.max.total_seconds(),
            jitter=policy.backoff.jitter,
        ),
        dlq_topic=policy.dlq_for(topic),
        retry_topic=policy.retry_for(topic),
        keep_payload_after_seconds=keep.total_seconds() if keep is not None else None,
    )


def _stats(context: ApiContext, counts: TopicCounts, window: int, now_ms: int) -> TopicStats:
    seconds = window * 60.0
    redeliveries, covered = context.rates.increase(counts.topic, seconds)
    oldest = counts.oldest_in_flight_first_seen_ms
    return TopicStats(
        topic=counts.topic,
        in_flight=counts.in_flight,
        delayed=counts.delayed,
        rejected=counts.rejected,
        lost=counts.lost,
        dead_lettered=counts.dead_lettered,
        dead_letters_waiting=counts.dead_letters_waiting,
        oldest_in_flight_first_seen=when(oldest),
        oldest_in_flight_age_seconds=max(0.0, (now_ms - oldest) / 1000) if oldest else None,
        next_delayed_due=when(counts.next_delayed_due_ms),
        window_minutes=window,
        redeliveries=redeliveries,
        redeliveries_per_minute=(redeliveries / (covered / 60.0))
        if redeliveries is not None and covered > 0
        else None,
        redeliveries_window_seconds=covered,
        dead_lettered_in_window=counts.dead_lettered_recently,
        dead_lettered_per_minute=counts.dead_lettered_recently / window,
        groups=[
            GroupStats(
                group=name,
                in_flight=group.in_flight,
                delayed=group.delayed,
                rejected=group.rejected,
                lost=group.lost,
                dead_lettered=group.dead_lettered,
                dead_letters_waiting=group.dead_letters_waiting,
            )
            for name, group in sorted(counts.groups.items())
        ],
        policy=policy_view(counts.topic, context.settings.policy_for(counts.topic)),
    )


@router.get(
    "",
    response_model=TopicList,
    summary="Statistics of every known topic",
    responses=errors(*READ_ERRORS),
)
async def list_topics(context: Context, _: Reader, window_minutes: Window = 5) -> TopicList:
    """Every topic with tracked messages or dead letters, or a policy override."""
    now_ms = context.now_ms()
    counts = await context.queries.topic_counts(since_ms=now_ms - window_minutes * 60_000)
    for topic in context.settings.topics:
        counts.setdefault(topic, TopicCounts(topic))
    return TopicList(
        items=[_stats(context, counts[t], window_minutes, now_ms) for t in sorted(counts)]
    )


@router.get(
    "/{topic}",
    response_model=TopicStats,
    summary="Statistics and effective policy of one topic",
    responses=errors(*READ_ERRORS),
)
async def get_topic(
    topic: Annotated[str, Path(pattern=TOPIC_PATTERN, examples=["orders"])],
    context: Context,
    _: Reader,
    window_minutes: Window = 5,
) -> TopicStats:
    """One topic's numbers (zeros for a topic the tracker has not seen) and its policy."""
    now_ms = context.now_ms()
    counts = await context.queries.topic_counts(
        since_ms=now_ms - window_minutes * 60_000, topic=topic
    )
    return _stats(context, counts.get(topic) or TopicCounts(topic), window_minutes, now_ms)
