"""`inboxd migrate`: apply schema.sql to the configured database.

schema.sql is idempotent and applied in one transaction under an advisory lock
(`pipeline.schema`), so running this again, or from two replicas at once, is
safe and changes nothing the second time.
"""

from __future__ import annotations

import argparse
import time

import anyio
import asyncpg

from inboxd.daemon.commands.common import (
    EXIT_OK,
    CommandError,
    Subparsers,
    database_error,
    emit_json,
    load_config,
    open_pool,
    resolve,
    target_of,
)
from inboxd.pipeline.errors import DATABASE_ERRORS
from inboxd.pipeline.schema import SCHEMA_PATH, apply_schema

# schema.sql on an empty database takes well under a second; an advisory lock held
# by another replica's migration is waited for, up to this long.
MIGRATE_TIMEOUT_S = 120.0


def register(subparsers: Subparsers, parent: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "migrate",
        parents=[parent],
        help="create or update the database schema (safe to re-run)",
        description="Apply schema.sql to the database. Idempotent: running it again "
        "changes nothing. `inboxd import` applies it too.",
    )
    parser.set_defaults(handler=run)


async def run(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    choice = await resolve(args, config)
    started = time.monotonic()
    async with open_pool(choice, max_size=1) as pool:
        try:
            async with pool.acquire() as conn:
                await apply_with_deadline(conn)
                database = await conn.fetchval("SELECT current_database()")
        except DATABASE_ERRORS as exc:
            raise database_error(exc, choice) from exc
    elapsed_s = time.monotonic() - started
    target = target_of(choice)
    if args.json:
        emit_json(
            {
                "command": "migrate",
                "status": "ok",
                "database": database,
                "server": target,
                "dsn_source": choice.source,
                "elapsed_s": round(elapsed_s, 3),
            }
        )
    else:
        print(
            f"schema applied to database {database} at {target} "
            f"({choice.source} DSN) in {elapsed_s:.2f} s"
        )
    return EXIT_OK


async def apply_with_deadline(conn: asyncpg.Connection) -> None:
    """apply_schema within MIGRATE_TIMEOUT_S; CommandError when schema.sql is missing."""
    try:
        with anyio.fail_after(MIGRATE_TIMEOUT_S):
            await apply_schema(conn)
    except FileNotFoundError as exc:
        raise CommandError(f"schema file {SCHEMA_PATH} is missing: reinstall inboxd") from exc
    except TimeoutError as exc:
        raise CommandError(
            f"applying the schema did not finish within {MIGRATE_TIMEOUT_S:g} s "
            "(another migration holding the lock?)"
        ) from exc
