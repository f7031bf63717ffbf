"""Keeping an Outlook mailbox's change-notification subscriptions alive.

One subscription per synced folder (`users/{u}/mailFolders('{folder}')/messages`,
changeType `created`: updates and deletions come through delta), each with a
random `clientState` kept in `graph_subscriptions` (adapters/outlook/tables.py)
and never logged. `maintain()` runs at the start of every sync run, before delta:

    no row, or lifecycle subscriptionRemoved   create (Graph validates both URLs
                                               first; the listener answers)
    less than half its lifetime left, or       renew (PATCH expirationDateTime);
    lifecycle reauthorizationRequired          a 404 means Graph dropped it: create
    lifecycle missed                           nothing here: this run's delta is the
                                               resync
    then                                       the lifecycle event is cleared (only
                                               if none arrived meanwhile)

A failure (Graph down, validation refused) is recorded on the subscription row and
logged; it never stops the sync, which goes on by delta, and the next run tries
again — runs come from pushes, polls, or push mode's daily safety sync, so a failed
renewal is retried at least daily while the subscription still has days left.
`forget()` deletes them at Graph and in the table (a mailbox removed on SIGHUP).
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

import asyncpg
import structlog

from inboxd.adapters.outlook import tables as rows
from inboxd.adapters.outlook.client import GraphClient
from inboxd.adapters.outlook.config import OutlookMailbox, OutlookSettings
from inboxd.adapters.outlook.errors import (
    OutlookAuthError,
    OutlookRequestRejected,
    OutlookRetriable,
)
from inboxd.pipeline.errors import describe

__all__ = ["SUBSCRIPTION_LIFETIME", "SubscriptionKeeper"]

log = structlog.get_logger(__name__)

#: Lifetime asked for. Graph's maximum for Outlook messages is 10,080 minutes in
#: today's docs (4,230 in older ones, and Graph refuses a longer expiry with 400):
#: 4,200 minutes is valid under both, and renewal at half of it (35 h) is well
#: inside push mode's daily safety sync.
SUBSCRIPTION_LIFETIME = timedelta(minutes=4200)
#: Bytes of randomness in a clientState (Graph allows up to 128 characters).
CLIENT_STATE_BYTES = 32

WatchRecorder = Callable[[datetime | None], Awaitable[None]]


class SubscriptionKeeper:
    """The subscriptions of one mailbox (module docstring)."""

    def __init__(
        self,
        tenant_id: str,
        mailbox_id: str,
        settings: OutlookSettings,
        mailbox: OutlookMailbox,
        pool: asyncpg.Pool,
        record_watch: WatchRecorder | None = None,
    ) -> None:
        self.tenant_id = tenant_id
        self.mailbox_id = mailbox_id
        self.mailbox = mailbox
        self.pool = pool
        self._urls = settings.push_urls(tenant_id)
        self._record_watch = record_watch
        self._log = log.bind(tenant=tenant_id, mailbox=mailbox_id)

    @property
    def enabled(self) -> bool:
        return self._urls is not None

    async def maintain(self, client: GraphClient, *, now: datetime | None = None) -> None:
        """Create, renew or recreate what needs it (module docstring). Auth errors
        propagate (the mailbox needs attention); others are recorded and logged."""
        if self._urls is None:
            return
        now = now or datetime.now(UTC)
        current = {
            s.folder: s
            for s in await rows.subscriptions_of(self.pool, self.tenant_id, self.mailbox_id)
        }
        for folder in self.mailbox.folders:
            row = current.get(folder)
            try:
                if row is None or row.lifecycle_event == "subscriptionRemoved":
                    await self._create(client, folder, now)
                elif (
                    row.lifecycle_event == "reauthorizationRequired"
                    or row.expires_at - now < SUBSCRIPTION_LIFETIME / 2
                ):
                    await self._renew(client, folder, row.subscription_id, now)
            except OutlookAuthError:
                raise
            except (OutlookRetriable, OutlookRequestRejected) as exc:
                await rows.record_renew_failure(
                    self.pool, self.tenant_id, self.mailbox_id, folder, describe(exc)
                )
                self._log.warning("graph_subscription_failed", folder=folder, error=describe(exc))
                continue
            if row is not None and row.lifecycle_event is not None:
                await rows.clear_lifecycle(
                    self.pool, self.tenant_id, self.mailbox_id, folder, seen_at=row.lifecycle_at
                )
        await self._record_expiry()

    async def forget(self, client: GraphClient) -> None:
        """Delete every subscription of the mailbox at Graph, then the rows."""
        for row in await rows.subscriptions_of(self.pool, self.tenant_id, self.mailbox_id):
            await client.delete_subscription(row.subscription_id)
        await rows.delete_subscriptions(self.pool, self.tenant_id, self.mailbox_id)
        if self._record_watch is not None:
            await self._record_watch(None)

    async def _create(self, client: GraphClient, folder: str, now: datetime) -> None:
        assert self._urls is not None
        notification_url, lifecycle_url = self._urls
        client_state = secrets.token_urlsafe(CLIENT_STATE_BYTES)
        created = await client.create_subscription(
            folder, notification_url, lifecycle_url, client_state, now + SUBSCRIPTION_LIFETIME
        )
        await rows.save_subscription(
            self.pool,
            self.tenant_id,
            self.mailbox_id,
            folder,
            created.id,
            client_state,
            created.expires_at,
        )
        self._log.info(
            "graph_subscription_created", folder=folder, expires_at=str(created.expires_at)
        )

    async def _renew(
        self, client: GraphClient, folder: str, subscription_id: str, now: datetime
    ) -> None:
        try:
            renewed = await client.renew_subscription(subscription_id, now + SUBSCRIPTION_LIFETIME)
        except OutlookRequestRejected as exc:
            if exc.status != 404:
                raise
            await self._create(client, folder, now)  # Graph dropped it meanwhile
            return
        await rows.record_renewal(
            self.pool, self.tenant_id, self.mailbox_id, folder, renewed.expires_at
        )
        self._log.info(
            "graph_subscription_renewed", folder=folder, expires_at=str(renewed.expires_at)
        )

    async def _record_expiry(self) -> None:
        if self._record_watch is None:
            return
        current = await rows.subscriptions_of(self.pool, self.tenant_id, self.mailbox_id)
        wanted = [s.expires_at for s in current if s.folder in self.mailbox.folders]
        await self._record_watch(min(wanted) if wanted else None)
