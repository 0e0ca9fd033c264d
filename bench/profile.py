"""Profile the hot paths with pyinstrument: ``python -m bench.profile [--label after]``.

Profiles the kmq consumer loop (scenario 1) and the tracker's ingest of acked and unacked
markers (scenario 2) and writes the text reports to ``bench/results/profiles/<label>-*``
(``--label``: ``before`` or ``after`` a change, so that both can be kept side by side).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

from aiokafka import AIOKafkaProducer

from . import consumer_overhead as co
from . import ingest
from . import markers as mk
from .common import ROOT, Infra, create_topic, highwaters, infrastructure, unique


def _profiler() -> object:
    from pyinstrument import Profiler  # noqa: PLC0415 - a bench extra

    return Profiler(interval=0.001, async_mode="disabled")


async def profile(infra: Infra, out: Path, label: str, messages: int) -> None:
    b = infra.bootstrap
    topic = await create_topic(b, unique("prof-q"), co.PARTITIONS)
    markers = await create_topic(b, unique("prof-m"), co.PARTITIONS)
    await co.fill_topic(b, topic, messages, 100)
    prof: object = _profiler()
    prof.start()  # type: ignore[attr-defined]
    rate = await co.kmq_throughput(b, topic, markers, messages)
    prof.stop()  # type: ignore[attr-defined]
    text = prof.output_text(unicode=False, color=False)  # type: ignore[attr-defined]
    (out / f"{label}-client-kmq_consumer.txt").write_text(f"# {rate}\n{text}")
    print(label, "kmq consumer", rate)
    for acked, store in ((True, "sqlite"), (False, "postgres")):
        queue = await create_topic(b, unique("prof-q"), ingest.PARTITIONS)
        topic = await create_topic(b, unique("prof-m"), ingest.PARTITIONS)
        producer = AIOKafkaProducer(bootstrap_servers=b, acks="all")
        await producer.start()
        try:
            work = ingest.workload(queue, messages, acked=acked)
            await mk.produce_markers(producer, topic, work, ingest.PARTITIONS)
        finally:
            await producer.stop()
        ends = await highwaters(b, topic)
        prof = _profiler()
        prof.start()  # type: ignore[attr-defined]
        found = await ingest.tracker_ingest(
            infra, infra.database_url(store, unique("p")), topic, ends
        )
        prof.stop()  # type: ignore[attr-defined]
        name = f"{label}-ingest-{'acked' if acked else 'unacked'}-{store}.txt"
        text = prof.output_text(unicode=False, color=False)  # type: ignore[attr-defined]
        (out / name).write_text(f"# {found}\n{text}")
        print(label, name, found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--label", default="after", help="file name prefix of the reports")
    parser.add_argument("--messages", type=int, default=100_000)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    out = ROOT / "bench" / "results" / "profiles"
    out.mkdir(parents=True, exist_ok=True)
    with infrastructure() as infra:
        asyncio.run(profile(infra, out, args.label, args.messages))


if __name__ == "__main__":
    main()
