"""Console sessions: signed cookies that hold no token, expire, and die with their token."""

from __future__ import annotations

from typing import Any

import pytest

from api.console.render import hex_dump, shown_bytes
from api.console.session import csrf_matches, open_session, read_session
from api.models import BytesPreview
from api.security import Role
from tracker.settings import TrackerSettings

pytestmark = [pytest.mark.unit]

ADMIN = "an-admin-token-1"
READER = "a-reader-token-1"
NOW = 1_800_000_000


def settings(**overrides: Any) -> TrackerSettings:
    values: dict[str, Any] = {
        "kafka_bootstrap_servers": "localhost:9092",
        "database_url": "sqlite+aiosqlite:///:memory:",
        "api_token": ADMIN,
        "api_read_token": READER,
        "console_session": 3600,
    }
    values.update(overrides)
    return TrackerSettings(**values)


def test_a_session_round_trips_and_holds_no_token() -> None:
    cookie, session = open_session(settings(), Role.ADMIN, NOW)
    assert ADMIN not in cookie
    read = read_session(settings(), cookie, NOW + 10)
    assert read == session
    assert read is not None
    assert read.can_act
    assert csrf_matches(read, session.csrf)
    assert not csrf_matches(read, session.csrf[:-1] + "x")
    assert not csrf_matches(read, None)


def test_a_read_session_cannot_act_and_cannot_be_promoted() -> None:
    cookie, session = open_session(settings(), Role.READ, NOW)
    assert not session.can_act
    promoted = cookie.replace(".read.", ".admin.")
    assert read_session(settings(), promoted, NOW) is None


@pytest.mark.parametrize(
    "change",
    [
        lambda c: c[:-2] + ("AA" if not c.endswith("AA") else "BB"),  # signature
        lambda c: c.replace(f".{NOW + 3600}.", f".{NOW + 999_999}."),  # expiry pushed out
        lambda c: "v0" + c[2:],  # another format
        lambda c: c + ".extra",
        lambda _c: "",
        lambda _c: "x" * 600,
    ],
)
def test_a_changed_cookie_is_refused(change: Any) -> None:
    cookie, _ = open_session(settings(), Role.ADMIN, NOW)
    assert read_session(settings(), change(cookie), NOW) is None


def test_a_session_expires() -> None:
    cookie, _ = open_session(settings(), Role.ADMIN, NOW)
    assert read_session(settings(), cookie, NOW + 3599) is not None
    assert read_session(settings(), cookie, NOW + 3600) is None


def test_rotating_or_removing_a_token_ends_its_sessions() -> None:
    admin_cookie, _ = open_session(settings(), Role.ADMIN, NOW)
    read_cookie, _ = open_session(settings(), Role.READ, NOW)
    rotated = settings(api_token="another-admin-token")  # noqa: S106
    assert read_session(rotated, admin_cookie, NOW) is None
    assert read_session(rotated, read_cookie, NOW) is not None  # its own token did not change
    assert read_session(settings(api_read_token=None), read_cookie, NOW) is None


def test_no_session_for_a_role_without_a_token() -> None:
    with pytest.raises(ValueError, match="no token"):
        open_session(settings(api_read_token=None), Role.READ, NOW)


def test_payloads_show_as_json_text_or_hex() -> None:
    as_json = shown_bytes(
        BytesPreview(encoding="utf-8", data='{"a":[1,2]}', size=11, truncated=False)
    )
    assert as_json["kind"] == "json"
    assert as_json["text"] == '{\n  "a": [\n    1,\n    2\n  ]\n}'
    text = shown_bytes(BytesPreview(encoding="utf-8", data="<b>hi</b>", size=9, truncated=False))
    assert (text["kind"], text["text"]) == ("text", "<b>hi</b>")
    binary = shown_bytes(BytesPreview(encoding="base64", data="AAFBQg==", size=4, truncated=False))
    assert binary["kind"] == "hex"
    assert binary["text"] == f"00000000  {' 00 01 41 42'[1:]:<47}  ..AB"
    cut = shown_bytes(BytesPreview(encoding="utf-8", data='{"a":', size=900, truncated=True))
    assert cut["kind"] == "text"


def test_hex_dumps_are_capped() -> None:
    dump = hex_dump(bytes(range(256)) * 40, limit=32)
    lines = dump.splitlines()
    assert len(lines) == 3
    assert lines[-1] == "… 10,208 more bytes"


def test_json_nested_too_deep_for_python_shows_as_text() -> None:
    deep = "[" * 2000 + "]" * 2000
    shown = shown_bytes(BytesPreview(encoding="utf-8", data=deep, size=4000, truncated=False))
    assert (shown["kind"], shown["text"]) == ("text", deep)


def test_a_form_token_that_is_not_ascii_does_not_match() -> None:
    _, session = open_session(settings(), Role.ADMIN, NOW)
    assert not csrf_matches(session, "\u00e9" * len(session.csrf))
