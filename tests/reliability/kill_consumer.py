"""A consumer process the consumer-kill test SIGKILLs again and again.

Usage: python kill_consumer.py BOOTSTRAP TOPIC GROUP MARKERS_TOPIC LEASE_S [batches|pool|v1]

For every batch handed to it, it prints ``BATCH <n>`` and ``GOT <origin> <attempt>`` for each
message (a message read again after a kill is printed again), works on it for half a second (so that
a kill often finds it holding a batch, with the next one prepared), acks the messages whose
index (the ``m<i>`` payload) is not a multiple of 10 on their first delivery and every copy,
prints ``ACKING <origin> <attempt>`` for each, waits until the broker acknowledged the
SETTLEs (``flush()``), then prints ``ACKED <origin> <attempt>`` for each. A kill between
the two lines leaves those messages in doubt (their SETTLE may or may not have reached the
broker); the test accounts for that.

``v1`` is ``batches`` with protocol v1 (a START per message, which the tracker keeps as one
range per batch, and an ACK per message).

``pool`` runs the same work through ``consumer.run(handler, concurrency=16)``: each handler
works for 50-300 ms (so a kill finds many in flight, and more waiting in the pool), prints
``BATCH 1`` on the first call, ``GOT`` on every call, ``ACKING`` as it returns (the pool acks
it then) or raises for a dropped one (the pool retries it); a side task flushes every 200 ms
and prints ``ACKED`` for what was acked before that flush.
"""

from __future__ import annotations

import asyncio
import random
import sys
from datetime import timedelta

from tracker.client import KmqConsumer, KmqMessage


def _name(message: object) -> str:
    origin = message.origin  # type: ignore[attr-defined]
    return f"{origin.topic}/{origin.partition}/{origin.offset} {message.attempt}"  # type: ignore[attr-defined]


def _consumer(
    bootstrap: str, topic: str, group: str, markers: str, lease: float, *, version: int = 2
) -> KmqConsumer:
    return KmqConsumer(
        topic,
        group_id=group,
        bootstrap_servers=bootstrap,
        markers_topic=markers,
        processing_timeout=timedelta(seconds=lease),
        consumer_config={"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000},
        marker_version=version,
    )


async def main(
    bootstrap: str, topic: str, group: str, markers: str, lease: float, *, version: int = 2
) -> None:
    consumer = _consumer(bootstrap, topic, group, markers, lease, version=version)
    await consumer.start()
    print("JOINED", flush=True)
    async for batch in consumer.batches():
        print(f"BATCH {len(batch)}", flush=True)
        print("".join(f"GOT {_name(message)}\n" for message in batch), end="", flush=True)
        await asyncio.sleep(0.5)  # the work
        acked = []
        for message in batch:
            index = int((message.value or b"m0")[1:])
            if message.attempt >= 2 or index % 10:
                await message.ack()
                acked.append(_name(message))
        print("".join(f"ACKING {name}\n" for name in acked), end="", flush=True)
        await consumer.flush()
        print("".join(f"ACKED {name}\n" for name in acked), end="", flush=True)


async def pool_main(bootstrap: str, topic: str, group: str, markers: str, lease: float) -> None:
    consumer = _consumer(bootstrap, topic, group, markers, lease)
    await consumer.start()
    print("JOINED", flush=True)
    acking: list[str] = []
    working = False

    async def handler(message: KmqMessage) -> None:
        nonlocal working
        if not working:
            working = True
            print("BATCH 1", flush=True)
        print(f"GOT {_name(message)}", flush=True)
        await asyncio.sleep(random.uniform(0.05, 0.3))  # the work
        index = int((message.value or b"m0")[1:])
        if message.attempt < 2 and not index % 10:
            raise RuntimeError("dropped")  # retried by the pool
        name = _name(message)
        acking.append(name)
        print(f"ACKING {name}", flush=True)  # returns at once: the pool acks it now

    async def confirm() -> None:
        while True:
            await asyncio.sleep(0.2)
            done = acking[:]
            del acking[:]
            await consumer.flush()
            print("".join(f"ACKED {name}\n" for name in done), end="", flush=True)

    confirming = asyncio.create_task(confirm())
    try:
        await consumer.run(handler, concurrency=16)
    finally:
        confirming.cancel()


if __name__ == "__main__":
    bootstrap, topic, group, markers, lease = sys.argv[1:6]
    mode = sys.argv[6] if len(sys.argv) > 6 else "batches"
    if mode == "pool":
        asyncio.run(pool_main(bootstrap, topic, group, markers, float(lease)))
    else:
        version = 1 if mode == "v1" else 2
        asyncio.run(main(bootstrap, topic, group, markers, float(lease), version=version))
