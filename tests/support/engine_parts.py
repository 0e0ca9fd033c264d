"""Stand-ins for the engine's internal signals, for tests that run one loop on its own."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tracker.domain.entries import EntryKey


def _nothing_pending(_keys: Iterable[EntryKey]) -> set[EntryKey]:
    return set()


@dataclass
class FixedProgress:
    """An ``IngestProgress`` whose answers the test gives (redelivery without ingest)."""

    owned: Callable[[], dict[int, int]]
    safe: Callable[[], dict[int, int]]
    pending: Callable[[Iterable[EntryKey]], set[EntryKey]] = _nothing_pending

    def owned_epochs(self) -> dict[int, int]:
        return self.owned()

    def safe_until(self) -> dict[int, int]:
        return self.safe()

    def pending_keys(self, keys: Iterable[EntryKey]) -> set[EntryKey]:
        return self.pending(keys)


@dataclass
class RecordingListener:
    """An ``IngestListener`` that writes down what ingest told it."""

    dues: list[int] = field(default_factory=list)
    horizons: list[int] = field(default_factory=list)
    ownership_changes: int = 0

    def due(self, due_ms: int) -> None:
        self.dues.append(due_ms)

    def caught_up(self, safe_ms: int) -> None:
        self.horizons.append(safe_ms)

    def ownership_changed(self) -> None:
        self.ownership_changes += 1
