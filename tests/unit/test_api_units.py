"""Pure pieces of the admin API and redrive: rate limiting, action rules, ids, cursors, previews."""

from __future__ import annotations

import base64
from dataclasses import replace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter
from pydantic import BaseModel, ValidationError

from api import models
from api.http_errors import ApiError, _is_json, _item
from api.message_ids import decode_cursor, encode_cursor, format_message_id, parse_message_id
from api.previews import bytes_preview
from api.rates import CounterRates
from tracker.domain.actions import ActionKind, ActionOutcome, ActionRequest, decide_action
from tracker.domain.entries import Entry, State
from tracker.headers import REDRIVE_ITEM, REDRIVE_JOB, job_marks, redrive_headers, redrive_marks
from tracker.ratelimit import TokenBucket

pytestmark = [pytest.mark.unit]

NOW = 1_800_000_000_000
ROUND = "round-7"  #: a redelivery round's claim token


class FakeTime:
    """A monotonic clock that only moves when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


async def test_token_bucket_keeps_the_rate_over_time() -> None:
    fake = FakeTime()
    bucket = TokenBucket(1000, clock=fake.clock, sleep=fake.sleep)
    assert bucket.burst == 250  # a quarter of a second
    taken = 0
    while taken < 5000:
        taken += await bucket.take(500)
    # 5000 tokens at 1000/s, starting from one: about 5 seconds.
    assert fake.now - 100.0 == pytest.approx(5.0, abs=0.01)
    assert all(s > 0 for s in fake.slept)


async def test_token_bucket_never_grants_more_than_the_burst() -> None:
    fake = FakeTime()
    bucket = TokenBucket(10, clock=fake.clock, sleep=fake.sleep)
    assert await bucket.take(5) == 1  # starts with one token
    fake.now += 60  # idle for a minute
    assert await bucket.take(1000) == 2  # burst = max(1, 10 * 0.25)
    slow = TokenBucket(0.5, clock=fake.clock, sleep=fake.sleep)
    await slow.take(1)
    before = fake.now
    assert await slow.take(1) == 1
    assert fake.now - before == pytest.approx(2.0)
    with pytest.raises(ValueError, match="positive"):
        TokenBucket(0)


async def test_token_bucket_waits_at_most_max_wait() -> None:
    fake = FakeTime()
    bucket = TokenBucket(0.1, clock=fake.clock, sleep=fake.sleep)  # one per 10 s
    assert await bucket.take(1) == 1
    assert await bucket.take(1, max_wait=4) == 0
    assert await bucket.take(1, max_wait=4) == 0
    assert await bucket.take(1, max_wait=4) == 1  # 12 s in: the token is there after 2 more
    assert fake.slept == pytest.approx([4, 4, 2])


def test_redrive_headers_drop_dlq_headers_and_mark_the_record() -> None:
    headers = [
        ("app", b"1"),
        ("kmq-origin", b"orders/0/1"),
        ("kmq-dlq-reason", b"x"),
        ("kmq-dlq-attempts", b"5"),
        (REDRIVE_JOB, b"3"),  # from an earlier redrive: replaced
        (REDRIVE_ITEM, b"9"),
        ("nullable", None),
    ]
    out = redrive_headers(headers, job_marks(7, 42))
    assert out == [
        ("app", b"1"),
        ("kmq-origin", b"orders/0/1"),
        ("nullable", None),
        (REDRIVE_JOB, b"7"),
        (REDRIVE_ITEM, b"42"),
    ]
    assert redrive_marks(out) == (7, 42)
    assert redrive_marks([("app", b"1")]) is None
    assert redrive_marks([(REDRIVE_JOB, b"x"), (REDRIVE_ITEM, b"1")]) is None


ENTRY = Entry(
    group_id="billing",
    origin_topic="orders",
    origin_partition=0,
    origin_offset=1,
    markers_partition=0,
    state=State.IN_FLIGHT,
    attempt=1,
    copy_topic="orders",
    copy_partition=0,
    copy_offset=1,
    due_at_ms=NOW + 60_000,
    first_seen_ms=NOW - 1000,
    updated_ms=NOW - 1000,
)


def request(action: ActionKind, **kw: object) -> ActionRequest:
    return ActionRequest(key=ENTRY.key, action=action, actor="admin", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("state", "action", "outcome"),
    [
        (State.IN_FLIGHT, ActionKind.REDELIVER, ActionOutcome.APPLIED),
        (State.DELAYED, ActionKind.REDELIVER, ActionOutcome.APPLIED),
        (State.REJECTED, ActionKind.REDELIVER, ActionOutcome.CONFLICT),
        (State.LOST, ActionKind.REDELIVER, ActionOutcome.CONFLICT),
        (State.IN_FLIGHT, ActionKind.EXTEND, ActionOutcome.APPLIED),
        (State.DELAYED, ActionKind.EXTEND, ActionOutcome.CONFLICT),
        (State.REJECTED, ActionKind.EXTEND, ActionOutcome.CONFLICT),
        (State.LOST, ActionKind.EXTEND, ActionOutcome.CONFLICT),
        (State.IN_FLIGHT, ActionKind.DEAD_LETTER, ActionOutcome.APPLIED),
        (State.DELAYED, ActionKind.DEAD_LETTER, ActionOutcome.APPLIED),
        (State.REJECTED, ActionKind.DEAD_LETTER, ActionOutcome.UNCHANGED),
        (State.LOST, ActionKind.DEAD_LETTER, ActionOutcome.CONFLICT),
        (State.IN_FLIGHT, ActionKind.ACK, ActionOutcome.APPLIED),
        (State.LOST, ActionKind.ACK, ActionOutcome.APPLIED),
    ],
)
def test_action_rules(state: State, action: ActionKind, outcome: ActionOutcome) -> None:
    entry = replace(ENTRY, state=state, due_at_ms=None if state is State.LOST else NOW + 60_000)
    decision = decide_action(entry, request(action, extend_ms=5000, reason="why"), NOW)
    assert decision.outcome is outcome, decision.detail
    if outcome is not ActionOutcome.APPLIED:
        assert decision.changes is None
        assert not decision.delete
        return
    if action is ActionKind.ACK:
        assert decision.delete
    elif action is ActionKind.REDELIVER:
        assert decision.changes == {"due_at_ms": NOW, "claim_token": None, "updated_ms": NOW}
    elif action is ActionKind.EXTEND:
        assert decision.changes is not None
        assert decision.changes["due_at_ms"] == NOW + 5000
    else:
        assert decision.changes is not None
        assert decision.changes["state"] == "rejected"
        assert decision.changes["reason"] == "dead-lettered by admin: why"


def test_redeliver_of_a_due_message_changes_nothing_and_claimed_ones_are_left_alone() -> None:
    due = replace(ENTRY, due_at_ms=NOW - 1)
    assert decide_action(due, request(ActionKind.REDELIVER), NOW).outcome is ActionOutcome.UNCHANGED
    claimed = replace(ENTRY, claim_token=ROUND, due_at_ms=NOW + 1000)
    for action in ActionKind:
        assert decide_action(claimed, request(action), NOW).outcome is ActionOutcome.CONFLICT
    stale = replace(ENTRY, claim_token=ROUND, due_at_ms=NOW - 1000)  # its replica died
    assert decide_action(stale, request(ActionKind.ACK), NOW).outcome is ActionOutcome.APPLIED


def test_message_ids() -> None:
    assert parse_message_id("billing/orders/3/42") == ("billing", "orders", 3, 42)
    assert parse_message_id("team/a/b/orders/3/42") == ("team/a/b", "orders", 3, 42)
    assert format_message_id(("team/a/b", "orders", 3, 42)) == "team/a/b/orders/3/42"
    for bad in (
        "orders/3/42",
        "g/orders/x/1",
        "g/bad topic/0/1",
        "/orders/0/1",
        "g/t/0/-1",
        f"g/t/{2**31}/1",
        f"g/t/0/{2**63}",
        "g\x00/t/0/1",
        "g/t/\uff10/1",  # a non-ASCII digit
    ):
        with pytest.raises(ApiError) as caught:
            parse_message_id(bad)
        assert caught.value.status == 422


KEY_SHAPE = (str, str, int, int)


def test_cursors_belong_to_their_query() -> None:
    cursor = encode_cursor(["billing", "orders", 3, 42], "q1")
    assert decode_cursor(cursor, "q1", KEY_SHAPE) == ["billing", "orders", 3, 42]
    assert set(cursor) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
    for bad, query in ((cursor, "q2"), ("%%%", "q1"), ("e30", "q1")):
        with pytest.raises(ApiError):
            decode_cursor(bad, query, KEY_SHAPE)


def test_a_cursor_holds_only_what_a_page_could_have_ended_on() -> None:
    """A forged cursor of the right query is refused (422) when a value could not be a row's:
    an integer past 64 bits (the database would overflow: a 500), a bool, a string with NUL
    or longer than any name, a value too many or too few."""
    good = ["billing", "orders", 3, 2**63 - 1]
    assert decode_cursor(encode_cursor(good, "q"), "q", KEY_SHAPE) == good
    assert decode_cursor(encode_cursor([-(2**63)], "q"), "q", (int,)) == [-(2**63)]
    for position in (
        ["billing", "orders", 3, 2**63],
        ["billing", "orders", 3, -(2**63) - 1],
        ["billing", "orders", True, 1],
        ["billing", "orders", 3, 1.5],
        ["bill\x00ing", "orders", 3, 1],
        ["b" * 1025, "orders", 3, 1],
        ["billing", 7, 3, 1],
        ["billing", "orders", 3],
        ["billing", "orders", 3, 1, 1],
    ):
        with pytest.raises(ApiError) as caught:
            decode_cursor(encode_cursor(position, "q"), "q", KEY_SHAPE)
        assert caught.value.status == 422
        assert "invalid cursor" in str(caught.value.detail)


def test_bytes_preview() -> None:
    assert bytes_preview(None, 10) is None
    text = bytes_preview("héllo\nworld".encode(), 2)  # cuts é in half: dropped
    assert text is not None
    assert (text.encoding, text.data, text.size, text.truncated) == ("utf-8", "h", 12, True)
    control = bytes_preview(b"a\x00b", 10)
    assert control is not None
    assert control.encoding == "base64"
    assert base64.b64decode(control.data) == b"a\x00b"
    invalid = bytes_preview(b"\xff\xfe", 1)
    assert invalid is not None
    assert (invalid.encoding, base64.b64decode(invalid.data), invalid.truncated) == (
        "base64",
        b"\xff",
        True,
    )


def test_counter_rates_cover_the_window() -> None:
    registry = CollectorRegistry()
    counter = Counter("x_total", "x", ["topic"], registry=registry)
    now = [0.0]
    rates = CounterRates(counter, clock=lambda: now[0], every_seconds=5)
    assert rates.increase("orders", 60) == (None, 0.0)
    for _ in range(24):  # two minutes, 10 per 5 s
        now[0] += 5
        counter.labels("orders").inc(10)
        rates.sample()
    increase, covered = rates.increase("orders", 60)
    assert covered == 60
    assert increase == 120
    assert rates.increase("other", 60) == (0.0, 60)


def test_every_model_has_examples_that_validate() -> None:
    """The OpenAPI schema shows an example for every model, and each one is valid."""
    checked = 0
    for name in dir(models):
        model = getattr(models, name)
        if not (
            isinstance(model, type)
            and issubclass(model, BaseModel)
            and model.__module__.startswith(f"{models.__name__}.")
        ):
            continue
        extra = model.model_config.get("json_schema_extra")
        assert isinstance(extra, dict), f"{name} has no examples"
        examples = extra["examples"]
        assert isinstance(examples, list)
        assert examples, f"{name} has no examples"
        for example in examples:
            model.model_validate(example)
        checked += 1
    assert checked >= 30


#: The models of request bodies (the sidecar's batch is checked through MarkerIn).
REQUEST_MODELS = [
    models.ActionBody,
    models.ExtendBody,
    models.DeadLetterFilterBody,
    models.RedriveCreate,
    models.MarkerIn,
]


def _wrong_input(prop: dict[str, Any]) -> tuple[Any, str, tuple[int, ...]] | None:
    """For a property of a request body: a value a client gets wrong, pydantic's error type
    for it, and where under the field the error is (a list's first item)."""
    branches = [b for b in prop.get("anyOf", [prop]) if b.get("type") != "null"]
    if len(branches) != 1:
        return None
    (schema,) = branches
    kind = schema.get("type")
    if kind == "array" and schema["items"].get("type") == "integer":
        return ["1"], "int_type", (0,)
    if kind in ("integer", "number", "boolean"):
        expected = {"integer": "int_type", "number": "float_type", "boolean": "bool_type"}[kind]
        # "x1", not "1": a Kafka position may come as digits (api.models._int64_text).
        return "x1", expected, ()
    if kind == "string" and schema.get("format") == "date-time":
        return "2026-01-01T00:00:00", "timezone_aware", ()
    if kind == "string" and "maxLength" in schema:
        return "x" * (schema["maxLength"] + 1), "string_too_long", ()
    return None


@pytest.mark.parametrize("model", REQUEST_MODELS, ids=lambda m: m.__name__)
def test_request_bodies_check_json_types_text_lengths_and_time_zones(
    model: type[BaseModel],
) -> None:
    """Every field of every request body: a number or flag sent as a string is refused (not
    coerced), a text over its limit is "at most N characters" (not "items"), a time needs a
    zone. New fields are covered as they come."""
    extra = model.model_config.get("json_schema_extra")
    assert isinstance(extra, dict)
    examples = extra["examples"]
    assert isinstance(examples, list)
    base = examples[0]
    assert isinstance(base, dict)
    checked = 0
    for name, prop in model.model_json_schema()["properties"].items():
        wrong = _wrong_input(prop)
        if wrong is None:
            continue
        value, expected, under = wrong
        with pytest.raises(ValidationError) as caught:
            model.model_validate({**base, name: value})
        found = [e for e in caught.value.errors() if e["loc"] == (name, *under)]
        assert [e["type"] for e in found] == [expected], (name, caught.value.errors())
        if expected == "string_too_long":
            assert "characters" in found[0]["msg"]
        checked += 1
    assert checked, f"{model.__name__}: no field checked"


def test_validation_errors_are_said_for_people() -> None:
    def said(err: dict[str, Any]) -> dict[str, Any]:
        return _item({"loc": ("body", "x"), "input": "", "ctx": {}, **err})

    naive = said({"type": "timezone_aware", "msg": "Input should have timezone info"})
    assert naive["msg"].startswith("Input should have timezone info: add Z (UTC) or an offset")
    assert models.EXAMPLE_TIME in naive["msg"]
    garbled = said({"type": "datetime_from_date_parsing", "msg": "Input should be a valid date"})
    assert "with a timezone" in garbled["msg"]
    nul = said(
        {
            "type": "string_pattern_mismatch",
            "msg": "String should match pattern",
            "ctx": {"pattern": models.TEXT_PATTERN},
        }
    )
    assert nul["msg"] == "must not contain NUL characters"
    # A length checked after a validator: pydantic says items; for a string we say characters.
    long = said(
        {
            "type": "too_long",
            "msg": "Value should have at most 10 items after validation, not 11",
            "input": "x" * 11,
            "ctx": {"field_type": "Value", "max_length": 10, "actual_length": 11},
        }
    )
    assert long == {
        "loc": ["body", "x"],
        "msg": "String should have at most 10 characters",
        "type": "string_too_long",
    }
    short = said({"type": "too_short", "msg": "", "input": "", "ctx": {"min_length": 1}})
    assert short["msg"] == "String should have at least 1 character"
    items = said({"type": "too_long", "msg": "List should have at most 1 item", "input": [1, 2]})
    assert items["msg"] == "List should have at most 1 item"
    assert said({"type": "value_error", "msg": "Value error, bad"})["msg"] == "bad"


def test_json_content_types() -> None:
    for json in ("application/json", "Application/JSON; charset=utf-8", "application/x+json"):
        assert _is_json(json), json
    for other in (None, "", "text/plain", "application/x-www-form-urlencoded", "text/json"):
        assert not _is_json(other), other


def test_the_http_port_is_taken_at_once_so_a_second_tracker_fails_fast() -> None:
    """Bound *and* listening: a second process cannot bind the same port meanwhile."""
    from api.server import ApiServerError, bind_http  # noqa: PLC0415

    first = bind_http("127.0.0.1", 0)
    try:
        port = first.getsockname()[1]
        with pytest.raises(ApiServerError, match=f"cannot listen on 127.0.0.1:{port}"):
            bind_http("127.0.0.1", port).close()
    finally:
        first.close()
