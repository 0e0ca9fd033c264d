"""Errors as JSON ``{"error": ..., "detail": ...}`` with the right status, never a stack trace.

Handlers translate the domain's exceptions: an unreachable database or broker is 503 (try
again), invalid input 422 with each problem spelled out, anything unexpected 500 with a
reference to the server log (where the traceback goes, and only there).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tracker.errors import MarkerWriteFailed
from tracker.kafka.original_records import OriginalsUnavailable
from tracker.kafka.topic_admin import KafkaUnavailable
from tracker.store import StoreUnavailable

from .models import EXAMPLE_TIME, TEXT_PATTERN, ErrorResponse

log = logging.getLogger("api")

_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "validation_error",
    429: "too_many_requests",
    500: "internal_error",
    503: "unavailable",
}


def code_for(status: int) -> str:
    return _CODES.get(status) or HTTPStatus(status).phrase.lower().replace(" ", "_")


class ApiError(Exception):
    """An error the API answers with: status, code, and a sentence for people."""

    def __init__(
        self,
        status: int,
        detail: str,
        *,
        error: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.error = error or code_for(status)
        self.headers = dict(headers or {})


def error_response(
    status: int,
    detail: str,
    *,
    error: str | None = None,
    headers: Mapping[str, str] | None = None,
    errors: list[dict[str, Any]] | None = None,
) -> JSONResponse:
    body = ErrorResponse.model_validate(
        {"error": error or code_for(status), "detail": detail, "errors": errors}
    )
    return JSONResponse(
        body.model_dump(mode="json"), status_code=status, headers=dict(headers or {})
    )


def _where(loc: tuple[Any, ...] | list[Any]) -> str:
    return ".".join(str(part) for part in loc) or "request"


#: How to write a time, for the errors about one.
_TIME_EXAMPLES = f"e.g. {EXAMPLE_TIME} or 2026-11-21T10:30:00+01:00"
#: pydantic's error types for a time it could not read.
_TIME_ERRORS = frozenset(
    {"datetime_type", "datetime_parsing", "datetime_from_date_parsing", "datetime_object_invalid"}
)


def _item(err: Mapping[str, Any]) -> dict[str, Any]:
    """One of pydantic's errors as we list it: ``loc``, ``msg`` (said for people), ``type``."""
    loc = [p if isinstance(p, int) else str(p) for p in err.get("loc", ())]
    msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    kind = str(err.get("type", "value_error"))
    ctx = err.get("ctx") or {}
    if kind == "timezone_aware":
        # Every time the API takes needs a zone: a naive one is refused, never guessed.
        msg = f"{msg}: add Z (UTC) or an offset, {_TIME_EXAMPLES}"
    elif kind in _TIME_ERRORS:
        msg = f"{msg}: send an ISO 8601 time with a timezone, {_TIME_EXAMPLES}"
    elif kind == "string_pattern_mismatch" and ctx.get("pattern") == TEXT_PATTERN:
        msg = "must not contain NUL characters"
    elif kind in ("too_long", "too_short") and isinstance(err.get("input"), str):
        # A length checked after a validator is pydantic's generic "items"; for text, say
        # characters (the models check lengths first, so this is only a safety net).
        bound, limit = ("most", "max_length") if kind == "too_long" else ("least", "min_length")
        count = ctx.get(limit)
        unit = "character" if count == 1 else "characters"
        msg = f"String should have at {bound} {count} {unit}"
        kind = f"string_{kind}"
    return {"loc": loc, "msg": msg, "type": kind}


def _is_json(content_type: str | None) -> bool:
    """Whether FastAPI reads a body of this Content-Type as JSON (else it gets the bytes)."""
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


def _validation(exc: RequestValidationError, content_type: str | None = None) -> JSONResponse:
    items = [_item(err) for err in exc.errors()]
    if not _is_json(content_type):
        # FastAPI hands a body of another Content-Type over as bytes, which no model takes:
        # say what is wrong (a 422 like any invalid body; the API never answers 415).
        sent = f"Content-Type {content_type}" if content_type else "no Content-Type"
        for item in items:
            if item["loc"] == ["body"] and item["type"] != "missing":
                item["msg"] = (
                    f"the body must be JSON, sent with Content-Type: application/json "
                    f"(this one has {sent})"
                )
                item["type"] = "content_type"
    summary = "; ".join(f"{_where(i['loc'])}: {i['msg']}" for i in items[:10])
    if len(items) > 10:
        summary += f"; and {len(items) - 10} more"
    return error_response(422, f"invalid request: {summary}", errors=items)


def install_error_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)  # noqa: S101 - registered for ApiError only
        return error_response(exc.status, exc.detail, error=exc.error, headers=exc.headers)

    async def http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)  # noqa: S101
        detail = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        if exc.status_code == 400:
            # FastAPI's answer to a body it cannot decode (not UTF-8 JSON): invalid input
            # like any other, so 422 with our wording.
            return error_response(
                422, f"invalid request: the body could not be read as JSON ({detail})"
            )
        if exc.status_code == 404 and detail == "Not Found":
            detail = "no such endpoint; see /docs for the API"
        return error_response(exc.status_code, detail, headers=exc.headers)

    async def validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)  # noqa: S101
        return _validation(exc, request.headers.get("content-type"))

    async def unavailable(_: Request, exc: Exception) -> JSONResponse:
        what = "database" if isinstance(exc, StoreUnavailable) else "Kafka"
        log.warning("%s unavailable while serving a request: %s", what, exc)
        return error_response(
            503, f"the {what} is unavailable right now; try again shortly ({exc})"
        )

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    for kind in (StoreUnavailable, OriginalsUnavailable, KafkaUnavailable, MarkerWriteFailed):
        app.add_exception_handler(kind, unavailable)


class CatchAllMiddleware:
    """Turns any unexpected exception into a 500 JSON answer and logs it with a reference.

    The traceback goes to the log only; the client gets the reference to find it there.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            reference = uuid.uuid4().hex[:12]
            log.exception(
                "unexpected error serving %s %s (reference %s)",
                scope.get("method"),
                scope.get("path"),
                reference,
            )
            if started:
                return  # the client sees a truncated response; nothing else can be done
            response = error_response(
                500, f"unexpected error; the server log has the details (reference {reference})"
            )
            await response(scope, receive, send)
