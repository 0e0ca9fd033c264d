"""The interfaces between the layers: what one part asks of another, and nothing more.

* :class:`OriginalsSource`: what redelivery, redrive jobs and the payload keeper read from
  Kafka (``tracker.kafka.originals.OriginalsReader`` in production, fakes in tests).
* :class:`EngineHandle` and :class:`EngineHealth`: what the API asks of the engine running in
  its process (health, and a wake-up when an operator's action set a due time). The API never
  sees ``Tracker`` itself: ``tracker.runtime`` hands it the engine through this port.
* :class:`RedriveService`: the redrive-job runner as the API drives it (wake it when a job is
  created; run it when the API serves alone).

The store's port is ``tracker.store.port.TrackerStore`` (adapters: the SQL store over
SQLite and PostgreSQL, and the in-memory store); the engine's own internal signals are in
``tracker.engine.signals``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tracker.ids import MessageId
from tracker.kafka.original_records import Missing, OriginalRecord


class OriginalsSource(Protocol):
    """Records read back by position, in batches (one fetch per run of offsets)."""

    async def fetch(
        self, positions: Sequence[MessageId]
    ) -> dict[MessageId, OriginalRecord | Missing]: ...


@dataclass(frozen=True, slots=True)
class EngineHealth:
    """What readiness is made of."""

    running: bool
    store_ok: bool
    broker_ok: bool
    owned_partitions: list[int]
    last_error: str | None

    @property
    def ready(self) -> bool:
        return self.running and self.store_ok and self.broker_ok


class EngineHandle(Protocol):
    """The running engine, as the API in the same process sees it."""

    async def health(self) -> EngineHealth:
        """Readiness, with a (bounded) database ping."""
        ...

    def engine_state(self) -> tuple[bool, str | None]:
        """Whether the engine runs, and its last error, without a round trip."""
        ...

    def wake_redelivery(self, due_ms: int) -> None:
        """An action set a due time: wake redelivery if it would sleep past it."""
        ...


class RedriveService(Protocol):
    """The runner of redrive jobs."""

    def notify(self) -> None:
        """A job was created or changed: look at the jobs now."""
        ...

    async def run(self, stopping: asyncio.Event) -> None:
        """Run jobs until ``stopping`` is set."""
        ...
