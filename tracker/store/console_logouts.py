"""Console sessions that their operator ended: the one piece of server-side session state.

A console session is a signed cookie (``api.console.session``): every replica with the same
tokens accepts it without asking anyone, and rotating a token ends all of its sessions. Logging
out must end *that* session everywhere too, also for a copy of the cookie left in another tab or
taken by someone else. So a logout records the session's nonce here until the session would
have expired, and every console request checks it: one primary-key read.

Rows are deleted once their session would have expired anyway (at the next logout): the table
holds at most the sessions ended within one ``console_session``.
"""

from __future__ import annotations

from sqlalchemy import delete, select

from .admin_reads import AdminQueries
from .dialects import insert_ignore
from .tables import console_logouts


class ConsoleLogouts(AdminQueries):
    """Record ended sessions and answer whether a session was ended."""

    async def record(self, nonce: str, expires_s: int, now_s: int) -> None:
        """End the session ``nonce`` (valid until ``expires_s``); forget expired ones."""
        async with self._transaction() as conn:
            await conn.execute(delete(console_logouts).where(console_logouts.c.expires_s <= now_s))
            row = {"nonce": nonce, "expires_s": expires_s}
            await conn.execute(insert_ignore(self.engine, console_logouts, [row]))

    async def ended(self, nonce: str) -> bool:
        """Whether the session ``nonce`` was logged out."""
        async with self._transaction(read_only=True) as conn:
            found = await conn.execute(
                select(console_logouts.c.nonce).where(console_logouts.c.nonce == nonce)
            )
            return found.first() is not None
