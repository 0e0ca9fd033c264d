"""The engine loops' sleep: until there is work (a wake-up event) or a stop, at most a while."""

from __future__ import annotations

import asyncio
import contextlib


async def wait_any(*events: asyncio.Event, timeout: float) -> None:  # noqa: ASYNC109
    """Return once one of ``events`` is set, or after ``timeout`` seconds.

    A loop that sleeps on its wake-up event alone would make every shutdown wait out the
    sleep: the redelivery loop, the redrive runner and the payload keeper wait on their
    wake-up event and the stop event together, through this.
    """
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiting in waits:
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
