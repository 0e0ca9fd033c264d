"""One token bucket for every rate-limited republish: redrive jobs (async, in the tracker or
the API) and the Spark pipeline's bulk redrive (blocking, one per executor task).

``rate`` tokens per second, holding at most ``burst``. It starts with one token at its first
take, and its clock starts then too: time spent before (preparing the first batch) does not
add up to a burst. Clock and sleep are injectable (seconds, monotonic) for tests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

Sleep = Callable[[float], Awaitable[None]]

#: By default the bucket holds at most this much of the rate (how far a late sender catches up).
BURST_SECONDS = 0.25


class TokenBucket:
    def __init__(
        self,
        rate: float,
        burst: float | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Sleep = asyncio.sleep,
        blocking_sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be positive, not {rate}")
        self.rate = rate
        self.burst = burst if burst is not None else max(1.0, rate * BURST_SECONDS)
        self._clock = clock
        self._sleep = sleep
        self._blocking_sleep = blocking_sleep
        self._tokens = min(1.0, self.burst)
        self._at: float | None = None  #: the clock starts at the first take

    def _refill(self) -> None:
        now = self._clock()
        if self._at is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now

    def _wait(self) -> float:
        """Seconds until a whole token is there (0: one is)."""
        self._refill()
        return 0.0 if self._tokens >= 1 else (1 - self._tokens) / self.rate

    def _grant(self, wanted: int, waited: bool) -> int:
        self._refill()
        if waited:
            # The sleep was for exactly this token: rounding must not make us wait again.
            self._tokens = max(self._tokens, 1.0)
        granted = min(wanted, int(self._tokens))
        self._tokens -= granted
        return granted

    async def take(self, wanted: int, *, max_wait: float | None = None) -> int:
        """Wait for at least one token; take up to ``wanted`` of them and return how many.

        With ``max_wait``, wait at most that long and return 0 if the next token is further
        away (the redrive runner renews its lease in between at slow rates).
        """
        if wanted <= 0:
            return 0
        wait = self._wait()
        if max_wait is not None and wait > max_wait:
            await self._sleep(max_wait)
            self._refill()
            return 0
        if wait > 0:
            await self._sleep(wait)
        return self._grant(wanted, waited=wait > 0)

    def take_blocking(self, wanted: int) -> int:
        """:meth:`take` for code that may block its thread (a Spark executor's task)."""
        if wanted <= 0:
            return 0
        wait = self._wait()
        if wait > 0:
            self._blocking_sleep(wait)
        return self._grant(wanted, waited=wait > 0)
