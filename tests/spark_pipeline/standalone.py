"""A real Spark standalone cluster for tests: a master and a worker process started from the
pyspark installation (``bin/spark-class``), bound to loopback, stopped with their process
groups."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import pyspark


@dataclass(frozen=True)
class StandaloneCluster:
    master_url: str  #: spark://127.0.0.1:<port>
    work_dir: Path  #: the worker's directory: one subdirectory per application


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _alive_workers(ui_port: int) -> int:
    """The master's count of alive workers, 0 while its web UI cannot say yet.

    While the master starts, its UI can answer ``/json/`` with the HTML status page (the root
    handler is serving before the JSON one is attached); that is "not yet", like a refused
    connection, not a failure."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/json/", timeout=2) as answer:
            workers: int = json.load(answer).get("aliveworkers", 0)
            return workers
    except (OSError, ValueError):  # ValueError: json.JSONDecodeError, an HTML page
        return 0


def _stop(process: subprocess.Popen[bytes]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        with suppress(subprocess.TimeoutExpired):
            process.wait(timeout=15)
        if process.poll() is not None:
            return


@contextmanager
def standalone_cluster(
    directory: Path, *, cores: int = 2, memory: str = "2g"
) -> Iterator[StandaloneCluster]:
    """Start a master and one worker; yield once the master counts the worker as alive."""
    spark_class = Path(pyspark.__file__).parent / "bin" / "spark-class"
    env = {
        **os.environ,
        "SPARK_HOME": str(spark_class.parent.parent),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,  # the executors' Python workers
        # A port taken between _free_port() and the bind fails the daemon at once (its log
        # is shown) instead of moving it to another port that this fixture does not know.
        # The REST submission server (port 6066 by default) is not needed.
        "SPARK_DAEMON_JAVA_OPTS": "-Dspark.port.maxRetries=0 -Dspark.master.rest.enabled=false",
    }
    port, ui_port, worker_ui = _free_port(), _free_port(), _free_port()
    work_dir = directory / "work"
    work_dir.mkdir(parents=True, exist_ok=True)
    processes: list[subprocess.Popen[bytes]] = []

    def start(name: str, *args: str) -> None:
        with (directory / f"{name}.log").open("wb") as log:  # the child keeps its own copy
            processes.append(
                subprocess.Popen(
                    [str(spark_class), *args],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )

    try:
        start(
            "master",
            "org.apache.spark.deploy.master.Master",
            *("--host", "127.0.0.1", "--port", str(port), "--webui-port", str(ui_port)),
        )
        start(
            "worker",
            "org.apache.spark.deploy.worker.Worker",
            *("--host", "127.0.0.1", "--cores", str(cores), "--memory", memory),
            *("--webui-port", str(worker_ui), "--work-dir", str(work_dir)),
            f"spark://127.0.0.1:{port}",
        )
        deadline = time.monotonic() + 120
        while _alive_workers(ui_port) < 1:
            for process in processes:
                if process.poll() is not None:
                    logs = "".join(p.read_text() for p in directory.glob("*.log"))
                    raise RuntimeError(f"a Spark daemon exited:\n{logs[-4000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError("the Spark worker did not register with the master in 120 s")
            time.sleep(0.5)
        yield StandaloneCluster(f"spark://127.0.0.1:{port}", work_dir)
    finally:
        for process in reversed(processes):
            _stop(process)
