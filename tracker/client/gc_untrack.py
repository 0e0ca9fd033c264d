"""Fetched records out of the cyclic garbage collector's sight while the client holds them.

Why: the START pipeline fetches batches ahead of the application (tens of thousands of
aiokafka ``ConsumerRecord`` objects on a fast consumer), and each is an object that CPython's
cyclic GC tracks. CPython runs a young collection for every ~700 tracked objects allocated
and not freed yet; a plain consumer frees a batch's records before it fetches the next one and
triggers almost none, but records held ahead are allocated in bursts, survive every young
collection, are promoted and walked again by the older ones. Measured on the consumer bench
(200k records of 100 B): ~0.15 us per record of GC, a fifth of what plain aiokafka spends
per record in all.

Untracking them is what CPython does itself for tuples and dicts whose contents cannot form a
cycle: reference counting still frees them, the collector just stops walking them. It is
safe only when no reference cycle can pass through a record, which holds when its fields are
what aiokafka's fetcher gives without deserializers (str, int, bytes, None and a tuple of
``(str, bytes)`` header tuples: nothing can refer back to the record). With a key or value
deserializer a value may be any object, which the application could make refer to its
message (and so to the record): a cycle the collector would no longer see. So the consumer
untracks only when it has no deserializers; nothing else changes either way.

The lists that hold them are untracked too (they hold nothing else, and the client never
changes them): a collection that walks a list touches the header of every item in it, tracked
or not, and tens of thousands of records held ahead made each full collection cost ~10 ms of
cache misses.

The work is done by ``tracker._speedups`` (a loop in C over each batch); without the C
extension (or with ``KMQ_PURE_PYTHON`` set) records stay tracked, which is correct, only
slower.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping
from typing import Any

from tracker.c_extension import load_c_extension

#: aiokafka consumer options that put arbitrary objects in a record.
DESERIALIZERS = ("key_deserializer", "value_deserializer")


def _c_untrack_list() -> Callable[[list[Any]], None] | None:
    speedups = load_c_extension()
    untrack: Callable[[list[Any]], None] | None = getattr(speedups, "untrack_list", None)
    return untrack


_untrack_list = _c_untrack_list()


def records_untracker(
    consumer_config: Mapping[str, Any], batch: int
) -> Callable[[Mapping[Any, list[Any]]], None] | None:
    """What takes a fetched batch's records out of the GC, or None where it must not (a
    deserializer is configured) or cannot (no C extension).

    ``batch``: the most records one fetch returns. See :func:`young_collection_now`.
    """
    if _untrack_list is None or any(consumer_config.get(name) for name in DESERIALIZERS):
        return None
    untrack = _untrack_list

    def untrack_fetched(fetched: Mapping[Any, list[Any]]) -> None:
        for records in fetched.values():
            untrack(records)
        if young_collection_now(batch):
            gc.collect(0)

    return untrack_fetched


def young_collection_now(batch: int) -> bool:
    """Whether to run the young collection that the next fetch would start anyway, now.

    Untracking takes the records out of the collector's lists but does not take back the
    allocations they counted: CPython starts a young collection once its count of tracked
    allocations not yet freed passes ``threshold0`` (700), and records held ahead are not
    freed before the next batch is fetched. So, holding batches ahead, nearly every fetch
    crossed the threshold *while aiokafka made its records*, and that collection walked up to
    700 records just made (~0.1 ms: 0.13-0.2 us per message on the consumer bench, where plain
    aiokafka, which frees each batch before the next, runs almost none). Run right after the
    untracking, the same collection finds little to walk, and the next batch fits under the
    threshold. Only when the next batch would cross it (so no collection is added), never
    when one batch alone crosses it (the next fetch collects mid-batch whatever runs now),
    and never when the application turned automatic collection off.
    """
    threshold = gc.get_threshold()[0]
    if not threshold or batch >= threshold or not gc.isenabled():
        return False
    return gc.get_count()[0] + batch >= threshold
