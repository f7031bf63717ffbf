"""The Outlook sync loop: `pages(cursor)` of the source contract (adapters/base.py).

The cursor is one delta position per synced folder (cursor.py). One run:

    subscriptions.maintain()        create / renew / recreate (push only); never
                                    moves a delta position
    per folder, in config order:
      position absent               a fresh round: `…/mailFolders/{f}/messages/delta()`
                                    with the backfill $filter (its bound kept in the
                                    cursor as `since`); pages flagged backfill
      since only (state expired)    a fresh round with the same bound: everything the
                                    expired state would have reported, the mail that
                                    arrived while the cursor was stale included
      otherwise                     the stored nextLink or deltaLink
      each delta page → Page
        items       messages in the folder this mailbox does not store yet (one
                    "which are stored" query per page), fetched raw by $batch
        labels      every message of the page now in the folder: [folder] (a copy
                    marked removed that is back in a synced folder is restored)
        removed     `@removed` entries of copies we store, looked up: gone → "deleted",
                    in a folder we do not sync → "moved"; in another synced folder →
                    its labels there instead (Graph says "deleted" for moves too)
        cursor_after  the whole cursor with this folder at the page's nextLink,
                    or at the round's deltaLink on its last page
    410 Gone / syncStateNotFound on a folder → CursorExpired(restart_from = the
    cursor this run started from, that folder at "since only"): the runner records
    the reset and resyncs; only that folder starts a fresh round, and the cascade
    and the "stored" query make it idempotent with no body downloaded twice.

Pages are pipelined (adapters/overlap.py): the next delta page is read and its
bodies downloaded while the current one is parsed. External id = immutable id,
thread key = conversationId, labels = [folder]; `sentitems` copies are outbound.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import asyncpg

from inboxd.adapters.base import Page
from inboxd.adapters.outlook.auth import GraphTokens
from inboxd.adapters.outlook.client import DeltaPage, GraphClient, RawBatch
from inboxd.adapters.outlook.config import SENT_FOLDER, OutlookMailbox, OutlookSettings
from inboxd.adapters.outlook.cursor import DeltaCursor, bound_of
from inboxd.adapters.outlook.errors import DeltaExpired
from inboxd.adapters.outlook.subscriptions import SubscriptionKeeper, WatchRecorder
from inboxd.adapters.outlook.token_store import DatabaseRefreshTokens
from inboxd.adapters.outlook.transport import GraphTransport
from inboxd.adapters.overlap import overlapped_pages
from inboxd.pipeline.errors import CursorExpired
from inboxd.pipeline.message import AttachmentData, DeadItem, MessageData
from inboxd.pipeline.mime.workers import parse_in_workers
from inboxd.pipeline.outcomes import ItemResult

__all__ = ["KnownCopies", "OutlookSource"]

PROVIDER = "outlook"
HTTP_TIMEOUT_S = 60.0
#: How far our clock may run ahead of Exchange's before a first round's "now"
#: bound (backfill "none") drops mail: 15 minutes, three times the 5 minutes of
#: clock skew Entra's own token validation tolerates. Mail received up to this long
#: before the mailbox was added is stored too (once, as part of the first round).
CLOCK_SKEW_MARGIN_S = 15 * 60.0

KnownCopies = Callable[[Sequence[str]], Awaitable[set[str]]]


@dataclass(slots=True)
class _Downloaded:
    """A delta page whose new bodies are downloaded, not parsed yet."""

    page: Page  # everything but the items
    folder: str
    threads: dict[str, str | None] = dataclasses.field(default_factory=dict)
    todo: list[str] = dataclasses.field(default_factory=list)
    batch: RawBatch = dataclasses.field(default_factory=RawBatch)


class OutlookSource:
    """One Outlook mailbox's sync (module docstring)."""

    provider = PROVIDER
    lazy_attachments = False  # $value carries the attachments

    def __init__(
        self,
        tenant_id: str,
        mailbox_id: str,
        settings: OutlookSettings,
        mailbox: OutlookMailbox,
        known: KnownCopies,
        pool: asyncpg.Pool,
        *,
        record_watch: WatchRecorder | None = None,
        transport_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.tenant_id = tenant_id
        self.mailbox_id = mailbox_id
        self.settings = settings
        self.mailbox = mailbox
        self._known = known
        self._pool = pool
        self.subscriptions = SubscriptionKeeper(
            tenant_id, mailbox_id, settings, mailbox, pool, record_watch
        )
        self._session: aiohttp.ClientSession | None = None
        self._transport: GraphTransport | None = None
        self._client: GraphClient | None = None
        self._transport_options = dict(transport_options or {})
        self._folder_names: dict[str, str] | None = None  # folder id → configured name
        # each folder's round bound as this run knows it (a first round's is fixed
        # before its first page is committed): what an expiry restarts with
        self._bounds: dict[str, str] = {}

    # --- the contract ----------------------------------------------------------------------

    async def pages(self, cursor: str | None) -> AsyncGenerator[Page, None]:
        client = self._ensure_client()
        start = DeltaCursor.decode(cursor, self.mailbox.folders)
        self._bounds = {}
        await self.subscriptions.maintain(client)
        try:
            async for page in overlapped_pages(self._downloads(client, start), self._finish):
                yield page
        except DeltaExpired as exc:
            restart = start.without(exc.folder, self._bounds.get(exc.folder))
            # a folder whose first round started in this run goes back to its start,
            # but keeps that round's bound: started again later, its bound would be
            # later, and mail stamped in between that no round reported yet lost
            for folder, since in self._bounds.items():
                if folder != exc.folder and restart.folders[folder].since is None:
                    restart = restart.bounded(folder, since)
            raise CursorExpired(str(exc), restart_from=restart.encode()) from exc

    async def settle(self, page: Page, results: list[ItemResult]) -> None:
        """Nothing to do at Graph: we never modify the mailbox."""

    async def fetch_attachment(self, item: MessageData, attachment: AttachmentData) -> bytes:
        raise NotImplementedError("$value carries every attachment")

    async def forget(self) -> None:
        """Removed from the configuration: delete its subscriptions (Graph and rows)."""
        await self.subscriptions.forget(self._ensure_client())

    async def aclose(self) -> None:
        if self._transport is not None:
            await self._transport.aclose()
        if self._session is not None:
            await self._session.close()
        self._session = self._transport = self._client = None

    # --- delta -----------------------------------------------------------------------------

    async def _downloads(
        self, client: GraphClient, start: DeltaCursor
    ) -> AsyncGenerator[_Downloaded, None]:
        current = start
        for folder in self.mailbox.folders:
            position = current.folders[folder]
            if position.since is not None:
                self._bounds[folder] = position.since
            if position.link is None:
                if position.since is None:  # the folder's first round
                    self._bounds[folder] = self._first_bound()
                    current = current.bounded(folder, self._bounds[folder])
                position = current.folders[folder]
            since = position.since_time
            link, first = position.link, position.first
            while True:
                delta = await client.delta_page(folder, link, since)
                link = delta.next_link or delta.delta_link
                assert link is not None  # the client refuses a page with neither
                current = current.at(folder, link, first=first and delta.next_link is not None)
                page = Page(items=[], cursor_after=current.encode(), backfill=first)
                yield await self._download(client, folder, delta, page)
                if delta.delta_link is not None:
                    break

    def _first_bound(self) -> str:
        """The bound of a folder's first round: the backfill window, or for "none"
        this moment less CLOCK_SKEW_MARGIN_S (only mail from now on: the bound is
        compared with receivedDateTime, which Exchange stamps with its clock, and
        a folder's rounds keep it for good, so mail stamped below it is never
        reported; a clock of ours ahead of Exchange's must not drop the first
        minutes of mail)."""
        if self.mailbox.backfill == "none":
            return bound_of(datetime.now(UTC) - timedelta(seconds=CLOCK_SKEW_MARGIN_S))
        return bound_of(self.mailbox.received_since())

    async def _download(
        self, client: GraphClient, folder: str, delta: DeltaPage, page: Page
    ) -> _Downloaded:
        threads = {item.id: item.conversation_id for item in delta.items}
        # every message of the page is in this folder now (restores a removed copy)
        page.labels = {mid: [folder] for mid in threads if mid not in delta.removed}
        page.removed = await self._departures(client, delta.removed, page.labels)
        # a message that left this folder may be in another synced one by now
        page.removed_from = folder
        if not threads:
            return _Downloaded(page, folder)
        stored = await self._known(list(threads))
        todo = [mid for mid in threads if mid not in stored]
        batch = await client.get_raw_batch(todo) if todo else RawBatch()
        return _Downloaded(page, folder, threads, todo, batch)

    async def _departures(
        self, client: GraphClient, removed: Mapping[str, str], labels: dict[str, list[str]]
    ) -> dict[str, str]:
        """What `@removed` means for the copies we store: Graph says "deleted" for a
        move out of the folder too, so each stored one is looked up (one $batch
        request per message): in another synced folder → its labels there (no
        removal, no event); gone (404) → deleted; elsewhere → moved out."""
        out = dict(removed)
        stored = await self._known(list(removed)) if removed else set()
        if not stored:
            return out
        where = await client.locate(stored)
        if self._folder_names is None:
            self._folder_names = await client.folder_ids(self.mailbox.folders)
        for mid, parent in where.items():
            if parent is None:
                out[mid] = "deleted"
            elif parent in self._folder_names:
                del out[mid]
                labels[mid] = [self._folder_names[parent]]
            else:
                out[mid] = "moved"
        return out

    async def _finish(self, downloaded: _Downloaded) -> Page:
        batch = downloaded.batch
        fetched = [mid for mid in downloaded.todo if mid in batch.raw]
        parsed = await parse_in_workers(
            [batch.raw[mid] for mid in fetched], self.tenant_id, self.mailbox_id, PROVIDER
        )
        items: list[MessageData | DeadItem] = [
            self._as_outlook_copy(mid, downloaded, item)
            for mid, item in zip(fetched, parsed, strict=True)
        ]
        for mid in downloaded.todo:
            if mid in batch.gone:
                items.append(
                    DeadItem(
                        self.tenant_id,
                        self.mailbox_id,
                        mid,
                        "deleted_before_fetch",
                        "Graph answered 404: the message was deleted before it was fetched",
                    )
                )
            elif mid in batch.rejected:
                items.append(
                    DeadItem(self.tenant_id, self.mailbox_id, mid, "rejected", batch.rejected[mid])
                )
        downloaded.page.items = items
        # a new message's labels travel on the item; the page's only for stored ones
        for mid in downloaded.todo:
            downloaded.page.labels.pop(mid, None)
        return downloaded.page

    def _as_outlook_copy(
        self, mid: str, downloaded: _Downloaded, item: MessageData | DeadItem
    ) -> MessageData | DeadItem:
        if isinstance(item, DeadItem):
            return dataclasses.replace(item, external_id=mid)
        item.external_id = mid
        item.external_thread_id = downloaded.threads.get(mid)
        item.labels = [downloaded.folder]
        if downloaded.folder == SENT_FOLDER:
            item.direction = "outbound"
        return item

    # --- plumbing --------------------------------------------------------------------------

    def _ensure_client(self) -> GraphClient:
        if self._client is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
            )
            store = DatabaseRefreshTokens(self._pool, self.tenant_id, self.mailbox_id)
            tokens = GraphTokens(self.settings, self.mailbox, self._session, store)
            self._transport = GraphTransport(self.settings, tokens, **self._transport_options)
            self._client = GraphClient(self._transport, self.mailbox.address)
        return self._client
