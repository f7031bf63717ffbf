"""Upgrading a database made by the previous release: forward-only, in place.

`fixtures/schema-0.1.0.sql` is schema.sql as release 0.1.0 shipped it (the first
recorded release, CHANGELOG.md). A database it created is migrated with today's
schema.sql by `apply_schema`, exactly as a replica starting on the new release does,
and then takes mail through today's ingest stage. When a release ships, its schema.sql
becomes the next fixture (docs/upgrading.md).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import asyncpg
import pytest

from inboxd.pipeline.ingest.stage import IngestBatch, IngestStage
from inboxd.pipeline.mime.parse import parse_raw
from inboxd.pipeline.objectstore.local import LocalDirectoryStore
from inboxd.pipeline.outcomes import Outcome
from inboxd.pipeline.schema import apply_schema, schema_sql
from inboxd.pipeline.tenancy import ensure_mailbox

PREVIOUS = Path(__file__).parent / "fixtures" / "schema-0.1.0.sql"
MESSAGES = 20


@pytest.fixture
async def previous_release_db(empty_db: str) -> str:
    """A database as release 0.1.0's `inboxd migrate` left it."""
    text = PREVIOUS.read_text(encoding="utf-8")
    conn = await asyncpg.connect(empty_db)
    try:
        async with conn.transaction():
            await conn.execute(text)
            await conn.execute(
                "INSERT INTO inboxd_schema_version (schema_sha256) VALUES ($1)",
                hashlib.sha256(text.encode()).hexdigest(),
            )
    finally:
        await conn.close()
    return empty_db


async def test_a_previous_release_database_upgrades_and_takes_mail(
    previous_release_db: str, corpus: Path, tmp_path: Path
) -> None:
    pool = await asyncpg.create_pool(previous_release_db, min_size=1, max_size=4)
    assert pool is not None
    try:
        async with pool.acquire() as conn:
            if PREVIOUS.read_text(encoding="utf-8") != schema_sql():
                assert await apply_schema(conn) is True
            assert await apply_schema(conn) is False  # a second replica changes nothing
            await ensure_mailbox(conn, "acme", "inbox", provider="import")
        files = sorted((corpus / "mime").rglob("*.eml"))[:MESSAGES]
        items = [
            parse_raw(f.read_bytes(), tenant_id="acme", mailbox_id="inbox", source="import")
            for f in files
        ]
        async with LocalDirectoryStore(tmp_path / "objects") as store:
            stage = IngestStage(pool, store)
            results = await stage.ingest(IngestBatch("acme", "inbox", items))
        assert {r.outcome for r in results} <= {Outcome.NEW, Outcome.MERGED, Outcome.DUPLICATE}
        assert Outcome.NEW in {r.outcome for r in results}
        stored = await pool.fetchval("SELECT count(*) FROM messages WHERE tenant_id = 'acme'")
        assert stored == sum(r.outcome is Outcome.NEW for r in results)
    finally:
        await pool.close()
