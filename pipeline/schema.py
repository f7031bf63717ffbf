"""Applying schema.sql: `inboxd migrate` and test fixtures.

schema.sql lives at the top of the repository (DESIGN.md §1) and is written to
be idempotent. Concurrent migrations (two replicas starting at once) are
serialised by an advisory lock so CREATE … IF NOT EXISTS never races itself.
"""

from __future__ import annotations

from pathlib import Path

import asyncpg

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "schema.sql"
# Arbitrary constant naming inboxd's migration lock (pg_advisory_xact_lock key).
_MIGRATION_LOCK_KEY = 0x1B0CD


def schema_sql() -> str:
    """The schema text; raises FileNotFoundError with the path when missing."""
    return SCHEMA_PATH.read_text(encoding="utf-8")


async def apply_schema(conn: asyncpg.Connection) -> None:
    """Apply schema.sql in one transaction; a no-op when already applied."""
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATION_LOCK_KEY)
        await conn.execute(schema_sql())
