"""What every area of the console's pages shares: who reads, how many rows, form tokens.

Apart from the page modules so that each area (overview, topic, message, dead letters) can
use it without importing another area.
"""

from __future__ import annotations

import secrets

from ..security import Principal
from .session import ConsoleSession

#: Rows per page of the message and dead-letter listings.
PAGE_SIZE = 50


def reader(session: ConsoleSession) -> Principal:
    return Principal(session.role.value, session.role)


def form_token() -> str:
    """An Idempotency-Key for one rendered form: submitting it twice acts once."""
    return "console-" + secrets.token_urlsafe(18)
