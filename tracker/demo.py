"""``kmq-tracker demo``: the whole thing on one machine, narrated live in the terminal.

It starts a local broker (tansu) unless ``KAFKA_BOOTSTRAP_SERVERS`` is set, the tracker on a
SQLite file, a producer and two workers. Jobs of a few kinds show each feature:

* ``ok``       acked at once;
* ``flaky``    fails twice (retry with the backoff policy), then succeeds;
* ``crashy``   the worker "dies" holding it (never settles): redelivered after the lease;
* ``slow``     takes longer than its lease, renews it with ``extend``, then acks;
* ``poison``   rejected at once: dead-lettered with its reason;
* ``hopeless`` fails every time: dead-lettered after the maximum attempts;
* ``delayed``  produced with ``delay=``: handed over only when due.

Ctrl-C (or ``--duration``) stops everything cleanly and prints a summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import ClassVar

from tracker.client import KmqConsumer, KmqMessage, KmqProducer
from tracker.engine.redelivery_rounds import TrackerEvent
from tracker.localbroker import LocalBroker

TOPIC = "demo.orders"
GROUP = "demo-workers"
KINDS = ["ok", "ok", "flaky", "ok", "crashy", "slow", "ok", "poison", "hopeless", "delayed"]
LEASE = timedelta(seconds=3)
DEMO_API_PORT = 8080


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class Narrator:
    """Prints one timestamped, coloured line per event."""

    COLOURS: ClassVar[dict[str, int]] = {
        "producer": 36,
        "tracker": 35,
        "worker-1": 32,
        "worker-2": 33,
        "demo": 1,
    }

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.colour = sys.stdout.isatty()
        self.counts: Counter[str] = Counter()

    def say(self, who: str, text: str) -> None:
        elapsed = time.monotonic() - self.start
        label = f"{who:<9}"
        if self.colour:
            label = f"\033[{self.COLOURS.get(who, 0)}m{label}\033[0m"
        print(f"{elapsed:6.1f}s  {label} {text}", flush=True)


async def produce(narrator: Narrator, bootstrap: str, stopping: asyncio.Event) -> None:
    async with KmqProducer(bootstrap) as producer:
        for n in itertools.count(1):
            if stopping.is_set():
                return
            kind = KINDS[(n - 1) % len(KINDS)]
            body = f"job-{n}:{kind}".encode()
            if kind == "delayed":
                await producer.send(TOPIC, body, key=body, delay=timedelta(seconds=6))
                narrator.say("producer", f"-> job-{n} ({kind}, due in 6 s)")
            else:
                await producer.send(TOPIC, body, key=body)
                narrator.say("producer", f"-> job-{n} ({kind})")
            narrator.counts["produced"] += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), 1.2)


async def handle(narrator: Narrator, who: str, message: KmqMessage) -> None:
    name, kind = (message.value or b"?:?").decode().split(":", 1)
    where = f"{name} attempt {message.attempt}"
    if kind == "flaky" and message.attempt < 3:
        await message.retry(reason="flaky dependency timed out")
        narrator.say(who, f"x {where} failed, retry with backoff")
    elif kind == "hopeless":
        await message.retry(timedelta(seconds=1), reason="always fails")
        narrator.say(who, f"x {where} failed, retry in 1 s")
    elif kind == "crashy" and message.attempt == 1:
        narrator.say(who, f"! {where}: worker crashes holding it (no ack)")
    elif kind == "poison":
        await message.reject("payload does not parse")
        narrator.say(who, f"# {where} rejected as poison")
    elif kind == "slow":
        narrator.say(who, f"~ {where} is slow: extending its lease")
        await message.extend(LEASE * 3)
        await asyncio.sleep(LEASE.total_seconds() * 1.5)
        await message.ack()
        narrator.say(who, f"v {where} done after extending")
        narrator.counts["acked"] += 1
    else:
        await message.ack()
        note = " (was delayed)" if kind == "delayed" else ""
        narrator.say(who, f"v {where} done{note}")
        narrator.counts["acked"] += 1


async def work(narrator: Narrator, who: str, bootstrap: str, stopping: asyncio.Event) -> None:
    async with KmqConsumer(
        TOPIC,
        group_id=GROUP,
        bootstrap_servers=bootstrap,
        processing_timeout=LEASE,
        consumer_id=who,
        consumer_config={"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000},
    ) as consumer:
        tasks: set[asyncio.Task[None]] = set()
        while not stopping.is_set():
            for message in await consumer.getmany(timedelta(milliseconds=300)):
                task = asyncio.create_task(handle(narrator, who, message))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def demo(bootstrap: str, workdir: Path, duration: float | None) -> Counter[str]:
    from tracker.kafka.topic_admin import ensure_topic  # noqa: PLC0415
    from tracker.runtime import create_tracker  # noqa: PLC0415
    from tracker.settings import TrackerSettings  # noqa: PLC0415

    narrator = Narrator()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)

    async def on_event(event: TrackerEvent) -> None:
        entry = event.entry
        body = f"{entry.origin_topic}/{entry.origin_partition}/{entry.origin_offset}"
        symbol = {"redelivered": "<>", "dead_lettered": "XX", "lost": "??"}[event.kind]
        narrator.say("tracker", f"{symbol} {event.kind} {body}: {event.detail}")
        narrator.counts[event.kind] += 1

    port = DEMO_API_PORT if _port_free(DEMO_API_PORT) else 0
    settings = TrackerSettings(
        http_port=port,
        kafka_bootstrap_servers=bootstrap,
        database_url=f"sqlite+aiosqlite:///{workdir / 'kmq-demo.db'}",
        migrate_on_start=True,
        markers_partitions=4,
        coalesce_window=timedelta(milliseconds=500),
        default_policy={
            "processing_timeout": LEASE,
            "max_attempts": 4,
            "backoff": {"initial": 1, "multiplier": 2, "max": 8, "jitter": 0.1},
        },
    )
    await ensure_topic(bootstrap, TOPIC, partitions=3)
    narrator.say("demo", f"broker {bootstrap}, store {workdir / 'kmq-demo.db'}; Ctrl-C stops")
    if port:
        narrator.say("demo", f"admin API: http://127.0.0.1:{port}/docs (try GET /v1/topics)")
    async with create_tracker(settings, on_event=on_event):
        tasks = [
            asyncio.create_task(produce(narrator, bootstrap, stopping)),
            asyncio.create_task(work(narrator, "worker-1", bootstrap, stopping)),
            asyncio.create_task(work(narrator, "worker-2", bootstrap, stopping)),
        ]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), duration)
        stopping.set()
        narrator.say("demo", "stopping ...")
        await asyncio.gather(*tasks)
    return narrator.counts


def run_demo(duration: float | None = None, workdir: str | None = None) -> int:
    """Run the demo; stop in order on Ctrl-C/SIGTERM: workload, tracker, then the broker.

    The local broker runs in its own session (the terminal's Ctrl-C does not reach it), so it
    serves the clients until they closed, and the ``finally`` stops it on every way out. Once
    ``demo`` runs, Ctrl-C and SIGTERM ask it to wind down; until then (the broker starting),
    SIGTERM interrupts like Ctrl-C instead of killing the process, which would leave the
    broker running.
    """
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    # aiokafka logs each refused connection while the local broker starts: not news here.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    # A directory of our own (no --workdir) holds only the demo's SQLite file and the local
    # broker's log: removed at the end, so that demo runs do not pile up kmq-demo-* folders in
    # the temp directory.
    owned = workdir is None
    directory = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="kmq-demo-"))
    directory.mkdir(parents=True, exist_ok=True)
    external = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    broker: LocalBroker | None = None
    try:
        if not external:
            broker = LocalBroker(log_dir=directory / "broker")
            print("starting a local broker (tansu) ...", flush=True)
            broker.start()
        bootstrap = external or (broker.bootstrap_servers if broker else "")
        counts = asyncio.run(demo(bootstrap, directory, duration))
    finally:
        if broker is not None:
            broker.stop()
        if owned:
            shutil.rmtree(directory, ignore_errors=True)
    summary = ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "no job yet"
    print(f"demo stopped cleanly: {summary}", flush=True)
    return 0
