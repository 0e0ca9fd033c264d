"""Crash safety: the tracker process is SIGKILLed at random moments while a workload runs.

The tracker runs as a real ``kmq-tracker run`` subprocess; the workload (a producer and a
worker) runs in the test process and outlives every tracker incarnation:

* the producer sends ``MESSAGES`` messages in small batches, an equal share in each kill
  cycle (sent while that cycle's incarnation works and the next one starts);
* the worker acks ~70% of first deliveries at once and "crashes" on the others (drops them
  without any marker), and acks every redelivered copy (attempt >= 2);
* ``KILLS`` times, after a seeded random 0.5-3 s of work, the tracker gets SIGKILL and a new
  incarnation is started; the test waits until it has claimed every markers partition in the
  store (its epochs moved past the dead one's) before the next random interval starts.

At the end the last incarnation runs until every message is done, is stopped with SIGTERM, and
the fate of every produced message is accounted for from the queue topic (originals and
copies, which carry ``kmq-origin``/``kmq-attempt``) and the worker's receptions:

(a) nothing lost: every message was acked (first delivery or a copy);
(b) nothing acked-then-redelivered: no copy with attempt n+1 of an origin whose attempt n was
    acked (in particular no copy at all of a message acked on its first delivery);
(c) duplicate copies (same origin and attempt twice) are counted and printed, and bounded by
    ``KILLS * REDELIVERY_BATCH``. Why that bound: a duplicate can only come from a tracker
    dying after it produced the copies of a claimed redelivery round and before it recorded
    the round (DESIGN: at-least-once); a round holds at most ``redelivery_batch`` entries and
    each kill interrupts at most one round. Marker replay after a crash cannot make copies
    (applied offsets are stored with the state they produced), nor can a graceful stop;
(d) the store holds nothing for the workers' group at the end: no tracked entry (so nothing
    lost or still pending) and no dead letter.

Why each incarnation joins a fresh tracker consumer group: on tansu (and on Kafka) a member
killed with SIGKILL stays in its group until its session times out, and the tracker's markers
consumer uses aiokafka's default 10 s session (``kafka_client_config`` is shared with the
producer, which refuses consumer-only keys). A same-group restart therefore waits ~15-18 s per
kill, which would put this test at several minutes. The tracker group holds no crash-safety
state: where each markers partition resumes is recorded in the store with the state it
produced (and partition epochs fence the dead incarnation), so a fresh group exercises the
same recovery path; ``test_same_group_restart_after_sigkill`` covers the same-group rejoin
once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

import pytest
from support.broker import TopicFactory, unique_topic

from tracker.client import KmqMessage
from tracker.domain.entries import State
from tracker.store import Store, StoreUnavailable

from .engine_support import TopicWatcher, high_watermarks
from .workload import Ledger, Worker, message_index, produce_cycle_share, produce_over_time

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SEED = int(os.environ.get("KMQ_CRASH_SEED", "20240611"))
MESSAGES = 300
KILLS = 5
ACK_SHARE = 0.7
LEASE_S = 2
REDELIVERY_BATCH = 20
MARKERS_PARTITIONS = 4
READY_WITHIN = 40.0  #: a restarted tracker must own every markers partition within this
ROOT = Path(__file__).resolve().parents[2]


class TrackerProcess:
    """``python -m tracker.cli run`` incarnations with one configuration, logs kept per run."""

    def __init__(self, env: dict[str, str], log_dir: Path, group_prefix: str) -> None:
        self._env = env
        self._log_dir = log_dir
        self._group_prefix = group_prefix
        self.incarnation = 0
        self.fresh_group = True
        self.process: asyncio.subprocess.Process | None = None
        self._log: IO[bytes] | None = None
        self.log_paths: list[Path] = []

    @property
    def group(self) -> str:
        suffix = self.incarnation if self.fresh_group else 0
        return f"{self._group_prefix}-{suffix}"

    async def start(self) -> None:
        assert self.process is None or self.process.returncode is not None
        self.incarnation += 1
        path = self._log_dir / f"tracker-{self.incarnation}.log"
        self.log_paths.append(path)
        self._close_log()
        self._log = path.open("wb")
        env = {
            **self._env,
            "KMQ_TRACKER_GROUP": self.group,
            "KMQ_REPLICA_ID": f"crash-test-{self.incarnation}",
        }
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tracker.cli",
            "run",
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=self._log,
            stderr=asyncio.subprocess.STDOUT,
            cwd=str(ROOT),
        )

    def check_alive(self) -> None:
        assert self.process is not None
        if self.process.returncode is not None:
            raise AssertionError(
                f"tracker incarnation {self.incarnation} exited on its own with "
                f"{self.process.returncode}:\n{self.log_tail()}"
            )

    async def kill(self) -> None:
        assert self.process is not None
        self.check_alive()
        self.process.send_signal(signal.SIGKILL)
        await self.process.wait()

    async def terminate(self, within: float = 30.0) -> int:
        """SIGTERM (graceful stop); returns the exit code."""
        assert self.process is not None
        self.check_alive()
        self.process.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(self.process.wait(), within)
        self._close_log()
        return code

    async def close(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signal.SIGKILL)
            await self.process.wait()
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_paths:
            return "(no tracker log)"
        text = self.log_paths[-1].read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def count_in_logs(self, needle: str) -> int:
        return sum(p.read_text(errors="replace").count(needle) for p in self.log_paths)


async def partition_epochs(store: Store, markers: str) -> dict[int, int]:
    """``{partition: epoch}`` from the store, ``{}`` while the schema does not exist yet."""
    try:
        offsets = await store.partition_offsets(markers)
    except StoreUnavailable:
        return {}
    return {p: epoch for p, (epoch, _) in offsets.items()}


async def wait_until_owning(
    tracker: TrackerProcess, store: Store, markers: str, before: dict[int, int]
) -> float:
    """Wait until the tracker claimed every markers partition (epochs past ``before``)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    while True:
        tracker.check_alive()
        epochs = await partition_epochs(store, markers)
        if len(epochs) == MARKERS_PARTITIONS and all(
            epoch > before.get(p, 0) for p, epoch in epochs.items()
        ):
            return loop.time() - started
        assert loop.time() - started < READY_WITHIN, (
            f"tracker incarnation {tracker.incarnation} did not claim the markers partitions "
            f"(epochs {epochs}, before {before}):\n{tracker.log_tail()}"
        )
        await asyncio.sleep(0.1)


def tracker_env(bootstrap: str, database_url: str, markers: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KMQ_")}
    env.update(
        {
            "KMQ_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
            "KMQ_DATABASE_URL": database_url,
            "KMQ_MARKERS_TOPIC": markers,
            "KMQ_MARKERS_PARTITIONS": str(MARKERS_PARTITIONS),
            "KMQ_MIGRATE_ON_START": "true",
            "KMQ_COALESCE_WINDOW": "0.3",
            "KMQ_ACK_GRACE": "0.2",
            "KMQ_CLAIM_LEASE": "2",
            "KMQ_REDELIVERY_BATCH": str(REDELIVERY_BATCH),
            "KMQ_MAX_IDLE_SLEEP": "2",
            "KMQ_DEFAULT_POLICY__PROCESSING_TIMEOUT": str(LEASE_S),
            "KMQ_DEFAULT_POLICY__MAX_ATTEMPTS": "50",
            "KMQ_LOG_LEVEL": "INFO",
            "KMQ_HTTP_PORT": "0",  # the HTTP API on a free port: tests must not need 8080
        }
    )
    return env


async def group_entries(store: Store, group: str) -> list[Any]:
    return [e for e in await store.list_entries(limit=1_000_000) if e.group_id == group]


async def wait_all_done(
    *,
    tracker: TrackerProcess,
    store: Store,
    worker: Worker,
    sent: dict[Any, int],
    group: str,
    bootstrap: str,
    markers: str,
    within: float = 60.0,
) -> None:
    """Every message acked, every marker applied, no tracked entry left for the group."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within

    def check(condition: bool, what: str) -> bool:
        tracker.check_alive()
        worker.check_alive()
        if condition:
            return True
        assert loop.time() < deadline, f"timed out waiting for {what}:\n{tracker.log_tail()}"
        return False

    while True:
        acked = worker.acked_attempts()
        if check(all(acked.get(origin) for origin in sent), "every message acked"):
            break
        await asyncio.sleep(0.2)
    ends = await high_watermarks(bootstrap, markers)
    while True:
        offsets = await store.partition_offsets(markers)
        applied = all(offsets.get(p, (0, -1))[1] >= end for p, end in ends.items() if end)
        entries = await group_entries(store, group)
        if check(applied and not entries, f"markers applied and no entries left ({entries[:5]})"):
            return
        await asyncio.sleep(0.2)


def first_delivery_acks(rng: random.Random) -> set[int]:
    return {i for i in range(MESSAGES) if rng.random() < ACK_SHARE}


async def test_tracker_killed_at_random_moments_loses_nothing(
    kafka_bootstrap: str, topic_factory: TopicFactory, database_url: str, tmp_path: Path
) -> None:
    rng = random.Random(SEED)
    ack_first = first_delivery_acks(rng)
    topic = await topic_factory(partitions=3, prefix="crash-queue")
    markers = await topic_factory(partitions=MARKERS_PARTITIONS, prefix="crash-markers")
    group = unique_topic("crash-workers")

    def should_ack(message: KmqMessage) -> bool:
        return message.attempt >= 2 or message_index(message) in ack_first

    tracker = TrackerProcess(
        tracker_env(kafka_bootstrap, database_url, markers), tmp_path, f"tracker-{markers}"
    )
    store = Store.from_url(database_url)
    sent: dict[Any, int] = {}
    timings: list[str] = []
    started = time.monotonic()
    try:
        async with (
            TopicWatcher(kafka_bootstrap, topic) as watcher,
            Worker(kafka_bootstrap, topic, group, markers, should_ack) as worker,
        ):
            await tracker.start()
            ready = await wait_until_owning(tracker, store, markers, {})
            lives = [[time.time() * 1000, 0.0]]  # [owning since, killed at] per incarnation
            timings.append(f"first start {ready:.1f}s")
            await worker.wait_joined()
            # Production is paced by the kill cycles, not by a guess of their length: each
            # cycle's share is sent while its incarnation works and the next one starts, so
            # every incarnation has leases expiring under it (with one schedule over the whole
            # phase, restarts slower than guessed left the last kills on an idle tracker).
            producing: asyncio.Task[Any] | None = None
            try:
                for cycle in range(KILLS):
                    producing = asyncio.create_task(
                        produce_cycle_share(
                            kafka_bootstrap,
                            topic,
                            total=MESSAGES,
                            cycles=KILLS,
                            cycle=cycle,
                            batch=15,
                            interval=1.0,
                            sent=sent,
                        )
                    )
                    await asyncio.sleep(rng.uniform(0.5, 3.0))
                    worker.check_alive()
                    before = await partition_epochs(store, markers)
                    await tracker.kill()
                    lives[-1][1] = time.time() * 1000
                    await tracker.start()
                    ready = await wait_until_owning(tracker, store, markers, before)
                    lives.append([time.time() * 1000, 0.0])
                    timings.append(f"restart {tracker.incarnation - 1}: {ready:.1f}s")
                    await producing
            finally:
                if producing is not None and not producing.done():
                    producing.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await producing
            assert len(sent) == MESSAGES
            await wait_all_done(
                tracker=tracker,
                store=store,
                worker=worker,
                sent=sent,
                group=group,
                bootstrap=kafka_bootstrap,
                markers=markers,
            )
            await worker.stop()
            # The worker's last markers (if it took a late copy) are applied too.
            await wait_all_done(
                tracker=tracker,
                store=store,
                worker=worker,
                sent=sent,
                group=group,
                bootstrap=kafka_bootstrap,
                markers=markers,
            )
            assert await tracker.terminate() == 0, tracker.log_tail()
            ledger = Ledger.build(sent, await watcher.read_to_end(topic), worker)
        entries = await group_entries(store, group)
        dead = [d for d in await store.list_dead_letters() if d["origin_topic"] == topic]
        lost = [e for e in entries if e.state is State.LOST]
    finally:
        await tracker.close()
        await store.close()

    duplicates = ledger.duplicates()
    # Copies each killed incarnation produced while it owned the partitions: the kills hit a
    # tracker at work, not an idle one.
    busy = [
        sum(1 for r in ledger.copy_records if since - 500 <= r.timestamp_ms <= killed)
        for since, killed in lives[:-1]
    ]
    print(
        f"\n[crash-safety {database_url.split(':', maxsplit=1)[0]}] seed {SEED}, {KILLS} kills, "
        f"{time.monotonic() - started:.0f}s ({', '.join(timings)}): {ledger.summary()}; "
        f"copies made by each killed incarnation: {busy}; "
        f"tracker logs: {tracker.log_paths[0].parent}"
    )
    assert sorted(ledger.originals) == sorted(sent), "the topic's originals are not what was sent"
    assert sum(busy) > 0, "no kill hit a tracker that was redelivering"
    assert ledger.strangers() == []
    # (a) zero lost
    assert ledger.never_acked() == [], f"never acked: {ledger.never_acked()[:20]}"
    # (b) zero acked-then-redelivered
    assert ledger.acked_then_redelivered() == [], (
        f"redelivered after an ack: {ledger.acked_then_redelivered()[:20]}"
    )
    # Every message dropped on its first delivery came back as attempt 2.
    dropped = [o for o, i in sent.items() if i not in ack_first]
    assert [o for o in dropped if ledger.copies[(o, 2)] == 0] == []
    # (c) duplicates are possible (at-least-once) but bounded
    assert sum(duplicates.values()) <= KILLS * REDELIVERY_BATCH, duplicates
    # (d) nothing tracked, dead-lettered or lost at the end
    assert lost == []
    assert entries == []
    assert dead == []


async def test_same_group_restart_after_sigkill(
    kafka_bootstrap: str, topic_factory: TopicFactory, postgres_url: str, tmp_path: Path
) -> None:
    """A tracker restarted in the same consumer group after SIGKILL takes over and redelivers.

    The dead member lingers in the group until its session times out, so this takes ~15-20 s;
    it is done once (Postgres only) rather than per kill above.
    """
    topic = await topic_factory(partitions=2, prefix="crash1-queue")
    markers = await topic_factory(partitions=MARKERS_PARTITIONS, prefix="crash1-markers")
    group = unique_topic("crash1-workers")
    tracker = TrackerProcess(
        tracker_env(kafka_bootstrap, postgres_url, markers), tmp_path, f"tracker-{markers}"
    )
    tracker.fresh_group = False
    store = Store.from_url(postgres_url)
    sent: dict[Any, int] = {}
    try:
        async with (
            TopicWatcher(kafka_bootstrap, topic) as watcher,
            Worker(
                kafka_bootstrap,
                topic,
                group,
                markers,
                lambda m: m.attempt >= 2,
                processing_timeout=timedelta(seconds=LEASE_S),
            ) as worker,
        ):
            await tracker.start()
            await wait_until_owning(tracker, store, markers, {})
            await worker.wait_joined()
            await produce_over_time(kafka_bootstrap, topic, 20, batch=20, interval=0, sent=sent)
            # Killed while every message is in flight (leases not yet expired).
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while len({r.origin for r in worker.received}) < 20:
                assert loop.time() < deadline, "the worker did not receive the 20 messages"
                await asyncio.sleep(0.1)
            before = await partition_epochs(store, markers)
            await tracker.kill()
            await tracker.start()
            took = await wait_until_owning(tracker, store, markers, before)
            await wait_all_done(
                tracker=tracker,
                store=store,
                worker=worker,
                sent=sent,
                group=group,
                bootstrap=kafka_bootstrap,
                markers=markers,
            )
            assert await tracker.terminate() == 0, tracker.log_tail()
            ledger = Ledger.build(sent, await watcher.read_to_end(topic), worker)
    finally:
        await tracker.close()
        await store.close()
    print(f"\n[same-group restart] took over after {took:.1f}s: {ledger.summary()}")
    assert ledger.never_acked() == []
    assert ledger.acked_then_redelivered() == []
    assert sorted(origin for origin, attempt in ledger.copies if attempt == 2) == sorted(sent)


def test_cli_accepts_durations_in_seconds_from_the_environment(tmp_path: Path) -> None:
    """``KMQ_DEFAULT_POLICY__PROCESSING_TIMEOUT=2``: durations as plain seconds, as documented.

    Environment variables are strings; ``"0.3"`` used to be refused (only ISO 8601 such as
    ``PT0.3S`` parsed), so the subprocess configuration above did not start.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("KMQ_")}
    env.update(
        {
            "KMQ_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'kmq.sqlite3'}",
            "KMQ_DEFAULT_POLICY__PROCESSING_TIMEOUT": "2",
            "KMQ_COALESCE_WINDOW": "0.3",
            "KMQ_CLAIM_LEASE": "30",
        }
    )
    result = subprocess.run(
        [sys.executable, "-m", "tracker.cli", "migrate"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=str(ROOT),
    )
    assert result.returncode == 0, result.stderr.strip().splitlines()[-1:]
    assert "database schema at revision" in result.stdout
