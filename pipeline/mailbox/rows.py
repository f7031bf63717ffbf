"""What every write to a `mailboxes` row shares: leases.py (who syncs it, its cursor)
and scheduling.py (when it is polled, its health) work on the same row under the
same rules, so the fencing condition, the error-line rule and the connection and
argument helpers live here, not in either of them.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TypeAlias

import asyncpg

__all__ = [
    "CLEAN_RUN",
    "ERROR_MAX_CHARS",
    "HELD",
    "Executor",
    "MailboxNotFound",
    "connection",
    "one_line",
    "positive_seconds",
    "require_owner",
]

# Explicit alias: asyncpg ships no types, and mypy reads an untyped union as a variable.
Executor: TypeAlias = asyncpg.Connection | asyncpg.Pool

# mailboxes.last_error is shown in `inboxd status` and /metrics labels: one short line.
ERROR_MAX_CHARS = 300

# The fencing condition shared by every write a lease holder makes (leases.py, and
# scheduling.set_sync_state with a token): $3 is the holder's lease token.
HELD = "lease_token = $3 AND lease_owner IS NOT NULL AND lease_expires_at > now()"

# What a clean sync run writes on its row (scheduling.record_success, and
# leases.finish_run, which releases the lease in the same statement).
CLEAN_RUN = (
    "last_success_at = now(), throttle_backoff_s = 0, throttle_until = NULL, sync_state = 'idle'"
)


class MailboxNotFound(LookupError):
    """No mailbox row with that (tenant_id, mailbox_id)."""

    def __init__(self, tenant_id: str, mailbox_id: str) -> None:
        super().__init__(f"no mailbox {mailbox_id!r} in tenant {tenant_id!r}")
        self.tenant_id = tenant_id
        self.mailbox_id = mailbox_id


def one_line(text: str, limit: int = ERROR_MAX_CHARS) -> str:
    """`text` with whitespace runs (newlines included) collapsed and NULs dropped (a
    PostgreSQL text column refuses U+0000), cut to `limit` chars."""
    flat = " ".join(str(text).replace("\x00", "").split()) or "unknown error"
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


@asynccontextmanager
async def connection(conn: Executor) -> AsyncIterator[asyncpg.Connection]:
    """A connection for a multi-statement transaction: `conn` itself, or one from the pool."""
    if isinstance(conn, asyncpg.Pool):
        async with conn.acquire() as acquired:
            yield acquired
    else:
        yield conn


def require_owner(owner: str) -> None:
    """ValueError for an empty lease owner."""
    if not owner:
        raise ValueError("lease owner must be a non-empty string")


def positive_seconds(name: str, value: float) -> float:
    """`value` as a float; ValueError naming `name` unless finite and > 0."""
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)
