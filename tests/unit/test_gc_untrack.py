"""Fetched records held ahead of the application are out of the cyclic GC (gc_untrack).

What a user relies on: the records are still freed as soon as nothing holds them (reference
counting), nothing is untracked when a deserializer could make a record part of a cycle, and a
consumer without the C extension behaves the same, only slower.
"""

from __future__ import annotations

import gc
import os
import weakref
from typing import Any

import pytest
from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord

from tracker.client import KmqConsumer, gc_untrack
from tracker.client.gc_untrack import records_untracker
from tracker.testing import InMemoryMarkerSink

BUILT = gc_untrack._untrack_list is not None


def _records(n: int) -> list[Any]:
    return [
        ConsumerRecord("orders", 0, i, 0, 0, None, b"v", None, -1, 1, (("h", b"x"),))
        for i in range(n)
    ]


def test_the_c_untracking_is_built_where_required() -> None:
    """CI sets KMQ_REQUIRE_SPEEDUPS: there records must be untracked, not silently tracked."""
    if os.environ.get("KMQ_REQUIRE_SPEEDUPS") and not os.environ.get("KMQ_PURE_PYTHON"):
        assert BUILT


@pytest.mark.skipif(not BUILT, reason="the C extension is not built (checked above under CI)")
def test_untracked_records_are_still_freed_when_dropped() -> None:
    untrack = records_untracker({"fetch_max_bytes": 1 << 20})
    assert untrack is not None
    fetched = {TopicPartition("orders", 0): _records(500), TopicPartition("orders", 1): []}
    refs = [weakref.ref(r) for r in fetched[TopicPartition("orders", 0)]]
    untrack(fetched)
    assert not any(gc.is_tracked(r) for r in fetched[TopicPartition("orders", 0)])
    assert not gc.is_tracked(fetched[TopicPartition("orders", 0)]), "nor the list (walked)"
    del fetched
    assert all(ref() is None for ref in refs), "reference counting frees them, no GC needed"


@pytest.mark.parametrize("option", ["key_deserializer", "value_deserializer"])
def test_nothing_is_untracked_when_a_deserializer_can_put_any_object_in_a_record(
    option: str,
) -> None:
    assert records_untracker({option: bytes.decode}) is None


def test_without_the_c_extension_records_stay_tracked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KMQ_PURE_PYTHON", "1")
    assert gc_untrack._c_untrack_list() is None
    monkeypatch.setattr(gc_untrack, "_untrack_list", None)
    assert records_untracker({}) is None


@pytest.mark.skipif(not BUILT, reason="the C extension is not built (checked above under CI)")
def test_what_is_not_a_list_is_left_tracked_not_refused() -> None:
    """An aiokafka that returned another sequence must not stop the consumer's pipeline."""
    assert gc_untrack._untrack_list is not None
    records = tuple(_records(2))
    gc_untrack._untrack_list(records)  # type: ignore[arg-type]
    assert all(gc.is_tracked(r) for r in records)


@pytest.mark.skipif(not BUILT, reason="the C extension is not built (checked above under CI)")
@pytest.mark.parametrize(
    ("consumer_config", "untracked"),
    [({}, True), ({"value_deserializer": bytes.decode}, False)],
    ids=["raw records", "a value deserializer"],
)
async def test_the_consumer_untracks_each_batch_it_fetches_unless_values_are_deserialized(
    consumer_config: dict[str, Any], untracked: bool
) -> None:
    """The wiring: what the START pipeline fetches through the consumer comes back untracked,
    and tracked when a deserializer could put any object in a record."""
    consumer = KmqConsumer(
        "orders",
        group_id="g",
        bootstrap_servers="localhost:1",
        marker_sink=InMemoryMarkerSink(),
        consumer_config=consumer_config,
    )
    fetched = {TopicPartition("orders", 0): _records(3)}

    async def getmany(**options: Any) -> dict[Any, list[Any]]:
        return fetched

    try:
        consumer._consumer.getmany = getmany
        got = await consumer._ranges._fetch_batch()
        assert got is fetched
        records = got[TopicPartition("orders", 0)]
        assert [gc.is_tracked(r) for r in records] == [not untracked] * 3
    finally:
        await consumer._close_clients()
