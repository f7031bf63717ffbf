"""`inboxd status`: which daemons run, then each mailbox's cursor, lag, throttle, state
and last error.

First line: the daemons recorded in `inboxd_daemons` (pipeline/mailbox/presence.py) — each
running replica's host, pid, version, start and last heartbeat, or when one was last
seen; `--daemons` shows them alone (with --json, a list). A mailbox that the
configuration given with --config does not name (removed from its tenant file, or a
typo'd id an earlier config had) is "not configured", without a lag, instead of an idle
mailbox whose lag grows for ever. A last error is shown with its time, and only while
no sync succeeded after it.

After the mailboxes, when a tenant has any, the extraction backlog: jobs by
state per processor and the feeder's inbox (daemon/commands/status_extraction.py);
`--extraction` shows it alone (with --json, as a list per tenant).

Read-only: one query (`pipeline.mailbox.status.mailbox_status`) against the database
the other commands use, so it shows what every replica sees, whichever
process runs it. On a terminal the table is drawn with rich; piped, it is
plain text in aligned columns (one line per mailbox, greppable); `--json`
prints a JSON list with one object per mailbox and every field, times in
RFC 3339 UTC.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime

import anyio
import asyncpg
import orjson

from inboxd.adapters.ses.tables import PollerRow, queue_summary
from inboxd.daemon.commands.common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    CommandError,
    Subparsers,
    configured_mailboxes,
    database_error,
    load_config,
    open_pool,
    resolve,
    target_of,
)
from inboxd.daemon.commands.status_extraction import TenantExtraction, extraction_status
from inboxd.daemon.database import DsnChoice
from inboxd.pipeline.errors import DATABASE_ERRORS
from inboxd.pipeline.mailbox.presence import DaemonRow, daemons
from inboxd.pipeline.mailbox.status import MailboxStatus, mailbox_status
from inboxd.pipeline.tenancy import validate_id

# A few small statements; a server that does not answer within this is stuck.
QUERY_TIMEOUT_S = 30.0
# Cursors are provider strings up to a Graph deltaLink URL (~300 chars): the
# table shows the start and the end, where the token is.
CURSOR_SHOWN_CHARS = 24
ERROR_SHOWN_CHARS = 60
COLUMNS = (
    "TENANT",
    "MAILBOX",
    "PROVIDER",
    "MODE",
    "CURSOR",
    "LAST SUCCESS",
    "LAG",
    "THROTTLE UNTIL",
    "STATE",
    "DEAD",
    "ATT PENDING",
    "LAST ERROR",
)


def register(subparsers: Subparsers, parent: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "status",
        parents=[parent],
        help="show each mailbox's cursor, lag, throttle and last error",
        description="Show every mailbox's sync position and health from the database: "
        "tenant, mailbox, provider, sync mode, cursor, last successful sync, lag "
        "since then, throttle, state and last error. --json prints a list of "
        "objects with all fields. Run `inboxd migrate` first on a new database.",
    )
    parser.add_argument("--tenant", metavar="T", help="only this tenant's mailboxes")
    only = parser.add_mutually_exclusive_group()
    only.add_argument(
        "--extraction",
        action="store_true",
        help="show the extraction backlog instead: per tenant and processor, jobs pending, "
        "running, in retry_wait and needing review, due now and the oldest due one's wait, "
        "and the new mail not yet matched to processors (with --json, a list per tenant)",
    )
    only.add_argument(
        "--daemons",
        action="store_true",
        help="show the daemons instead: each replica's host, pid, version, start time, last "
        "heartbeat and whether it runs (with --json, a list)",
    )
    only.add_argument(
        "--queues",
        action="store_true",
        help="show the queue pollers (SES SQS) instead: queue, messages received, stored, "
        "duplicate, dead, unrouted, left for redelivery, last error (with --json, a list)",
    )
    parser.set_defaults(handler=run)


async def run(args: argparse.Namespace) -> int:
    tenant = valid_id_option("tenant", args.tenant)
    config = load_config(args.config)
    choice = await resolve(args, config, start=False)
    configured = await anyio.to_thread.run_sync(configured_mailboxes, args.config)
    async with open_pool(choice, max_size=1) as pool:
        with database_call(choice):
            running = await daemons(pool)
            statuses = await mailbox_status(pool, tenant)
            # tenant-less: shown to the operator's whole view only
            pollers = [] if tenant else await _pollers(pool)
            extraction = await extraction_status(pool, tenant)
    if args.daemons:
        _print_daemons(running, as_json=args.json)
        return EXIT_OK
    if args.extraction:
        _print_extraction(extraction, as_json=args.json)
        return EXIT_OK
    if args.queues:
        _print_pollers(pollers, as_json=args.json)
        return EXIT_OK
    views = [MailboxView(s, _is_configured(s, configured)) for s in statuses]
    if args.json:
        sys.stdout.buffer.write(
            orjson.dumps([as_json(v) for v in views], option=orjson.OPT_APPEND_NEWLINE)
        )
        sys.stdout.flush()
        return EXIT_OK
    print(daemons_line(running))
    if not statuses:
        print(
            "no mailboxes"
            + (f" in tenant {tenant}" if tenant else "")
            + " (they are created from the tenant config by `inboxd run`, or by `inboxd import`)"
        )
    elif sys.stdout.isatty():
        _print_rich([table_row(v) for v in views])
    else:
        print(plain_table([table_row(v) for v in views]))
    if pollers:
        print()
        _print_pollers(pollers, as_json=False)
    if extraction:
        print()
        _print_extraction(extraction, as_json=False)
    return EXIT_OK


EXTRACTION_COLUMNS = (
    "TENANT",
    "PROCESSOR",
    "PENDING",
    "RUNNING",
    "RETRY WAIT",
    "NEEDS REVIEW",
    "DUE",
    "OLDEST DUE",
)


def _print_extraction(tenants: list[TenantExtraction], *, as_json: bool) -> None:
    if as_json:
        sys.stdout.buffer.write(
            orjson.dumps([t.as_json() for t in tenants], option=orjson.OPT_APPEND_NEWLINE)
        )
        sys.stdout.flush()
        return
    if not tenants:
        print("no extraction backlog (every job completed, no new mail waiting)")
        return
    rows = [
        (
            t.tenant_id,
            b.processor_id,
            str(b.pending),
            str(b.running),
            str(b.retry_wait),
            str(b.needs_review),
            str(b.due),
            format_duration(b.oldest_due_s) if b.due else "-",
        )
        for t in tenants
        for b in t.processors
    ]
    if rows:
        print(plain_table(rows, EXTRACTION_COLUMNS))
    for t in tenants:
        if t.inbox:
            print(
                f"extraction inbox of {t.tenant_id}: {t.inbox} new messages not yet matched "
                f"to processors (oldest {format_duration(t.inbox_oldest_s)})"
            )


POLLER_COLUMNS = (
    "QUEUE",
    "DAEMON",
    "RECEIVED",
    "STORED",
    "DUPLICATE",
    "DEAD",
    "UNROUTED",
    "UNROUTED OPEN",
    "LEFT",
    "LAST ERROR",
)


async def _pollers(pool: asyncpg.Pool) -> list[PollerRow]:
    async with pool.acquire() as conn:
        return await queue_summary(conn)


def _print_pollers(pollers: list[PollerRow], *, as_json: bool) -> None:
    if as_json:
        sys.stdout.buffer.write(
            orjson.dumps([dataclasses.asdict(p) for p in pollers], option=orjson.OPT_APPEND_NEWLINE)
        )
        sys.stdout.flush()
        return
    if not pollers:
        print("no queue pollers running (a daemon with an [ses] table runs one)")
        return
    rows = [
        (
            p.door,
            p.owner,
            str(p.received),
            str(p.stored),
            str(p.duplicates),
            str(p.dead),
            str(p.unrouted),
            str(p.unrouted_open),
            str(p.left_for_retry),
            shorten_end(p.last_error, ERROR_SHOWN_CHARS) if p.last_error else "-",
        )
        for p in pollers
    ]
    print(plain_table(rows, POLLER_COLUMNS))


@contextmanager
def database_call(choice: DsnChoice) -> Iterator[None]:
    """Statements under QUERY_TIMEOUT_S; their errors as one-line CommandErrors."""
    try:
        with anyio.fail_after(QUERY_TIMEOUT_S):
            yield
    except (asyncpg.UndefinedTableError, asyncpg.UndefinedColumnError) as exc:
        raise CommandError(
            f"database at {target_of(choice)} has no inboxd schema, or an older one: "
            "run `inboxd migrate`",
            EXIT_FAILURE,
        ) from exc
    except TimeoutError as exc:
        raise CommandError(
            f"database at {target_of(choice)} did not answer within {QUERY_TIMEOUT_S:g} s"
        ) from exc
    except DATABASE_ERRORS as exc:
        raise database_error(exc, choice) from exc


@dataclasses.dataclass(frozen=True, slots=True)
class MailboxView:
    """A mailbox's status as shown: `configured` is None when no configuration was
    given to compare with (or it has problems), False for a mailbox it does not name."""

    status: MailboxStatus
    configured: bool | None

    @property
    def error_is_current(self) -> bool:
        """The last error happened after the last successful sync (or there was none)."""
        s = self.status
        if s.last_error is None:
            return False
        if s.last_success_at is None or s.last_error_at is None:
            return True
        return s.last_error_at >= s.last_success_at


def _is_configured(s: MailboxStatus, configured: set[tuple[str, str]] | None) -> bool | None:
    if configured is None or s.provider == "import":  # imported mail has no config entry
        return None
    return (s.tenant_id, s.mailbox_id) in configured


def as_json(view: MailboxView) -> dict[str, object]:
    """Every field of a status; lag rounded to milliseconds; `configured` (null: not
    compared) and `last_error_current` (the error came after the last success)."""
    status = view.status
    out = dataclasses.asdict(status)
    if status.lag_s is not None:
        out["lag_s"] = round(status.lag_s, 3)
    out["configured"] = view.configured
    out["last_error_current"] = view.error_is_current
    return out


def table_row(view: MailboxView) -> tuple[str, ...]:
    s = view.status
    unconfigured = view.configured is False
    state = "not configured" if unconfigured else s.sync_state
    state += " (cancel requested)" if s.cancel_requested else ""
    error = "-"
    if view.error_is_current and s.last_error is not None:
        when = f"{format_time(s.last_error_at)}: " if s.last_error_at else ""
        error = shorten_end(when + s.last_error, ERROR_SHOWN_CHARS + len(when))
    return (
        s.tenant_id,
        s.mailbox_id,
        s.provider,
        s.sync_mode,
        shorten_middle(s.cursor, CURSOR_SHOWN_CHARS) if s.cursor else "-",
        format_time(s.last_success_at) if s.last_success_at else "never",
        format_duration(s.lag_s) if s.lag_s is not None and not unconfigured else "-",
        format_time(s.throttle_until) if s.throttled and s.throttle_until else "-",
        state,
        str(s.dead_items),
        str(s.attachments_pending),
        error,
    )


def daemons_line(rows: list[DaemonRow]) -> str:
    """One line: the running daemons, or when one was last seen."""
    alive = [d for d in rows if d.running]
    if alive:
        shown = "; ".join(
            f"{d.host} pid {d.pid} inboxd {d.version}, started {format_time(d.started_at)}, "
            f"heartbeat {format_duration(d.heartbeat_age_s)} ago"
            for d in alive
        )
        return f"daemons: {len(alive)} running — {shown}"
    if rows:
        last = rows[0]
        return (
            f"daemons: none running (last seen: {last.host} pid {last.pid}, heartbeat "
            f"{format_duration(last.heartbeat_age_s)} ago); mail is not being synced"
        )
    return "daemons: none has run against this database; start one with 'inboxd run'"


def _print_daemons(rows: list[DaemonRow], *, as_json: bool) -> None:
    if as_json:
        out = [
            dataclasses.asdict(d) | {"heartbeat_age_s": round(d.heartbeat_age_s, 3)} for d in rows
        ]
        sys.stdout.buffer.write(orjson.dumps(out, option=orjson.OPT_APPEND_NEWLINE))
        sys.stdout.flush()
        return
    print(daemons_line(rows))


def plain_table(rows: Sequence[tuple[str, ...]], columns: tuple[str, ...] = COLUMNS) -> str:
    """Columns and rows as text, columns padded to their widest cell, no trailing blanks."""
    widths = [max(len(r[i]) for r in [columns, *rows]) for i in range(len(columns))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(r, widths, strict=True)).rstrip()
        for r in [columns, *rows]
    )


def _print_rich(rows: list[tuple[str, ...]]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, header_style="bold")
    for name in COLUMNS:
        table.add_column(name, overflow="fold" if name == "LAST ERROR" else "ellipsis")
    for r in rows:
        style = (
            "red"
            if r[8].startswith("needs_attention")
            else ("yellow" if r[7] != "-" or r[8].startswith("not configured") else None)
        )
        table.add_row(*(Text(cell) for cell in r), style=style)  # cells are data, not markup
    Console().print(table)


def format_time(value: datetime) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def format_duration(seconds: float) -> str:
    """42s, 3m05s, 2h10m, 3d04h: two units at most, for a lag column."""
    total = max(0, int(seconds))
    days, rest = divmod(total, 86_400)
    hours, rest = divmod(rest, 3_600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def shorten_middle(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    head = (limit - 1) // 2
    return text[:head] + "…" + text[len(text) - (limit - 1 - head) :]


def shorten_end(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def valid_id_option(kind: str, value: str | None) -> str | None:
    """A --tenant/--mailbox value checked like the ids in config (exit 2 when invalid)."""
    if value is None:
        return None
    try:
        return validate_id(kind, value)
    except ValueError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from exc
