"""When may the tracker act on a deadline? Once it has read every marker written before it.

``MarkerIngest.safe_until`` is how far that holds per markers partition. It comes from fetch
responses: each one reports the partition's high watermark at that moment, and once we have
read up to a watermark, every marker the broker had then has been read. The consumer only keeps
the newest watermark, and with markers arriving continuously the next response is in before
we have read to the previous one's end; these tests pin that the horizon still advances with
every response we read past, and never past what we have read.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import pytest
from aiokafka import TopicPartition
from support.engine_parts import RecordingListener

from tracker.clock import ManualClock, to_millis
from tracker.engine.ingest import MarkerIngest
from tracker.engine.partition_reading import PartitionReading
from tracker.metrics import Metrics

pytestmark = pytest.mark.unit

GRACE_MS = 500
TOPIC = "markers"


class FakeConsumer:
    """What ``AIOKafkaConsumer`` reports per partition: the newest fetch response, position."""

    def __init__(self) -> None:
        self._highwater: dict[int, int] = {}
        self._fetched_at: dict[int, float] = {}  #: wall-clock ms of the newest response
        self.positions: dict[int, int] = {}

    def respond(self, partition: int, highwater: int, ago_ms: int) -> None:
        """A fetch response for ``partition`` arrived ``ago_ms`` ago."""
        self._highwater[partition] = highwater
        self._fetched_at[partition] = time.time() * 1000 - ago_ms

    def highwater(self, tp: TopicPartition) -> int | None:
        return self._highwater.get(tp.partition)

    def last_poll_timestamp(self, tp: TopicPartition) -> float | None:
        return self._fetched_at.get(tp.partition)

    async def position(self, tp: TopicPartition) -> int:
        return self.positions.get(tp.partition, 0)


def ingest_over(
    consumer: Any,
    clock: ManualClock,
    partitions: list[int],
    listener: RecordingListener | None = None,
) -> MarkerIngest:
    ingest = MarkerIngest(
        consumer=consumer,
        store=None,  # type: ignore[arg-type]  # not reached: no flush here
        parker=None,  # type: ignore[arg-type]
        markers_topic=TOPIC,
        replica_id="r",
        policy_for=lambda _topic: None,  # type: ignore[arg-type,return-value]
        clock=clock,
        metrics=Metrics(),
        coalesce_window=0.5,
        ack_grace_ms=GRACE_MS,
        max_records=100,
        max_pending=1000,
        listener=listener,
    )
    for p in partitions:
        ingest._owned[p] = PartitionReading(epoch=1, applied_next=0)
    return ingest


@pytest.fixture
def clock() -> ManualClock:
    # The tracker's clock runs with the wall clock here: a fetch at wall time w is at w on it.
    return ManualClock(datetime.fromtimestamp(time.time(), UTC))


async def test_the_horizon_follows_every_response_read_past_not_only_the_newest(
    clock: ManualClock,
) -> None:
    state = FakeConsumer()
    heard = RecordingListener()  # what the redelivery loop is told (it wakes if something is due)
    told = heard.horizons
    ingest = ingest_over(state, clock, [0], listener=heard)
    now = to_millis(clock.now())

    state.respond(0, highwater=10, ago_ms=300)
    state.positions[0] = 4  # still reading that response's records
    await ingest._note_caught_up()
    assert ingest.safe_until() == {}, "nothing read to a watermark yet: nothing may be acted on"
    assert told == []

    # The next response came in (prefetched) before we read to 10; now we have.
    state.respond(0, highwater=25, ago_ms=200)
    state.positions[0] = 10
    await ingest._note_caught_up()
    safe = ingest.safe_until()[0]
    assert abs(safe - (now - 300 - GRACE_MS)) <= 20, safe - now
    assert told == [safe]

    # And again: one more response in, we read to 25.
    state.respond(0, highwater=31, ago_ms=100)
    state.positions[0] = 25
    await ingest._note_caught_up()
    safe = ingest.safe_until()[0]
    assert abs(safe - (now - 200 - GRACE_MS)) <= 20, safe - now

    # Reading the newest response's records completes the picture.
    state.positions[0] = 31
    await ingest._note_caught_up()
    safe = ingest.safe_until()[0]
    assert abs(safe - (now - 100 - GRACE_MS)) <= 20, safe - now
    assert told[-1] == safe
    assert len(told) == 3

    await ingest._note_caught_up()  # no new response: nothing new to tell
    assert len(told) == 3


async def test_the_horizon_never_passes_what_was_read(clock: ManualClock) -> None:
    state = FakeConsumer()
    ingest = ingest_over(state, clock, [0, 1])
    now = to_millis(clock.now())
    state.respond(0, highwater=100, ago_ms=50)
    state.respond(1, highwater=0, ago_ms=50)  # empty partition
    state.positions.update({0: 99, 1: 0})
    await ingest._note_caught_up()
    safe = ingest.safe_until()
    assert 0 not in safe, "one record short of the watermark: not caught up"
    assert abs(safe[1] - (now - 50 - GRACE_MS)) <= 20  # the empty one is

    # Responses keep coming with the same watermark while we are stuck below it.
    for ago in (40, 30, 20):
        state.respond(0, highwater=100, ago_ms=ago)
        await ingest._note_caught_up()
        assert 0 not in ingest.safe_until()
    state.positions[0] = 100
    await ingest._note_caught_up()
    assert abs(ingest.safe_until()[0] - (now - 20 - GRACE_MS)) <= 20
