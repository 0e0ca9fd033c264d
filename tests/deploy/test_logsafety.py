"""Secrets and payloads stay out of the JSON log lines."""

from __future__ import annotations

import json
import logging

import pytest
from pydantic import SecretStr

from tracker.logs import JsonFormatter
from tracker.logsafety import REDACTED, is_sensitive, safe_field, scrub

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "name",
    ["password", "sasl_plain_password", "api_token", "Authorization", "payload", "value", "secret"],
)
def test_sensitive_field_names(name: str) -> None:
    assert is_sensitive(name)
    assert safe_field(name, "hunter2") == REDACTED


@pytest.mark.parametrize("name", ["message_id", "group", "topic", "offset", "attempt", "reason"])
def test_identities_are_logged_as_they_are(name: str) -> None:
    assert not is_sensitive(name)
    assert safe_field(name, "orders/3/42") == "orders/3/42"
    assert safe_field(name, 42) == 42


def test_url_credentials_are_masked() -> None:
    text = "cannot connect to postgresql+asyncpg://kmq:s3cr3t@db:5432/kmq (timeout)"
    assert scrub(text) == "cannot connect to postgresql+asyncpg://kmq:***@db:5432/kmq (timeout)"
    assert scrub("sqlite+aiosqlite:////data/kmq.db") == "sqlite+aiosqlite:////data/kmq.db"
    assert safe_field("url", "postgresql://u:p@h/d") == "postgresql://u:***@h/d"


def test_secret_str_never_prints_its_value() -> None:
    assert safe_field("sasl", SecretStr("hunter2")) == "**********"


def test_json_formatter_lines_are_json_with_structured_fields() -> None:
    """What the formatter writes today: one object per line, ``extra`` fields included."""
    record = logging.LogRecord(
        "tracker.engine", logging.ERROR, __file__, 1, "lost: %s", ("x",), None
    )
    record.message_id = "orders/3/42"
    record.group = "billing"
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "lost: x"
    assert line["message_id"] == "orders/3/42"
    assert line["group"] == "billing"
    assert line["level"] == "ERROR"
