"""Marker decode throughput, next to two baselines measured in the same run.

* ``json``: the same markers as JSON documents decoded with the standard library, i.e. what a
  straightforward text protocol would cost;
* ``struct-head``: only unpacking the 19-byte fixed head, a floor no full decoder can beat.

Usage: python -m bench.protocol_decode [--markers N] [--repeat R] [--output PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import struct
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tracker.ids import MessageId
from tracker.protocol import Marker, decode_batch, decode_marker, encode_marker


def workload(n: int) -> list[bytes]:
    """A realistic mix: one START and one ACK per message, 10% retried copies, some extends."""
    values: list[bytes] = []
    for i in range(n // 2):
        message = MessageId("orders", i % 12, 1_000_000 + i)
        if i % 10 == 9:
            origin = MessageId("orders", (i + 1) % 12, i)
            values.append(
                encode_marker(
                    Marker.start(
                        "billing",
                        message,
                        attempt=2,
                        origin=origin,
                        timeout_ms=30_000,
                        consumer="worker-7",
                    )
                )
            )
            values.append(encode_marker(Marker.ack("billing", message, attempt=2, origin=origin)))
        elif i % 10 == 5:
            values.append(encode_marker(Marker.extend("billing", message, timeout_ms=60_000)))
            values.append(encode_marker(Marker.delay("billing", message, reason="busy")))
        else:
            values.append(
                encode_marker(
                    Marker.start("billing", message, timeout_ms=30_000, consumer="worker-7")
                )
            )
            values.append(encode_marker(Marker.ack("billing", message)))
    return values


def as_json(values: list[bytes]) -> list[bytes]:
    return [
        json.dumps(
            {k: (v.name if k == "kind" else v) for k, v in decode_marker(b)._asdict().items()}
        ).encode()
        for b in values
    ]


def best_rate(fn: Callable[[], Any], n: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return n / best


def run(markers: int, repeat: int) -> dict[str, Any]:
    values = workload(markers)
    docs = as_json(values)
    head = struct.Struct(">BBBHiqH").unpack_from
    rates = {
        "kmq_decode_batch": best_rate(lambda: decode_batch(values), len(values), repeat),
        "json_loads": best_rate(lambda: [json.loads(d) for d in docs], len(values), repeat),
        "struct_head_only": best_rate(lambda: [head(v) for v in values], len(values), repeat),
    }
    return {
        "benchmark": "protocol_decode",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"python": platform.python_version(), "processor": platform.machine()},
        "markers": len(values),
        "avg_marker_bytes": sum(map(len, values)) / len(values),
        "avg_json_bytes": sum(map(len, docs)) / len(docs),
        "rates_per_s": {k: round(v) for k, v in rates.items()},
        "ratios": {
            "kmq_vs_json": round(rates["kmq_decode_batch"] / rates["json_loads"], 2),
            "kmq_vs_struct_head": round(rates["kmq_decode_batch"] / rates["struct_head_only"], 2),
        },
        "target": {"kmq_decode_batch_per_s": 1_000_000},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--markers", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    result = run(args.markers, args.repeat)
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
