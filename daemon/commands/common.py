"""What every command shares: global options, exit codes, config, DSN, pool, output.

Exit codes (every command):
  0   done
  1   operational failure: database down, a path unreadable, work left undone
  2   usage or configuration error: bad option, bad config file, invalid id,
      a DSN the server rejects (wrong credentials or database name)
  130 interrupted (SIGINT/SIGTERM), after stopping cleanly

Errors reach the user as `CommandError`: one line, no traceback, no password
(`cli.main` prints ``inboxd: error: <message>``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tomllib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeAlias

import anyio.to_thread
import asyncpg
import orjson

from inboxd.daemon.config.reader import relative_to
from inboxd.daemon.database import (
    ENV_DSN,
    DatabaseRejected,
    DatabaseUnavailable,
    DsnChoice,
    DsnError,
    connect_pool,
    describe_target,
    resolve_dsn,
)
from inboxd.daemon.embedded_pg.data_dir import ENV_DATA_DIR, data_dir_and_origin, default_data_dir
from inboxd.daemon.embedded_pg.errors import EmbeddedPostgresError
from inboxd.daemon.logging import LOG_LEVELS

# What every command module's `register` receives: argparse's subcommand registry
# (the class is private in argparse; typeshed names it).
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a Ctrl-C'd command

# Sub-directory of the data directory holding the default local object store.
OBJECTS_DIR = "objects"
# Appended to every "cannot reach the database" message: the two things that pick it.
WHICH_DATABASE_HINT = (
    f"without --dsn / {ENV_DSN} / [database] dsn, commands use the embedded server of "
    f"{ENV_DATA_DIR} (`make run` uses <checkout>/var); `inboxd db url` prints the database "
    "commands use"
)
# A pool closes in milliseconds; past this a connection is stuck and is cut.
POOL_CLOSE_TIMEOUT_S = 5.0


class CommandError(Exception):
    """A failure to report as one line on stderr, with the exit code to end on."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILURE) -> None:
        super().__init__(" ".join(message.split()))
        self.exit_code = exit_code


def global_options(*, config_required: bool = False) -> argparse.ArgumentParser:
    """Options every command accepts (used as an argparse parent parser).

    `config_required`: --config is mandatory (`inboxd run`), and `--help` says so.
    """
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("global options")
    group.add_argument(
        "--dsn",
        metavar="DSN",
        help="PostgreSQL DSN, or env:NAME / file:/path (default: $INBOXD_DSN, then "
        "[database] dsn in --config, then an embedded server in the data directory)",
    )
    group.add_argument(
        "--config",
        metavar="FILE",
        type=Path,
        required=config_required,
        help="main config file (TOML); "
        + (
            "required"
            if config_required
            else "[database] and [object_store] are read, relative paths from its directory"
        ),
    )
    group.add_argument(
        "--json", action="store_true", help="print the result as one JSON object on stdout"
    )
    group.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="warning",
        help="log to stderr from this level on (default: %(default)s); "
        "logs are JSON lines when stderr is not a terminal",
    )
    return parent


def load_config(path: Path | None) -> dict[str, Any]:
    """The parsed main config, or {} without --config. Raises CommandError (exit 2)."""
    if path is None:
        return {}
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise CommandError(f"config file {path}: no such file", EXIT_USAGE) from None
    except OSError as exc:
        raise CommandError(f"config file {path}: {exc.strerror or exc}", EXIT_USAGE) from exc
    except tomllib.TOMLDecodeError as exc:
        raise CommandError(f"config file {path}: invalid TOML: {exc}", EXIT_USAGE) from exc


def object_store_spec(config: dict[str, Any], config_path: Path | None = None) -> dict[str, Any]:
    """`[object_store]` of the config, checked, else a local directory under the data
    directory; a bad table is a CommandError (exit 2).

    A relative local `path` is relative to the config file's directory, as for
    `inboxd run` (daemon/config/main.py), so `import --config F` and `run --config F`
    write to the same store whatever the working directory.
    """
    spec = config.get("object_store")
    if spec is None:
        return {"kind": "local", "path": str(default_data_dir(os.environ) / OBJECTS_DIR)}
    if not isinstance(spec, dict):
        raise CommandError("[object_store] in the config file must be a table", EXIT_USAGE)
    path = spec.get("path")
    if spec.get("kind", "local") == "local" and isinstance(path, str) and config_path is not None:
        spec = {**spec, "path": str(relative_to(config_path.expanduser().absolute().parent, path))}
    from inboxd.adapters.objectstore import ObjectStoreConfig

    try:
        ObjectStoreConfig.from_mapping(spec)  # a bad table fails before any connection
    except ValueError as exc:
        raise CommandError(f"config file: {exc}", EXIT_USAGE) from exc
    return spec


def configured_mailboxes(config: Path | None) -> set[tuple[str, str]] | None:
    """(tenant, mailbox) of every mailbox the configuration's tenant files name; None
    without a configuration, without `[tenants]`, or when a tenant file has problems
    (its mailboxes are unknown then). Blocks: call from a worker thread."""
    if config is None:
        return None
    from inboxd.daemon.config.main import ConfigError, load_main, load_tenants

    try:
        tenants = load_tenants(load_main(config))
    except ConfigError:
        return None
    if tenants.problems:
        return None
    return {(t.tenant_id, m.mailbox_id) for t in tenants.tenants.values() for m in t.mailboxes}


class _NotRunning(Exception):
    """The embedded server a read-only command would use is not running."""


def _running_embedded() -> str:
    from inboxd.daemon.embedded_pg.server import find_running

    server = find_running(environ=os.environ)
    if server is None:
        raise _NotRunning
    return server.dsn


async def resolve(
    args: argparse.Namespace, config: dict[str, Any], *, start: bool = True
) -> DsnChoice:
    """The DSN to use (database.resolve_dsn), resolved in a worker thread.

    It may start the embedded server, which blocks for seconds on a first run.
    `start=False` is for commands that only read (status, db url, extract list,
    delivery status, sync): they use an embedded server that runs and never start one
    (a status typed after `inboxd db stop` must not bring up a database to report on
    an empty one), a CommandError saying how to start it instead.
    """
    embedded = None if start else _running_embedded
    try:
        return await anyio.to_thread.run_sync(
            lambda: resolve_dsn(args.dsn, config, embedded=embedded), abandon_on_cancel=True
        )
    except _NotRunning:
        data_dir, origin = data_dir_and_origin(os.environ)
        raise CommandError(
            f"no database is running: the embedded PostgreSQL of data directory {data_dir} "
            f"({origin}) is stopped; start it with 'inboxd run' (or 'make run'), or name a "
            f"running server with --dsn or {ENV_DSN}"
        ) from None
    except DsnError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from exc
    except EmbeddedPostgresError as exc:
        data_dir, origin = data_dir_and_origin(os.environ)
        raise CommandError(
            f"embedded PostgreSQL in {data_dir} ({origin}): {exc}; {WHICH_DATABASE_HINT}"
        ) from exc


@asynccontextmanager
async def open_pool(choice: DsnChoice, *, max_size: int = 2) -> AsyncIterator[asyncpg.Pool]:
    """A connected pool (database.connect_pool), closed on exit; errors as CommandError."""
    try:
        # min_size=0: after a lost connection asyncpg would otherwise reconnect in the
        # background to keep its floor, logging a traceback on every failed attempt.
        pool = await connect_pool(choice.dsn, min_size=0, max_size=max_size)
    except DatabaseUnavailable as exc:
        raise CommandError(f"{exc} ({origin_of(choice)}); {WHICH_DATABASE_HINT}") from exc
    except DatabaseRejected as exc:
        raise CommandError(f"{exc} ({origin_of(choice)})", EXIT_USAGE) from exc
    except DsnError as exc:
        raise CommandError(f"{exc} ({origin_of(choice)})", EXIT_USAGE) from exc
    try:
        yield pool
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(POOL_CLOSE_TIMEOUT_S):
            await pool.close()
        pool.terminate()  # no-op when close() finished; cuts stragglers when it did not


def origin_of(choice: DsnChoice) -> str:
    """Where the DSN came from, for messages: the option, variable or data directory."""
    if choice.source == "embedded":
        data_dir, origin = data_dir_and_origin(os.environ)
        return f"the embedded server of data directory {data_dir}, {origin}"
    return {"cli": "DSN from --dsn", "env": f"DSN from {ENV_DSN}"}.get(
        choice.source, "DSN from [database] dsn of --config"
    )


def target_of(choice: DsnChoice) -> str:
    """host:port (or socket) of a DSN, safe to print."""
    return describe_target(choice.dsn)


def emit_json(obj: dict[str, Any] | list[dict[str, Any]]) -> None:
    """Write `obj` as one JSON line on stdout."""
    sys.stdout.buffer.write(orjson.dumps(obj, option=orjson.OPT_APPEND_NEWLINE))
    sys.stdout.flush()


def database_error(exc: BaseException, choice: DsnChoice) -> CommandError:
    """An error from a statement, as a one-line CommandError naming the server."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return CommandError(f"database at {target_of(choice)}: {text}")
