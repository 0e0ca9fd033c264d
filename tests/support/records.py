"""A stand-in for aiokafka's ``ConsumerRecord`` in the client's unit tests.

The client reads only these fields of a fetched record; tests build batches of them without a
broker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

from tracker.clock import to_millis

#: The time the fake records were written (and the tests' "now" unless they move it).
RECORDS_AT = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)


@dataclass
class FakeRecord:
    topic: str
    partition: int
    offset: int
    headers: list[tuple[str, bytes]] = field(default_factory=list)
    key: bytes | None = b"k"
    value: bytes | None = b"v"
    timestamp: int = to_millis(RECORDS_AT)
