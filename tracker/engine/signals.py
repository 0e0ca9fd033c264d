"""How ingest and the loops that act on its state talk to each other.

Ingest is the only part that knows how far the markers were read and which partitions this
replica owns; redelivery and the payload keeper act on what ingest made durable. Two small
interfaces carry that, instead of loose callbacks:

* :class:`IngestProgress`: what redelivery asks of ingest before it acts (owned partitions
  and their epochs, how far each is safe to act on, which entries still have markers in the
  coalescing window);
* :class:`IngestListener`: what ingest tells when that changes (an earlier due time, a safe
  horizon that moved, an ownership change), so that sleeping loops wake up at once.

``tracker.engine.process.Tracker`` wires them: ingest is the progress, the tracker's
:class:`~tracker.engine.process.EngineWakeups` is the listener.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from tracker.domain.entries import EntryKey


class IngestProgress(Protocol):
    def owned_epochs(self) -> dict[int, int]:
        """The markers partitions this replica owns, with the epoch that fences each."""
        ...

    def safe_until(self) -> dict[int, int]:
        """Per owned partition, the time (ms) up to which every marker has been applied."""
        ...

    def pending_keys(self, keys: Iterable[EntryKey]) -> set[EntryKey]:
        """Those of ``keys`` with markers read but not yet applied to the store."""
        ...


class IngestListener(Protocol):
    def due(self, due_ms: int) -> None:
        """A flush made an entry due at ``due_ms`` (may be earlier than any known)."""
        ...

    def caught_up(self, safe_ms: int) -> None:
        """The safe horizon moved to ``safe_ms``: entries due by then may be acted on."""
        ...

    def ownership_changed(self) -> None:
        """Partitions were assigned or revoked."""
        ...


class NoListener:
    """An :class:`IngestListener` that hears nothing (ingest on its own, in tests)."""

    def due(self, due_ms: int) -> None:
        pass

    def caught_up(self, safe_ms: int) -> None:
        pass

    def ownership_changed(self) -> None:
        pass
