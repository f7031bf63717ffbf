"""`inboxd db url|stop`: which database the commands use, and stopping the embedded one.

`inboxd db url` resolves the DSN exactly as every other command does (`--dsn`,
`INBOXD_DSN`, `[database] dsn` of `--config`, else the embedded server of the data
directory, started when it is not running) and prints it, so
`psql "$(inboxd db url)"` opens the database `inboxd status` reads. `--psql` prints
the whole psql command line instead; `--json` adds where the DSN came from, the
server and the data directory. A password in a configured DSN is printed masked
(psql then reads it from PGPASSWORD or ~/.pgpass); the embedded server needs none.

`inboxd db stop` fast-shuts-down the embedded server of the data directory
(`embedded_pg.stop_embedded`: sessions rolled back, checkpoint, exit) and waits
until it has exited; with none running it says so and exits 0 too. `make clean`
runs it before deleting `var/`: a postmaster whose directory was deleted under it
keeps running, and holding its memory, until the machine reboots.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
from pathlib import Path

import anyio.to_thread

from inboxd.daemon.commands.common import (
    EXIT_OK,
    CommandError,
    Subparsers,
    emit_json,
    load_config,
    resolve,
    target_of,
)
from inboxd.daemon.database import dsn_has_password
from inboxd.daemon.embedded_pg.binaries import find_binaries
from inboxd.daemon.embedded_pg.data_dir import data_dir_and_origin
from inboxd.daemon.embedded_pg.errors import EmbeddedPostgresError
from inboxd.daemon.embedded_pg.server import stop_embedded


def register(subparsers: Subparsers, parent: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "db",
        help="the database commands use: print its URL, stop the embedded server",
        description="Which PostgreSQL inboxd commands use (README 'Which database').",
    )
    actions = parser.add_subparsers(dest="db_action", metavar="ACTION", required=True)
    url = actions.add_parser(
        "url",
        parents=[parent],
        help="print the DSN every command would use (starts the embedded server if needed)",
        description="Print the DSN inboxd commands use, resolved like every command: "
        "--dsn, INBOXD_DSN, [database] dsn of --config, else the embedded server of "
        'INBOXD_DATA_DIR (started when not running). Use: psql "$(inboxd db url)".',
    )
    url.add_argument(
        "--psql", action="store_true", help="print a psql command line instead of the DSN"
    )
    url.set_defaults(handler=run_url)
    stop = actions.add_parser(
        "stop",
        parents=[parent],
        help="stop the embedded PostgreSQL of the data directory",
        description="Stop the embedded PostgreSQL of INBOXD_DATA_DIR and wait until it "
        "has exited (exit 0 also when none was running).",
    )
    stop.set_defaults(handler=run_stop)


async def run_url(args: argparse.Namespace) -> int:
    choice = await resolve(args, load_config(args.config), start=False)
    has_password = dsn_has_password(choice.dsn)
    shown = choice.masked if has_password else choice.dsn
    psql = f"{shlex.quote(_psql_path())} {shlex.quote(shown)}"
    data_dir = data_dir_and_origin(os.environ)[0] if choice.source == "embedded" else None
    if args.json:
        emit_json(
            {
                "dsn": shown,
                "password_masked": has_password,
                "source": choice.source,
                "server": target_of(choice),
                "data_dir": None if data_dir is None else str(data_dir),
                "psql": psql,
            }
        )
    else:
        print(psql if args.psql else shown)
    return EXIT_OK


async def run_stop(args: argparse.Namespace) -> int:
    data_dir, origin = data_dir_and_origin(os.environ)
    try:
        stopped = await anyio.to_thread.run_sync(stop_embedded)
    except EmbeddedPostgresError as exc:
        raise CommandError(f"embedded PostgreSQL in {data_dir} ({origin}): {exc}") from exc
    if args.json:
        emit_json({"data_dir": str(data_dir), "stopped": stopped})
    elif stopped:
        print(f"embedded PostgreSQL in {data_dir} stopped")
    else:
        print(f"no embedded PostgreSQL running in {data_dir} ({origin})")
    return EXIT_OK


def _psql_path() -> str:
    """psql on PATH, else the one shipped beside the embedded server's binaries."""
    if found := shutil.which("psql"):
        return found
    for bins in find_binaries():
        if (candidate := Path(bins.bin_dir) / "psql").is_file():
            return str(candidate)
    return "psql"
