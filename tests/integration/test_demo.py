"""``kmq-tracker demo``: the narrated local demo runs, shows every feature and stops cleanly.

The demo starts its own tansu broker, so these tests need neither the session broker nor a
database. With ``KAFKA_BOOTSTRAP_SERVERS`` set (the suite runs against an external cluster)
the variable is passed through and the demo uses that cluster instead.

The demo runs in its own session and is stopped as a terminal stops a foreground job: SIGINT
to its whole process group. Its narration and summary go to stdout; a clean stop leaves
stderr empty (no traceback, no "Unclosed AIOKafka..." complaint) and its own broker stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def demo_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KMQ_")}
    env.pop("KAFKA_BOOTSTRAP_SERVERS", None)
    external = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "").strip()
    if external:
        env["KAFKA_BOOTSTRAP_SERVERS"] = external
    if "KMQ_TANSU_BIN" in os.environ:
        env["KMQ_TANSU_BIN"] = os.environ["KMQ_TANSU_BIN"]
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Demo:
    """The demo as a subprocess in its own session; stdout and stderr collected line by line."""

    def __init__(self, *args: str, tmpdir: Path | None = None) -> None:
        self.args = args
        self.tmpdir = tmpdir  #: the demo's TMPDIR, to check what it leaves behind
        self.lines: list[str] = []  #: stdout
        self.errors: list[str] = []  #: stderr
        self.process: asyncio.subprocess.Process | None = None
        self._readers: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Demo:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tracker.cli",
            "demo",
            *self.args,
            env={**demo_env(), **({"TMPDIR": str(self.tmpdir)} if self.tmpdir else {})},
            cwd=str(ROOT),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # its own process group, as a terminal's foreground job
        )
        assert self.process.stdout is not None
        assert self.process.stderr is not None
        self._readers = [
            asyncio.create_task(self._read(self.process.stdout, self.lines)),
            asyncio.create_task(self._read(self.process.stderr, self.errors)),
        ]
        return self

    @staticmethod
    async def _read(stream: asyncio.StreamReader, into: list[str]) -> None:
        async for raw in stream:
            into.append(raw.decode(errors="replace").rstrip("\n"))

    @property
    def output(self) -> str:
        err = "\n".join(self.errors)
        return "\n".join(self.lines) + (f"\n--- stderr ---\n{err}" if err else "")

    def interrupt(self) -> None:
        """Ctrl-C as a terminal sends it: SIGINT to every process in the foreground group."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGINT)

    async def wait(self, within: float) -> int:
        """Wait for the exit (and the end of its output); returns the exit code."""
        assert self.process is not None
        try:
            code = await asyncio.wait_for(self.process.wait(), within)
            await asyncio.wait_for(asyncio.gather(*self._readers), 10)
        except TimeoutError:
            raise AssertionError(
                f"the demo did not exit within {within:.0f}s; output:\n{self.output}"
            ) from None
        return code

    async def wait_for(self, pattern: str, count: int, within: float) -> None:
        assert self.process is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while len(self.matching(pattern)) < count:
            assert self.process.returncode is None, f"the demo exited early:\n{self.output}"
            assert loop.time() < deadline, f"no {count} lines /{pattern}/ in:\n{self.output}"
            await asyncio.sleep(0.1)

    def matching(self, pattern: str) -> list[str]:
        regex = re.compile(pattern)
        return [line for line in self.lines if regex.search(line)]

    async def __aexit__(self, *exc: object) -> None:
        """After a failure: SIGTERM (the demo still stops its broker), SIGKILL as a last resort."""
        process = self.process
        if process is not None and process.returncode is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), 30)
            except TimeoutError:
                os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*self._readers), 10)


def assert_clean(demo: Demo) -> None:
    """Summary last on stdout, nothing at all on stderr, and the demo's own broker gone."""
    assert not demo.errors, f"stderr is not empty:\n{demo.output}"
    assert "Traceback" not in demo.output, demo.output
    assert demo.lines, "the demo printed nothing"
    assert re.fullmatch(r"demo stopped cleanly: \w+ \d+(, \w+ \d+)*", demo.lines[-1]), demo.output
    if not os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "").strip():
        (announced,) = demo.matching(r"demo\s+broker \S+, store")
        host, port = re.findall(r"broker (\S+):(\d+),", announced)[0]
        with pytest.raises(ConnectionRefusedError):  # the broker was stopped, not leaked
            socket.create_connection((host, int(port)), timeout=2).close()


async def test_demo_shows_every_feature_and_stops_after_its_duration() -> None:
    async with Demo("--duration", "25") as demo:
        code = await demo.wait(within=90)
    print(f"\n[demo --duration 25]\n{demo.output}")
    assert code == 0, demo.output
    assert_clean(demo)
    assert len(demo.matching(r"producer\s+-> job-\d+ \(")) >= 10, "produced jobs"
    # A worker "crashed" holding a job; the tracker redelivered it after the lease.
    assert demo.matching(r"worker crashes holding it")
    assert demo.matching(r"tracker\s+<> redelivered \S+: attempt 2 ->")
    # A retry with backoff, and its next attempt.
    assert demo.matching(r"failed, retry with backoff")
    assert demo.matching(r"v job-\d+ attempt 3 done")
    # Dead letters: a poison message (rejected) and a hopeless one (max attempts).
    assert demo.matching(r"tracker\s+XX dead_lettered \S+: rejected by the consumer")
    assert demo.matching(r"tracker\s+XX dead_lettered \S+: max attempts reached")
    # A delayed job handed over when due (republished without counting an attempt).
    assert demo.matching(r"tracker\s+<> redelivered \S+: delayed message due")
    assert demo.matching(r"v job-\d+ attempt 1 done \(was delayed\)")
    summary = demo.lines[-1]
    for word in ("produced", "acked", "redelivered", "dead_lettered"):
        assert word in summary, summary


async def test_demo_stops_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    async with Demo(tmpdir=tmp_path) as demo:
        await demo.wait_for(r"^\s*[\d.]+s\s+tracker\s", count=2, within=60)
        demo.interrupt()
        code = await demo.wait(within=30)
    print(f"\n[demo, Ctrl-C]\n{demo.output}")
    assert code == 0, demo.output
    assert_clean(demo)
    # Its working directory (the SQLite store) and the broker's log are gone with it.
    assert os.listdir(tmp_path) == []
    assert demo.matching(r"demo\s+stopping \.\.\.")
