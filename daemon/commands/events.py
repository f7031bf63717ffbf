"""`inboxd events replay [--dead] [--since T] [--source S] [--tenant T]`: re-queue delivery events.

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
from datetime import UTC, datetime

from inboxd.daemon.commands.common import (
    EXIT_OK,
    EXIT_USAGE,
    CommandError,
    emit_json,
    load_config,
    open_pool,
    resolve,
)
from inboxd.daemon.commands.status import database_call, valid_id_option
from inboxd.pipeline.delivery.worker import replay_events


def register(subparsers: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "events", help="delivery events: replay stored events",
        description="Work with stored delivery events (ESP webhooks).")
    actions = parser.add_subparsers(dest="events_action", metavar="ACTION", required=True)
    replay = actions.add_parser(
        "replay", parents=[parent], help="re-queue events for the event workers",
        description="Re-queue stored delivery events; running daemons apply them again. "
                    "Re-applying changes nothing that is already right. Exit codes: 0 done, "
                    "1 database failure, 2 usage error.")
    replay.add_argument("--dead", action="store_true", help="only dead events")
    replay.add_argument("--since", metavar="TIME",
                        help="only events received at or after TIME (ISO 8601; UTC if no offset)")
    replay.add_argument("--source", metavar="S", help="only this delivery source id")
    replay.add_argument("--tenant", metavar="T", help="only this tenant")
    replay.set_defaults(handler=run_replay)


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
    since = parse_since(args.since)
    tenant = valid_id_option("tenant", args.tenant)
    source = valid_id_option("source", args.source)
    choice = await resolve(args, load_config(args.config))
    async with open_pool(choice, max_size=1) as pool, pool.acquire() as conn:
        with database_call(choice):
            count = await replay_events(conn, tenant_id=tenant, dead_only=args.dead,
                                        since=since, source=source)
    if args.json:
        emit_json({"command": "events replay", "status": "ok", "requeued": count})
    else:
        which = "dead " if args.dead else ""
        print(f"{count} {which}delivery event{'s' if count != 1 else ''} re-queued")
    return EXIT_OK
