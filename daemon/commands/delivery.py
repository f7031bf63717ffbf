"""`inboxd delivery status|replay`: look at and re-queue stored delivery events.

"events" alone means the outbox (the `events` table, `GET /v1/events`); this
command was `inboxd events` until it was renamed for that reason, and the old
spelling still works with a deprecation note on stderr.

`inboxd delivery status [--tenant T] [--json]` counts events per tenant, source
and state (pending / applied / dead), with the oldest pending event's receive
time and the latest error of a dead one: what an operator checks before a
replay.

`inboxd delivery replay [--dead] [--since T] [--source S] [--tenant T]`:

Puts stored delivery events back to pending (`pipeline.delivery.worker.replay_events`)
so the event workers of any running replica apply them again — after fixing
whatever made them dead, or to rebuild evidence and suppressions. Safe at any
time: applying an already-applied event changes nothing, and no event is
ever sent anywhere by replaying.

  --dead      only events in state dead (default: dead and applied)
  --since     only events received at or after this ISO-8601 time
  --source    only this delivery source id
  --tenant    only this tenant
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime

from inboxd.daemon.commands.common import (
    EXIT_OK,
    EXIT_USAGE,
    CommandError,
    Subparsers,
    emit_json,
    load_config,
    open_pool,
    resolve,
)
from inboxd.daemon.commands.status import database_call, format_time, valid_id_option
from inboxd.pipeline.delivery.worker import delivery_status, replay_events

# The command's name before 2026-12 (`inboxd events …`), kept working with a note.
DEPRECATED_NAME = "events"


def note_deprecated_name(args: argparse.Namespace) -> None:
    """One line on stderr when the command was typed with its old name."""
    if getattr(args, "command", None) == DEPRECATED_NAME:
        print(
            "inboxd: note: 'inboxd events' is now 'inboxd delivery'; the old name will be removed",
            file=sys.stderr,
        )


def register(subparsers: Subparsers, parent: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "delivery",
        aliases=[DEPRECATED_NAME],
        help="delivery events (ESP webhooks): status, replay",
        description="Work with stored delivery events (ESP webhooks).",
    )
    actions = parser.add_subparsers(dest="delivery_action", metavar="ACTION", required=True)
    replay = actions.add_parser(
        "replay",
        parents=[parent],
        help="re-queue events for the event workers",
        description="Re-queue stored delivery events; running daemons apply them again. "
        "Re-applying changes nothing that is already right. Exit codes: 0 done, "
        "1 database failure, 2 usage error.",
    )
    replay.add_argument("--dead", action="store_true", help="only dead events")
    replay.add_argument(
        "--since",
        metavar="TIME",
        help="only events received at or after TIME (ISO 8601; UTC if no offset)",
    )
    replay.add_argument("--source", metavar="S", help="only this delivery source id")
    replay.add_argument("--tenant", metavar="T", help="only this tenant")
    replay.set_defaults(handler=run_replay)
    status = actions.add_parser(
        "status",
        parents=[parent],
        help="count stored events by source and state",
        description="Count stored delivery events per tenant, source and state.",
    )
    status.add_argument("--tenant", metavar="T", help="only this tenant")
    status.set_defaults(handler=run_status)


async def run_status(args: argparse.Namespace) -> int:
    note_deprecated_name(args)
    tenant = valid_id_option("tenant", args.tenant)
    choice = await resolve(args, load_config(args.config), start=False)
    async with open_pool(choice, max_size=1) as pool, pool.acquire() as conn:
        with database_call(choice):
            rows = await delivery_status(conn, tenant)
    if args.json:
        for row in rows:
            if row["oldest_pending"] is not None:
                row["oldest_pending"] = row["oldest_pending"].isoformat()
        emit_json(rows)
        return EXIT_OK
    if not rows:
        print("no delivery events")
        return EXIT_OK
    print(
        f"{'TENANT':16} {'SOURCE':16} {'PENDING':>8} {'APPLIED':>9} {'DEAD':>6}  "
        "OLDEST PENDING        LAST DEAD ERROR"
    )
    for row in rows:
        oldest = format_time(row["oldest_pending"]) if row["oldest_pending"] else "-"
        error = (row["last_dead_error"] or "-")[:60]
        print(
            f"{row['tenant_id']:16} {row['source']:16} {row['pending']:>8} "
            f"{row['applied']:>9} {row['dead']:>6}  {oldest:21} {error}"
        )
    return EXIT_OK


def parse_since(text: str | None) -> datetime | None:
    """ISO-8601 time → aware datetime (UTC when no offset); CommandError (2) when invalid."""
    if text is None:
        return None
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise CommandError(f"--since: not an ISO 8601 time: {text!r}", EXIT_USAGE) from None
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


async def run_replay(args: argparse.Namespace) -> int:
    note_deprecated_name(args)
    since = parse_since(args.since)
    tenant = valid_id_option("tenant", args.tenant)
    source = valid_id_option("source", args.source)
    choice = await resolve(args, load_config(args.config))
    async with open_pool(choice, max_size=1) as pool, pool.acquire() as conn:
        with database_call(choice):
            count = await replay_events(
                conn, tenant_id=tenant, dead_only=args.dead, since=since, source=source
            )
    if args.json:
        emit_json({"command": "delivery replay", "status": "ok", "requeued": count})
    else:
        which = "dead " if args.dead else ""
        print(f"{count} {which}delivery event{'s' if count != 1 else ''} re-queued")
    return EXIT_OK
