"""Waiting on a condition with a deadline, for tests that drive an event loop themselves."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(check: Callable[[], bool], within: float = 10.0, what: str = "condition") -> None:
    """Let the loop run until ``check()`` holds, or fail once ``within`` seconds have passed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not check():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)
