"""Store errors: driver exceptions are translated into these at the manager's boundary."""

from __future__ import annotations

from tracker.errors import KmqError


class StoreUnavailable(KmqError):
    """The database is unreachable or refused the operation; retry later."""


class Fenced(KmqError):
    """Another replica took over these markers partitions (their epoch moved on)."""

    def __init__(self, partitions: set[int]) -> None:
        super().__init__(f"fenced out of markers partitions {sorted(partitions)}")
        self.partitions = partitions


class SchemaOutdated(KmqError):
    """The database schema is not at the version this tracker needs: run `kmq-tracker migrate`."""


class MigrationRefused(KmqError):
    """Alembic refused the migration asked for (an unknown revision, say): nothing was run."""
