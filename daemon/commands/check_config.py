"""`inboxd check-config FILE`: validate a main config and all its tenant files.

Prints every problem, one per line, as `file: key: message` on stderr and exits 2
(configuration error) when there is any; otherwise prints `config OK: N tenants,
M mailboxes` and exits 0. Secret references are resolved to report unset
variables and missing files; their values are never printed. Nothing else is
touched: no database, no network, no directory created.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import anyio.to_thread

from inboxd.daemon.commands.common import EXIT_OK, EXIT_USAGE, CommandError, Subparsers, emit_json
from inboxd.daemon.config.main import ConfigReport, inspect_config
from inboxd.daemon.webhooks.esp_config import build_delivery_hooks


def register(subparsers: Subparsers, parent: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "check-config",
        parents=[parent],
        help="validate a config file and its tenant files",
        description="Validate the main config FILE and every tenant file of its tenants "
        "directory: TOML syntax, unknown keys, types, ids, duplicate tenant "
        "and mailbox ids, secret references (resolved, never printed). "
        "Prints every problem on stderr and exits 2 if there is any.",
    )
    parser.add_argument(
        "file", metavar="FILE", type=Path, nargs="?", help="main config file (default: --config)"
    )
    parser.set_defaults(handler=run)


async def run(args: argparse.Namespace) -> int:
    path: Path | None = args.file or args.config
    if path is None:
        raise CommandError("check-config needs a config FILE", EXIT_USAGE)
    report = await anyio.to_thread.run_sync(inspect_config, path)
    if report.tenants is not None:
        report.problems.extend(build_delivery_hooks(report.tenants.tenants)[1])
    tenants = len(report.tenants.tenants) if report.tenants is not None else 0
    mailboxes = len(report.tenants.mailboxes) if report.tenants is not None else 0
    if args.json:
        emit_json(_as_json(path, report, tenants, mailboxes))
    if report.problems:
        for problem in report.problems:
            print(problem, file=sys.stderr)
        count = len(report.problems)
        raise CommandError(
            f"{path}: {count} configuration problem{'s' if count > 1 else ''}", EXIT_USAGE
        )
    if not args.json:
        print(f"config OK: {_plural(tenants, 'tenant')}, {_plural(mailboxes, 'mailbox')}")
    return EXIT_OK


def _as_json(path: Path, report: ConfigReport, tenants: int, mailboxes: int) -> dict[str, Any]:
    return {
        "command": "check-config",
        "status": "ok" if report.ok else "invalid",
        "config": str(path),
        "tenants": tenants,
        "mailboxes": mailboxes,
        "problems": [
            {"file": str(p.file), "key": p.key, "message": p.message} for p in report.problems
        ],
    }


def _plural(count: int, word: str) -> str:
    if count == 1:
        return f"{count} {word}"
    return f"{count} {word}{'es' if word.endswith('x') else 's'}"
