"""One router per resource; ``errors(...)`` documents the error answers of an operation."""

from __future__ import annotations

from typing import Any

from ..models import ErrorResponse

_DESCRIPTIONS = {
    401: "Missing or invalid bearer token.",
    403: "The read-only token cannot do this.",
    404: "Not found.",
    409: "Conflicts with the current state.",
    413: "Request body too large.",
    422: "Invalid parameters or body (each problem is listed).",
    500: "Unexpected error (see the server log with the reference given).",
    503: "Database or Kafka unavailable, or mutations disabled (no admin token configured).",
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for these error codes (plus 500, which any operation may give)."""
    return {
        code: {"model": ErrorResponse, "description": _DESCRIPTIONS[code]}
        for code in sorted({*codes, 500})
    }


READ_ERRORS = (401, 422, 503)
WRITE_ERRORS = (401, 403, 413, 422, 503)
