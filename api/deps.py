"""Request dependencies: the app's context, authentication, and shared parameters."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Query, Request
from fastapi.security import HTTPAuthorizationCredentials

from . import security
from .context import ApiContext
from .http_errors import ApiError
from .security import Principal, bearer_scheme


def get_context(request: Request) -> ApiContext:
    context = getattr(request.app.state, "context", None)
    if not isinstance(context, ApiContext):
        raise ApiError(503, "the API is starting up; try again shortly")
    return context


Context = Annotated[ApiContext, Depends(get_context)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)]


def require_reader(context: Context, credentials: Credentials) -> Principal:
    return security.reader(context.settings, credentials)


def require_admin(context: Context, credentials: Credentials) -> Principal:
    return security.admin(context.settings, credentials)


Reader = Annotated[Principal, Depends(require_reader)]
Admin = Annotated[Principal, Depends(require_admin)]

IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=255,
        pattern=r"^[\x21-\x7e]+$",
        description="Repeat a request safely: the same key with the same request gets the "
        "same answer (printable ASCII, at most 255 characters).",
    ),
]
Limit = Annotated[int, Query(ge=1, le=1000, description="Page size (default 100, at most 1000).")]
Cursor = Annotated[
    str | None,
    Query(
        min_length=1,
        max_length=4000,
        pattern=r"^[A-Za-z0-9_-]+$",
        description="`next_cursor` of the previous page.",
    ),
]
