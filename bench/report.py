"""The Markdown table and PNG plots of a benchmark run (``bench/results/<date>.json``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

BEGIN = "<!-- BEGIN GENERATED: python -m bench rewrites this part -->"
END = "<!-- END GENERATED -->"

_HEADER = """# Benchmarks

`make bench` runs the scenarios of issue 7 and rewrites the generated part of this page.
The notes after the generated part (method, profiles, proposed fixes) are written by hand.

"""


def _fmt(value: float | None) -> str:
    if value is None:
        return "n/a"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


def table(document: dict[str, Any]) -> str:
    lines = [
        "| scenario | figure | value | target | result |",
        "|---|---|---|---|---|",
    ]
    for scenario in document["scenarios"]:
        title = scenario["title"].split(":")[0]
        for f in scenario["figures"]:
            target = f"{f['op']} {f['target']:g}" if f["target"] is not None else ""
            status = {"PASS": "PASS", "MISS": "**MISS**"}.get(f["status"], "")
            note = f" ({f['note']})" if f["note"] else ""
            value = f"{_fmt(f['value'])} {f['unit']}"
            lines.append(f"| {title} | {f['name']}{note} | {value} | {target} | {status} |")
    return "\n".join(lines)


def _speed(run: dict[str, Any]) -> str:
    """The machine's Python speed at a run (``bench.common.python_loop_us``), if recorded."""
    us = run.get("python_loop_us")
    return "" if us is None else f"; a fixed Python loop took {us:g} us"


def write_docs(document: dict[str, Any], docs: Path, source: Path, plots: list[Path]) -> None:
    """Replace the generated part of ``docs`` (create the page if it is missing)."""
    text = docs.read_text() if docs.exists() else _HEADER + BEGIN + "\n" + END + "\n"
    if BEGIN not in text or END not in text:
        text = text.rstrip("\n") + "\n\n" + BEGIN + "\n" + END + "\n"
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    m = document["machine"]
    summary = document["summary"]
    rel = os.path.relpath(source, docs.parent)
    parts = [
        BEGIN,
        "",
        f"Run of {document['date']} (profile `{document['profile']}`, "
        f"{document['seconds']:.0f} s; {m['cpus']} CPUs, Python {m['python']}, "
        f"load average at start {m['loadavg_at_start'][0]}{_speed(m)}; "
        f"Kafka: {m.get('kafka', '?')}). "
        f"Raw results: [`{Path(rel).as_posix()}`]({Path(rel).as_posix()}). "
        f"**{summary['pass']} PASS, {summary['miss']} MISS.**",
        "",
        *[
            f"Re-run of {', '.join(u['scenarios'])} on {u['date']} "
            f"({u['seconds']:.0f} s{_speed(u)})."
            for u in document.get("updates", [])
        ],
        "",
        table(document),
        "",
    ]
    for plot in plots:
        link = Path(os.path.relpath(plot, docs.parent)).as_posix()
        parts.append(f"![{plot.stem}]({link})")
        parts.append("")
    parts.append(END)
    docs.write_text(head + "\n".join(parts) + tail)


# -- plots ------------------------------------------------------------------------------------


def plots(document: dict[str, Any], directory: Path) -> list[Path]:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    directory.mkdir(parents=True, exist_ok=True)
    by_name = {s["scenario"]: s for s in document["scenarios"]}
    out: list[Path] = []
    makers = (
        ("consumer_overhead", _plot_consumer),
        ("ingest", _plot_ingest),
        ("redelivery", _plot_redelivery),
        ("scale", _plot_scale),
        ("scale_ranges", _plot_scale_ranges),
        ("api_load", _plot_api),
        ("worker_pool", _plot_worker_pool),
    )
    for name, maker in makers:
        if name in by_name:
            path = directory / f"{name}.png"
            maker(by_name[name]["data"], path)
            out.append(path)
    return out


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    import matplotlib.pyplot as plt  # noqa: PLC0415

    plt.close(fig)


def _plot_consumer(data: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    sizes = list(data)
    x = range(len(sizes))
    kinds = list(data[sizes[0]]["runs"])  # both plain baselines, then the kmq forms
    width = 0.8 / len(kinds)
    for k, kind in enumerate(kinds):
        best = [max(r["rate"] for r in data[s]["runs"][kind]) for s in sizes]
        offset = (k - (len(kinds) - 1) / 2) * width
        ax1.bar([i + offset for i in x], best, width, label=kind)
    ax1.set_xticks(list(x), [f"{s} B" for s in sizes])
    ax1.set_ylabel("messages/s")
    ax1.set_yscale("log")
    ax1.set_title("Consumer throughput (best run)")
    ax1.legend()
    qs = ("p50", "p95", "p99")
    for s in sizes:
        ax2.plot(qs, [data[s]["latency_plain"][f"{q}_ms"] for q in qs], "o--", label=f"plain {s} B")
        ax2.plot(qs, [data[s]["latency_kmq"][f"{q}_ms"] for q in qs], "o-", label=f"kmq {s} B")
    ax2.set_ylabel("produce -> hand-over (ms)")
    ax2.set_title("Latency")
    ax2.legend()
    _save(fig, path)


def _plot_ingest(data: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(8, 4))
    labels: list[str] = []
    values: list[float] = []
    for name, entry in data.items():
        if not isinstance(entry, dict):  # the queue's raw read rate, the v2 workloads' baseline
            labels.append(f"{name}\n(messages/s)")
            values.append(float(entry))
            continue
        if "raw_read_rate" in entry:  # (c) garbage is judged against (a), not a raw read
            labels.append(f"{name}\nraw read")
            values.append(entry["raw_read_rate"])
        for store, run in entry["stores"].items():
            labels.append(f"{name}\n{store}" + ("\n(valid)" if name == "garbage" else ""))
            values.append(run["rate"])
    grey = ("raw", "queue_read_rate")
    colors = ["grey" if any(g in label for g in grey) else "C0" for label in labels]
    ax.bar(labels, values, color=colors)
    ax.set_yscale("log")
    ax.set_ylabel("markers/s (v1), messages covered/s (v2_*)")
    ax.set_title("Ingest rate vs plain reads of the markers and of the queue")
    _save(fig, path)


def _plot_redelivery(data: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    bursts = {k[6:]: v for k, v in data.items() if k.startswith("burst_")}
    labels, values = [], []
    for store, b in bursts.items():
        labels += [f"raw produce\n({store} run)", f"republish\n{store}"]
        values += [b["raw_produce_rate"], b["republish_rate"]]
    ax1.bar(labels, values, color=["grey", "C0"] * len(bursts))
    ax1.set_ylabel("records/s")
    ax1.set_title("(a) burst: republish vs raw produce")
    for key, samples in data.items():
        if key.startswith("steady_") and key.endswith("_samples_ms") and samples:
            store = key[len("steady_") : -len("_samples_ms")]
            ys = [i / len(samples) for i in range(1, len(samples) + 1)]
            ax2.plot(samples, ys, label=store)
    ax2.set_xlabel("copy timestamp - deadline (ms)")
    ax2.set_ylabel("fraction of messages")
    ax2.set_title("(b) steady 1k/s: lateness CDF (incl. ack_grace)")
    ax2.legend()
    _save(fig, path)


def _plot_store_series(
    data: dict[str, Any], path: Path, keys: tuple[tuple[str, str], ...], title: str
) -> None:
    """One panel per figure, one line per store, against the store size (log scale)."""
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(2, 4, figsize=(14, 6))
    for ax, (key, label) in zip(axes.flat, keys, strict=False):
        for store, series in data.items():
            ax.plot([p["size"] for p in series], [p[key] for p in series], "o-", label=store)
        ax.set_xscale("log")
        ax.set_title(label)
        ax.set_ylim(bottom=0)
        ax.legend()
    axes.flat[-1].axis("off")
    fig.suptitle(title)
    _save(fig, path)


_STORE_PANELS = (
    ("claim_due_ms", "claim_due 1,000 (ms)"),
    ("next_due_ms", "next_due_ms (ms)"),
    ("api_list_ms", "API list (ms)"),
    ("api_list_due_ms", "API list by due (ms)"),
    ("api_stats_ms", "API stats (ms)"),
    ("rss_mb", "tracker RSS (MB)"),
)


def _plot_scale(data: dict[str, Any], path: Path) -> None:
    keys = (("ingest_us_per_marker", "ingest (us/marker)"), *_STORE_PANELS)
    _plot_store_series(data, path, keys, "Cost per operation vs tracked entries")


def _plot_scale_ranges(data: dict[str, Any], path: Path) -> None:
    keys = (("ingest_us_per_message", "ingest (us/message covered)"), *_STORE_PANELS)
    title = "Cost per operation vs messages in flight, range markers (500 per range)"
    _plot_store_series(data, path, keys, title)


def _plot_api(data: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(9, 4))
    labels, p50, p99 = [], [], []
    for store, d in data.items():
        for name in ("list", "list_due", "stats"):
            labels.append(f"{store}\n{name}")
            p50.append(d[name]["p50_ms"])
            p99.append(d[name]["p99_ms"])
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], p50, 0.4, label="p50")
    ax.bar([i + 0.2 for i in x], p99, 0.4, label="p99")
    ax.axhline(50, color="red", linestyle=":", label="p99 target")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("ms")
    ax.set_title("Admin API latency under ingest load")
    ax.legend()
    _save(fig, path)


def _plot_worker_pool(data: dict[str, Any], path: Path) -> None:
    """Throughput vs concurrency (log-log), one line per handler time, with the ideal
    ``c / h`` (dotted), the event loop's own ceiling (dash-dotted), plain aiokafka with one
    consumer per partition (a square at its ``partitions`` workers) and the no-op handler's
    rates (the CPU-bound maximum)."""
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(12, 5))
    partitions = data["partitions"]
    bound_label: str | None = "CPU- or machine-bound (not judged)"
    for i, (h, runs) in enumerate(data["kmq"].items()):
        color = f"C{i}"
        cs = sorted(int(c) for c in runs)
        ax.plot(cs, [runs[str(c)]["rate"] for c in cs], "o-", color=color, label=f"kmq, {h} ms")
        ax.plot(cs, [c / (float(h) / 1000) for c in cs], ":", color=color, label=f"ideal, {h} ms")
        loops = (data.get("loop") or {}).get(h) or {}
        alone = [c for c in cs if str(c) in loops]
        if alone:
            ax.plot(
                alone,
                [loops[str(c)]["rate"] for c in alone],
                "-.",
                color=color,
                alpha=0.6,
                label=f"the event loop alone (no Kafka), {h} ms",
            )
        plain = data["plain"].get(h)
        if plain is not None:
            ax.plot(
                [partitions],
                [plain["rate"]],
                "s",
                color=color,
                markersize=9,
                markerfacecolor="none",
                label=f"plain aiokafka, {partitions} consumers, {h} ms",
            )
        bound = [c for c in cs if runs[str(c)].get("bound")]
        if bound:
            ax.plot(
                bound,
                [runs[str(c)]["rate"] for c in bound],
                "x",
                color="black",
                markersize=10,
                label=bound_label,
            )
            bound_label = None
    noop = data.get("noop") or {}
    if noop:
        cs = sorted(int(c) for c in noop)
        ax.plot(
            cs,
            [noop[str(c)]["rate"] for c in cs],
            "--",
            color="grey",
            label="no-op handler (the CPU-bound maximum)",
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("concurrency")
    ax.set_ylabel("handler completions/s")
    ax.set_title(
        f"KmqConsumer.run: throughput vs concurrency ({partitions} partitions, "
        f"{data['message_bytes']} B, handler = asyncio.sleep(h))"
    )
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    _save(fig, path)


def main() -> None:
    import sys  # noqa: PLC0415

    source = Path(sys.argv[1])
    document = json.loads(source.read_text())
    root = Path(__file__).resolve().parent.parent
    made = plots(document, root / "bench" / "results" / "plots")
    write_docs(document, root / "docs" / "benchmarks.md", source, made)


if __name__ == "__main__":
    main()
