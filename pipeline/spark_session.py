"""The SparkSession every job runs in: local by default, any cluster when asked.

* No ``--master`` and not launched by ``spark-submit``: ``local[*]``, bound to the loopback
  interface, with the Python workers on this interpreter (``PYSPARK_PYTHON``), so
  ``python -m pipeline ...`` in a virtualenv just works.
* ``--master`` given, or ``spark-submit`` (which sets ``spark.master`` itself): that cluster.
  The executors then need this project importable: ``ship_code=True`` zips ``pipeline`` and
  ``tracker`` as this interpreter imports them, compiled C decoder included, ships the zip
  with ``spark.archives`` (unpacked in each executor's working directory as ``kmq-code``) and
  puts it first on the Python workers' path, so the executors decode with the C decoder as
  the driver does. Under ``spark-submit`` the context's settings are fixed before this code
  runs: the zip is added with ``addPyFile`` (pure Python) unless the submit command ships it
  with ``--archives`` itself. aiokafka and pyarrow must be installed on the executors.

Settings every job relies on: the session time zone is UTC (ledger dates and report buckets
are UTC days and hours), and map keys built from record headers keep the last duplicate (like
the tracker's own header parsing).
"""

from __future__ import annotations

import os
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

DEFAULT_CONF: dict[str, str] = {
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.mapKeyDedupPolicy": "LAST_WIN",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    # HotSpot does not compile a method of more than 8,000 bytes of bytecode: it runs
    # interpreted. Spark's default limit for its whole-stage generated code is 64 KiB, so a
    # stage whose generated method is larger runs interpreted; at 8000 (the value Spark's own
    # docs suggest on HotSpot) Spark turns whole-stage code generation off for that stage, and
    # its operators run their own smaller generated code, which HotSpot compiles. The JVM
    # ledger fold's output (17 columns, a history of 16-field structs) is such a stage: the
    # fold of 1M markers took 5.0-5.5 s without the limit, 1.5-2.5 s with it (warm).
    "spark.sql.codegen.hugeMethodLimit": "8000",
}

#: Extra settings for local runs: small shuffles (the default 200 partitions is for clusters).
LOCAL_CONF: dict[str, str] = {
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.sql.shuffle.partitions": "8",
}


def is_local(master: str | None) -> bool:
    return master is None or master.startswith("local")


def launched_by_spark_submit() -> bool:
    """``spark-submit`` starts the Python driver with a gateway to an existing JVM."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def build_session(
    master: str | None = None,
    *,
    app_name: str = "kmq-pipeline",
    conf: Mapping[str, str] | None = None,
    ship_code: bool | None = None,
    log_level: str = "WARN",
    progress: bool = False,
) -> SparkSession:
    """Create (or get) the session for a job; see the module docstring.

    ``progress`` shows Spark's console progress bar (stages and tasks, on stderr).
    """
    from pyspark.sql import SparkSession  # noqa: PLC0415 - pyspark is optional

    from pipeline.jvm_jar import pipeline_jar, with_pipeline_jar  # noqa: PLC0415
    from pipeline.source import register  # noqa: PLC0415

    submitted = launched_by_spark_submit()
    if master is None and not submitted:
        master = "local[*]"
    local = is_local(master) and not submitted
    if local:
        # Python workers must run the interpreter (and virtualenv) that has this project.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = SparkSession.builder.appName(app_name)
    if master is not None:
        builder = builder.master(master)
    settings = {**DEFAULT_CONF, **(LOCAL_CONF if local else {})}
    settings["spark.ui.showConsoleProgress"] = "true" if progress else "false"
    settings.update(conf or {})
    ship = ship_code if ship_code is not None else not local
    if not submitted:
        settings[_DRIVER_JAVA_OPTIONS] = quiet_logging(settings.get(_DRIVER_JAVA_OPTIONS, ""))
        jar = pipeline_jar()
        if jar is not None:  # to the driver and every executor (pipeline/jvm_jar.py)
            settings["spark.jars"] = with_pipeline_jar(settings.get("spark.jars", ""), jar)
        if ship:
            settings.update(shipping_conf(code_archive(), settings))
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(log_level)
    shipped = f"#{CODE_DIR}" in spark.sparkContext.getConf().get("spark.archives", "")
    if ship and submitted and not shipped:
        # spark-submit started the context: its settings are fixed. The code still reaches
        # the executors as a Python zip (pure Python: the compiled decoder does not load from
        # a zip, and a zip added here would come first on their path); ship it with
        # --archives ...#kmq-code for the compiled one (docs/pipeline.md).
        spark.sparkContext.addPyFile(str(code_archive()))
    register(spark)
    return spark


_DRIVER_JAVA_OPTIONS = "spark.driver.extraJavaOptions"
_EXECUTOR_PYTHONPATH = "spark.executorEnv.PYTHONPATH"
LOG_CONFIG = Path(__file__).with_name("log4j2.properties")


def quiet_logging(java_options: str) -> str:
    """The driver's Java options with the pipeline's log4j2 configuration added, unless the
    user names one of their own (see pipeline/log4j2.properties for what it leaves out)."""
    if "log4j2.configurationFile" in java_options or "log4j.configurationFile" in java_options:
        return java_options
    return f"{java_options} -Dlog4j2.configurationFile={LOG_CONFIG.as_uri()}".strip()


#: Where the code archive is unpacked on every executor (in its working directory); the
#: executors' Python workers get it first on their path.
CODE_DIR = "kmq-code"


def code_archive(directory: Path | None = None) -> Path:
    """A zip of the ``pipeline`` and ``tracker`` packages as this interpreter imports them:
    sources, package data and compiled extension modules (the C marker decoder).

    Shipped with ``spark.archives``, it is unpacked, not imported from the zip, so executors
    load the compiled decoder as the driver does (it was built for this Python and platform;
    an executor on another one falls back to the pure-Python decoder, which applies the same
    rules).
    """
    import pipeline  # noqa: PLC0415
    import tracker  # noqa: PLC0415

    wanted = {".py", ".typed", ".properties", *EXTENSION_SUFFIXES}
    out_dir = directory or Path(tempfile.mkdtemp(prefix="kmq-pipeline-code-"))
    archive = out_dir / "kmq-pipeline-code.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        for package in (pipeline, tracker):
            if package.__file__ is None:
                raise RuntimeError(f"{package.__name__} is not a regular package")
            root = Path(package.__file__).parent
            for path in sorted(root.rglob("*")):
                if "__pycache__" in path.parts or not path.is_file():
                    continue
                if path.suffix in wanted or any(path.name.endswith(x) for x in EXTENSION_SUFFIXES):
                    zf.write(path, Path(root.name) / path.relative_to(root))
    return archive


def shipping_conf(archive: Path, conf: Mapping[str, str]) -> dict[str, str]:
    """The settings that ship ``archive`` to every executor and put it on the Python workers'
    path, added to what ``conf`` already asks for."""
    archives = conf.get("spark.archives", "")
    python_path = conf.get(_EXECUTOR_PYTHONPATH, "")
    return {
        "spark.archives": ",".join(a for a in (archives, f"{archive}#{CODE_DIR}") if a),
        _EXECUTOR_PYTHONPATH: os.pathsep.join(p for p in (CODE_DIR, python_path) if p),
    }
