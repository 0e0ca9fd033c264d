"""The configuration reference and the metrics table are generated and cannot drift."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import docs_config
import pytest

from tracker.metrics import Metrics
from tracker.settings import TrackerSettings
from tracker.settings_loading import load_settings

pytestmark = pytest.mark.unit

REGENERATE = "run `python scripts/docs_config.py` and commit the result"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KMQ_"):
            monkeypatch.delenv(name)


def test_configuration_reference_matches_the_settings_model() -> None:
    committed = docs_config.CONFIGURATION_MD.read_text(encoding="utf-8")
    assert committed == docs_config.render_configuration(), REGENERATE


def test_metrics_table_matches_the_registry() -> None:
    document = docs_config.OBSERVABILITY_MD.read_text(encoding="utf-8")
    expected = docs_config.with_metrics_table(document, docs_config.render_metrics_table())
    assert document == expected, REGENERATE


def test_check_mode_agrees(capsys: pytest.CaptureFixture[str]) -> None:
    assert docs_config.main(["--check"]) == 0, capsys.readouterr().err


def test_every_setting_and_its_environment_variable_is_documented() -> None:
    """Independent of the generator: each field of the model is in the committed reference."""
    text = docs_config.CONFIGURATION_MD.read_text(encoding="utf-8")

    def walk(model: Any, path: str, env: str) -> None:
        for name, field in model.model_fields.items():
            here, var = f"{path}{name}", f"{env}{name.upper()}"
            assert f"| `{here}` | `{var}` |" in text, here
            nested = docs_config._model_of(field.annotation)
            if nested is not None:
                walk(nested, f"{here}.", f"{var}__")
            by_key = docs_config._dict_model(field.annotation)
            if by_key is not None:
                walk(by_key, f"{here}.<topic>.", f"{var}__<topic>__")

    walk(TrackerSettings, "", "KMQ_")


def test_every_metric_is_documented() -> None:
    text = docs_config.OBSERVABILITY_MD.read_text(encoding="utf-8")
    for family in Metrics().registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        assert f"| `{name}` | {family.type} |" in text, name


def test_the_example_toml_loads_as_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "kmq.toml"
    path.write_text(docs_config.toml_example(), encoding="utf-8")
    loaded = load_settings(path)
    defaults = TrackerSettings()
    skip = {"replica_id"}  # computed per process
    assert loaded.model_dump(exclude=skip) == defaults.model_dump(exclude=skip)
    # The commented per-topic example is valid once uncommented.
    topic_lines = re.findall(r"^# (\[topics\.orders.*\])$", docs_config.toml_example(), re.M)
    assert topic_lines == ["[topics.orders]", "[topics.orders.backoff]"]


def test_environment_variable_names_in_the_reference_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The names the reference gives for nested and per-topic settings are the ones read."""
    monkeypatch.setenv("KMQ_DEFAULT_POLICY__BACKOFF__MAX", "PT100S")
    monkeypatch.setenv("KMQ_TOPICS__orders__MAX_ATTEMPTS", "9")
    monkeypatch.setenv("KMQ_COALESCE_WINDOW", "500ms")
    monkeypatch.setenv("KMQ_ALLOWED_TOPICS", '["orders", "pay"]')
    settings = TrackerSettings()
    assert settings.default_policy.backoff.max.total_seconds() == 100
    assert settings.policy_for("orders").max_attempts == 9
    assert settings.coalesce_window.total_seconds() == 0.5
    assert settings.allowed_topics == ["orders", "pay"]


@pytest.mark.parametrize(
    ("annotation", "expected"),
    [
        (str | None, "string, optional"),
        (list[str], "list of strings"),
        (dict[str, Any], "table"),
    ],
)
def test_type_names(annotation: Any, expected: str) -> None:
    assert docs_config.type_name(annotation) == expected
