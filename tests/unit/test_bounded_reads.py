"""The API's bounded Kafka reads: joined while running, reused only when the caller allows."""

from __future__ import annotations

import asyncio

import pytest

from api.context import BoundedReads, ReadTimedOut
from tracker.kafka.original_records import OriginalsUnavailable

pytestmark = [pytest.mark.unit]


class Counted:
    """A read that counts its calls and answers when released."""

    def __init__(self) -> None:
        self.calls = 0
        self.release = asyncio.Event()
        self.fail = False

    async def __call__(self) -> int:
        self.calls += 1
        await self.release.wait()
        if self.fail:
            raise OriginalsUnavailable("broker gone")
        return self.calls


def deadline(seconds: float = 5.0) -> float:
    return asyncio.get_running_loop().time() + seconds


async def test_concurrent_reads_of_one_thing_share_one_read() -> None:
    reads, read = BoundedReads("test", 5.0), Counted()
    waiting = [asyncio.create_task(reads.run("k", read, deadline())) for _ in range(3)]
    await asyncio.sleep(0)
    read.release.set()
    assert await asyncio.gather(*waiting) == [1, 1, 1]
    assert read.calls == 1


async def test_a_finished_read_is_reused_only_within_max_age() -> None:
    reads, read = BoundedReads("test", 5.0), Counted()
    read.release.set()
    assert await reads.run("k", read, deadline(), max_age=60.0) == 1
    assert await reads.run("k", read, deadline(), max_age=60.0) == 1  # reused
    assert read.calls == 1
    assert await reads.run("k", read, deadline()) == 2  # no max_age: read again
    assert await reads.run("other", read, deadline(), max_age=60.0) == 3  # another key
    # Once older than max_age, it is read again.
    await asyncio.sleep(0.05)
    assert await reads.run("k", read, deadline(), max_age=0.01) == 4
    assert read.calls == 4


async def test_a_failed_read_is_not_reused() -> None:
    reads, read = BoundedReads("test", 5.0), Counted()
    read.release.set()
    read.fail = True
    with pytest.raises(OriginalsUnavailable):
        await reads.run("k", read, deadline(), max_age=60.0)
    read.fail = False
    assert await reads.run("k", read, deadline(), max_age=60.0) == 2


async def test_the_request_stops_waiting_at_its_deadline_and_the_read_goes_on() -> None:
    reads, read = BoundedReads("test", 5.0), Counted()
    with pytest.raises(ReadTimedOut):
        await reads.run("k", read, deadline(0.01), max_age=60.0)
    assert reads.pending == 1
    read.release.set()
    # The next request joins the read still running, and gets its answer.
    assert await reads.run("k", read, deadline(), max_age=60.0) == 1
    assert read.calls == 1
    await reads.close()
