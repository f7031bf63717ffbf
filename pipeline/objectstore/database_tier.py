"""DatabaseTierStore: small objects in PostgreSQL, the others in the configured store.

Why it exists (issue 15, bench/README.md "ingest.py — raw bytes"): the local
directory store spends ≈ 0.6 ms of CPU per object on a temp file, a rename and the
fsyncs of file and directory, more than parsing the message or the whole cascade.
Most mail is small (94 % of tests/corpus is at most 64 KiB), and PostgreSQL makes a
whole batch of small objects durable with one statement and one WAL flush at commit.

Where an object lives follows from the size of the bytes put under its key:

* ``len(data) <= max_bytes`` → a row of ``small_objects`` (tenant_id, key, data),
  one INSERT per ``DB_PUT_CHUNK_BYTES`` of data. The ingest stage passes its batch's
  connection (``put_many(conn=…)``): the rows are written in its transaction, under
  a savepoint, and commit with the messages that point at them — one WAL flush for
  bytes and rows, and a rolled-back batch leaves no orphan. Without a connection
  each chunk is a transaction of its own, committed with ``synchronous_commit = on``
  whatever the server's default, so ``put_many`` reports an object stored only once
  its bytes are as durable as a fsynced file (the promise ingest relies on before it
  acknowledges a provider: docs/architecture.md §3; ingest sets the same for its
  own transaction);
* larger → the ``large`` store (local directory or S3), unchanged.

Reads look in the table first, then in ``large``. A key whose bytes are replaced by
bytes of the other size class moves: a large put deletes the key's row once the large
store has the bytes (so the key is never absent in between), and a small put wins
over the large copy because the table is read first. Content-addressed keys (all of
the pipeline's) never see either case.

Tenancy: the table's primary key is (tenant_id, key), tenant_id being the key's
second segment (``raw/<tenant>/<sha256>``, ``att/<tenant>/…``); a key with fewer than
three segments has tenant_id ``''``. Every query names both.

The contract of ``pipeline/objectstore/store.py`` holds as for every store
(``tests/adapters/objectstore`` runs the same suite against this one): bad keys and
non-bytes data fail their own item only; a database failure is an
``ObjectStoreError`` (retriable) for the items it touched.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import anyio
import asyncpg

from inboxd.pipeline.errors import DATABASE_ERRORS
from inboxd.pipeline.objectstore.store import (
    READS_AT_ONCE,
    ObjectStore,
    ObjectStoreError,
    StoreContext,
    object_bytes,
    run_bounded,
    validate_key,
    validate_url_expiry,
)

__all__ = ["DB_PUT_CHUNK_BYTES", "DEFAULT_MAX_BYTES", "MAX_MAX_BYTES", "DatabaseTierStore"]

# Objects up to this size go to the table by default. 94 % of tests/corpus (real mail
# from 15 projects) is at most 64 KiB; what is larger carries attachments, which are
# better served and backed up as files. bench/ingest.py measures the tier at this size.
DEFAULT_MAX_BYTES = 64 * 1024
# The largest max_bytes accepted: a row past this is no longer "small" (PostgreSQL
# reads a bytea whole into memory, and one row caps at 1 GB).
MAX_MAX_BYTES = 16 * 1024 * 1024
# Bytes sent in one INSERT (one transaction, one WAL flush). Bounds the statement a
# batch of many small attachments builds: 8 MiB is ~1,400 messages of the corpus's
# mean 5.7 KB, more than one ingest batch.
DB_PUT_CHUNK_BYTES = 8 * 1024 * 1024

# New keys are inserted; a key that exists is left alone unless its bytes differ.
# Not ON CONFLICT DO UPDATE … WHERE: that locks every conflicting row until commit,
# even the ones it does not update, so two ingests of one tenant carrying the same
# attachment (a logo, a cc'd file) would wait on each other, and deadlock when their
# batches held the keys in opposite orders. An UPDATE locks only the rows it changes,
# and content-addressed keys (all of the pipeline's) never change.
_INSERT = (
    "INSERT INTO small_objects (tenant_id, key, data) "
    "SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[]) "
    "ON CONFLICT (tenant_id, key) DO NOTHING RETURNING key"
)
_REPLACE = (
    "UPDATE small_objects o SET data = u.d, stored_at = now() "
    "FROM unnest($1::text[], $2::text[], $3::bytea[]) AS u(t, k, d) "
    "WHERE o.tenant_id = u.t AND o.key = u.k AND o.data <> u.d"
)


class DatabaseTierStore(StoreContext):
    """``ObjectStore``: objects up to ``max_bytes`` in ``small_objects``, the rest in ``large``.

    ``max_bytes = 0`` writes nothing to the table but still reads it: objects an
    earlier configuration (or version) kept there stay readable after the tier is
    turned off or the store moves to S3.

    ``pool`` is the daemon's (or the importer's) connection pool; the store acquires a
    connection per call and holds none between calls. ``start``/``aclose`` start and
    close ``large``.
    """

    def __init__(self, pool: asyncpg.Pool, large: ObjectStore, *, max_bytes: int) -> None:
        if not 0 <= max_bytes <= MAX_MAX_BYTES:
            raise ValueError(f"max_bytes must be 0..{MAX_MAX_BYTES}, not {max_bytes}")
        self.pool = pool
        self.large = large
        self.max_bytes = max_bytes

    def __repr__(self) -> str:
        return f"DatabaseTierStore(max_bytes={self.max_bytes}, large={self.large!r})"

    async def start(self) -> None:
        await self.large.start()

    async def aclose(self) -> None:
        await self.large.aclose()

    async def put(
        self, key: str, data: bytes, *, content_type: str = "application/octet-stream"
    ) -> None:
        validate_key(key)
        data = object_bytes(data)
        error = (await self.put_many([(key, data, content_type)]))[0]
        if error is not None:
            raise error

    async def put_many(
        self, items: Sequence[tuple[str, bytes, str]], *, conn: asyncpg.Connection | None = None
    ) -> list[BaseException | None]:
        """Small items in the table, large ones in ``large``, both at once; one result
        per item as the protocol says.

        With ``conn`` (a connection in the caller's transaction) the rows are written
        there under a savepoint: they commit with the caller's rows, and a failed
        insert fails these items without aborting the caller's transaction. Without
        it, each chunk is a transaction of its own on a pool connection.
        """
        results: list[BaseException | None] = [None] * len(items)
        # one row per key (one INSERT cannot write a row twice); the last bytes win, as
        # for a put after a put
        small: dict[str, tuple[bytes, list[int]]] = {}
        large: list[int] = []
        for i, (key, data, _content_type) in enumerate(items):
            try:
                validate_key(key)
                data = object_bytes(data)
            except (ValueError, TypeError) as exc:
                results[i] = exc
                continue
            if self.max_bytes and len(data) <= self.max_bytes:
                small[key] = (data, [*small.get(key, (b"", []))[1], i])
            else:
                large.append(i)

        async def put_small() -> None:
            for chunk in _chunks([(key, data) for key, (data, _) in small.items()]):
                error = await self._insert(chunk, conn)
                for key, _data in chunk:
                    for i in small[key][1]:
                        results[i] = None if error is None else _store_error("storing", key, error)

        async def put_large() -> None:
            errors = await self.large.put_many([items[i] for i in large])
            for i, error in zip(large, errors, strict=True):
                results[i] = error

        async with anyio.create_task_group() as tg:
            if small:
                tg.start_soon(put_small)
            if large:
                tg.start_soon(put_large)
        stored_large = [i for i in large if results[i] is None]
        if stored_large:
            # a key that held small bytes before must not answer with them now; after
            # the inserts, so the caller's connection is never used by two tasks
            error = await self._delete([items[i][0] for i in stored_large], conn)
            if error is not None:
                for i in stored_large:
                    results[i] = _store_error("storing", items[i][0], error)
        return results

    async def get(self, key: str) -> bytes:
        validate_key(key)
        try:
            async with self.pool.acquire() as conn:
                data = await conn.fetchval(
                    "SELECT data FROM small_objects WHERE tenant_id = $1 AND key = $2",
                    _tenant_of(key),
                    key,
                )
        except DATABASE_ERRORS as exc:
            raise _store_error("reading", key, exc) from exc
        if data is not None:
            return bytes(data)
        return await self.large.get(key)

    async def get_many(self, keys: Iterable[str]) -> dict[str, bytes | Exception]:
        """Per key, its bytes or the exception reading it raised (ObjectNotFound for no
        object, ValueError for a bad key, ObjectUnreadable …): `objectstore.read_many`
        sorts them. One statement for the small ones (a `get` each cost one round trip:
        100 keys took 25 ms against 3 ms, bench/extraction.py); larger ones from the
        large store, four at a time. A failed statement (the database) is raised."""
        results: dict[str, bytes | Exception] = {}
        wanted: list[str] = []
        for key in sorted(set(keys)):
            try:
                wanted.append(validate_key(key))
            except ValueError as exc:
                results[key] = exc
        if not wanted:
            return results
        try:
            rows = await self.pool.fetch(
                "SELECT key, data FROM small_objects "
                "WHERE tenant_id = ANY($1::text[]) AND key = ANY($2::text[])",
                sorted({_tenant_of(key) for key in wanted}),
                wanted,
            )
        except DATABASE_ERRORS as exc:
            raise _store_error("reading", wanted[0], exc) from exc
        results.update((r["key"], bytes(r["data"])) for r in rows)
        rest = [key for key in wanted if key not in results]
        from_large = await run_bounded(self.large.get, rest, concurrency=READS_AT_ONCE)
        results.update(zip(rest, from_large, strict=True))
        return results

    async def exists(self, key: str) -> bool:
        return bool(await self.exists_many([key]))

    async def exists_many(self, keys: Iterable[str]) -> set[str]:
        wanted = sorted({validate_key(key) for key in keys})
        if not wanted:
            return set()
        found = await self._in_table(wanted)
        rest = [key for key in wanted if key not in found]
        return found | (await self.large.exists_many(rest) if rest else set())

    async def url_for(self, key: str, *, expires_s: int) -> str | None:
        """None for an object in the table (served from ``get``), else ``large``'s URL."""
        validate_key(key)
        validate_url_expiry(expires_s)
        if await self._in_table([key]):
            return None
        return await self.large.url_for(key, expires_s=expires_s)

    async def _insert(
        self, chunk: list[tuple[str, bytes]], conn: asyncpg.Connection | None
    ) -> BaseException | None:
        # one order for every writer: concurrent inserts of the same new keys wait on
        # each other in that order, never in a cycle
        chunk = sorted(chunk, key=lambda item: (_tenant_of(item[0]), item[0]))
        try:
            if conn is not None:
                async with conn.transaction():  # a savepoint in the caller's transaction
                    await _write(conn, chunk)
                return None
            async with self.pool.acquire() as own, own.transaction():
                # durable at commit even where the server's default is off: put_many's
                # callers acknowledge providers once it returns
                await own.execute("SET LOCAL synchronous_commit = on")
                await _write(own, chunk)
        except DATABASE_ERRORS as exc:
            return exc
        return None

    async def _delete(
        self, keys: list[str], conn: asyncpg.Connection | None
    ) -> BaseException | None:
        query = (
            "DELETE FROM small_objects o USING unnest($1::text[], $2::text[]) AS u(t, k) "
            "WHERE o.tenant_id = u.t AND o.key = u.k"
        )
        tenants = [_tenant_of(key) for key in keys]
        try:
            if conn is not None:
                async with conn.transaction():
                    await conn.execute(query, tenants, keys)
                return None
            async with self.pool.acquire() as own:
                await own.execute(query, tenants, keys)
        except DATABASE_ERRORS as exc:
            return exc
        return None

    async def _in_table(self, keys: list[str]) -> set[str]:
        try:
            async with self.pool.acquire() as conn:
                rows = await conn.fetch(
                    "SELECT o.key FROM small_objects o "
                    "JOIN unnest($1::text[], $2::text[]) AS u(t, k) "
                    "ON o.tenant_id = u.t AND o.key = u.k",
                    [_tenant_of(key) for key in keys],
                    keys,
                )
        except DATABASE_ERRORS as exc:
            raise ObjectStoreError(f"checking {len(keys)} objects failed: {exc}") from exc
        return {row["key"] for row in rows}


async def _write(conn: asyncpg.Connection, chunk: list[tuple[str, bytes]]) -> None:
    """Insert the new keys; replace the bytes of existing keys whose bytes differ."""
    inserted = {
        row["key"]
        for row in await conn.fetch(
            _INSERT,
            [_tenant_of(key) for key, _ in chunk],
            [key for key, _ in chunk],
            [data for _, data in chunk],
        )
    }
    existing = [(key, data) for key, data in chunk if key not in inserted]
    if existing:
        await conn.execute(
            _REPLACE,
            [_tenant_of(key) for key, _ in existing],
            [key for key, _ in existing],
            [data for _, data in existing],
        )


def _tenant_of(key: str) -> str:
    parts = key.split("/", 2)
    return parts[1] if len(parts) == 3 else ""


def _chunks(items: list[tuple[str, bytes]]) -> Iterable[list[tuple[str, bytes]]]:
    chunk: list[tuple[str, bytes]] = []
    size = 0
    for item in items:
        if chunk and size + len(item[1]) > DB_PUT_CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
        chunk.append(item)
        size += len(item[1])
    if chunk:
        yield chunk


def _store_error(doing: str, key: str, exc: BaseException) -> ObjectStoreError:
    if isinstance(exc, ObjectStoreError):
        return exc
    error = ObjectStoreError(f"{doing} object {key!r} in the database failed: {exc}")
    error.__cause__ = exc
    return error
