"""Settings: environment, TOML file, validation with clear messages, per-topic policies."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from pydantic import ValidationError

from tracker.cli import main
from tracker.domain.policy import BackoffPolicy
from tracker.settings import TrackerSettings
from tracker.settings_loading import ConfigFileError, load_settings, unknown_environment

pytestmark = pytest.mark.unit

README_TOML = """
[default_policy]
processing_timeout = 30      # seconds, or ISO 8601 ("PT30S")
max_attempts = 5

[topics.orders]
max_attempts = 10
dlq_topic = "orders.dead"
backoff = { initial = 2, multiplier = 3, max = 600, jitter = 0.2 }
"""


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(__import__("os").environ):
        if name.startswith("KMQ_"):
            monkeypatch.delenv(name)


def test_defaults_work_for_the_embedded_mode() -> None:
    settings = TrackerSettings()
    assert settings.is_sqlite
    assert settings.invalid_topic == "kmq-markers.invalid"
    assert settings.policy_for("anything").dlq_for("anything") == "anything.dlq"


def test_the_readme_toml_example_loads(tmp_path: Path) -> None:
    path = tmp_path / "kmq.toml"
    path.write_text(README_TOML)
    settings = load_settings(path)
    orders = settings.policy_for("orders")
    assert orders.max_attempts == 10
    assert orders.processing_timeout == timedelta(seconds=30)
    assert orders.dlq_for("orders") == "orders.dead"
    assert orders.backoff == BackoffPolicy(initial=2, multiplier=3, max=600, jitter=0.2)
    assert settings.policy_for("payments").max_attempts == 5


def test_environment_overrides_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "kmq.toml"
    path.write_text(README_TOML)
    monkeypatch.setenv("KMQ_DEFAULT_POLICY__MAX_ATTEMPTS", "7")
    monkeypatch.setenv("KMQ_COALESCE_WINDOW", "PT0.25S")
    settings = load_settings(path)
    assert settings.default_policy.max_attempts == 7
    assert settings.coalesce_window == timedelta(milliseconds=250)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"database_url": "mysql://x"}, "database_url must start with"),
        ({"markers_topic": "bad topic"}, "not a legal Kafka topic name"),
        ({"default_policy": {"max_attempts": 0}}, "greater than or equal to 1"),
        ({"default_policy": {"processing_timeout": 0}}, "processing_timeout must be positive"),
        ({"topics": {"bad/name": {}}}, "not a legal Kafka topic name"),
        ({"coalesce_window": -1}, "must not be negative"),
        ({"gc_gen0_threshold": -1}, "greater than or equal to 0"),
        ({"no_such_setting": 1}, "Extra inputs are not permitted"),
        ({"default_policy": {"backoff": {"initial": 10, "max": 1}}}, "0 < initial <= max"),
    ],
)
def test_bad_settings_are_refused_with_a_clear_message(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        TrackerSettings(**overrides)  # type: ignore[arg-type]


def test_a_missing_config_file_is_an_error() -> None:
    with pytest.raises(ConfigFileError, match="does not exist"):
        load_settings("/nonexistent/kmq.toml")


def test_cli_reports_bad_configuration_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KMQ_DEFAULT_POLICY__MAX_ATTEMPTS", "zero")
    assert main(["run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert err.startswith("kmq-tracker: invalid configuration: default_policy.max_attempts")


def test_cli_reports_a_missing_config_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["migrate", "--config", "/nonexistent.toml"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_backoff_grows_is_capped_and_is_deterministic_per_message() -> None:
    backoff = BackoffPolicy(initial=1, multiplier=2, max=10, jitter=0.2)
    delays = [backoff.delay_ms(n, b"msg") for n in range(1, 8)]
    assert delays == [backoff.delay_ms(n, b"msg") for n in range(1, 8)]
    assert 800 <= delays[0] <= 1200
    assert 1600 <= delays[1] <= 2400
    assert all(d <= 12_000 for d in delays)
    spread = {backoff.delay_ms(1, f"m{i}".encode()) for i in range(50)}
    assert len(spread) > 10, "jitter spreads different messages"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30", timedelta(seconds=30)),
        ("0.5", timedelta(milliseconds=500)),
        ("250ms", timedelta(milliseconds=250)),
        ("5m", timedelta(minutes=5)),
        ("2h", timedelta(hours=2)),
        ("7d", timedelta(days=7)),
        ("PT30S", timedelta(seconds=30)),
        ("00:01:00", timedelta(minutes=1)),
    ],
)
def test_durations_from_the_environment(
    text: str, expected: timedelta, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KMQ_DEFAULT_POLICY__PROCESSING_TIMEOUT", text)
    monkeypatch.setenv("KMQ_CLAIM_LEASE", text if expected > timedelta(seconds=1) else "60")
    settings = TrackerSettings()
    assert settings.default_policy.processing_timeout == expected


@pytest.mark.parametrize("value", ["soon", "banana", "-5", "", "-PT5S", -5, -0.5])
def test_an_unreadable_or_negative_duration_is_refused_with_the_accepted_forms(
    value: object,
) -> None:
    with pytest.raises(ValidationError, match="coalesce_window") as refused:
        TrackerSettings(coalesce_window=value)
    assert "500ms, 30s, 5m, 2h, 7d, or ISO 8601 (PT30S)" in str(refused.value)


def test_kmq_variables_that_set_nothing_are_named_with_a_suggestion() -> None:
    environ = {
        "KMQ_DATABSE_URL": "postgresql+asyncpg://db/kmq",  # a typo: would silently use SQLite
        "KMQ_DATABASE_URL": "sqlite+aiosqlite:///kmq.db",
        "KMQ_DEFAULT_POLICY__MAX_ATTEMPTS": "8",  # a nested setting
        "KMQ_CONFIG_FILE": "kmq.toml",  # read by the loader, not a field
        "KMQ_FROBNICATE": "1",
        "PATH": "/usr/bin",
    }
    assert unknown_environment(environ) == [
        "environment variable KMQ_DATABSE_URL is not a setting and is ignored "
        "(did you mean KMQ_DATABASE_URL?)",
        "environment variable KMQ_FROBNICATE is not a setting and is ignored",
    ]
