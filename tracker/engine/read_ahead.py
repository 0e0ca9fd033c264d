"""Reading originals ahead: an expired entry's record is read while ``ack_grace`` runs.

An entry may be redelivered once it is due *and* ingest has read its markers partition past
due + ``ack_grace`` (the safe horizon, ``tracker.engine.due_alarm``). For that grace (500 ms by
default) the tracker already knows the entry will very likely be redelivered (only an ACK
written before the deadline and still on its way can save it) and which record it will copy.
Reading that record then, instead of after the claim, takes the read (a Kafka fetch, about
half of a round) out of the time between the horizon passing and the copy leaving: the round
finds the record in memory. This is the lateness budget's second half (issue 14).

:class:`HeldOriginals` is the round's ``OriginalsSource``: records read ahead are handed out
once, anything else is read as before. It is bounded: at most ``max_bytes`` of record data
are held, and once that is reached nothing more is read ahead until rounds take what is held
(rounds claim in due order, so the earliest records are the ones to keep: in a burst of
expiries, dropping them for later ones would make every round miss). A record no round took
within ``HOLD_SECONDS`` (its entry was acked in the grace, another replica took its
partition) is dropped. Kafka never changes the record at a position; a held record can only
differ from a fresh read in that retention or compaction removed it meanwhile, and then the
round copies a record that existed moments ago instead of recording it lost.

:class:`ReadAhead` decides what to read: every due entry and range of the owned markers
partitions once, as its deadline passes (``TrackerStore.copies_falling_due``, a read-only
query on the due-time indexes), woken early when ingest writes a nearer due time, and looking
back (one batch) when ingest writes one already past.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from tracker.clock import Clock, to_millis
from tracker.engine.wakeup import wait_any
from tracker.ids import MessageId
from tracker.kafka.original_records import Missing, OriginalRecord, OriginalsUnavailable
from tracker.metrics import Metrics
from tracker.ports import OriginalsSource
from tracker.store import StoreUnavailable
from tracker.store.port import TrackerStore

log = logging.getLogger(__name__)

#: A record read ahead and not taken by a round within this long is dropped.
HOLD_SECONDS = 10.0
#: How often due entries are looked for while some are due or falling due.
TICK_SECONDS = 0.05
#: Positions read ahead per look at most (one batched read, like a round's).
READ_AHEAD_BATCH = 2000


def record_size(record: OriginalRecord) -> int:
    """The bytes a held record keeps alive (key, value and headers; not Python's overhead)."""
    size = len(record.key or b"") + len(record.value or b"")
    for name, value in record.headers:
        size += len(name) + len(value or b"")
    return size


class HeldOriginals:
    """Originals read ahead, handed to the round that needs them (an ``OriginalsSource``)."""

    def __init__(
        self,
        source: OriginalsSource,
        *,
        max_bytes: int,
        metrics: Metrics,
        hold_seconds: float = HOLD_SECONDS,
    ) -> None:
        self._source = source
        self._max_bytes = max_bytes
        self._hold = hold_seconds
        self._metrics = metrics
        #: position -> (monotonic time read, record, size), oldest first
        self._held: OrderedDict[MessageId, tuple[float, OriginalRecord, int]] = OrderedDict()
        self._bytes = 0
        #: the read ahead under way and its positions: a round that wants one waits for it
        self._reading: asyncio.Future[None] | None = None
        self._reading_positions: frozenset[MessageId] = frozenset()

    @property
    def held(self) -> int:
        """Records held now."""
        return len(self._held)

    @property
    def held_bytes(self) -> int:
        return self._bytes

    async def fetch(
        self, positions: Sequence[MessageId]
    ) -> dict[MessageId, OriginalRecord | Missing]:
        """The records at ``positions``: those read ahead (handed out once), the rest read now."""
        reading = self._reading
        if reading is not None and not self._reading_positions.isdisjoint(positions):
            await asyncio.shield(reading)  # read twice at once, it would be held and wasted
        out: dict[MessageId, OriginalRecord | Missing] = {}
        rest: list[MessageId] = []
        for position in positions:
            held = self._held.pop(position, None)
            if held is None:
                rest.append(position)
            else:
                self._bytes -= held[2]
                out[position] = held[1]
        hits = len(out)
        if hits:
            self._metrics.read_ahead.labels("hit").inc(hits)
        if rest:
            self._metrics.read_ahead.labels("miss").inc(len(rest))
            out.update(await self._source.fetch(rest))
        return out

    async def read_ahead(self, positions: Iterable[MessageId]) -> int:
        """Read and hold the records at ``positions`` not held yet; returns how many were read.

        A broker that cannot be read now is no error here: the round reads them itself.
        """
        self._expire()
        wanted = [p for p in dict.fromkeys(positions) if p not in self._held]
        if not wanted or self._bytes >= self._max_bytes:
            return 0
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._reading, self._reading_positions = done, frozenset(wanted)
        try:
            found = await self._source.fetch(wanted)
        except OriginalsUnavailable as exc:
            log.debug("read ahead skipped, originals unavailable: %s", exc)
            return 0
        finally:
            self._reading, self._reading_positions = None, frozenset()
            done.set_result(None)
        now = time.monotonic()
        read = 0
        for position in wanted:  # in the order asked: the earliest due first
            record = found.get(position)
            if not isinstance(record, OriginalRecord):  # a missing one is the round's to record
                continue
            size = record_size(record)
            if self._bytes + size > self._max_bytes:
                break  # full: the rest is read by its round
            self._held[position] = (now, record, size)
            self._bytes += size
            read += 1
        return read

    def _expire(self) -> None:
        """Drop what no round took within the hold time."""
        oldest = time.monotonic() - self._hold
        held = self._held
        while held:
            position, (read_at, _record, size) = next(iter(held.items()))
            if read_at > oldest:
                break
            del held[position]
            self._bytes -= size


class ReadAhead:
    """Reads each due entry's original once its deadline passes, for the round to come."""

    def __init__(
        self,
        *,
        store: TrackerStore,
        originals: HeldOriginals,
        owned_partitions: Callable[[], Iterable[int]],
        clock: Clock,
        max_idle: float,
        batch: int = READ_AHEAD_BATCH,
    ) -> None:
        self._store = store
        self.originals = originals
        self._owned = owned_partitions
        self._clock = clock
        self._max_idle = max_idle
        self._batch = batch
        self._wake = asyncio.Event()
        self._wake_at_ms: int | None = None
        #: due times up to this were looked at (set as a look starts); ingest writing an
        #: earlier one sends the next look back for it
        self._looked_to_ms: int | None = None
        self._rewind_to_ms: int | None = None
        #: the rounds' last claim took a whole batch: they work through a backlog
        self._rounds_behind = False
        #: looks so far, those that stood aside for a backlog included (tests wait on it)
        self.looks = 0

    @property
    def standing_aside(self) -> bool:
        return self._rounds_behind

    def rounds_behind(self, behind: bool) -> None:
        """The rounds' last claim took a whole batch (``behind``: more is due than a round
        takes) or less.

        Behind, the rounds are busy on a backlog of due messages: each round reads the
        originals it claimed, and a read ahead would only take the event loop from them (in
        a burst of 100k it cost a tenth of redelivery's CPU and served 2 % of the reads).
        So it stands aside until a claim takes less than a batch; what fell due meanwhile is
        the backlog's, left to the rounds.
        """
        caught_up = self._rounds_behind and not behind
        self._rounds_behind = behind
        if caught_up:
            self._wake.set()

    def notify_due(self, due_ms: int) -> None:
        """Ingest wrote an entry due at ``due_ms``: look at it then, if sooner than planned.

        An entry written already due (its lease ran out before ingest read its START: a
        tracker catching up a backlog; a 1 ms EXTEND that gives a batch back) falls before
        what the last look covered: the read ahead wakes at once and looks back for it.
        """
        looked = self._looked_to_ms
        if looked is not None and due_ms <= looked:
            self._look_back_from(due_ms - 1)
            self._wake.set()
            return
        wake_at = self._wake_at_ms
        if wake_at is None or due_ms < wake_at:
            self._wake.set()

    def _look_back_from(self, after_ms: int) -> None:
        """The next look goes back to ``after_ms`` (the earliest of those asked for)."""
        rewind = self._rewind_to_ms
        if rewind is None or after_ms < rewind:
            self._rewind_to_ms = after_ms

    def notify_ownership(self) -> None:
        """The replica's markers partitions changed: look at once (a replica that starts owns
        none at its first look, and would otherwise sleep ``max_idle``)."""
        self._wake.set()

    async def run(self, stopping: asyncio.Event) -> None:
        """Until ``stopping``: read ahead what fell due since the last look, then sleep until
        the next due time (a tick while entries wait for their claim)."""
        after_ms = to_millis(self._clock.now())  # a backlog due before the start: the rounds'
        backoff = 0.5
        while not stopping.is_set():
            self._wake.clear()
            rewind, self._rewind_to_ms = self._rewind_to_ms, None
            try:
                if self._rounds_behind:
                    # A backlog: what fell due is the rounds' (see rounds_behind); looked at
                    # again once they catch up, which wakes this loop.
                    after_ms = self._looked_to_ms = to_millis(self._clock.now())
                    delay = self._max_idle
                    self.looks += 1
                else:
                    if rewind is not None and rewind < after_ms:
                        await self._look_back(rewind, after_ms)
                    rewind = None
                    after_ms, delay = await self._look(after_ms)
                backoff = 0.5
            except StoreUnavailable as exc:
                log.debug("read ahead paused, store unavailable: %s", exc)
                if rewind is not None:
                    # The look back did not happen: the next look after the pause does it.
                    self._look_back_from(rewind)
                delay, backoff = backoff, min(backoff * 2, 10.0)
            if delay > 0:
                self._wake_at_ms = to_millis(self._clock.now()) + int(delay * 1000)
                try:
                    await wait_any(self._wake, stopping, timeout=delay)
                finally:
                    self._wake_at_ms = None

    async def _look_back(self, after_ms: int, until_ms: int) -> None:
        """Read ahead one batch of the copies due in ``(after_ms, until_ms]``: what ingest
        wrote already due, earliest first. One batch, not every page: the window also holds
        what is due and not claimed yet (read ahead before, or left to the rounds in a
        backlog), and asking for all of it at each write would load the store for nothing."""
        owned = sorted(self._owned())
        if owned:
            await self._read_falling_due(owned, after_ms, until_ms)

    async def _read_falling_due(
        self, owned: list[int], after_ms: int, until_ms: int
    ) -> list[tuple[int, MessageId]]:
        """Read ahead (one batch of) the copies due in ``(after_ms, until_ms]``; returns
        their ``(due_ms, position)``, earliest first."""
        found = await self._store.copies_falling_due(owned, after_ms, until_ms, self._batch)
        if found:
            await self.originals.read_ahead(position for _, position in found)
        return found

    async def _look(self, after_ms: int) -> tuple[int, float]:
        """Read ahead the copies due in ``(after_ms, now]``; returns the new ``after_ms`` and
        how long to sleep."""
        owned = sorted(self._owned())
        now_ms = to_millis(self._clock.now())
        if not owned:
            return now_ms, self._max_idle
        self._looked_to_ms = now_ms  # before the query: a write during it sends the next back
        found = await self._read_falling_due(owned, after_ms, now_ms)
        self.looks += 1
        if len(found) >= self._batch:
            # More fell due than one read takes: go on from the last one at once (copies of
            # the same due time past the batch are read by their round).
            return found[-1][0], 0.0
        if found:
            # They are due and not claimed yet, so the next due time is at or before now:
            # look again in a tick for those falling due meanwhile (no need to ask).
            return now_ms, TICK_SECONDS
        next_due = await self._store.next_due_ms(owned)
        if next_due is None:
            return now_ms, self._max_idle
        # Entries due and not claimed yet keep the next due time at or before now: a tick.
        return now_ms, min(self._max_idle, max(TICK_SECONDS, (next_due - now_ms) / 1000))
