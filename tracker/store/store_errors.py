"""Store errors: driver exceptions are translated into these at the manager's boundary."""

from __future__ import annotations

from collections.abc import Sequence

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


class IdempotencyConflict(KmqError):
    """The Idempotency-Key was already used for a different request."""


class LeaseLost(KmqError):
    """This replica no longer holds the redrive job's lease (another replica took it over)."""


class JobNotCancellable(KmqError):
    """The redrive job already finished; it cannot be cancelled."""


class UnknownDeadLetters(KmqError):
    """Some of the requested dead letters do not exist."""

    def __init__(self, missing: Sequence[int]) -> None:
        shown = ", ".join(str(i) for i in list(missing)[:20])
        more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
        super().__init__(f"no dead letters with ids {shown}{more}")
        self.missing = list(missing)


class ServesAnotherMarkersTopic(KmqError):
    """The database serves another markers topic (``tracker/store/topic_binding.py``)."""

    def __init__(self, database: str, bound: str, bound_by: str, asked: str) -> None:
        super().__init__(
            f"the database {database} serves markers topic {bound!r} (bound by {bound_by}), "
            f"not {asked!r}: one database serves one markers topic, since the tracked entries "
            f"are keyed by markers partition. Point database_url at a database of its own, "
            f"or, if {asked!r} replaces {bound!r} for good, move the database over with "
            f"`kmq-tracker rebind-markers-topic --from {bound}`"
        )
        self.bound = bound
        self.asked = asked


class NotBoundToMarkersTopic(KmqError):
    """A rebind named a markers topic the database does not serve."""
