"""A consumer process the tests kill with SIGKILL after it received messages.

Usage: python crash_consumer.py BOOTSTRAP TOPIC GROUP MARKERS_TOPIC EXPECTED [MARKER_VERSION]

It prints ``RECEIVED <partition> <offset>`` for each message handed to it (flushing stdout),
then ``ALL <n>`` once it has EXPECTED messages, and then blocks without acking anything, so the
test can kill it "after fetch and before ack".
"""

from __future__ import annotations

import asyncio
import sys
from datetime import timedelta

from tracker.client import KmqConsumer


async def main(
    bootstrap: str, topic: str, group: str, markers: str, expected: int, *, version: int
) -> None:
    consumer = KmqConsumer(
        topic,
        group_id=group,
        bootstrap_servers=bootstrap,
        markers_topic=markers,
        processing_timeout=timedelta(seconds=30),
        consumer_id="crash-consumer",
        marker_version=version,
    )
    await consumer.start()
    received = 0
    while received < expected:
        for message in await consumer.getmany():
            received += 1
            print(f"RECEIVED {message.partition} {message.offset}", flush=True)
    print(f"ALL {received}", flush=True)
    await asyncio.Event().wait()  # hold the messages unsettled until killed


if __name__ == "__main__":
    bootstrap, topic, group, markers, expected = sys.argv[1:6]
    version = int(sys.argv[6]) if len(sys.argv) > 6 else 2
    asyncio.run(main(bootstrap, topic, group, markers, int(expected), version=version))
