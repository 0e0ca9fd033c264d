"""The benchmark code must not rot: every scenario runs with tiny sizes (``--smoke``).

Checks the structure of the JSON it writes (every scenario present, figures with values, a
PASS/MISS verdict wherever there is a target), never the targets themselves: at these sizes the
figures mean nothing. Runs against the session's broker (``KAFKA_BOOTSTRAP_SERVERS``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = {
    "consumer_overhead",
    "ingest",
    "redelivery",
    "scale",
    "scale_ranges",
    "api_load",
    "worker_pool",
    "delayed_backlog",
}


def test_every_scenario_runs_and_reports(kafka_bootstrap: str, tmp_path: Path) -> None:
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap, "PYTHONPATH": str(ROOT)}
    docs = tmp_path / "benchmarks.md"
    # Plots need the `bench` extra (matplotlib); the dev install may not have it.
    plotting = importlib.util.find_spec("matplotlib") is not None
    args = ["--smoke", "--output-dir", str(tmp_path), "--docs", str(docs)]
    completed = subprocess.run(
        [sys.executable, "-m", "bench", *args, *([] if plotting else ["--no-plots"])],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]

    [result] = tmp_path.glob("*-smoke.json")
    document = json.loads(result.read_text())
    scenarios = {s["scenario"]: s for s in document["scenarios"]}
    assert set(scenarios) == EXPECTED
    targeted = 0
    for scenario in scenarios.values():
        assert scenario["figures"], scenario["scenario"]
        assert scenario["data"], scenario["scenario"]
        for figure in scenario["figures"]:
            assert {"name", "value", "unit", "target", "status"} <= set(figure)
            if figure["target"] is None:
                assert figure["status"] == "INFO"
            else:
                targeted += 1
                assert figure["status"] in {"PASS", "MISS"}
                assert figure["op"] in {"<=", ">="}
    assert targeted >= 10
    # The worker-pool scenario measured every cell and its baseline, and judged each cell
    # against its ideal unless the run was bound by the CPU or the machine.
    pool = scenarios["worker_pool"]["data"]
    assert pool["plain"]
    assert pool["noop"]
    assert pool["kmq"]
    for handler_ms, runs in pool["kmq"].items():
        assert handler_ms in pool["plain"]
        # The event loop's own ceiling was measured at every concurrency and at the plain
        # consumers' four workers, and every cell was set against it.
        assert set(pool["loop"][handler_ms]) == {*runs, "4"}
        for run in runs.values():
            assert run["rate"] > 0
            assert run["stats"]["acked"] > 0
            assert run["bound"] in {None, "cpu", "machine"}
            assert run["ratio_loop"] > 0
    summary = document["summary"]
    assert summary["pass"] + summary["miss"] == targeted

    # The Markdown table and the plots are written too.
    text = docs.read_text()
    assert "| scenario | figure | value | target | result |" in text
    if plotting:
        plots = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
        # Scenario 7 (delayed backlog) reports its figures as a table only.
        assert plots == sorted(f"{name}.png" for name in EXPECTED - {"delayed_backlog"})
    # Every scenario prints its figures with the verdict.
    assert "[PASS]" in completed.stdout or "[MISS]" in completed.stdout
