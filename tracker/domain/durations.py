"""Durations as settings and policies spell them: ``30``, ``500ms``, ``5m``, ``7d``, ``PT30S``.

``Duration`` is the pydantic type of every duration field, in the tracker's settings and in a
topic's policy alike, so that both accept the same forms and refuse the same mistakes.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_HUMAN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")


_DURATION_FORMS = "seconds (30, 0.5), 500ms, 30s, 5m, 2h, 7d, or ISO 8601 (PT30S)"


def _parse_duration(value: Any) -> Any:
    """Accept seconds (``30``, ``"0.5"``) and ``500ms``/``30s``/``5m``/``2h``/``7d`` as well
    as everything pydantic accepts for ``timedelta`` (ISO 8601 ``PT30S``, ``HH:MM:SS``).

    Anything else is refused with the accepted forms, not with pydantic's ISO 8601 wording,
    which confuses someone who wrote ``banana`` or ``-5``.
    """
    if isinstance(value, str):
        match = _HUMAN.match(value)
        if match:
            return timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2) or "s"])
        text = value.strip()
        if not (text.upper().startswith("P") or ":" in text):
            raise ValueError(f"{value!r} is not a duration; use {_DURATION_FORMS}")
    return value


def _not_negative(value: timedelta) -> timedelta:
    if value < timedelta(0):
        raise ValueError(f"a duration must not be negative; use {_DURATION_FORMS}")
    return value


#: A duration field of settings and policies; :func:`_parse_duration` lists the accepted forms.
Duration = Annotated[timedelta, BeforeValidator(_parse_duration), AfterValidator(_not_negative)]
