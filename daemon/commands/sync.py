"""`inboxd sync cancel|now --mailbox M [--tenant T]`: steer a mailbox's sync from anywhere.

Both act through the database, so they reach whichever replica syncs the
mailbox, from any host that can reach the database:

  cancel   sets the mailbox's cancel flag while a sync runs
           (`pipeline.mailbox.leases.cancel_running_sync`); the running sync stops
           between pages, without moving its cursor past unprocessed work, and
           clears the flag. With no sync running it says so and sets nothing.
  now      rings the doorbell (`pipeline.doorbell.ring`, NOTIFY inboxd_doorbell);
           a listening daemon syncs the mailbox at once, or right after the run
           in progress (coalesced). Nothing happens when no daemon listens:
           the poll scanner catches up on its interval.

The mailbox id alone is enough when it is unique across tenants; otherwise
--tenant is required (exit 2 names the tenants). A mailbox that does not exist
is exit 1.
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable

import asyncpg

from inboxd.daemon.commands.common import (
    EXIT_FAILURE,
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
from inboxd.pipeline.doorbell import DOORBELL_CHANNEL, ring
from inboxd.pipeline.mailbox import leases
from inboxd.pipeline.mailbox import status as mailbox_status


def register(subparsers: Subparsers, parent: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "sync",
        help="cancel a mailbox's running sync, or start one now",
        description="Steer one mailbox's sync through the database, whichever replica "
        "runs it. Exit codes: 0 done, 1 no such mailbox or database failure, "
        "2 usage error or a mailbox id found in several tenants.",
    )
    actions = parser.add_subparsers(dest="sync_action", metavar="ACTION", required=True)
    for name, help_text, handler in (
        ("cancel", "stop the mailbox's running sync between pages (cursor kept safe)", run_cancel),
        ("now", "ring the mailbox's doorbell: a running daemon syncs it at once", run_now),
    ):
        action = actions.add_parser(
            name,
            parents=[parent],
            help=help_text,
            description=help_text[0].upper() + help_text[1:] + ".",
        )
        action.add_argument("--mailbox", metavar="M", required=True, help="mailbox id")
        action.add_argument(
            "--tenant",
            metavar="T",
            help="tenant of the mailbox (needed when the id exists in several tenants)",
        )
        action.set_defaults(handler=handler)


async def run_cancel(args: argparse.Namespace) -> int:
    async def act(pool: asyncpg.Pool, tenant: str, mailbox: str) -> None:
        running = await leases.cancel_running_sync(pool, tenant, mailbox)
        if running is None:
            raise CommandError(f"no mailbox {mailbox} in tenant {tenant}", EXIT_FAILURE)
        status = await _status(pool, tenant, mailbox) if running else None
        owner = status.lease_owner if status is not None else None
        if args.json:
            emit_json(
                {
                    "command": "sync cancel",
                    "status": "ok",
                    "tenant": tenant,
                    "mailbox": mailbox,
                    "running": running,
                    "lease_owner": owner,
                }
            )
        elif running:
            print(
                f"cancel requested for {tenant}/{mailbox}: the sync running in {owner} "
                "stops after its current page"
            )
        else:
            print(f"no sync is running for {tenant}/{mailbox}: nothing to cancel (nothing set)")

    return await _with_mailbox(args, act)


async def run_now(args: argparse.Namespace) -> int:
    async def act(pool: asyncpg.Pool, tenant: str, mailbox: str) -> None:
        await ring(pool, tenant, mailbox)
        status = await _status(pool, tenant, mailbox)
        throttle_until = status.throttle_until if status and status.throttled else None
        if args.json:
            emit_json(
                {
                    "command": "sync now",
                    "status": "ok",
                    "tenant": tenant,
                    "mailbox": mailbox,
                    "channel": DOORBELL_CHANNEL,
                    "throttle_until": throttle_until.isoformat() if throttle_until else None,
                }
            )
            return
        print(
            f"doorbell rung for {tenant}/{mailbox}: a running inboxd syncs it now, "
            "or right after the sync in progress"
        )
        if throttle_until is not None:
            print(
                f"note: the mailbox is throttled until {format_time(throttle_until)} "
                "(provider backoff)"
            )

    return await _with_mailbox(args, act)


async def _with_mailbox(
    args: argparse.Namespace,
    act: Callable[[asyncpg.Pool, str, str], Awaitable[None]],
) -> int:
    """Resolve DSN and (tenant, mailbox), then run `act` with a pool."""
    mailbox = valid_id_option("mailbox", args.mailbox) or ""
    tenant = valid_id_option("tenant", args.tenant)
    config = load_config(args.config)
    choice = await resolve(args, config, start=False)
    async with open_pool(choice, max_size=1) as pool:
        with database_call(choice):
            tenant = await find_tenant(pool, mailbox, tenant)
            await act(pool, tenant, mailbox)
    return EXIT_OK


async def _status(
    pool: asyncpg.Pool, tenant: str, mailbox: str
) -> mailbox_status.MailboxStatus | None:
    statuses = await mailbox_status.mailbox_status(pool, tenant, mailbox_id=mailbox)
    return statuses[0] if statuses else None


async def find_tenant(pool: asyncpg.Pool, mailbox: str, tenant: str | None) -> str:
    """The tenant owning `mailbox`; CommandError when missing (1) or ambiguous (2)."""
    tenants = await mailbox_status.tenants_of_mailbox(pool, mailbox)
    if tenant is not None:
        if tenant in tenants:
            return tenant
        elsewhere = f" (it exists in tenant {', '.join(tenants)})" if tenants else ""
        raise CommandError(f"no mailbox {mailbox} in tenant {tenant}{elsewhere}", EXIT_FAILURE)
    if not tenants:
        raise CommandError(f"no mailbox {mailbox} in any tenant", EXIT_FAILURE)
    if len(tenants) > 1:
        raise CommandError(
            f"mailbox {mailbox} exists in {len(tenants)} tenants ({', '.join(tenants)}): "
            "choose one with --tenant",
            EXIT_USAGE,
        )
    return tenants[0]
