"""A consumer process the consumer-kill test SIGKILLs again and again (protocol v2).

Usage: python kill_consumer.py BOOTSTRAP TOPIC GROUP MARKERS_TOPIC LEASE_S

For every batch handed to it, it prints ``BATCH <n>``, works on it for half a second (so that
a kill often finds it holding a batch, with the next one prepared), acks the messages whose
index (the ``m<i>`` payload) is not a multiple of 10 on their first delivery and every copy,
prints ``ACKING <origin> <attempt>`` for each, waits until the broker acknowledged the
SETTLEs (``flush()``), then prints ``ACKED <origin> <attempt>`` for each. A kill between
the two lines leaves those messages in doubt (their SETTLE may or may not have reached the
broker); the test accounts for that.
"""

from __future__ import annotations

import asyncio
import sys
from datetime import timedelta

from tracker.client import KmqConsumer


def _name(message: object) -> str:
    origin = message.origin  # type: ignore[attr-defined]
    return f"{origin.topic}/{origin.partition}/{origin.offset} {message.attempt}"  # type: ignore[attr-defined]


async def main(bootstrap: str, topic: str, group: str, markers: str, lease: float) -> None:
    consumer = KmqConsumer(
        topic,
        group_id=group,
        bootstrap_servers=bootstrap,
        markers_topic=markers,
        processing_timeout=timedelta(seconds=lease),
        consumer_config={"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000},
    )
    await consumer.start()
    print("JOINED", flush=True)
    async for batch in consumer.batches():
        print(f"BATCH {len(batch)}", flush=True)
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


if __name__ == "__main__":
    bootstrap, topic, group, markers, lease = sys.argv[1:6]
    asyncio.run(main(bootstrap, topic, group, markers, float(lease)))
