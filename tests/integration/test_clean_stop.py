"""``kmq-tracker run`` stops cleanly on SIGINT and SIGTERM, also while the broker is away.

Each test starts a real ``kmq-tracker run`` in its own session and signals its whole process
group, as a terminal's Ctrl-C or a container runtime does, with the broker:

* answering (the session's cluster: an external one when ``KAFKA_BOOTSTRAP_SERVERS`` is set);
* gone while the tracker runs (a private tansu broker, stopped once readiness reports it);
* never there (an address where nothing listens: the tracker is still starting).

A clean stop is: exit status 0 within ``STOP_WITHIN`` seconds, and on stderr nothing but
JSON log records, none with a traceback, none from ``asyncio`` (where "Unclosed
AIOKafkaProducer" and lost task exceptions are reported), and no error but aiokafka's
complaints about the connections it cannot make while the broker is away.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from support.broker import LocalBroker, delete_topics, free_port
from support.tracker_run import TrackerRun, broker_down, ready

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BROKER_DOWN_WITHIN = 30.0  #: readiness says the broker is down ~5 s after it went away
SIGNALS = [pytest.param(signal.SIGINT, id="SIGINT"), pytest.param(signal.SIGTERM, id="SIGTERM")]


def assert_clean_stop(run: TrackerRun, code: int, *, broker_away: bool) -> None:
    """Exit 0, and stderr holds only log records, without a traceback or asyncio complaint.

    Errors are allowed only from aiokafka while the broker is away (its connection attempts).
    """
    assert code == 0, f"exit status {code}:\n{run.log}"
    records = run.records()
    assert len(records) == len(run.stderr), f"stderr holds more than log records:\n{run.log}"
    for record in records:
        logger = str(record.get("logger"))
        assert "exception" not in record, f"a traceback was logged:\n{run.log}"
        assert logger != "asyncio", f"asyncio complained:\n{run.log}"
        if record.get("level") in ("ERROR", "CRITICAL"):
            expected = broker_away and logger.startswith("aiokafka")
            assert expected, f"an error was logged:\n{run.log}"


async def test_run_stops_cleanly_on_ctrl_c_while_the_broker_answers(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    run = TrackerRun(kafka_bootstrap, tmp_path)
    try:
        async with run:
            await run.wait_for_readiness("ready", ready)
            code = await run.stop_with(signal.SIGINT)
    finally:
        await delete_topics(kafka_bootstrap, [run.markers, f"{run.markers}.invalid"])
    assert_clean_stop(run, code, broker_away=False)


@pytest.mark.parametrize("signum", SIGNALS)
async def test_run_stops_cleanly_while_the_broker_is_away(signum: int, tmp_path: Path) -> None:
    broker = LocalBroker(log_dir=tmp_path / "tansu")
    async with broker, TrackerRun(broker.bootstrap_servers, tmp_path) as run:
        await run.wait_for_readiness("ready", ready)
        await broker.astop()
        await run.wait_for_readiness(
            "reporting the broker down", broker_down, within=BROKER_DOWN_WITHIN
        )
        code = await run.stop_with(signum)
    assert_clean_stop(run, code, broker_away=True)


@pytest.mark.parametrize("signum", SIGNALS)
async def test_run_stops_cleanly_while_starting_without_a_broker(
    signum: int, tmp_path: Path
) -> None:
    async with TrackerRun(f"127.0.0.1:{free_port()}", tmp_path) as run:
        # aiokafka complains about each refused connection: the tracker is waiting for Kafka.
        await run.wait_for_record(
            "from aiokafka", lambda record: str(record.get("logger")).startswith("aiokafka")
        )
        code = await run.stop_with(signum)
    assert_clean_stop(run, code, broker_away=True)
