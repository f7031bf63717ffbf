"""The newest refresh token of a delegated Outlook mailbox, in `graph_refresh_tokens`.

Entra answers a new refresh token with every refresh and may refuse the one it
replaced (issue 22 item 6): a token kept only in memory is lost with the process,
and the configured one is then refused. The door writes each new token here before
it uses it, and reads it back at start:

    load_refresh_token(configured_sha256)   the stored token, only if the row was
                                            written while the configuration named
                                            the same token (sha256); a changed
                                            configured token (`inboxd connect
                                            outlook` again) wins over the row
    save_refresh_token(...)                 insert or replace, committed with
                                            synchronous_commit on before it returns

One row per (tenant, mailbox); every statement is scoped by tenant. The token never
leaves this module but as the return value of `load_refresh_token`; nothing here logs.
"""

from __future__ import annotations

import asyncpg

from inboxd.pipeline.tenancy import validate_id

__all__ = ["load_refresh_token", "save_refresh_token"]


async def load_refresh_token(
    pool: asyncpg.Pool, tenant_id: str, mailbox_id: str, configured_sha256: str
) -> str | None:
    """The stored refresh token of the mailbox, None when there is none or it was
    stored for another configured token."""
    validate_id("tenant", tenant_id)
    validate_id("mailbox", mailbox_id)
    value = await pool.fetchval(
        "SELECT refresh_token FROM graph_refresh_tokens"
        " WHERE tenant_id = $1 AND mailbox_id = $2 AND configured_sha256 = $3",
        tenant_id,
        mailbox_id,
        configured_sha256,
    )
    return value if isinstance(value, str) else None


async def save_refresh_token(
    pool: asyncpg.Pool,
    tenant_id: str,
    mailbox_id: str,
    configured_sha256: str,
    refresh_token: str,
) -> None:
    """Keep `refresh_token` as the mailbox's newest, durably: the commit is flushed
    (synchronous_commit on) before this returns. Raises asyncpg/OS errors."""
    validate_id("tenant", tenant_id)
    validate_id("mailbox", mailbox_id)
    if not refresh_token:
        raise ValueError("refresh_token must be a non-empty secret")
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("SET LOCAL synchronous_commit = on")
        await conn.execute(
            """
            INSERT INTO graph_refresh_tokens
                   (tenant_id, mailbox_id, refresh_token, configured_sha256)
            VALUES ($1, $2, $3, $4)
            ON CONFLICT (tenant_id, mailbox_id) DO UPDATE
               SET refresh_token = EXCLUDED.refresh_token,
                   configured_sha256 = EXCLUDED.configured_sha256,
                   updated_at = now()
            """,
            tenant_id,
            mailbox_id,
            refresh_token,
            configured_sha256,
        )
