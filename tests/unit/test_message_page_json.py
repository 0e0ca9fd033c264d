"""The listing's JSON writer (``api/message_page_json.py``) says what the response model says.

``GET /v1/messages`` writes its pages without :class:`api.models.MessagePage` (the model cost
more CPU than the queries); the OpenAPI document still promises that model. For any entries,
any time and any cursor, the written page and the model's serialization of the same entries
must parse to the same value.
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import TypeAdapter

from api.message_page_json import json_time, message_page_json
from api.models import MessagePage
from api.views import message_summary_data
from tracker.clock import from_millis
from tracker.domain.entries import Entry, State
from tracker.store.admin_reads import EntryView

pytestmark = [pytest.mark.unit]

#: from 1900 to 2200 (what ``datetime`` and the store's times can hold, and then some)
millis = st.integers(-2_208_988_800_000, 7_258_118_400_000)
#: names and texts as they reach the store: any Unicode, quotes, controls, separators
text = st.text(max_size=40)
non_negative = st.integers(0, 2**63 - 1)

entries = st.builds(
    Entry,
    group_id=text,
    origin_topic=text,
    origin_partition=st.integers(0, 2**31 - 1),
    origin_offset=non_negative,
    markers_partition=st.integers(0, 2**31 - 1),
    state=st.sampled_from(State),
    attempt=st.integers(1, 0xFFFF),
    copy_topic=text,
    copy_partition=st.integers(0, 2**31 - 1),
    copy_offset=non_negative,
    due_at_ms=st.none() | millis,
    first_seen_ms=millis,
    updated_ms=millis,
    deferred=st.booleans(),
    consumer=text,
    reason=st.text(max_size=300),
    keep_payload=st.booleans(),
    claim_token=st.none() | st.text(min_size=1, max_size=8),
)
views = st.builds(EntryView, entries, st.booleans())


def _as_the_model_writes_it(
    page: list[EntryView], now_ms: int, cursor: str | None, limit: int
) -> object:
    data = {
        "items": [message_summary_data(view, now_ms) for view in page],
        "next_cursor": cursor,
        "limit": limit,
    }
    return json.loads(MessagePage.model_validate(data).model_dump_json())


@given(
    page=st.lists(views, max_size=6),
    now_ms=millis,
    cursor=st.none() | text,
    limit=st.integers(1, 1000),
)
def test_a_written_page_is_the_models_page(
    page: list[EntryView], now_ms: int, cursor: str | None, limit: int
) -> None:
    written = message_page_json(page, now_ms, cursor, limit)
    assert json.loads(written) == _as_the_model_writes_it(page, now_ms, cursor, limit)


@given(ms=millis)
def test_times_are_written_as_pydantic_writes_them(ms: int) -> None:
    """Same text, not only the same instant: clients compare and sort these strings."""
    assert json.loads(json_time(ms)) == TypeAdapter(datetime).dump_python(
        from_millis(ms), mode="json"
    )


def test_a_message_being_republished_is_one_claimed_and_not_yet_due_again() -> None:
    base = Entry("g", "t", 0, 1, 0, State.IN_FLIGHT, 1, "t", 0, 1, 2_000, 1_000, 1_000)
    claimed = EntryView(replace(base, claim_token="round-1"), False)  # noqa: S106 - a round id
    for now_ms, expected in ((1_999, True), (2_000, False)):
        (item,) = json.loads(message_page_json([claimed], now_ms, None, 1))["items"]
        assert item["being_republished"] is expected
    (item,) = json.loads(message_page_json([EntryView(base, True)], 0, None, 1))["items"]
    assert (item["being_republished"], item["payload_kept"]) == (False, True)
