"""Hypothesis strategies for markers of both protocol versions (valid by construction)."""

from __future__ import annotations

from hypothesis import strategies as st

from tracker.ids import MessageId
from tracker.protocol import MAX_DELAY_MS, MAX_TIMEOUT_MS, Marker, MarkerKind
from tracker.protocol_v2 import MAX_RANGE_WIDTH, RangeKind, RangeMarker

topics = st.from_regex(r"[a-zA-Z0-9._-]{1,249}", fullmatch=True).filter(
    lambda t: t not in {".", ".."}
)


def _no_nul(text: str) -> str:
    """Markers refuse U+0000 in their text (tracker/protocol_text.py: decode_text)."""
    return text.replace("\x00", "?")


texts = (
    st.text(max_size=40)
    .map(_no_nul)
    .filter(lambda s: len(s.encode("utf-8", "surrogatepass")) <= 255)
)
safe_texts = texts.filter(lambda s: not any(0xD800 <= ord(c) <= 0xDFFF for c in s))
groups = safe_texts.filter(lambda s: 0 < len(s.encode()) <= 255)
message_ids = st.builds(MessageId, topics, st.integers(0, 2**31 - 1), st.integers(0, 2**63 - 1))


@st.composite
def markers(draw: st.DrawFn) -> Marker:
    kind = draw(st.sampled_from(MarkerKind))
    group = draw(groups)
    message = draw(message_ids)
    origin = draw(st.one_of(st.none(), message_ids.filter(lambda o: o != message)))
    attempt = 1 if origin is None else draw(st.integers(1, 0xFFFF))
    if kind is MarkerKind.START:
        return Marker.start(
            group,
            message,
            attempt=attempt,
            origin=origin,
            timeout_ms=draw(st.integers(0, MAX_TIMEOUT_MS)),
            consumer=draw(safe_texts),
        )
    if kind is MarkerKind.ACK:
        return Marker.ack(group, message, attempt=attempt, origin=origin)
    if kind is MarkerKind.DELAY:
        return Marker.delay(
            group,
            message,
            attempt=attempt,
            origin=origin,
            delay_ms=(delay := draw(st.one_of(st.none(), st.integers(0, MAX_DELAY_MS)))),
            reason=draw(safe_texts),
            deferred=delay is not None and draw(st.booleans()),
        )
    if kind is MarkerKind.EXTEND:
        return Marker.extend(
            group,
            message,
            attempt=attempt,
            origin=origin,
            timeout_ms=draw(st.integers(1, MAX_TIMEOUT_MS)),
        )
    return Marker.reject(group, message, attempt=attempt, origin=origin, reason=draw(safe_texts))


@st.composite
def range_markers(draw: st.DrawFn) -> RangeMarker:
    kind = draw(st.sampled_from(RangeKind))
    first = draw(st.integers(0, 2**63 - 1 - MAX_RANGE_WIDTH))
    width = draw(st.one_of(st.integers(1, 64), st.integers(1, MAX_RANGE_WIDTH)))
    full = (1 << width) - 1
    exceptions = draw(st.one_of(st.just(0), st.integers(0, full - 1)))
    timeout = 0
    if kind is RangeKind.RANGE_START:
        timeout = draw(st.integers(0, 2**32 - 1))
    elif kind is RangeKind.RANGE_EXTEND:
        timeout = draw(st.integers(1, 2**32 - 1))
    consumer = draw(st.text(max_size=20).map(_no_nul)) if kind is RangeKind.RANGE_START else ""
    return RangeMarker(
        kind,
        draw(st.text(min_size=1, max_size=20).map(_no_nul)),
        draw(
            st.from_regex(r"[a-zA-Z0-9._-]{1,40}", fullmatch=True).filter(
                lambda t: t not in (".", "..")
            )
        ),
        draw(st.integers(0, 2**31 - 1)),
        first,
        first + width - 1,
        exceptions,
        timeout,
        consumer,
    )
