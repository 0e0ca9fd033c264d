"""Time, injected: all deadline arithmetic goes through a :class:`Clock`.

Only timezone-aware UTC datetimes are used. Tests pass a :class:`ManualClock` to control time.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Protocol


class Clock(Protocol):
    def now(self) -> datetime:
        """The current time, timezone-aware (UTC)."""
        ...


class SystemClock:
    """The wall clock."""

    def now(self) -> datetime:
        return datetime.now(UTC)


class ManualClock:
    """A clock that moves only when told to (for tests and simulations)."""

    def __init__(self, start: datetime | None = None) -> None:
        start = start or datetime(2026, 1, 1, tzinfo=UTC)
        if start.tzinfo is None:
            raise ValueError("ManualClock needs a timezone-aware start time")
        self._now = start

    def now(self) -> datetime:
        return self._now

    def advance(self, delta: timedelta) -> None:
        self._now += delta


def to_millis(when: datetime) -> int:
    """Milliseconds since the Unix epoch; refuses naive datetimes."""
    if when.tzinfo is None or when.utcoffset() is None:
        raise ValueError("naive datetime: pass a timezone-aware datetime")
    return int(when.timestamp() * 1000)


def from_millis(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC)
