"""DatabaseTierStore's own behaviour: which tier an object lands in, moving between
tiers, and a database that fails. The ObjectStore contract itself runs against it in
tests/adapters/objectstore (the `db` store)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import anyio
import asyncpg
import pytest

from inboxd.pipeline.objectstore import database_tier as objectstore_db
from inboxd.pipeline.objectstore.database_tier import DatabaseTierStore
from inboxd.pipeline.objectstore.local import LocalDirectoryStore
from inboxd.pipeline.objectstore.store import ObjectNotFound, ObjectStoreError

MAX_BYTES = 1000


def key_of(tenant: str, data: bytes) -> str:
    return f"raw/{tenant}/{hashlib.sha256(data).hexdigest()}"


@pytest.fixture
def large(tmp_path: Path) -> LocalDirectoryStore:
    return LocalDirectoryStore(tmp_path / "objects")


@pytest.fixture
def tier(pool: asyncpg.Pool, large: LocalDirectoryStore) -> DatabaseTierStore:
    return DatabaseTierStore(pool, large, max_bytes=MAX_BYTES)


async def rows(pool: asyncpg.Pool) -> dict[tuple[str, str], bytes]:
    found = await pool.fetch("SELECT tenant_id, key, data FROM small_objects")
    return {(r["tenant_id"], r["key"]): bytes(r["data"]) for r in found}


async def test_small_objects_go_to_the_table_and_large_ones_to_the_store(
    tier: DatabaseTierStore, large: LocalDirectoryStore, pool: asyncpg.Pool
) -> None:
    small = b"x" * MAX_BYTES
    big = b"y" * (MAX_BYTES + 1)
    items = [
        (key_of("acme", small), small, "message/rfc822"),
        (key_of("acme", big), big, "message/rfc822"),
        (f"att/globex/{'a' * 64}", b"pdf", "application/pdf"),
    ]

    assert await tier.put_many(items) == [None, None, None]

    assert await rows(pool) == {
        ("acme", items[0][0]): small,
        ("globex", items[2][0]): b"pdf",
    }
    assert not large.path_for(items[0][0]).exists()
    assert large.path_for(items[1][0]).read_bytes() == big
    for key, data, _ in items:
        assert await tier.get(key) == data
    assert await tier.exists_many([k for k, _, _ in items]) == {k for k, _, _ in items}


async def test_a_key_replaced_by_bytes_of_the_other_size_answers_with_the_new_bytes(
    tier: DatabaseTierStore, pool: asyncpg.Pool
) -> None:
    key = "html/acme/message-1"
    small, big = b"<p>short</p>", b"<p>" + b"long " * 400 + b"</p>"

    await tier.put(key, small)
    await tier.put(key, big)
    assert await tier.get(key) == big
    assert await rows(pool) == {}  # the small copy is gone, not shadowing the new bytes

    await tier.put(key, small)
    assert await tier.get(key) == small


async def test_a_re_put_of_the_same_bytes_changes_nothing(
    tier: DatabaseTierStore, pool: asyncpg.Pool
) -> None:
    data = b"same bytes"
    key = key_of("acme", data)
    await tier.put(key, data)
    first = await pool.fetchval("SELECT xmin::text FROM small_objects WHERE key = $1", key)
    await tier.put(key, data)
    assert await pool.fetchval("SELECT xmin::text FROM small_objects WHERE key = $1", key) == first


async def test_one_key_twice_in_a_batch_is_one_row_with_the_last_bytes(
    tier: DatabaseTierStore, pool: asyncpg.Pool
) -> None:
    # two messages of one batch carry the same attachment; a re-put replaced bytes
    items = [("att/acme/same", b"first", "x/y"), ("att/acme/same", b"second", "x/y")]

    assert await tier.put_many(items) == [None, None]

    assert await rows(pool) == {("acme", "att/acme/same"): b"second"}


async def test_with_the_callers_connection_the_bytes_commit_or_roll_back_with_its_rows(
    tier: DatabaseTierStore, pool: asyncpg.Pool
) -> None:
    kept, dropped = ("raw/acme/kept", b"kept", "x/y"), ("raw/acme/dropped", b"dropped", "x/y")
    async with pool.acquire() as conn:
        async with conn.transaction():
            assert await tier.put_many([kept], conn=conn) == [None]
        transaction = conn.transaction()
        await transaction.start()
        assert await tier.put_many([dropped], conn=conn) == [None]
        await transaction.rollback()

    assert await rows(pool) == {("acme", "raw/acme/kept"): b"kept"}


@pytest.mark.own_database  # adds a constraint
async def test_a_failed_insert_does_not_abort_the_callers_transaction(
    tier: DatabaseTierStore, pool: asyncpg.Pool
) -> None:
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("ALTER TABLE small_objects ADD CHECK (length(data) < 3)")
        results = await tier.put_many([("raw/acme/x", b"too long", "x/y")], conn=conn)

        assert isinstance(results[0], ObjectStoreError)
        # the caller's transaction goes on: its other statements still run
        assert await conn.fetchval("SELECT count(*) FROM small_objects") == 0


async def test_two_open_transactions_putting_a_stored_key_do_not_wait_on_each_other(
    tier: DatabaseTierStore, pool: asyncpg.Pool
) -> None:
    # a tenant's logo attached to mail of two mailboxes ingested at once
    logo = ("att/acme/logo", b"\x89PNG logo", "image/png")
    other = ("att/acme/other", b"another", "image/png")
    await tier.put_many([logo, other])
    async with pool.acquire() as one, pool.acquire() as two:
        first, second = one.transaction(), two.transaction()
        await first.start()
        await second.start()
        try:
            with anyio.fail_after(10):
                assert await tier.put_many([logo, other], conn=one) == [None, None]
                assert await tier.put_many([other, logo], conn=two) == [None, None]
        finally:
            await first.rollback()
            await second.rollback()


async def test_many_small_objects_are_split_into_bounded_statements(
    tier: DatabaseTierStore, pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(objectstore_db, "DB_PUT_CHUNK_BYTES", 2_000)
    items = [(f"raw/acme/m{i:03d}", bytes([i]) * 900, "message/rfc822") for i in range(25)]

    assert await tier.put_many(items) == [None] * 25

    stored = await rows(pool)
    assert {key: data for (_, key), data in stored.items()} == {k: d for k, d, _ in items}
    # 25 objects of 900 bytes at most 2,000 bytes a statement: 13 transactions
    assert len(await pool.fetch("SELECT DISTINCT xmin FROM small_objects")) == 13


@pytest.mark.own_database  # drops a table
async def test_a_database_failure_fails_the_small_items_only(
    large: LocalDirectoryStore, db_dsn: str
) -> None:
    pool = await asyncpg.create_pool(db_dsn, min_size=1, max_size=2)
    await pool.execute("DROP TABLE small_objects")  # every statement on it now fails
    try:
        tier = DatabaseTierStore(pool, large, max_bytes=MAX_BYTES)
        small, big = b"small", b"z" * (MAX_BYTES + 1)
        results = await tier.put_many(
            [(key_of("acme", small), small, "x/y"), (key_of("acme", big), big, "x/y")]
        )

        assert isinstance(results[0], ObjectStoreError)
        assert "in the database failed" in str(results[0])
        # the large object reached its store, but its row check failed: not reported stored
        assert isinstance(results[1], ObjectStoreError)
        with pytest.raises(ObjectStoreError) as raised:
            await tier.get(key_of("acme", small))
        assert not isinstance(raised.value, ObjectNotFound)  # unknown, not absent
        with pytest.raises(ObjectStoreError):
            await tier.exists(key_of("acme", small))
    finally:
        await pool.close()


async def test_a_missing_key_is_not_found_in_either_tier(tier: DatabaseTierStore) -> None:
    with pytest.raises(ObjectNotFound):
        await tier.get("raw/acme/" + "0" * 64)
    assert await tier.url_for("raw/acme/" + "0" * 64, expires_s=60) is None


async def test_with_the_tier_off_objects_kept_in_the_table_stay_readable(
    tier: DatabaseTierStore, pool: asyncpg.Pool, large: LocalDirectoryStore
) -> None:
    await tier.put("raw/acme/kept", b"stored while the tier was on")
    off = DatabaseTierStore(pool, large, max_bytes=0)

    assert await off.get("raw/acme/kept") == b"stored while the tier was on"
    await off.put("raw/acme/new", b"x")  # small, but the tier is off: a file
    assert large.path_for("raw/acme/new").read_bytes() == b"x"
    assert await off.exists_many(["raw/acme/kept", "raw/acme/new"]) == {
        "raw/acme/kept",
        "raw/acme/new",
    }


async def test_max_bytes_is_bounded(pool: asyncpg.Pool, large: LocalDirectoryStore) -> None:
    for bad in (-1, objectstore_db.MAX_MAX_BYTES + 1):
        with pytest.raises(ValueError):
            DatabaseTierStore(pool, large, max_bytes=bad)
