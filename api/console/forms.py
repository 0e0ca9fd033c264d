"""The console's form posts: log in and out, act on a message, start and cancel redrive jobs.

Every mutation goes through the API's own handler (``api.routes``), so the console enforces
the same rules, records the same audit trail (actor ``admin (console)``) and answers the same
errors. Forms work without JavaScript: a post redirects (303) to the page that shows the
result, so reloading it never posts twice; each rendered form also carries an
Idempotency-Key, so a double click acts once.
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Literal
from urllib.parse import quote

from fastapi import APIRouter, Form, Request, Response
from fastapi.responses import RedirectResponse
from fastapi.security import HTTPAuthorizationCredentials
from pydantic import ValidationError

from .. import models
from ..http_errors import ApiError
from ..message_ids import format_message_id, parse_message_id
from ..routes import message_actions, redrive
from ..security import identify
from .guard import ConsoleError, ConsoleRoute, Context, Session, actor, open_reads, safe_next
from .render import render
from .session import COOKIE, open_session

router = APIRouter(prefix="/console", route_class=ConsoleRoute, include_in_schema=False)

Csrf = Annotated[str | None, Form(max_length=200)]
FormKey = Annotated[str | None, Form(max_length=255, pattern=r"^[\x21-\x7e]+$")]
Text = Annotated[str, Form(max_length=1000)]

#: A wrong token costs this long: guessing tokens through the login form stays slow.
FAILED_LOGIN_DELAY = 1.0


def _see(target: str) -> RedirectResponse:
    return RedirectResponse(target, status_code=303)


@router.get("/login")
async def login_page(request: Request, context: Context, next: str | None = None) -> Response:
    del context  # the page needs no data, but the app must be up
    return render(request, "login.html", None, next=safe_next(next), error=None)


@router.post("/login")
async def login(
    request: Request,
    context: Context,
    token: Annotated[str, Form(max_length=4096)],
    next: Annotated[str | None, Form(max_length=4000)] = None,
) -> Response:
    settings = context.settings
    if open_reads(context):
        return _see(safe_next(next))  # reads are open; there is nothing to log in to
    try:
        role = identify(settings, HTTPAuthorizationCredentials(scheme="Bearer", credentials=token))
    except ApiError:
        await asyncio.sleep(FAILED_LOGIN_DELAY)
        return render(
            request,
            "login.html",
            None,
            status_code=401,
            next=safe_next(next),
            error="That token is not valid for this tracker.",
        )
    cookie, _ = open_session(settings, role, int(time.time()))
    response = _see(safe_next(next))
    response.set_cookie(
        COOKIE,
        cookie,
        max_age=int(settings.console_session.total_seconds()),
        path="/console",
        # Behind a TLS-terminating proxy the app sees http; the proxy's header says https.
        secure=request.url.scheme == "https"
        or request.headers.get("x-forwarded-proto", "").lower() == "https",
        httponly=True,
        samesite="strict",
    )
    return response


@router.post("/logout")
async def logout(context: Context, session: Session, csrf: Csrf = None) -> Response:
    # No CSRF proof needed: a forged post could only end the victim's own session.
    del csrf
    if session.nonce:  # (no token configured: there is no session to end)
        # Recorded first: if the database is away, the error page says so, the cookie stays,
        # and the operator can try again rather than believe a copy of it is dead.
        await context.logouts.record(session.nonce, session.expires_s, int(time.time()))
    response = _see("/console/login")
    response.delete_cookie(COOKIE, path="/console", httponly=True, samesite="strict")
    return response


@router.post("/actions/{action}")
async def act(
    *,
    request: Request,
    context: Context,
    session: Session,
    action: Literal["redeliver", "extend", "ack", "dead_letter"],
    message_id: Annotated[str, Form(max_length=2000)],
    csrf: Csrf = None,
    idempotency_key: FormKey = None,
    reason: Text = "",
    extend_minutes: Annotated[float | None, Form(gt=0, le=7 * 24 * 60)] = None,
) -> Response:
    principal = actor(request, session, csrf)
    key = parse_message_id(message_id)
    canonical = format_message_id(key)
    body = models.ActionBody(reason=reason) if reason else None
    common = {
        "message_id": canonical,
        "context": context,
        "principal": principal,
        "idempotency_key": idempotency_key,
    }
    if action == "redeliver":
        await message_actions.redeliver(**common, body=body)  # type: ignore[arg-type]
    elif action == "ack":
        await message_actions.ack(**common, body=body)  # type: ignore[arg-type]
    elif action == "dead_letter":
        await message_actions.dead_letter(**common, body=body)  # type: ignore[arg-type]
    else:
        if extend_minutes is None:
            raise ConsoleError(422, "say by how many minutes to extend the lease")
        extend = models.ExtendBody(by_ms=round(extend_minutes * 60_000), reason=reason)
        await message_actions.extend(**common, body=extend)  # type: ignore[arg-type]
    return _see(f"/console/messages/{quote(canonical, safe='/')}?done={action}")


@router.post("/redrive")
async def start_redrive(
    *,
    request: Request,
    context: Context,
    session: Session,
    csrf: Csrf = None,
    idempotency_key: FormKey = None,
    topic: Annotated[str, Form(max_length=249)] = "",
    group: Annotated[str, Form(max_length=255)] = "",
    reason_filter: Text = "",
    key_filter: Annotated[str, Form(max_length=4096)] = "",
    ids: Annotated[str, Form(max_length=200_000)] = "",
    target_topic: Annotated[str, Form(max_length=249)] = "",
    rate: Annotated[float, Form(gt=0, le=100_000)] = 100.0,
    dry_run: Annotated[str | None, Form(max_length=10)] = None,
    why: Text = "",
) -> Response:
    principal = actor(request, session, csrf)
    raw: dict[str, object] = {
        "target_topic": target_topic or None,
        "rate": rate,
        "dry_run": dry_run is not None,
        "reason": why,
    }
    if ids.strip():
        try:
            raw["ids"] = [int(part) for part in ids.replace(",", " ").split()]
        except ValueError:
            raise ConsoleError(422, "dead letter ids are whole numbers") from None
    else:
        selection = {"topic": topic, "group": group, "reason": reason_filter, "key": key_filter}
        raw["filter"] = {k: v for k, v in selection.items() if v}
    try:
        body = models.RedriveCreate.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'form'}: {e['msg']}" for e in exc.errors()
        )
        raise ConsoleError(422, f"the redrive form is not valid: {problems}") from None
    job = await redrive.create_job(
        body=body,
        context=context,
        principal=principal,
        response=Response(),
        idempotency_key=idempotency_key,
    )
    return _see(f"/console/redrive/{job.id}")


@router.post("/redrive/{job_id}/cancel")
async def cancel_redrive(
    *,
    request: Request,
    context: Context,
    session: Session,
    job_id: int,
    csrf: Csrf = None,
) -> Response:
    principal = actor(request, session, csrf)
    if not 1 <= job_id <= 2**63 - 1:
        raise ConsoleError(404, f"no redrive job {job_id}")
    await redrive.cancel_job(job_id=job_id, context=context, _=principal)
    return _see(f"/console/redrive/{job_id}")
