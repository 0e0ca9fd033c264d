"""Consumers SIGKILLed mid-batch, again and again, under load (v2, and v1): nothing is lost.

A consumer process (``kill_consumer.py``) works through a queue that a producer keeps filling,
in one group, with range markers and the next batch prepared while it works; it is killed with
SIGKILL at seeded random moments (``KILLS`` times: mid-batch, with acks queued or on their way,
with a prepared batch the application never saw) and started again; the tracker runs
throughout. At the end a last incarnation runs until every message is acked. Then, from the
queue topic (originals and copies) and the consumers' output:

(a) nothing lost: every message was acked, or its ack was in doubt when the process died (its
    SETTLE may have reached the broker) and no copy of a later attempt came;
(b) nothing acked-then-redelivered: no copy with attempt n+1 produced after attempt n of its
    origin was confirmed acked, unless that very record was STARTed again (read by a later
    incarnation: its offset commit had not landed) between the ack and the copy, as the
    markers topic shows;
(c) the dropped messages (index multiple of 10) all came back as copies.

``make soak`` runs it with ``KMQ_SOAK=1``: 50 kills and 3,000 messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from integration.engine_support import TopicWatcher, eventually
from integration.test_engine import running_tracker
from integration.workload import copy_identity, produce_cycle_share
from support.broker import TopicFactory

from tracker.ids import MessageId
from tracker.protocol import Marker, MarkerKind, decode_marker
from tracker.protocol_v2 import RangeKind, RangeMarker

from .harness import Figures, report, size

pytestmark = [pytest.mark.integration]

KILLS = size(6, 50)
MESSAGES = size(400, 3000)
LEASE_S = 2.0
SEED = 20261125


class Incarnation:
    """One consumer process, and what it printed."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.joined = asyncio.Event()
        self.working = asyncio.Event()  #: it was handed a batch
        self.acking: set[tuple[MessageId, int]] = set()
        self.acked: set[tuple[MessageId, int]] = set()
        self.started_ms = time.time() * 1000
        self.killed_ms = 0.0
        self.acked_ms: dict[tuple[MessageId, int], float] = {}  #: when ACKED was printed
        #: when the application was handed each (origin, attempt), every time (GOT)
        self.got_ms: dict[tuple[MessageId, int], list[float]] = defaultdict(list)
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.process.stdout is not None
        async for raw in self.process.stdout:
            word, *rest = raw.decode().split()
            if word == "JOINED":
                self.joined.set()
                continue
            if word == "BATCH":
                self.working.set()
                continue
            where, attempt = rest
            topic, partition, offset = where.rsplit("/", 2)
            item = (MessageId(topic, int(partition), int(offset)), int(attempt))
            if word == "GOT":
                self.got_ms[item].append(time.time() * 1000)
                continue
            (self.acking if word == "ACKING" else self.acked).add(item)
            if word == "ACKED":
                self.acked_ms[item] = time.time() * 1000

    async def kill(self) -> None:
        self.killed_ms = time.time() * 1000
        self.process.send_signal(signal.SIGKILL)
        await asyncio.wait_for(self.process.wait(), 30)
        await self.reader


async def _start(args: list[str], log: Path) -> Incarnation:
    script = Path(__file__).with_name("kill_consumer.py")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    with log.open("a") as err:
        process = await asyncio.create_subprocess_exec(
            sys.executable, str(script), *args, stdout=asyncio.subprocess.PIPE, stderr=err, env=env
        )
    return Incarnation(process)


async def _abandon(producing: asyncio.Task[Any] | None, incarnations: list[Incarnation]) -> None:
    """Stop the producer and every consumer process still alive (a test that failed early)."""
    if producing is not None and not producing.done():
        producing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await producing
    for incarnation in incarnations:
        if incarnation.process.returncode is None:
            await incarnation.kill()


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("mode", ["batches", "pool", "v1"])
async def test_consumers_killed_mid_batch_lose_nothing(
    kafka_bootstrap: str, topic_factory: TopicFactory, sqlite_url: str, tmp_path: Path, mode: str
) -> None:
    """(The tracker is not what is killed here: one store, SQLite, is enough.)

    ``pool``: the consumer processes through ``run(handler, concurrency=16)``, so a kill finds
    up to 16 messages in progress and more waiting in the pool; the tracker must redeliver
    exactly the unsettled ones. ``v1``: batches with a START and an ACK per message, the
    STARTs of a batch kept by the tracker as one range (ACKs taking offsets out of it)."""
    rng = random.Random(SEED)
    started = time.monotonic()
    topic = await topic_factory(partitions=4, prefix="kills-queue")
    markers = await topic_factory(partitions=4, prefix="kills-markers")
    group = f"kills-{topic}"
    env = {
        "bootstrap": kafka_bootstrap,
        "database_url": sqlite_url,
        "topic": topic,
        "markers": markers,
        "group": group,
    }
    args = [kafka_bootstrap, topic, group, markers, str(LEASE_S), mode]
    log = tmp_path / "consumers.log"
    sent: dict[MessageId, int] = {}
    incarnations: list[Incarnation] = []

    def confirmed() -> dict[MessageId, set[int]]:
        out: dict[MessageId, set[int]] = defaultdict(set)
        for incarnation in incarnations:
            for origin, attempt in incarnation.acked:
                out[origin].add(attempt)
        return out

    policy = {"processing_timeout": LEASE_S, "max_attempts": 10}
    async with (
        running_tracker(env, default_policy=policy) as tracker,
        TopicWatcher(kafka_bootstrap, topic, markers) as watcher,
    ):
        producing: asyncio.Task[Any] | None = None
        try:
            # Production is paced by the kill cycles, not by a guess of their length: each cycle's
            # share is sent while its incarnation joins and works (so it always has messages of
            # its own to be killed over; with a fixed schedule, cycles slower than guessed ran out
            # of messages and an incarnation waited for a batch that never came).
            for cycle in range(KILLS):
                producing = asyncio.create_task(
                    produce_cycle_share(
                        kafka_bootstrap,
                        topic,
                        total=MESSAGES,
                        cycles=KILLS,
                        cycle=cycle,
                        batch=10,
                        interval=0.5,
                        sent=sent,
                    )
                )
                incarnation = await _start(args, log)
                incarnations.append(incarnation)
                await asyncio.wait_for(incarnation.joined.wait(), 60)
                # Until the group has given it partitions (the killed one's session must time out
                # first) and it holds a batch; then work for a while: mid-batch, acks queued or in
                # flight, the next batch prepared or not.
                await asyncio.wait_for(incarnation.working.wait(), 60)
                await asyncio.sleep(rng.uniform(0.3, 2.0))
                await incarnation.kill()
                await producing
            last = await _start(args, log)
            incarnations.append(last)

            def settled() -> bool:
                acked = confirmed()
                doubt = {o for i in incarnations for o, _ in i.acking - i.acked}
                return all(acked.get(origin) or origin in doubt for origin in sent)

            await eventually(settled, within=300, what=f"all {len(sent)} messages acked")
            # Then until the tracker holds nothing for the group: every SETTLE applied, and every
            # message in doubt whose SETTLE was lost redelivered and acked (no copy can come later).

            async def nothing_tracked() -> bool:
                return (
                    not await tracker.store.list_entries(group=group)
                    and settled()
                    and not last.acking - last.acked  # the last one's acks are confirmed
                )

            await eventually(nothing_tracked, within=120, what="nothing left in the store")
            await last.kill()
        finally:
            # On a failure (a wait timed out), leave nothing running behind the test.
            await _abandon(producing, incarnations)
        copies: dict[MessageId, set[int]] = defaultdict(set)
        copied_ms: dict[tuple[MessageId, int], int] = {}
        #: where each (origin, attempt) sits in the queue topic (attempt 1: the origin itself)
        position: dict[tuple[MessageId, int], MessageId] = {(o, 1): o for o in sent}
        for record in await watcher.read_to_end(topic):
            identity = copy_identity(record)
            if identity is not None:
                copies[identity[0]].add(identity[1])
                copied_ms[identity] = record.timestamp_ms
                position[identity] = MessageId(record.topic, record.partition, record.offset)
        #: queue-topic position -> when a START for it was written (ms), every time
        started_ms: dict[MessageId, list[int]] = defaultdict(list)
        for record in await watcher.read_to_end(markers):
            marker = decode_marker(record.value)
            if isinstance(marker, RangeMarker) and marker.kind is RangeKind.RANGE_START:
                for message in marker.messages():
                    started_ms[message].append(record.timestamp_ms)
            elif isinstance(marker, Marker) and marker.kind is MarkerKind.START:
                started_ms[marker.message].append(record.timestamp_ms)

    acked = confirmed()
    # In doubt: the last attempt of an origin whose ack may or may not have reached the
    # broker. It is not lost if no later copy came (the ack arrived, or the copy is pending).
    doubt: dict[MessageId, int] = {}
    for incarnation in incarnations:
        for origin, attempt in incarnation.acking - incarnation.acked:
            doubt[origin] = max(doubt.get(origin, 0), attempt)
    lost = [
        o
        for o in sent
        if not acked.get(o)
        and not (o in doubt and not any(n > doubt[o] for n in copies.get(o, ())))
    ]
    # When each (origin, attempt) was first confirmed acked (the test's clock, ms).
    confirmed_ms: dict[tuple[MessageId, int], float] = {}
    for incarnation in incarnations:
        for item, at in incarnation.acked_ms.items():
            confirmed_ms[item] = min(at, confirmed_ms.get(item, at))

    # A copy of attempt n+1 is a violation if it was produced after attempt n's ack was
    # confirmed. One produced before is the tracker acting on an expired lease of a killed
    # incarnation, while the next one read the same original again (it was fetched, STARTed
    # and not yet committed when the process died) and acked it: a duplicate, not a broken
    # ack (docs/reliability.md, "When duplicates happen").
    #
    # Nor is one that follows a re-read of the acked attempt itself: its ACK was durable, but the
    # process died before the offset commit that follows the hand-over, so the partition's next
    # owner read the same record again, STARTed it (a new delivery) and was killed before it
    # acked; the copy is that delivery's (docs/reliability.md, "When duplicates happen").
    # The markers topic decides, not the consumers' output: a batch prepared ahead is STARTed
    # before the application sees it, so a re-read can be killed before it prints anything.
    # The START must fall between the ack and the copy: one after the copy cannot explain it.
    def reread_unsettled(item: tuple[MessageId, int]) -> bool:
        copied = copied_ms[(item[0], item[1] + 1)]
        return any(confirmed_ms[item] < at <= copied for at in started_ms[position[item]])

    acked_pairs = [(o, n) for o, attempts in acked.items() for n in attempts if n + 1 in copies[o]]
    copied_after = [(o, n) for o, n in acked_pairs if copied_ms[(o, n + 1)] > confirmed_ms[(o, n)]]
    after_ack = [item for item in copied_after if not reread_unsettled(item)]
    reread = len(acked_pairs) - len(copied_after)
    reread_after_ack = len(copied_after) - len(after_ack)
    handed_again = sum(
        1
        for incarnation in incarnations
        for item, times in incarnation.got_ms.items()
        if item in confirmed_ms and any(at > confirmed_ms[item] for at in times)
    )
    dropped = [o for o, i in sent.items() if i % 10 == 0]
    redelivered = sum(1 for o, i in sent.items() if i % 10 and copies.get(o))
    report(
        Figures(
            test="consumers SIGKILLed mid-batch ("
            + ("v1, batches" if mode == "v1" else f"v2, {mode}")
            + ")",
            lost=len(lost),
            acked_then_redelivered=len(after_ack),
            duplicates=0,
            duplicate_bound=0,
            recovery_s=None,
            produced=len(sent),
            seconds=time.monotonic() - started,
            detail={
                "kills": KILLS,
                "copies": sum(len(a) for a in copies.values()),
                "held_by_a_killed_consumer": redelivered,
                "in_doubt_at_a_kill": len(doubt),
                "reread_and_copied": reread,
                "acked_then_read_again": handed_again,
                "read_again_unsettled_and_copied": reread_after_ack,
            },
        )
    )
    assert lost == [], "lost: " + "; ".join(
        f"{o} index {sent[o]} copies {sorted(copies.get(o, ()))} in doubt at {doubt.get(o)}"
        for o in lost[:10]
    )

    def story(origin: MessageId, attempt: int) -> str:
        """When the ack was confirmed, by which incarnation (started, killed), and when the
        next attempt's copy was produced (ms from the test's start)."""
        t0 = incarnations[0].started_ms
        for i, incarnation in enumerate(incarnations):
            at = incarnation.acked_ms.get((origin, attempt))
            if at is not None:
                copy_at = copied_ms.get((origin, attempt + 1), 0)
                handed = ", ".join(
                    f"{j} at {g - t0:.0f}"
                    for j, other in enumerate(incarnations)
                    for g in other.got_ms.get((origin, attempt), ())
                )
                return (
                    f"{origin} #{attempt} acked by incarnation {i} at {at - t0:.0f} "
                    f"(started {incarnation.started_ms - t0:.0f}, killed "
                    f"{incarnation.killed_ms - t0:.0f}); copy #{attempt + 1} at {copy_at - t0:.0f}"
                    f"; handed to incarnation {handed}"
                )
        return f"{origin} #{attempt}"

    assert after_ack == [], "redelivered after an ack: " + "; ".join(
        story(o, n) for o, n in after_ack[:6]
    )
    assert [o for o in dropped if 2 not in copies.get(o, set())] == [], (
        "a dropped message never came back"
    )
