"""The ``{message_id:path}`` parameter that every ``/v1/messages`` operation takes.

Apart from the routers so that the reads (``api.routes.messages``) and the operator actions
(``api.routes.message_actions``) document it once, the same way, without importing each other.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Path

MessageIdPath = Annotated[
    str,
    Path(
        description="`<group>/<topic>/<partition>/<offset>` of the origin, as is or "
        "percent-encoded.",
        examples=["billing/orders/3/42"],
    ),
]
