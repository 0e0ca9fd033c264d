"""Per-topic statistics for operators: entries by state and consumer group, oldest ages,
dead letters (recent and waiting).

Apart from the listings (:mod:`tracker.store.inspection`) because it is read differently: the
counts come from the counter tables (migration 0003), a few rows whatever the store's size,
and the figures counters cannot keep come from one index probe each, batched into few
statements. ``/v1/stats``, the Prometheus gauges and the console's overview all read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, func, select

from tracker.domain.entries import State

from .admin_reads import AdminQueries
from .tables import chunks, dead_letter_counts, dead_letters, ranges_table, tracked, tracked_counts


@dataclass(slots=True)
class GroupCounts:
    """One consumer group's entries of one origin topic by state, and its dead letters (0008)."""

    group: str
    in_flight: int = 0
    delayed: int = 0
    rejected: int = 0
    lost: int = 0
    dead_lettered: int = 0  #: dead letters recorded, redriven or not
    dead_letters_waiting: int = 0  #: dead letters not redriven


@dataclass(slots=True)
class TopicCounts:
    """Per origin topic: what the store holds right now (all consumer groups together).

    ``groups`` splits the entry and dead-letter counts by consumer group; the ages and the
    recent dead letters are the topic's.
    """

    topic: str
    in_flight: int = 0
    delayed: int = 0
    rejected: int = 0
    lost: int = 0
    groups: dict[str, GroupCounts] = field(default_factory=dict)
    oldest_in_flight_first_seen_ms: int | None = None
    next_delayed_due_ms: int | None = None
    dead_lettered: int = 0  #: dead letters recorded, redriven or not
    dead_letters_waiting: int = 0  #: dead letters not redriven
    dead_lettered_recently: int = 0  #: dead-lettered since the ``since_ms`` asked for

    def group(self, name: str) -> GroupCounts:
        """The counts of group ``name`` (created empty when first asked for)."""
        found = self.groups.get(name)
        if found is None:
            found = self.groups[name] = GroupCounts(name)
        return found


#: The entry states the statistics count, and the attribute of each.
_COUNTED = {
    State.IN_FLIGHT.value: "in_flight",
    State.DELAYED.value: "delayed",
    State.REJECTED.value: "rejected",
    State.LOST.value: "lost",
}

#: Scalar subqueries per statement in :meth:`TopicStatistics.topic_counts` (SQLite's default
#: limit on a SELECT's columns is 2,000).
_PROBES_PER_QUERY = 100

#: Probe attributes answered by more than one probe (entries and ranges): the earliest wins.
_EARLIEST = frozenset({"oldest_in_flight_first_seen_ms"})


def _probes(counts: TopicCounts, since_ms: int) -> list[tuple[TopicCounts, str, Any]]:
    """The figures of a topic that counters cannot keep: (counts, attribute, scalar query)."""
    t, d = tracked.c, dead_letters.c
    probes: list[tuple[TopicCounts, str, Any]] = []
    if counts.in_flight:
        # One probe of ix_tracked_topic_state (origin_topic, state, first_seen_ms). Written
        # as ORDER BY .. LIMIT 1, not MIN(): PostgreSQL turns MIN into that probe only when
        # its statistics say the topic has many rows; before the table is analyzed (after a
        # bulk load) it read all 1M index entries instead (500 ms).
        oldest = (
            select(t.first_seen_ms)
            .where(t.origin_topic == counts.topic, t.state == State.IN_FLIGHT.value)
            .order_by(t.first_seen_ms)
            .limit(1)
        )
        probes.append((counts, "oldest_in_flight_first_seen_ms", oldest))
        # And one probe of ix_ranges_topic_seen for the tracked ranges, for the same reason
        # (a MIN grouped by topic read every range of the topic: 1.6x slower at 10M messages
        # in flight than at 10k). The lower of the two answers is kept.
        r = ranges_table.c
        oldest_range = (
            select(r.first_seen_ms)
            .where(r.origin_topic == counts.topic)
            .order_by(r.first_seen_ms)
            .limit(1)
        )
        probes.append((counts, "oldest_in_flight_first_seen_ms", oldest_range))
    if counts.delayed:
        # Walks ix_tracked_state_due_key (state, due_at_ms, ...) to the topic's first delayed entry:
        # cheap however many delayed entries the topic has. ``|| ''`` keeps the planners
        # from choosing the topic index instead, which would read all of them and sort.
        next_due = (
            select(t.due_at_ms)
            .where(
                t.state == State.DELAYED.value,
                t.due_at_ms.is_not(None),
                t.origin_topic.concat("") == counts.topic,
            )
            .order_by(t.due_at_ms)
            .limit(1)
        )
        probes.append((counts, "next_delayed_due_ms", next_due))
    if counts.dead_lettered:
        # A range of ix_dead_letters_topic_time: as long as the recent dead letters.
        recent = select(func.count()).where(
            d.origin_topic == counts.topic, d.dead_lettered_ms >= since_ms
        )
        probes.append((counts, "dead_lettered_recently", recent))
    return probes


class TopicStatistics(AdminQueries):
    """The per-topic statistics query (the listings build on it: ``InspectionQueries``)."""

    async def topic_counts(
        self, *, since_ms: int, topic: str | None = None
    ) -> dict[str, TopicCounts]:
        """Per origin topic: entries by state, oldest ages, dead letters (recent and waiting).

        The counts come from the counter tables (migration 0003: entries kept by the store,
        dead letters by triggers), a few rows whatever the table's size; then, per topic, one
        index probe each for the oldest in-flight message, the next delayed one and the
        recent dead letters.
        """
        c = tracked_counts.c
        entries = select(c.origin_topic, c.group_id, c.state, func.sum(c.entries)).group_by(
            c.origin_topic, c.group_id, c.state
        )
        dc = dead_letter_counts.c
        dead = select(dc.origin_topic, dc.group_id, dc.total, dc.waiting)
        if topic is not None:
            entries = entries.where(c.origin_topic == topic)
            dead = dead.where(dc.origin_topic == topic)

        def counted(conn: Connection) -> dict[str, TopicCounts]:
            out: dict[str, TopicCounts] = {}
            for name, group, state, count in conn.execute(entries):
                attribute = _COUNTED.get(state)
                if not count or attribute is None:
                    continue
                counts = out.setdefault(name, TopicCounts(name))
                setattr(counts.group(group), attribute, int(count))
                setattr(counts, attribute, getattr(counts, attribute) + int(count))
            for name, group, total, waiting in conn.execute(dead):
                if total:
                    counts = out.setdefault(name, TopicCounts(name))
                    by_group = counts.group(group)
                    by_group.dead_lettered, by_group.dead_letters_waiting = int(total), int(waiting)
                    counts.dead_lettered += int(total)
                    counts.dead_letters_waiting += int(waiting)
            probes = [probe for counts in out.values() for probe in _probes(counts, since_ms)]
            for chunk in chunks(probes, _PROBES_PER_QUERY):
                queries = (query.scalar_subquery() for _, _, query in chunk)
                found = conn.execute(select(*queries)).one()
                for (counts, attribute, _), value in zip(chunk, found, strict=True):
                    if value is None:
                        continue
                    current = getattr(counts, attribute)
                    if attribute in _EARLIEST and current is not None:
                        setattr(counts, attribute, min(current, value))
                    else:
                        setattr(counts, attribute, value)
            return out

        return await self._read(counted)
