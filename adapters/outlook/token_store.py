"""The Outlook door's RefreshTokenStore (auth.py) on the database: one row per
delegated mailbox in `graph_refresh_tokens` (adapters/outlook/tables.py).

The database, not the file `inboxd connect outlook` wrote, because the reference
may be `env:` (nothing to write back to) or a read-only mount (systemd credentials,
Kubernetes secrets), and the database is where the mailbox's state already lives,
durably and scoped by tenant. A database error is OutlookUnavailable: the run is
retried, never the configured (possibly refused) token used in its place.
"""

from __future__ import annotations

import asyncpg

from inboxd.adapters.outlook import tables as rows
from inboxd.adapters.outlook.errors import OutlookUnavailable
from inboxd.pipeline.errors import DATABASE_ERRORS

__all__ = ["DatabaseRefreshTokens"]


class DatabaseRefreshTokens:
    """One mailbox's newest refresh token in the database (module docstring)."""

    def __init__(self, pool: asyncpg.Pool, tenant_id: str, mailbox_id: str) -> None:
        self._pool = pool
        self._tenant_id = tenant_id
        self._mailbox_id = mailbox_id

    async def load(self, configured_sha256: str) -> str | None:
        try:
            return await rows.load_refresh_token(
                self._pool, self._tenant_id, self._mailbox_id, configured_sha256
            )
        except DATABASE_ERRORS as exc:
            raise OutlookUnavailable(f"refresh token not read: {_kind(exc)}") from exc

    async def save(self, configured_sha256: str, refresh_token: str) -> None:
        try:
            await rows.save_refresh_token(
                self._pool, self._tenant_id, self._mailbox_id, configured_sha256, refresh_token
            )
        except DATABASE_ERRORS as exc:
            raise OutlookUnavailable(f"refresh token not stored: {_kind(exc)}") from exc


def _kind(exc: BaseException) -> str:
    """The error's class and SQLSTATE only: a PostgreSQL message or detail may quote
    the row, and the row holds the token."""
    state = getattr(exc, "sqlstate", None)
    return type(exc).__name__ + (f" ({state})" if state else "")
