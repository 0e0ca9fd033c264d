"""When the redelivery loop looks for due entries again: the alarm it sleeps on.

An entry may be acted on once it is due *and* ingest has read its markers partition up to
then (``safe_until``, which trails the clock by ``ack_grace`` at least). The alarm keeps, while
the loop sleeps, each owned partition's earliest due time, and is woken early by the three
things that can make an entry actionable sooner: ingest wrote a nearer due time
(:meth:`notify_due`), ingest read further (:meth:`notify_safe`), ownership changed
(:meth:`notify_ownership`). Kept apart from the rounds themselves because it is the
lateness budget's first half (the wake-up path), measured on its own in the redelivery bench.
"""

from __future__ import annotations

import asyncio

from tracker.clock import Clock, to_millis
from tracker.engine.signals import IngestProgress
from tracker.engine.wakeup import wait_any
from tracker.store.port import TrackerStore

NOT_READY_RECHECK = 0.05  #: seconds between looks at due entries that are not actionable yet


class DueAlarm:
    """The redelivery loop's alarm: sleep until an entry is actionable, woken early by ingest."""

    def __init__(
        self, *, store: TrackerStore, progress: IngestProgress, clock: Clock, max_idle: float
    ) -> None:
        self._store = store
        self._owned_epochs = progress.owned_epochs
        self._safe_until = progress.safe_until
        self._clock = clock
        self._max_idle = max_idle
        self._wake = asyncio.Event()
        #: while the loop sleeps: per markers partition, its earliest due time, and when the
        #: loop's timer runs out (ms)
        self._targets: dict[int, int] | None = None
        self._wake_at_ms: int | None = None

    def notify_due(self, due_ms: int) -> None:
        """Ingest wrote an entry due at ``due_ms``: wake up if that is earlier than planned."""
        wake_at = self._wake_at_ms
        if wake_at is None or due_ms < wake_at:
            self._wake.set()

    def notify_safe(self, safe_ms: int) -> None:
        """Ingest read further: entries due up to ``safe_ms`` may be actionable now.

        Wakes the loop if a partition it waits for has become actionable, rather than letting
        it find out at its next recheck (``NOT_READY_RECHECK``). Checked per partition: a
        wake-up for another partition's progress made the loop claim, find nothing it may
        act on, and hold the store (and the next real claim) up for nothing.
        """
        targets = self._targets
        if not targets or min(targets.values()) > safe_ms:
            return
        if self.actionable(targets):
            self._wake.set()

    def actionable(self, targets: dict[int, int]) -> bool:
        """Whether any partition's earliest due entry may be acted on now."""
        now_ms = to_millis(self._clock.now())
        safe = self._safe_until()
        return any(due <= now_ms and due <= safe.get(p, -1) for p, due in targets.items())

    def notify_ownership(self) -> None:
        """The replica's markers partitions changed: look again at once."""
        self._wake.set()

    async def sleep_until_due(
        self, stopping: asyncio.Event, *, claimed_nothing: bool = False
    ) -> None:
        """Return once an entry may be acted on (or a while has passed, or we stop).

        An entry may be acted on once it is due *and* ingest has read its markers partition
        up to then (``safe_until``, which trails the clock by ``ack_grace`` at least): waking
        at the due time alone, the loop claimed before it was allowed to act, found nothing,
        and slept again. So each partition's timer aims at the moment its horizon should
        reach its earliest due entry, and ingest's progress (``notify_safe``) wakes the loop
        as soon as a partition it waits for is actionable.
        """
        owned = self._owned_epochs()
        self._wake.clear()
        targets = await self._store.next_due_by_partition(owned) if owned else {}
        if targets and not claimed_nothing and self.actionable(targets):
            return  # it fell due while the last round ran: claim it now
        now_ms = to_millis(self._clock.now())
        safe = self._safe_until()
        waits = [max(due - now_ms, due - safe[p]) / 1000 for p, due in targets.items() if p in safe]
        # A partition still catching up (not in ``safe``) is announced by notify_safe;
        # rechecked shortly in any case.
        delay = min(waits, default=self._max_idle if not targets else NOT_READY_RECHECK)
        delay = min(max(NOT_READY_RECHECK, delay), self._max_idle)
        self._targets = targets
        self._wake_at_ms = now_ms + int(delay * 1000)
        try:
            await wait_any(self._wake, stopping, timeout=delay)
        finally:
            self._targets = None
            self._wake_at_ms = None
