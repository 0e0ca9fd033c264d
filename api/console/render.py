"""Rendering console pages: one Jinja2 environment, autoescaped, with the console's filters.

Every value shown comes from Kafka or from operators (topic names, keys, headers, payloads,
reasons): autoescaping is on for every template, no template marks a value ``|safe``, and
values that go into attributes are quoted. Payload previews are rendered as text, JSON
pretty-printed, or a hex dump: never as markup.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote, urlencode

import jinja2
from fastapi import Request
from fastapi.responses import HTMLResponse

from ..models import BytesPreview
from .session import ConsoleSession

#: Bytes of a hex dump shown at most (the preview itself is capped by the API).
HEX_DUMP_BYTES = 4096
#: Shown for a value that is not known or not set.
DASH = "\u2013"

_env = jinja2.Environment(
    loader=jinja2.PackageLoader("api.console", "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)


def _when(value: datetime | None) -> str:
    if value is None:
        return DASH
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _ms_when(value: int | None) -> str:
    return _when(datetime.fromtimestamp(value / 1000, UTC) if value is not None else None)


def duration(seconds: float | None) -> str:
    """``3 h 12 min``-style: what an operator reads at a glance."""
    if seconds is None:
        return DASH
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes = seconds / 60
    if minutes < 90:
        return f"{minutes:.0f} min"
    hours = minutes / 60
    if hours < 48:
        return f"{int(hours)} h {int(minutes % 60)} min"
    return f"{hours / 24:.1f} d"


def _number(value: float | int | None) -> str:
    if value is None:
        return DASH
    if isinstance(value, float) and not value.is_integer():
        return f"{value:,.1f}"
    return f"{int(value):,}"


def printable(data: bytes) -> str:
    """``data`` as ASCII, a dot for every byte that is not printable."""
    return "".join(chr(b) if 0x20 <= b < 0x7F else "." for b in data)


def hex_dump(data: bytes, limit: int = HEX_DUMP_BYTES) -> str:
    """Offset, 16 bytes in hex, and their printable ASCII, per line (like ``xxd``)."""
    lines = []
    for start in range(0, min(len(data), limit), 16):
        chunk = data[start : start + 16]
        hexed = " ".join(f"{b:02x}" for b in chunk)
        lines.append(f"{start:08x}  {hexed:<47}  {printable(chunk)}")
    if len(data) > limit:
        lines.append(f"… {len(data) - limit:,} more bytes")
    return "\n".join(lines)


def shown_bytes(preview: BytesPreview | None) -> dict[str, Any]:
    """How to show a preview: ``{"kind": "text"|"json"|"hex"|"none", "text": ...}``."""
    if preview is None:
        return {"kind": "none", "text": "", "size": 0, "truncated": False}
    base = {"size": preview.size, "truncated": preview.truncated}
    if preview.encoding == "base64":
        raw = base64.b64decode(preview.data)
        return {"kind": "hex", "text": hex_dump(raw), **base}
    if not preview.truncated:
        try:
            parsed = json.loads(preview.data)
        except (ValueError, RecursionError):  # not JSON, or nested deeper than Python parses
            pass
        else:
            if isinstance(parsed, dict | list):
                return {"kind": "json", "text": json.dumps(parsed, indent=2), **base}
    return {"kind": "text", "text": preview.data, **base}


def _query(params: Mapping[str, Any], **changes: Any) -> str:
    """``?a=1&b=2`` from ``params`` with ``changes`` (None drops a parameter)."""
    merged = {k: v for k, v in {**params, **changes}.items() if v not in (None, "", [])}
    return "?" + urlencode(merged, doseq=True) if merged else ""


def _path(value: str) -> str:
    """A path segment (or a message id with its slashes) percent-encoded for a URL."""
    return quote(value, safe="/")


_env.filters.update(
    when=_when,
    ms_when=_ms_when,
    duration=duration,
    number=_number,
    shown=shown_bytes,
    path=_path,
)
_env.globals.update(query=_query)


def render(
    request: Request,
    template: str,
    session: ConsoleSession | None,
    *,
    status_code: int = 200,
    **values: Any,
) -> HTMLResponse:
    """The page ``template`` with ``values``, the session (role, CSRF token) and the request."""
    page = _env.get_template(template).render(
        request=request,
        session=session,
        nav=values.pop("nav", ""),
        **values,
    )
    return HTMLResponse(page, status_code=status_code)
