"""The kmq headers on queue records, and their parsing.

The tracker stamps every redelivered copy with where it came from and which attempt it is; the
producer helper stamps delayed messages with when they are due. All kmq headers are ASCII and
start with ``kmq-`` so they never collide with an application's own headers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from tracker.errors import InvalidHeader
from tracker.ids import MessageId

#: ``topic/partition/offset`` of the first delivery of the logical message.
ORIGIN = "kmq-origin"
#: Delivery attempt of this copy, 1-based (the first delivery has no header and is attempt 1).
ATTEMPT = "kmq-attempt"
#: The consumer group a redelivered copy is meant for; other groups skip it.
GROUP = "kmq-group"
#: When the tracker first saw the logical message (ms since the epoch), carried on copies.
FIRST_SEEN = "kmq-first-seen"
#: When a delayed message becomes due: milliseconds since the Unix epoch (UTC), decimal.
DELIVER_AT = "kmq-deliver-at"

RESERVED_PREFIX = "kmq-"

# -- on records republished from a dead-letter topic (redrive)
#: The redrive job (admin API) that produced it: the job's id (decimal).
REDRIVE_JOB = "kmq-redrive-job"
#: The dead letter it republishes, for a redrive job: its id (decimal), unique within the job.
REDRIVE_ITEM = "kmq-redrive-item"
#: The pipeline's bulk redrive run that produced it.
REDRIVE_RUN = "kmq-redrive-run"
#: ``topic/partition/offset`` of the dead letter a bulk redrive republished.
REDRIVE_SOURCE = "kmq-redrive-source"
#: Headers the tracker puts on dead letters (reason, attempts, origin, times).
DLQ_HEADER_PREFIX = "kmq-dlq-"
REDRIVE_HEADER_PREFIX = "kmq-redrive-"

# -- on the copies of malformed markers parked in the invalid-markers topic
#: Why the marker was refused, and its category (``kmq_invalid_markers_total``'s label).
INVALID_REASON = "kmq-invalid-reason"
INVALID_CATEGORY = "kmq-invalid-category"
#: ``topic/partition/offset`` of the refused record in the markers topic.
INVALID_SOURCE = "kmq-invalid-source"
#: The refused record's own timestamp (decimal ms; the parked copy is stamped when parked).
INVALID_TIMESTAMP = "kmq-invalid-timestamp"
#: On a stub: why the broker refused the raw record, and the size of its key + value.
INVALID_STUB = "kmq-invalid-stub"
INVALID_SIZE = "kmq-invalid-size"

Headers = Sequence[tuple[str, bytes | None]]


def _ascii_int(raw: bytes, name: str, low: int, high: int) -> int:
    if not (raw.isascii() and raw.isdigit()):
        raise InvalidHeader(f"header {name}={raw[:40]!r} is not a non-negative decimal integer")
    value = int(raw)
    if not low <= value <= high:
        raise InvalidHeader(f"header {name}={value} is out of range [{low}, {high}]")
    return value


def format_deliver_at(when: datetime) -> bytes:
    return str(int(when.timestamp() * 1000)).encode("ascii")


def parse_deliver_at(raw: bytes) -> datetime:
    return datetime.fromtimestamp(_ascii_int(raw, DELIVER_AT, 0, 253402300799999) / 1000, tz=UTC)


@dataclass(frozen=True, slots=True)
class KmqHeaders:
    """The kmq headers of one record, parsed and validated."""

    origin: MessageId | None = None
    attempt: int = 1
    group: str | None = None
    deliver_at: datetime | None = None

    @classmethod
    def parse(cls, headers: Headers | None) -> KmqHeaders:
        """Read the kmq headers out of a record's headers (others are ignored).

        Raises :class:`InvalidHeader` when a kmq header is present but unreadable.
        """
        if not headers:
            return _EMPTY
        origin: MessageId | None = None
        attempt = 1
        group: str | None = None
        deliver_at: datetime | None = None
        for name, raw in headers:
            if not name.startswith(RESERVED_PREFIX):
                continue
            value = bytes(raw) if raw is not None else b""
            if name == ORIGIN:
                try:
                    origin = MessageId.parse(value.decode("ascii"))
                except UnicodeDecodeError:
                    raise InvalidHeader(f"header {ORIGIN} is not ASCII") from None
            elif name == ATTEMPT:
                attempt = _ascii_int(value, ATTEMPT, 1, 0xFFFF)
            elif name == GROUP:
                try:
                    group = value.decode("utf-8")
                except UnicodeDecodeError:
                    raise InvalidHeader(f"header {GROUP} is not UTF-8") from None
            elif name == DELIVER_AT:
                deliver_at = parse_deliver_at(value)
        if attempt > 1 and origin is None:
            raise InvalidHeader(f"{ATTEMPT}={attempt} without {ORIGIN}")
        return cls(origin, attempt, group, deliver_at)

    def to_headers(self) -> list[tuple[str, bytes]]:
        """The kmq headers as Kafka record headers (only those that are set)."""
        out: list[tuple[str, bytes]] = []
        if self.origin is not None:
            out.append((ORIGIN, str(self.origin).encode("ascii")))
        if self.attempt != 1:
            out.append((ATTEMPT, str(self.attempt).encode("ascii")))
        if self.group is not None:
            out.append((GROUP, self.group.encode("utf-8")))
        if self.deliver_at is not None:
            out.append((DELIVER_AT, format_deliver_at(self.deliver_at)))
        return out


_EMPTY = KmqHeaders()


def without_kmq_headers(headers: Headers | None) -> list[tuple[str, bytes | None]]:
    """The application's own headers, kmq ones removed (used when the tracker makes a copy)."""
    return [(k, v) for k, v in headers or () if not k.startswith(RESERVED_PREFIX)]


# Headers the tracker writes on dead-lettered records (besides kmq-origin and kmq-group).
DLQ_REASON = "kmq-dlq-reason"  #: why it was dead-lettered (UTF-8)
DLQ_ATTEMPTS = "kmq-dlq-attempts"  #: deliveries made (decimal)
DLQ_FIRST_SEEN = "kmq-dlq-first-seen"  #: first START seen, ms since the epoch (decimal)
DLQ_AT = "kmq-dlq-at"  #: when it was dead-lettered, ms since the epoch (decimal)
DLQ_LAST_ERROR = "kmq-dlq-last-error"  #: the consumer's last retry reason (UTF-8), may be empty
DLQ_SOURCE = "kmq-dlq-source"  #: topic/partition/offset of the copy that was dead-lettered


def redrive_headers(headers: Headers, marks: Headers) -> list[tuple[str, bytes | None]]:
    """The headers of a dead letter's republished copy: its own without ``kmq-dlq-*`` (what
    the tracker said about the dead letter) and ``kmq-redrive-*`` (an earlier redrive's
    marks), then ``marks``: the redrive job's or run's own (:data:`REDRIVE_JOB` and
    :data:`REDRIVE_ITEM`, or :data:`REDRIVE_RUN` and :data:`REDRIVE_SOURCE`)."""
    dropped = (DLQ_HEADER_PREFIX, REDRIVE_HEADER_PREFIX)
    return [*((k, v) for k, v in headers if not k.startswith(dropped)), *marks]


def job_marks(job_id: int, dead_letter_id: int) -> list[tuple[str, bytes | None]]:
    """A redrive job's marks on the copy of one dead letter (:func:`redrive_marks` reads them)."""
    return [(REDRIVE_JOB, str(job_id).encode()), (REDRIVE_ITEM, str(dead_letter_id).encode())]


def redrive_marks(headers: Headers) -> tuple[int, int] | None:
    """``(job id, dead letter id)`` of a record a redrive produced, else None."""
    job = item = None
    for key, value in headers:
        if key == REDRIVE_JOB and value is not None and value.isdigit():
            job = int(value)
        elif key == REDRIVE_ITEM and value is not None and value.isdigit():
            item = int(value)
    if job is None or item is None:
        return None
    return job, item
