"""A fetched batch between its STARTs' acknowledgement and its hand-over, and how much of
them the START pipeline may hold ahead of the application.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from tracker.ids import MessageId
from tracker.protocol import AnyMarker, Marker

from .planning import RangePlan

_VALUE_SIZE = attrgetter("serialized_value_size")


def value_bytes(fetched: dict[Any, list[Any]]) -> int:
    """The bytes of the values of a fetched batch (what prefetching holds in memory)."""
    return sum(sum(map(_VALUE_SIZE, records)) for records in fetched.values())


def prefetch_seconds(timeout_ms: int) -> float:
    """How much of the application's work may wait in the pipeline: a tenth of the lease the
    client asks for, at most one second (a lease left to the tracker's policy is at least
    seconds long: one second)."""
    return min(1.0, timeout_ms / 10_000) if timeout_ms else 1.0


@dataclass(frozen=True, slots=True)
class PreparedBatch:
    """A batch whose STARTs are acknowledged, ready to hand over (offsets committed after)."""

    plans: Sequence[RangePlan]
    at: float  #: time.monotonic() when it was ready: its leases run from about then
    timeout_ms: int  #: the lease its STARTs asked for (0: the topic's policy)
    group: str

    def stale(self) -> bool:
        """Whether it waited more than half its lease (known only when the client set it)."""
        return bool(self.timeout_ms) and (time.monotonic() - self.at) * 2000 > self.timeout_ms

    def extensions(self, timeout_ms: int) -> list[AnyMarker]:
        """EXTENDs of ``timeout_ms`` for every message it holds (1 ms: give them back)."""
        out: list[AnyMarker] = []
        for plan in self.plans:
            for whole in plan.ranges:
                extension = whole.extend(timeout_ms)
                if extension is not None:
                    out.append(extension)
            for opened, records, origin, attempt in plan.deliver:
                if opened is None:
                    record = records[0]
                    message = MessageId(record.topic, record.partition, record.offset)
                    out.append(
                        Marker.extend(
                            self.group,
                            message,
                            timeout_ms=timeout_ms,
                            attempt=attempt,
                            origin=origin,
                        )
                    )
        return out
