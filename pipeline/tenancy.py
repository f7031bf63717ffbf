"""Tenant and mailbox rows: created on first use, from config or the import command."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

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


async def mailbox_exists(conn: asyncpg.Connection, tenant_id: str, mailbox_id: str) -> bool:
    """True when the database has this tenant's mailbox (from a config or an import)."""
    return bool(
        await conn.fetchval(
            "SELECT EXISTS (SELECT 1 FROM mailboxes WHERE tenant_id = $1 AND mailbox_id = $2)",
            tenant_id,
            mailbox_id,
        )
    )


async def tenant_ids(conn: asyncpg.Connection) -> list[str]:
    """Every tenant the database has, in no particular order."""
    return [r["tenant_id"] for r in await conn.fetch("SELECT tenant_id FROM tenants")]


async def ensure_tenants(
    conn: asyncpg.Connection, tenants: Mapping[str, str] | Iterable[str]
) -> None:
    """Create missing tenant rows (tenants with delivery sources but no mailboxes).

    `tenants`: tenant id → display name (the tenant file's `name`), or bare ids.
    With names, an existing row's name follows the file (a rename in the tenant
    file shows after the next start or SIGHUP); bare ids never touch a name.
    """
    names = dict(tenants) if isinstance(tenants, Mapping) else dict.fromkeys(tenants, None)
    for tenant_id in names:
        validate_id("tenant", tenant_id)
    ids = sorted(names)
    # ORDER BY: rows locked in one order by every replica, so two never deadlock.
    await conn.execute(
        "INSERT INTO tenants (tenant_id, name) "
        "SELECT t.id, coalesce(t.name, '') FROM unnest($1::text[], $2::text[]) AS t (id, name) "
        "ORDER BY 1 "
        "ON CONFLICT (tenant_id) DO UPDATE SET name = EXCLUDED.name "
        "WHERE $3 AND tenants.name IS DISTINCT FROM EXCLUDED.name",
        ids,
        [names[i] for i in ids],
        isinstance(tenants, Mapping),
    )
