"""Read the test database: what a test asserts on, by query.

`db` is a pool (the `pool` fixture) or a DSN (`db_dsn`, a daemon subprocess's
database), in which case each call opens one connection and closes it: tests of
`inboxd run` read what another process committed and hold nothing open.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg

#: A pool, or the DSN of the database (one connection a call).
Database = asyncpg.Pool | str


@asynccontextmanager
async def _connection(db: Database) -> AsyncIterator[asyncpg.Connection]:
    if isinstance(db, str):
        conn = await asyncpg.connect(db)
        try:
            yield conn
        finally:
            await conn.close()
    else:
        async with db.acquire() as conn:
            yield conn


async def fetch(db: Database, sql: str, *args: Any) -> list[asyncpg.Record]:
    """The rows `sql` answers."""
    async with _connection(db) as conn:
        return list(await conn.fetch(sql, *args))


async def fetchval(db: Database, sql: str, *args: Any) -> Any:
    """The first column of the first row `sql` answers (None without a row)."""
    async with _connection(db) as conn:
        return await conn.fetchval(sql, *args)


async def count(db: Database, sql: str, *args: Any) -> int:
    """The number a `SELECT count(*) ...` query answers."""
    return int(await fetchval(db, sql, *args))


async def rows_in(db: Database, table: str) -> int:
    """How many rows `table` holds (a name the test writes, never input)."""
    return await count(db, f"SELECT count(*) FROM {table}")


async def extraction_jobs(
    db: Database, columns: str, *, order_by: str, tenant: str | None = None
) -> list[asyncpg.Record]:
    """`columns` (an SQL select list) of every row of extraction_jobs, in `order_by`
    order; of `tenant` only when given. A Record compares equal to a tuple."""
    where = "WHERE tenant_id = $1 " if tenant is not None else ""
    sql = f"SELECT {columns} FROM extraction_jobs {where}ORDER BY {order_by}"
    return await fetch(db, sql, *([tenant] if tenant is not None else []))
