"""Console logins: a signed session cookie instead of the token, and CSRF tokens for forms.

An operator logs in with the admin or the read token. The browser then keeps only a cookie
(``HttpOnly``, ``SameSite=Strict``, ``Secure`` over HTTPS) that says which role it is for and
until when, signed with HMAC-SHA256 under a key derived from *that role's token*:

* no token is ever stored in the browser, put in a URL or written to a log;
* every replica that has the same tokens accepts the cookie (no session is kept server-side,
  so API-only replicas behind a load balancer need no session store of their own);
* rotating a token ends every session opened with it, at once, on every replica;
* logging out ends that session on every replica, also for a copy of the cookie kept elsewhere:
  the one thing kept server-side is the list of sessions logged out before their expiry
  (``tracker/store/console_logouts.py``), checked on every request.

Each session carries a random nonce; the CSRF token of its forms is an HMAC of that nonce
under the same key. A form post must carry it (and a cross-site post cannot, as the page that
holds it cannot be read cross-origin), on top of ``SameSite=Strict`` and an Origin check.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from dataclasses import dataclass

from pydantic import SecretStr

from tracker.settings import TrackerSettings

from ..security import Role

COOKIE = "kmq_console"
#: Prefix of the signed payload: a format change bumps it, and old cookies then fail to verify.
_VERSION = "v1"


@dataclass(frozen=True, slots=True)
class ConsoleSession:
    """A verified login: who (role), until when, and the CSRF token of its forms."""

    role: Role
    expires_s: int
    csrf: str
    #: The session's random id: what a logout records (``tracker/store/console_logouts.py``).
    nonce: str = ""

    @property
    def can_act(self) -> bool:
        return self.role is Role.ADMIN


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _secret_of(settings: TrackerSettings, role: Role) -> SecretStr | None:
    if role is Role.ADMIN:
        return settings.api_token
    if role is Role.READ:
        return settings.api_read_token
    return None


def _key(secret: SecretStr) -> bytes:
    """The signing key of a role: derived from its token, never the token itself."""
    token = secret.get_secret_value().encode("utf-8", "surrogateescape")
    return hmac.new(token, b"kmq-console-session-key", hashlib.sha256).digest()


def _sign(key: bytes, payload: str) -> str:
    return _b64(hmac.new(key, payload.encode("ascii"), hashlib.sha256).digest())


def _csrf(key: bytes, nonce: str) -> str:
    return _sign(key, f"csrf.{nonce}")


def open_session(settings: TrackerSettings, role: Role, now_s: int) -> tuple[str, ConsoleSession]:
    """A new session of ``role``: ``(cookie value, session)``."""
    secret = _secret_of(settings, role)
    if secret is None:
        raise ValueError(f"no token is configured for the role {role.value!r}")
    key = _key(secret)
    expires = now_s + int(settings.console_session.total_seconds())
    nonce = secrets.token_urlsafe(16)
    payload = f"{_VERSION}.{role.value}.{expires}.{nonce}"
    session = ConsoleSession(role, expires, _csrf(key, nonce), nonce)
    return f"{payload}.{_sign(key, payload)}", session


def read_session(
    settings: TrackerSettings, cookie: str | None, now_s: int
) -> ConsoleSession | None:
    """The session ``cookie`` stands for, or None if it is missing, forged, expired, or was
    opened with a token that is no longer configured. (Whether it was logged out is the
    store's to say: :func:`api.console.guard.current_session`.)"""
    if not cookie or len(cookie) > 512 or not cookie.isascii():
        return None
    parts = cookie.split(".")
    if len(parts) != 5 or parts[0] != _VERSION:
        return None
    _, role_name, expires_text, nonce, signature = parts
    try:
        role = Role(role_name)
        expires = int(expires_text)
    except ValueError:
        return None
    secret = _secret_of(settings, role)
    if secret is None:
        return None
    key = _key(secret)
    payload = ".".join(parts[:4])
    if not hmac.compare_digest(_sign(key, payload), signature):
        return None
    if expires <= now_s:
        return None
    return ConsoleSession(role, expires, _csrf(key, nonce), nonce)


def csrf_matches(session: ConsoleSession, given: str | None) -> bool:
    return given is not None and given.isascii() and hmac.compare_digest(session.csrf, given)
