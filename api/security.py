"""Bearer-token authentication of the admin API.

* ``api_token`` (admin) is required for every mutation and accepted for reads.
* ``api_read_token`` (optional) is accepted for reads (GET) only; a mutation with it is 403.
* Reads need a token as soon as either token is configured; with none configured they are open
  (a local setup) while mutations are refused with 503: the API is never writable by default.

Tokens are compared in constant time (``secrets.compare_digest``) against both configured
tokens, whichever matches, and are never logged (settings keep them as ``SecretStr``).
"""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass

from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import SecretStr

from tracker.settings import TrackerSettings

from .http_errors import ApiError

#: The scheme, for the OpenAPI schema; auto_error off so that our errors have our format.
bearer_scheme = HTTPBearer(
    auto_error=False,
    description="`Authorization: Bearer <token>`: the admin token (KMQ_API_TOKEN) for "
    "everything, or the read token (KMQ_API_READ_TOKEN) for GET requests.",
)

_CHALLENGE = {"WWW-Authenticate": "Bearer"}


class Role(enum.StrEnum):
    ADMIN = "admin"
    READ = "read"
    ANONYMOUS = "anonymous"  #: no token configured at all: reads only


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: recorded as the actor of actions and redrive jobs."""

    name: str
    role: Role


def _matches(given: bytes, secret: SecretStr | None) -> bool:
    if secret is None:
        # Compare anyway, so the time taken does not tell which tokens are configured.
        secrets.compare_digest(given, given)
        return False
    return secrets.compare_digest(given, secret.get_secret_value().encode("utf-8"))


def identify(settings: TrackerSettings, credentials: HTTPAuthorizationCredentials | None) -> Role:
    """The role the credentials give (raises 401 for missing or unknown tokens)."""
    if settings.api_token is None and settings.api_read_token is None:
        return Role.ANONYMOUS
    if credentials is None or not credentials.credentials:
        raise ApiError(
            401,
            "missing bearer token: send `Authorization: Bearer <token>`",
            headers=_CHALLENGE,
        )
    given = credentials.credentials.encode("utf-8", "surrogateescape")
    is_admin = _matches(given, settings.api_token)
    is_reader = _matches(given, settings.api_read_token)
    if is_admin:
        return Role.ADMIN
    if is_reader:
        return Role.READ
    raise ApiError(401, "invalid bearer token", headers=_CHALLENGE)


def reader(
    settings: TrackerSettings, credentials: HTTPAuthorizationCredentials | None
) -> Principal:
    role = identify(settings, credentials)
    return Principal(role.value, role)


def admin(settings: TrackerSettings, credentials: HTTPAuthorizationCredentials | None) -> Principal:
    if settings.api_token is None:
        raise ApiError(
            503,
            "mutations are disabled: no admin token is configured (set KMQ_API_TOKEN)",
            error="not_configured",
        )
    role = identify(settings, credentials)
    if role is not Role.ADMIN:
        raise ApiError(403, "this token may only read; mutations need the admin token")
    return Principal(Role.ADMIN.value, Role.ADMIN)
