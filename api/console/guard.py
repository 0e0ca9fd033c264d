"""Who is using the console, and the errors its pages answer with (HTML, never JSON).

Pages need a session (see :mod:`.session`), except when the API has no token at all: reads are
open then, as they are for the API, and nothing can be changed. Form posts need the admin
role, the session's CSRF token, and, when the browser sends one, an Origin of the console's
own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from typing import Annotated, Any
from urllib.parse import quote, urlsplit

from fastapi import Depends, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import RedirectResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError

from tracker.kafka.original_records import OriginalsUnavailable
from tracker.store import StoreUnavailable

from ..context import ApiContext
from ..deps import get_context
from ..http_errors import ApiError
from ..security import Principal, Role
from .render import render
from .session import COOKIE, ConsoleSession, csrf_matches, read_session

LOGIN = "/console/login"
#: Recorded as the actor of what an operator does in the console (actions, redrive jobs).
CONSOLE_ACTOR = "admin (console)"


class LoginRequired(Exception):
    """No valid session: the browser is sent to the login page (and back afterwards)."""


class ConsoleError(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


def open_reads(context: ApiContext) -> bool:
    """No token is configured: reads are open (and mutations refused), as in the API."""
    settings = context.settings
    return settings.api_token is None and settings.api_read_token is None


def signed_session(request: Request) -> ConsoleSession:
    """The session the request's cookie stands for, by its signature and expiry alone."""
    context = get_context(request)  # its 503 while starting is shown as the error page
    if open_reads(context):
        return ConsoleSession(Role.ANONYMOUS, 0, "")
    session = read_session(context.settings, request.cookies.get(COOKIE), int(time.time()))
    if session is None:
        raise LoginRequired
    return session


async def current_session(request: Request) -> ConsoleSession:
    """The request's session, unless it was logged out (on any replica)."""
    session = signed_session(request)
    if session.nonce and await get_context(request).logouts.ended(session.nonce):
        raise LoginRequired
    return session


def actor(request: Request, session: ConsoleSession, csrf: str | None) -> Principal:
    """The principal of a form post, after the checks every mutation needs."""
    origin = request.headers.get("origin")
    if origin is not None and not _same_host(origin, request):
        raise ConsoleError(403, "this form was posted from another site")
    if session.role is not Role.ADMIN:
        raise ConsoleError(403, "this login may only read; actions need the admin token")
    if not csrf_matches(session, csrf):
        raise ConsoleError(403, "the form has expired or did not come from the console; reload")
    return Principal(CONSOLE_ACTOR, Role.ADMIN)


def _same_host(origin: str, request: Request) -> bool:
    """The post comes from a page of this host. The scheme is not compared: behind a
    TLS-terminating proxy the browser's origin is https while the app sees http."""
    return urlsplit(origin).netloc.lower() == request.url.netloc.lower()


def safe_next(target: str | None) -> str:
    """Where to go after logging in: a console path only (never another site)."""
    if (
        target
        and target.startswith("/console/")
        and not target.startswith("/console//")
        and not any(ch in target for ch in "\\\r\n")
    ):
        return target
    return "/console/"


def _login_redirect(request: Request) -> Response:
    here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    if request.method != "GET":
        here = "/console/"  # a form post cannot be replayed as a GET after logging in
    elif request.headers.get("hx-request"):
        # A refresh or a fragment (a message's Kafka part): back to the page that asked.
        shown = urlsplit(request.headers.get("hx-current-url", ""))
        here = shown.path + (f"?{shown.query}" if shown.query else "") or "/console/"
    target = f"{LOGIN}?next={quote(safe_next(here), safe='')}"
    if request.headers.get("hx-request"):
        # A background refresh: have htmx load the login page, not swap it into a section.
        return Response(status_code=200, headers={"HX-Redirect": target})
    return RedirectResponse(target, status_code=303)


def _error_page(request: Request, status: int, detail: str) -> Response:
    # The signature alone: the error may be the database's, which a logout check needs. The
    # page shows no data, only the error and the menu the session's role would see.
    try:
        session: ConsoleSession | None = signed_session(request)
    except (LoginRequired, ApiError):
        session = None
    return render(request, "error.html", session, status_code=status, status=status, detail=detail)


#: What the console's handlers depend on: the app's context and the caller's session.
Context = Annotated[ApiContext, Depends(get_context)]
Session = Annotated[ConsoleSession, Depends(current_session)]


class ConsoleRoute(APIRoute):
    """Routes whose errors are pages: a login redirect, or the error page with the API's
    own sentence (a 404, a 409 of an action, a 422 of a form, the database away)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def console_handler(request: Request) -> Response:
            try:
                return await handler(request)
            except LoginRequired:
                return _login_redirect(request)
            except ConsoleError as exc:
                return _error_page(request, exc.status, exc.detail)
            except ApiError as exc:
                return _error_page(request, exc.status, exc.detail)
            except ValidationError as exc:
                return _error_page(
                    request,
                    422,
                    f"invalid input: {exc.error_count()} error(s): {exc.errors()[0]['msg']}",
                )
            except RequestValidationError as exc:
                problems = "; ".join(
                    f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'request'}: {e['msg']}"
                    for e in exc.errors()
                )
                return _error_page(request, 422, f"invalid request: {problems}")
            except StoreUnavailable as exc:
                return _error_page(request, 503, f"the database is unavailable: {exc}")
            except OriginalsUnavailable as exc:
                return _error_page(request, 503, f"Kafka did not answer: {exc}")

        return console_handler
