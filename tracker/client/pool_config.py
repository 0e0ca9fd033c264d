"""How a worker pool is configured and what it reports: the arguments of ``KmqConsumer.run``,
checked (:func:`checked_run_options`), the pool's settings and its statistics.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from tracker.protocol import MAX_TIMEOUT_MS

from .ordering import Ordering


def checked_run_options(
    handler: object,
    *,
    concurrency: object,
    ordering: Ordering | str,
    max_processing: object,
    drain_timeout: object,
) -> tuple[Ordering, float, float]:
    """``run()``'s arguments, checked: the ordering, ``max_processing`` and ``drain_timeout``
    in seconds. Raises ``ValueError`` or ``TypeError`` naming the argument at fault."""
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency must be a positive integer, got {concurrency!r}")
    try:
        order = Ordering(ordering)
    except ValueError:
        choices = ", ".join(repr(o.value) for o in Ordering)
        raise ValueError(f"ordering must be one of {choices}, got {ordering!r}") from None
    if not isinstance(max_processing, timedelta):
        raise TypeError(f"max_processing must be a datetime.timedelta, got {max_processing!r}")
    if not isinstance(drain_timeout, timedelta):
        raise TypeError(f"drain_timeout must be a datetime.timedelta, got {drain_timeout!r}")
    max_s = max_processing.total_seconds()
    if not 0 < max_s * 1000 <= MAX_TIMEOUT_MS:
        raise ValueError("max_processing must be positive (and under ~49 days)")
    if drain_timeout < timedelta(0):
        raise ValueError("drain_timeout must not be negative")
    if not callable(handler):
        raise TypeError(f"the handler must be callable, got {type(handler).__name__}")
    return order, max_s, drain_timeout.total_seconds()


@dataclass(slots=True)
class PoolSettings:
    concurrency: int
    ordering: Ordering
    lease_ms: int  #: what each renewal asks for; renewed when a third of it is gone
    max_processing_s: float
    drain_s: float
    max_waiting: int  #: messages taken and not started, at most (before the next batch)
    #: while it takes nothing, the pool polls (records paused) this often, so that the group
    #: does not drop it as a stalled member (a third of ``max_poll_interval_ms``)
    keepalive_s: float = 100.0
    clock: Callable[[], float] = field(default=time.monotonic)


@dataclass(slots=True)
class WorkerStats:
    """What a pool did (returned by ``KmqConsumer.run``)."""

    acked: int = 0  #: handler returned: acked
    retried: int = 0  #: handler raised (or asked for a retry)
    rejected: int = 0  #: handler raised :class:`RejectMessage`
    timed_out: int = 0  #: ran longer than ``max_processing`` (counted in ``retried`` too)
    settled_by_handler: int = 0  #: the handler settled the message itself
    released: int = 0  #: given back to the tracker unfinished (stop, revocation, drain timeout)
    renewals: int = 0  #: EXTEND markers written to renew leases
    most_in_progress: int = 0  #: the most handlers that ran at once
