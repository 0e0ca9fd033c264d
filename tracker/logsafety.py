"""Keep secrets and payloads out of log lines.

Used by the JSON log formatter (:mod:`tracker.logs`) on every structured field (``extra=``)
and on the message text:

* a field whose name says it holds a secret or a payload (``password``, ``token``,
  ``sasl_plain_password``, ``authorization``, ``payload``, ``value``, ...) is replaced by
  ``"[redacted]"``, whatever its value;
* ``pydantic.SecretStr`` values print as ``**********`` on their own;
* credentials in URLs (``postgresql+asyncpg://user:secret@db/kmq``) are masked in any text.

Message identities (``topic/partition/offset``, group, attempt) are not secret and are logged
as they are: they are what an operator searches for.
"""

from __future__ import annotations

import re

REDACTED = "[redacted]"

#: Field names (case-insensitive, matched at the end of the name) that never reach a log line.
_SENSITIVE_NAME = re.compile(
    r"(pass(word|wd)?|secret|token|authori[sz]ation|credentials?|api_?key|cookie|"
    r"payload|value|body)$",
    re.IGNORECASE,
)
#: ``scheme://user:password@`` in URLs (database URLs, broker URLs).
_URL_CREDENTIALS = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s]+):[^@\s]+@")


def is_sensitive(name: str) -> bool:
    """Whether a field called ``name`` must not be logged."""
    return bool(_SENSITIVE_NAME.search(name))


def scrub(text: str) -> str:
    """``text`` with the passwords of any URLs in it masked."""
    return _URL_CREDENTIALS.sub(r"\g<head>:***@", text)


def safe_field(name: str, value: object) -> str | int | float | bool | None:
    """A structured log field as it may be written: redacted, scrubbed, JSON-friendly."""
    if is_sensitive(name):
        return REDACTED
    if value is None or isinstance(value, bool | int | float):
        return value
    return scrub(str(value))
