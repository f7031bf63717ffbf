"""Tenant and mailbox rows: created on first use, from config or the import command."""

from __future__ import annotations

import re

import asyncpg

_ID = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")


def validate_id(kind: str, value: str) -> str:
    """Tenant and mailbox ids end up in object-store keys: keep them boring."""
    if not _ID.fullmatch(value):
        raise ValueError(
            f"invalid {kind} id {value!r}: use 1-63 of a-z 0-9 . _ - starting with a letter/digit"
        )
    return value


async def ensure_mailbox(
    conn: asyncpg.Connection,
    tenant_id: str,
    mailbox_id: str,
    *,
    provider: str,
    address: str = "",
    tenant_name: str = "",
) -> None:
    """Create the tenant and mailbox rows if missing; existing rows are left alone."""
    validate_id("tenant", tenant_id)
    validate_id("mailbox", mailbox_id)
    await conn.execute(
        "INSERT INTO tenants (tenant_id, name) VALUES ($1, $2) ON CONFLICT DO NOTHING",
        tenant_id,
        tenant_name,
    )
    await conn.execute(
        "INSERT INTO mailboxes (tenant_id, mailbox_id, provider, address) VALUES ($1, $2, $3, $4) "
        "ON CONFLICT DO NOTHING",
        tenant_id,
        mailbox_id,
        provider,
        address,
    )


async def ensure_tenants(conn: asyncpg.Connection, tenant_ids: list[str]) -> None:
    """Create missing tenant rows (tenants with delivery sources but no mailboxes)."""
    for tenant_id in tenant_ids:
        validate_id("tenant", tenant_id)
    await conn.execute(
        "INSERT INTO tenants (tenant_id) SELECT unnest($1::text[]) ORDER BY 1 "
        "ON CONFLICT DO NOTHING",
        sorted(set(tenant_ids)),
    )
