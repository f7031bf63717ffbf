"""The `inboxd` command line: parses arguments and dispatches to `commands/<name>.py`.

Each subcommand lives in its own module (`commands.migrate`, `commands.importer`,
`reprocess`, `extract`, `run`, `status`, `check-config`, `sync`, `delivery`, `db`, `connect`) and
registers its parser; this module only builds the parser, configures logging and turns
the outcome into an exit code (see `commands.common` for the codes). Every failure is one line on
stderr, ``inboxd: error: …``, without a traceback (``--log-level debug`` logs it)
and without a password.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

import anyio

PROG = "inboxd"
# Exit codes, repeated from commands.common so this module imports nothing heavy:
# anyio's worker processes (MIME parsing) re-run the parent's main module, and
# importing every command here cost each worker ~40 MB (bench/README.md).
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors as one line (exit 2) instead of usage + message."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{PROG}: error: {message} (see '{self.prog} --help')\n")


# Command name → its module under inboxd.daemon.commands, in the order `--help` lists
# them. Only the module of the command being run is imported: `run` and
# `check-config` import the whole daemon (aioboto3, aiohttp, the provider SDKs),
# ~1.2 s that `inboxd import` or `inboxd status` never needs.
COMMANDS = {
    "migrate": "migrate",
    "import": "importer",
    "reprocess": "reprocess",
    "extract": "extract",
    "check-config": "check_config",
    "run": "run",
    "status": "status",
    "sync": "sync",
    "delivery": "delivery",
    "events": "delivery",  # the old name of `delivery`
    "db": "db",
    "connect": "connect",
}


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser for `argv`: with only the named command's options when `argv` names
    one (see COMMANDS), else with every command (for `--help` and usage errors)."""
    parser = _Parser(
        prog=PROG,
        description="inboxd: every way email reaches an organisation, into PostgreSQL, "
        "exactly once.",
        epilog="Exit codes: 0 ok, 1 operational failure, 2 usage or configuration error, "
        "130 interrupted. Run 'inboxd COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {installed_version()}")
    from inboxd.daemon.commands.common import global_options

    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parent = global_options()
    named = next((arg for arg in (argv or ()) if not arg.startswith("-")), None)
    modules = [COMMANDS[named]] if named in COMMANDS else list(dict.fromkeys(COMMANDS.values()))
    for module in modules:
        importlib.import_module(f"inboxd.daemon.commands.{module}").register(subparsers, parent)
    return parser


def installed_version() -> str:
    """The installed distribution's version (pyproject.toml `version`), or "unknown" when
    inboxd runs from a tree that was never installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("inboxd")
    except PackageNotFoundError:
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit code (the console script exits with it)."""
    import structlog

    from inboxd.daemon.commands.common import CommandError
    from inboxd.daemon.logging import configure_logging

    if argv is None:
        argv = sys.argv[1:]
    args = build_parser(argv).parse_args(argv)
    configure_logging(None, level=args.log_level)
    try:
        exit_code: int = anyio.run(args.handler, args)
        return exit_code
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BaseException as exc:  # the one place that turns errors into exit codes
        leaf = _leaf(exc)
        if isinstance(leaf, CommandError):
            print(f"{PROG}: error: {leaf}", file=sys.stderr)
            return leaf.exit_code
        if isinstance(leaf, KeyboardInterrupt):
            print(f"{PROG}: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        if isinstance(leaf, SystemExit):
            raise
        structlog.get_logger(__name__).debug("command_crashed", exc_info=exc)
        text = " ".join(str(leaf).split())[:300]
        print(
            f"{PROG}: error: unexpected {type(leaf).__name__}: {text} "
            "(run with --log-level debug for details)",
            file=sys.stderr,
        )
        return EXIT_FAILURE


def _leaf(exc: BaseException) -> BaseException:
    """The first meaningful exception inside (nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup):
        inner = [e for e in exc.exceptions if not isinstance(e, asyncio.CancelledError)] or list(
            exc.exceptions
        )
        exc = inner[0]
    return exc


if __name__ == "__main__":
    sys.exit(main())
