"""``python -m bench``: run the benchmark scenarios of issue 7 and write the results.

Starts a tansu broker unless ``KAFKA_BOOTSTRAP_SERVERS`` is set, creates fresh Postgres
databases on the local server (or on ``KMQ_BENCH_POSTGRES_URL``, a server URL whose role may
create databases), uses SQLite files in a temp dir. Writes ``bench/results/<date>.json`` and
the PNG plots under ``bench/results/plots/``, and rewrites the generated part of
``docs/benchmarks.md``.

Sizes: default (``make bench``, ~20 minutes on 2 cores), ``--full`` (adds 10M tracked entries on
Postgres; much longer), ``--quick`` (a few minutes, smaller sizes), ``--smoke`` (seconds; the
test suite's check that the code runs, figures meaningless).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from . import (
    consumer_overhead,
    delayed_backlog,
    ingest,
    redelivery,
    scale,
    scale_ranges,
    worker_pool,
)
from .common import ROOT, Infra, ScenarioResult, infrastructure, machine

SCENARIOS = (
    "consumer_overhead",
    "ingest",
    "redelivery",
    "scale",
    "scale_ranges",
    "worker_pool",
    "delayed_backlog",
)
#: Scenarios without a tracker store (``--stores`` does not apply).
STORELESS = ("consumer_overhead", "worker_pool")

PROFILES: dict[str, dict[str, dict[str, Any]]] = {
    "default": {
        "consumer_overhead": {"messages": 200_000, "repeat": 2, "latency_seconds": 8.0},
        "ingest": {"messages": 200_000},
        "redelivery": {"burst_messages": 100_000, "steady_seconds": 15.0},
        "scale": {"sizes": (10_000, 100_000, 1_000_000), "api_seconds": 8.0},
        "scale_ranges": {"sizes": (10_000, 100_000, 1_000_000, 10_000_000)},
        "worker_pool": {"backlog": 800_000},
        "delayed_backlog": {"sizes": (1_000_000, 10_000_000)},
    },
    "full": {
        "consumer_overhead": {"messages": 400_000, "repeat": 3, "latency_seconds": 15.0},
        "ingest": {"messages": 400_000},
        "redelivery": {"burst_messages": 100_000, "steady_seconds": 30.0},
        "scale": {
            "sizes": (10_000, 100_000, 1_000_000),
            "postgres_extra": (10_000_000,),
            "api_seconds": 15.0,
        },
        "scale_ranges": {"sizes": (10_000, 100_000, 1_000_000, 10_000_000)},
        "worker_pool": {"backlog": 1_600_000, "window_s": 8.0, "window_handlers": 60.0},
        "delayed_backlog": {"sizes": (1_000_000, 10_000_000), "probes": 200},
    },
    "quick": {
        "consumer_overhead": {"messages": 50_000, "repeat": 1, "latency_seconds": 4.0},
        "ingest": {"messages": 50_000},
        "redelivery": {"burst_messages": 20_000, "steady_seconds": 6.0},
        "scale": {"sizes": (10_000, 100_000), "reps": 5, "api_seconds": 4.0},
        "scale_ranges": {"sizes": (10_000, 1_000_000), "reps": 5},
        "worker_pool": {
            "concurrency": (1, 32, 512),
            "backlog": 600_000,
            "warmup_s": 1.0,
            "window_s": 2.0,
            "window_handlers": 15.0,
        },
        "delayed_backlog": {"sizes": (100_000, 1_000_000), "reps": 5, "probes": 50},
    },
    "smoke": {
        "consumer_overhead": {
            "messages": 3_000,
            "sizes": (100,),
            "repeat": 1,
            "latency_rate": 500,
            "latency_seconds": 1.0,
        },
        "ingest": {"messages": 4_000, "stores": ("sqlite",)},
        "redelivery": {
            "burst_messages": 800,
            "steady_rate": 200,
            "steady_fast_rate": 400,
            # v2 only: the 1k cell runs the v1 path, and the suite's timeout is 300 s
            "steady_fast_ranges": (True,),
            "steady_seconds": 1.5,
            "stores": ("sqlite",),
            "min_lease_ms": 2_500,
        },
        "scale": {
            "sizes": (1_000, 3_000),
            "stores": ("sqlite",),
            "reps": 2,
            "api_requests": 3,
            "api_seconds": 0.5,
            "load_rate": 200,
        },
        "scale_ranges": {
            "sizes": (1_000, 5_000),
            "stores": ("sqlite",),
            "reps": 2,
            "api_requests": 3,
        },
        "worker_pool": {
            "handler_ms": (5,),
            "concurrency": (1, 8),
            "backlog": 50_000,
            "warmup_s": 0.2,
            "window_s": 0.4,
            "window_handlers": 0.0,
        },
        "delayed_backlog": {"sizes": (1_000, 3_000), "stores": ("sqlite",), "reps": 2, "probes": 3},
    },
}


async def run_all(
    infra: Infra, profile: str, only: tuple[str, ...], stores: tuple[str, ...] | None
) -> list[ScenarioResult]:
    params = PROFILES[profile]
    results: list[ScenarioResult] = []
    for name in SCENARIOS:
        if name not in only:
            continue
        kwargs = dict(params[name])
        if stores is not None and name not in STORELESS:
            kwargs["stores"] = stores
        print(f"\n== {name} ({profile}) ==", flush=True)
        started = time.perf_counter()
        if name == "consumer_overhead":
            found = [await consumer_overhead.run(infra, **kwargs)]
        elif name == "ingest":
            found = [await ingest.run(infra, **kwargs)]
        elif name == "redelivery":
            found = [await redelivery.run(infra, **kwargs)]
        elif name == "scale_ranges":
            found = [await scale_ranges.run(infra, **kwargs)]
        elif name == "worker_pool":
            found = [await worker_pool.run(infra, **kwargs)]
        elif name == "delayed_backlog":
            found = [await delayed_backlog.run(infra, **kwargs)]
        else:
            found = list(await scale.run(infra, **kwargs))
        seconds = time.perf_counter() - started
        for result in found:
            result.seconds = seconds / len(found)
        results.extend(found)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_const", dest="profile", const="quick")
    size.add_argument("--full", action="store_const", dest="profile", const="full")
    size.add_argument("--smoke", action="store_const", dest="profile", const="smoke")
    parser.set_defaults(profile="default")
    parser.add_argument("--only", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--stores", nargs="+", choices=("sqlite", "postgres"))
    parser.add_argument("--output-dir", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--no-docs", action="store_true", help="do not touch docs/benchmarks.md")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument(
        "--update",
        type=Path,
        help="a results JSON whose scenarios run now (--only) replace; the rest is kept",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    started = time.perf_counter()
    info = machine()
    with infrastructure() as infra:
        results = asyncio.run(
            run_all(infra, args.profile, tuple(args.only), tuple(args.stores or ()) or None)
        )
        info["kafka"] = "external" if infra.external_kafka else "tansu (started by the bench)"
    now = datetime.now(UTC)
    document: dict[str, Any] = {
        "benchmark": "kmq-tracker issue 7",
        "date": now.isoformat(timespec="seconds"),
        "profile": args.profile,
        "machine": info,
        "seconds": round(time.perf_counter() - started, 1),
        "scenarios": [r.as_dict() for r in results],
    }
    for scenario in document["scenarios"]:
        scenario["ran_at"] = document["date"]
    if args.update is not None:
        previous = json.loads(args.update.read_text())
        fresh = {s["scenario"]: s for s in document["scenarios"]}
        merged = [fresh.pop(s["scenario"], s) for s in previous["scenarios"]]
        previous["scenarios"] = merged + list(fresh.values())
        previous.setdefault("updates", []).append(
            {
                "date": document["date"],
                "seconds": document["seconds"],
                "scenarios": list(args.only),
                "python_loop_us": info["python_loop_us"],
            }
        )
        document = previous
    figures = [f for s in document["scenarios"] for f in s["figures"] if f["target"] is not None]
    document["summary"] = {
        "pass": sum(f["status"] == "PASS" for f in figures),
        "miss": sum(f["status"] == "MISS" for f in figures),
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.profile == "default" else f"-{args.profile}"
    path = args.update or args.output_dir / f"{now:%Y-%m-%d}{suffix}.json"
    path.write_text(json.dumps(document, indent=1, default=_jsonable) + "\n")
    print(f"\nwrote {path}")
    from . import report  # noqa: PLC0415 - matplotlib only when reporting

    plots = [] if args.no_plots else report.plots(document, args.output_dir / "plots")
    if not args.no_docs:
        report.write_docs(document, args.docs, path, plots)
        print(f"updated {args.docs}")
    summary = document["summary"]
    print(f"{summary['pass']} PASS, {summary['miss']} MISS in {document['seconds']:.0f} s")
    return 0


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple | set):
        return list(value)
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
