"""Logging setup: plain text for people, JSON lines for log pipelines."""

from __future__ import annotations

import copy
import json
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TextIO

from tracker.logsafety import safe_field, scrub


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and any ``extra`` fields."""

    _STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": scrub(record.getMessage()),
        }
        for key, value in record.__dict__.items():
            if key not in self._STANDARD and not key.startswith("_"):
                out[key] = safe_field(key, value)
        if record.exc_info:
            out["exception"] = scrub(self.formatException(record.exc_info))
        return json.dumps(out, ensure_ascii=False)


class RepeatLimiter:
    """Lets one record of a kind through per ``interval``, and says how many it held back.

    A kind is the logger and the message template (not its arguments). aiokafka logs every
    failed connection attempt, a few per second and per broker while one is away: an outage of
    minutes grew a tracker's log by thousands of identical lines, burying the few that say
    what happened. Only loggers under ``prefixes`` are limited; the tracker's own lines are
    written to be few.
    """

    def __init__(
        self,
        interval: float = 60.0,
        *,
        prefixes: tuple[str, ...] = ("aiokafka",),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._interval = interval
        self._prefixes = prefixes
        self._clock = clock
        #: per kind: (clock time, wall time) of the last record let through
        self._last: dict[tuple[str, object], tuple[float, float]] = {}
        self._held: dict[tuple[str, object], int] = {}

    def admit(self, record: logging.LogRecord) -> str | None:
        """None: hold ``record`` back. Else a suffix for its message ("" for none)."""
        if not record.name.startswith(self._prefixes):
            return ""
        kind = (record.name, record.msg)
        now = self._clock()
        last = self._last.get(kind)
        if last is not None and now - last[0] < self._interval:
            self._held[kind] = self._held.get(kind, 0) + 1
            return None
        self._last[kind] = (now, record.created)
        held = self._held.pop(kind, 0)
        if not held or last is None:
            return ""
        since = datetime.fromtimestamp(last[1], UTC).strftime("%H:%M:%S")
        return f" (and {held} more like it since {since} UTC)"


class LimitedStreamHandler(logging.StreamHandler[TextIO]):
    """A stream handler that writes what a :class:`RepeatLimiter` admits.

    The count goes on a copy of the record: other handlers of the same record (a test's
    capture, a second sink) see it as it was logged.
    """

    def __init__(self, limiter: RepeatLimiter | None = None) -> None:
        super().__init__()
        self.limiter = limiter or RepeatLimiter()

    def emit(self, record: logging.LogRecord) -> None:
        suffix = self.limiter.admit(record)
        if suffix is None:
            return
        if suffix:
            record = copy.copy(record)
            record.msg = f"{record.msg}{suffix}"
        super().emit(record)


def configure_logging(level: str = "INFO", fmt: str = "text") -> None:
    handler = LimitedStreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # aiokafka logs every failed connection attempt at ERROR; ours say what matters.
    logging.getLogger("aiokafka").setLevel(max(logging.WARNING, root.level))
