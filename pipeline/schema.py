"""Applying schema.sql: `inboxd migrate`, `inboxd run` at start, test fixtures.

schema.sql lives at the top of the repository (docs/architecture.md §1) and is written to
be idempotent. Concurrent migrations (two replicas starting at once) are
serialised by an advisory lock so CREATE … IF NOT EXISTS never races itself.

Even a no-op pass takes table locks (ALTER … SET COMPRESSION and ADD COLUMN IF
NOT EXISTS take ACCESS EXCLUSIVE), which would queue all ingest and all
application reads behind any long query during a rolling restart. So the
sha256 of the applied text is recorded in `inboxd_schema_version`, and a start
whose schema.sql is unchanged only reads that row.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import asyncpg

# pipeline/schema.sql: in the source tree a link to the top-level schema.sql, in a wheel the
# file itself (pyproject.toml package-data).
SCHEMA_PATH = Path(__file__).parent / "schema.sql"
# Arbitrary constant naming inboxd's migration lock (pg_advisory_xact_lock key).
_MIGRATION_LOCK_KEY = 0x1B0CD


def schema_sql() -> str:
    """The schema text; raises FileNotFoundError with the path when missing."""
    return SCHEMA_PATH.read_text(encoding="utf-8")


async def apply_schema(conn: asyncpg.Connection) -> bool:
    """Apply schema.sql in one transaction; returns False when it was already applied."""
    text = schema_sql()
    digest = hashlib.sha256(text.encode()).hexdigest()
    if await _applied(conn, digest):
        return False
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATION_LOCK_KEY)
        if await _applied(conn, digest):  # another replica just did it
            return False
        await conn.execute(text)
        await conn.execute(
            "INSERT INTO inboxd_schema_version (schema_sha256) VALUES ($1) "
            "ON CONFLICT (schema_sha256) DO UPDATE SET applied_at = now()",
            digest,
        )
    return True


async def _applied(conn: asyncpg.Connection, digest: str) -> bool:
    if await conn.fetchval("SELECT to_regclass('inboxd_schema_version')") is None:
        return False
    return bool(
        await conn.fetchval(
            "SELECT EXISTS (SELECT 1 FROM inboxd_schema_version WHERE schema_sha256 = $1)", digest
        )
    )
