"""Fetched records held ahead of the application are out of the cyclic GC (gc_untrack).

What a user relies on: the records are still freed as soon as nothing holds them (reference
counting), nothing is untracked when a deserializer could make a record part of a cycle, a
consumer without the C extension behaves the same, only slower, and the young collection that
the next fetch would start while aiokafka makes its records runs at the batch boundary instead,
never when the application turned automatic collection off.
"""

from __future__ import annotations

import gc
import os
import weakref
from collections.abc import Iterator
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
    untrack = records_untracker({"fetch_max_bytes": 1 << 20}, 500)
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
    assert records_untracker({option: bytes.decode}, 500) is None


def test_without_the_c_extension_records_stay_tracked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KMQ_PURE_PYTHON", "1")
    assert gc_untrack._c_untrack_list() is None
    monkeypatch.setattr(gc_untrack, "_untrack_list", None)
    assert records_untracker({}, 500) is None


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


@pytest.fixture
def collector_settings() -> Iterator[None]:
    """The process's collector settings, put back after the test."""
    threshold, enabled = gc.get_threshold(), gc.isenabled()
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        (gc.enable if enabled else gc.disable)()


@pytest.mark.usefixtures("collector_settings")
def test_the_boundary_collection_runs_only_when_the_next_fetch_would_run_it() -> None:
    gc.set_threshold(700, 10, 10)
    gc.enable()
    gc.collect(0)
    assert not gc_untrack.young_collection_now(500), "a fresh count: the next batch fits"
    assert not gc_untrack.young_collection_now(700), "one batch crosses it alone: no use"
    held: list[list[int]] = [[] for _ in range(300)]  # tracked, not freed: the count rises
    assert gc_untrack.young_collection_now(500)
    gc.disable()
    assert not gc_untrack.young_collection_now(500), "the application turned it off"
    gc.enable()
    gc.set_threshold(0)
    assert not gc_untrack.young_collection_now(500), "automatic collection is off"
    del held


@pytest.mark.skipif(not BUILT, reason="the C extension is not built (checked above under CI)")
@pytest.mark.usefixtures("collector_settings")
def test_records_held_ahead_start_no_collection_while_the_next_batch_is_made() -> None:
    """The measured effect: holding fetched batches ahead (as the START pipeline does), the
    count of the young generation passed the threshold while the next batch's records were
    being made, so each collection walked freshly made records; now every collection runs
    right after a batch is untracked."""
    gc.set_threshold(700, 10, 10)
    gc.enable()
    untrack = records_untracker({}, 500)
    assert untrack is not None
    collected_while_making = 0
    making = False

    def watch(phase: str, info: dict[str, int]) -> None:
        nonlocal collected_while_making
        if phase == "start" and making and info["generation"] == 0:
            collected_while_making += 1

    held: list[dict[Any, list[Any]]] = []
    gc.collect()
    gc.callbacks.append(watch)
    try:
        for _ in range(20):
            making = True
            fetched = {TopicPartition("orders", 0): _records(500)}
            making = False
            untrack(fetched)
            held = [*held[-3:], fetched]  # four batches held ahead, the oldest let go
    finally:
        gc.callbacks.remove(watch)
    assert collected_while_making <= 1, "at most before the first boundary"
