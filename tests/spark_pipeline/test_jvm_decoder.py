"""The JVM marker decoder gives exactly the rows of the Python one (the C decoder's columns).

``decode_markers_frame`` decodes in the JVM where the session has the decoder's jar
(pipeline/jvm_jar.py): the same rules as the C decoder, re-written in Java, so every test
here decodes the same values both ways and compares whole rows, error texts included: valid
markers of both versions (ranges expanded into rows), every kind of garbage the markers fuzz
test produces, single-byte corruptions and truncations of valid values, random bytes behind
each version byte, illegal topic names (whose error quotes the name as Python's ``repr``
does), tombstones, and the test vectors of docs/protocol.md.
"""

from __future__ import annotations

import os
import random
import struct
import time
import zipfile
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability.markers_fuzz import GARBAGE, raw_marker
from support.marker_strategies import markers, range_markers
from support.protocol_vectors import documented_vectors

from pipeline import jvm_jar
from pipeline.connector_frames import decode_markers_frame
from tracker.errors import MarkerError
from tracker.ids import MessageId
from tracker.protocol import Marker, decode_marker, encode_any, encode_marker
from tracker.protocol_v2 import RangeKind, RangeMarker

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

pytestmark = [pytest.mark.integration]

BASE = datetime(2026, 12, 1, tzinfo=UTC)
RAW_SCHEMA = "partition INT, offset BIGINT, timestamp TIMESTAMP, value BINARY"


def _raw(spark: SparkSession, values: list[bytes | None]) -> DataFrame:
    rows = [
        (i % 3, i, BASE + timedelta(milliseconds=7 * i), value) for i, value in enumerate(values)
    ]
    return spark.createDataFrame(rows, RAW_SCHEMA)


def _rows(frame: DataFrame) -> list[tuple[Any, ...]]:
    rows = [tuple(row) for row in frame.collect()]
    # Record position, then the covered offset (a range's rows); refused rows have no offset.
    return sorted(rows, key=lambda r: (r[0], r[1], -1 if r[7] is None else r[7]))


def _assert_same_rows(spark: SparkSession, values: list[bytes | None]) -> list[tuple[Any, ...]]:
    raw = _raw(spark, values)
    in_jvm = decode_markers_frame(raw, decoder="jvm")
    in_python = decode_markers_frame(raw, decoder="python")
    assert in_jvm.schema.simpleString() == in_python.schema.simpleString()
    expected = _rows(in_python)
    got = _rows(in_jvm)
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected, strict=True):
        assert mine == theirs
    return got


def test_the_jvm_decoder_is_built_where_required(spark: SparkSession) -> None:
    """CI sets KMQ_REQUIRE_SPEEDUPS: there the JDK is present, so the session must decode in
    the JVM, not fall back to Python without a word."""
    if os.environ.get("KMQ_REQUIRE_SPEEDUPS"):
        assert jvm_jar.register_decoder(spark)
    plan = decode_markers_frame(_raw(spark, [None]))._jdf.queryExecution().analyzed().toString()
    assert (jvm_jar.FUNCTION in plan) == jvm_jar.register_decoder(spark)


def test_a_session_without_the_class_falls_back_to_python(spark: SparkSession) -> None:
    """Under spark-submit without --jars the class is missing: registering says so (no
    exception), so decoding takes the Python path."""
    assert not jvm_jar.register_decoder(
        spark, function="kmq_missing_rows", class_name="kmq.pipeline.NoSuchUdf"
    )
    assert not spark.catalog.functionExists("kmq_missing_rows")


def _samples() -> list[bytes]:
    """Valid values of every shape: each v1 kind with and without an origin, UTF-8 text,
    and range markers with no exceptions, a bitmap and runs."""
    message = MessageId("orders", 3, 42)
    origin = MessageId("orders.retry", 0, 7)
    v1 = [
        Marker.start("billing", message, timeout_ms=30_000, consumer="wörker-1"),
        Marker.start("billing", message, attempt=3, origin=origin, consumer=""),
        Marker.ack("billing", message),
        Marker.delay("bïlling", message, delay_ms=5_000, reason="try later ✓"),
        Marker.delay("billing", message, delay_ms=None, reason=""),
        Marker.delay("billing", message, delay_ms=60_000, deferred=True, reason="not due"),
        Marker.extend("billing", message, attempt=2, origin=origin, timeout_ms=120_000),
        Marker.reject("billing", message, reason="bad json"),
    ]
    v2 = [
        RangeMarker(RangeKind.RANGE_START, "billing", "orders", 3, 100, 163, 0, 30_000, "c-1"),
        RangeMarker(RangeKind.RANGE_SETTLE, "billing", "orders", 3, 100, 163, 0b1011 << 5, 0, ""),
        RangeMarker(RangeKind.RANGE_EXTEND, "billing", "orders", 3, 0, 9, 0b11, 60_000, ""),
        RangeMarker(RangeKind.RANGE_SETTLE, "billing", "orders", 3, 7, 7, 0, 0, ""),
        RangeMarker(
            RangeKind.RANGE_SETTLE, "billing", "orders", 1, 0, 899, (1 << 500) - (1 << 3), 0, ""
        ),
    ]
    return [encode_marker(m) for m in v1] + [encode_any(m) for m in v2]


def _corpus(rng: random.Random) -> list[bytes | None]:
    vectors = documented_vectors()
    assert len(vectors) >= 8, "docs/protocol.md lost its test vectors"
    values: list[bytes | None] = [*vectors.values(), *_samples()]
    for _ in range(20):  # every kind of garbage of the markers fuzz test, many times
        values += [make(rng, "orders") for make in GARBAGE.values()]
    for sample in _samples():
        values += [sample[:cut] for cut in range(len(sample))]
        values += [sample + b"\x00", sample + bytes(rng.randrange(256) for _ in range(5))]
        for position in range(len(sample)):
            for _ in range(3):
                corrupted = bytearray(sample)
                corrupted[position] = rng.randrange(256)
                values.append(bytes(corrupted))
    # A NUL in each text field (group, consumer, reason): refused by every decoder alike.
    for sample in _samples():
        for text in (b"billing", "wörker-1".encode(), b"try later", b"bad json", b"c-1"):
            if text in sample:
                values.append(sample.replace(text, text[:1] + b"\x00" + text[2:], 1))
    for version in (b"\x01", b"\x02", b"\x03", b""):
        values += [version + rng.randbytes(rng.randrange(60)) for _ in range(300)]
    # Topic names the error quotes: quotes, backslashes, control bytes, non-ASCII after them.
    for name in (
        b"it's",
        b'say "hi"',
        b"both'\"",
        b"back\\slash",
        b"tab\there",
        b"new\nline\r",
        b"del\x7f",
        b"nul\x00",
        b"bad name\xc3\xa9",
        b"\xc3\xa9first",
        b".",
        b"..",
        b"...",
        b"x" * 70 + b"!",
        b"!" + b"\xff" * 70,
    ):
        values.append(raw_marker(topic=name))
        values.append(struct.pack(">BBBiqqH", 2, 2, 0, 0, 0, 9, len(name)) + name + b"\x00\x01g")
    values += [None, b""]
    # A corrupted offset can make a valid range of up to 65,536 rows: a few such are enough.
    return [v for v in values if _rows_of(v) <= 1_024]


def _rows_of(value: bytes | None) -> int:
    try:
        marker = decode_marker(value)
    except MarkerError:
        return 1
    return marker.width if isinstance(marker, RangeMarker) else 1


def test_both_decoders_give_the_same_rows_on_valid_corrupted_and_random_values(
    spark: SparkSession,
) -> None:
    values = _corpus(random.Random(20261202))
    rows = _assert_same_rows(spark, values)
    refused = sum(1 for row in rows if row[-1] is not None)
    # The corpus exercises both outcomes in quantity, not only refusals.
    assert refused > 2_000
    assert len(rows) - refused > 1_000


def _narrow(marker: RangeMarker) -> bool:
    return marker.width <= 1_024


_values = st.one_of(
    markers().map(encode_marker),
    range_markers().filter(_narrow).map(encode_any),
    st.tuples(markers().map(encode_marker), st.integers(0, 400), st.integers(0, 255)).map(
        lambda t: t[0][: t[1] % len(t[0])] + bytes([t[2]]) + t[0][t[1] % len(t[0]) + 1 :]
    ),
    st.tuples(range_markers().map(encode_any), st.integers(0, 400)).map(
        lambda t: t[0][: t[1] % len(t[0])]
    ),
    st.binary(max_size=80).map(lambda b: b"\x01" + b),
    st.binary(max_size=80).map(lambda b: b"\x02" + b),
    st.none(),
)


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(values=st.lists(_values, min_size=1, max_size=150))
def test_both_decoders_agree_on_generated_values(spark: SparkSession, values: list[bytes]) -> None:
    _assert_same_rows(spark, list(values))


def test_an_unknown_decoder_is_refused(spark: SparkSession) -> None:
    with pytest.raises(ValueError, match="unknown decoder 'c'"):
        decode_markers_frame(_raw(spark, [b""]), decoder="c")


def test_the_jar_is_built_into_the_cache_named_by_source_and_spark_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    javac = jvm_jar.find_javac()
    if os.environ.get("KMQ_REQUIRE_SPEEDUPS"):
        assert javac is not None, "make test needs a JDK compiler for the JVM marker decoder"
    monkeypatch.setenv(jvm_jar.CACHE_ENV, str(tmp_path))
    jar = jvm_jar.pipeline_jar()
    if javac is None:  # nothing built: the pipeline decodes in Python
        assert jar is None
        assert list(tmp_path.iterdir()) == []
        return
    assert jar is not None
    assert jar == jvm_jar.jar_path()
    assert jar.parent == tmp_path
    with zipfile.ZipFile(jar) as built:
        assert {"kmq/pipeline/MarkerRowsUdf.class", "kmq/pipeline/LedgerFold.class"} <= set(
            built.namelist()
        )
    assert [p.name for p in tmp_path.iterdir()] == [jar.name]  # no partial file left


def test_without_a_compiler_the_build_step_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(jvm_jar.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(jvm_jar, "find_javac", lambda: None)
    assert jvm_jar.main([]) == 1
    assert "no javac found" in capsys.readouterr().err
    assert jvm_jar.main(["--if-possible"]) == 0
    assert jvm_jar.pipeline_jar() is None
    assert list(tmp_path.iterdir()) == []


def test_a_failed_compile_is_reported_with_the_compiler_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    javac = tmp_path / "javac"
    javac.write_text("#!/bin/sh\necho 'error: cannot find symbol UDF1' >&2\nexit 2\n")
    javac.chmod(0o755)
    monkeypatch.setenv(jvm_jar.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(jvm_jar, "find_javac", lambda: str(javac))
    assert jvm_jar.main([]) == 1
    assert "cannot find symbol UDF1" in capsys.readouterr().err
    assert jvm_jar.pipeline_jar() is None  # logged; the pipeline decodes in Python
    with pytest.raises(jvm_jar.JarBuildError, match="javac failed"):
        jvm_jar.build_jar(str(javac), tmp_path / "x.jar")


def test_a_build_removes_cached_jars_unused_for_a_month_and_use_marks_a_jar(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(jvm_jar.CACHE_ENV, str(tmp_path))
    month_ago = time.time() - (jvm_jar.UNUSED_DAYS + 1) * 86_400
    week_ago = time.time() - 7 * 86_400
    stale = tmp_path / "kmq-marker-rows-00000000000000aa.jar"
    stale_partial = tmp_path / "kmq-marker-rows-00000000000000bb.jar.123.part"
    in_use = tmp_path / "kmq-marker-rows-00000000000000cc.jar"  # another installation's
    not_ours = tmp_path / "notes.txt"
    for path, when in ((stale, month_ago), (stale_partial, month_ago), (in_use, week_ago)):
        path.write_bytes(b"jar")
        os.utime(path, (when, when))
    not_ours.write_text("kept")
    os.utime(not_ours, (month_ago, month_ago))

    def fake_build(javac: str, target: Path) -> Path:
        target.write_bytes(b"built")
        return target

    monkeypatch.setattr(jvm_jar, "find_javac", lambda: "/usr/bin/javac")
    monkeypatch.setattr(jvm_jar, "build_jar", fake_build)
    jar = jvm_jar.ensure_jar()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [jar.name, in_use.name, not_ours.name]
    )
    # A cached jar is marked as used each time a session takes it, so it is never stale
    # while some installation still uses it.
    os.utime(jar, (month_ago, month_ago))
    assert jvm_jar.ensure_jar() == jar
    assert jar.stat().st_mtime > week_ago


def test_the_jar_joins_the_jars_a_session_already_asks_for() -> None:
    jar = Path("/cache/kmq-marker-rows-0123.jar")
    assert jvm_jar.with_pipeline_jar("", jar) == str(jar)
    assert jvm_jar.with_pipeline_jar("a.jar,b.jar", jar) == f"a.jar,b.jar,{jar}"
    assert jvm_jar.with_pipeline_jar(f"a.jar,{jar}", jar) == f"a.jar,{jar}"
