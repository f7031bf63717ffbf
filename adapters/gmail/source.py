"""The Gmail sync loop: `pages(cursor)` of the source contract (adapters/base.py).

The cursor is a Gmail historyId (opaque to the daemon), or RELIST_CURSOR. One run:

    cursor None (first sync of a new mailbox)
      getProfile → H0                       read BEFORE listing, so nothing that
                                            arrives during a long backfill is missed
      per synced label: messages.list (the `backfill` window: q=newer_than:Nd, no q
        for "all", no list at all for "none"; newest first, pages of ≤ 500 ids)
        → Page(backfill=True)               ids already stored are never fetched
      Page([], cursor_after=H0)             history from H0 covers the rest
    cursor RELIST_CURSOR (a reset: the history after the last cursor expired)
      getProfile → H0, then per synced label messages.list with NO window, whatever
        `backfill` says: mail that arrived while the cursor was stale may carry any
        internalDate (delayed delivery, imports, restores), and "none" would list
        nothing. Every id not stored yet is fetched; stored ones never again. Not a
        backfill: each message found gets its own message.created event.
      Page([], cursor_after=H0)
    cursor H
      history.list(startHistoryId=H, messageAdded/Deleted, labelAdded/Removed),
      following pageToken with the same H → one Page per history page:
        items      messages added to (or labelled into) a synced label, not stored
                   yet, fetched raw
        removed    deleted, or in no synced label any more (the copy leaves the
                   mailbox; its row stays)
        labels     the current labels of every stored copy a record touched
        cursor_after  the last record's id on an intermediate page (a crash
                   resumes after it, never past a record not yet settled), the
                   response's historyId on the last page
      404 → CursorExpired(restart_from=RELIST_CURSOR): the runner stores that
        cursor (fenced, with a mailbox.cursor_reset event) and calls
        pages(RELIST_CURSOR). Stored, not remembered here: a reset interrupted by
        a crash or a shutdown goes on as a reset, never as a first sync.

Pages are pipelined (adapters/overlap.py): page k+1 is listed and its bodies
downloaded while page k is parsed, so a mailbox keeps spending its quota while
other mailboxes hold the parse worker.

Bodies: `format=raw` through the batch endpoint (GmailClient.get_raw_batch, ≤ 20
calls a batch, DOWNLOADS_IN_FLIGHT batches at once), so the fingerprint agrees
with every other door's view of the same message; a message deleted before we
fetched it (404) is a dead item (settled: it never pins the cursor). Before any
download, `known` asks the database once per page which ids this mailbox already
stores. External id = Gmail id, thread key = threadId, labels kept; SENT copies
are outbound.

Push: with a `[gmail] topic`, `watch(ring)` (the runner runs it in push and auto
mode) renews users.watch on its own schedule, syncs or not (watch.py); in poll
mode a run renews it when due. Neither touches the cursor.

Quota: every call goes through the mailbox's QuotaPacer (pacer.py); 429s and
rateLimitExceeded come back as GmailRateLimited after the client's retries, which
the runner records as the mailbox's throttle. Credentials refused → GmailAuthError
(needs attention).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import anyio

from inboxd.adapters.base import Page
from inboxd.adapters.gmail.answers import HistoryPage, Profile, RawBatch
from inboxd.adapters.gmail.auth import AccessTokens
from inboxd.adapters.gmail.client import GMAIL_BATCH_SIZE, GmailClient
from inboxd.adapters.gmail.config import GmailMailbox, GmailSettings
from inboxd.adapters.gmail.errors import HistoryExpired
from inboxd.adapters.gmail.pacer import GMAIL_USER_UNITS_PER_S, QuotaPacer
from inboxd.adapters.gmail.watch import WATCH_RENEW_PERIOD_S, WatchKeeper, WatchRecorder
from inboxd.adapters.overlap import gather, overlapped_pages
from inboxd.pipeline.errors import CursorExpired
from inboxd.pipeline.message import AttachmentData, DeadItem, MessageData
from inboxd.pipeline.mime.workers import parse_in_workers
from inboxd.pipeline.outcomes import ItemResult

__all__ = ["GmailSource", "KnownCopies"]

PROVIDER = "gmail"
HISTORY_TYPES = ("messageAdded", "messageDeleted", "labelAdded", "labelRemoved")
SENT_LABEL = "SENT"
# Batch requests of one page in flight at once. Gmail answers a batch of 20 raw
# messages in a few hundred ms, while the quota pays for one every 0.4 s (20 × 5
# units at 250 units/s): one at a time, latency would bound a mailbox below its
# quota; the pacer keeps two within it.
DOWNLOADS_IN_FLIGHT = 2
# One HTTP client session per source: connections are reused across runs.
HTTP_TIMEOUT_S = 60.0
# One connection pool serves every Gmail mailbox of the process (`shared_session`):
# at most this many requests to Gmail at once, one connection each (a sync keeps two
# batch downloads in flight), so file handles stay bounded whatever the number of
# mailboxes. A request waits for its turn before its deadline starts (client.py).
CONNECTIONS_PER_HOST = 256
# Idle connections are kept this long: longer than the default 60 s poll interval,
# so the next poll reuses one instead of a new TLS handshake (aiohttp's default 15 s
# closed them before every poll, issue 25).
KEEPALIVE_S = 120.0
# The cursor of a reset (module docstring): never a historyId, which is decimal
# digits (users.history reference: "historyId: string (uint64 format)").
RELIST_CURSOR = "relist"

KnownCopies = Callable[[Sequence[str]], Awaitable[set[str]]]


@dataclass(slots=True)
class _Wanted:
    thread_id: str
    labels: list[str]


@dataclass(slots=True)
class _Downloaded:
    """A page whose bodies are downloaded, not parsed yet (adapters/overlap.py)."""

    page: Page  # everything but the items
    wanted: dict[str, _Wanted] = dataclasses.field(default_factory=dict)
    todo: list[str] = dataclasses.field(default_factory=list)  # wanted, not stored yet
    batch: RawBatch = dataclasses.field(default_factory=RawBatch)


class GmailSource:
    """One Gmail mailbox's sync (module docstring)."""

    provider = PROVIDER
    lazy_attachments = False  # raw MIME carries the attachments

    def __init__(
        self,
        tenant_id: str,
        mailbox_id: str,
        settings: GmailSettings,
        mailbox: GmailMailbox,
        known: KnownCopies,
        *,
        record_watch: WatchRecorder | None = None,
        units_per_s: float = GMAIL_USER_UNITS_PER_S,
        client_options: Mapping[str, Any] | None = None,
        watch_renew_period_s: float = WATCH_RENEW_PERIOD_S,
        session: aiohttp.ClientSession | None = None,
        connections: anyio.CapacityLimiter | None = None,
    ) -> None:
        self.tenant_id = tenant_id
        self.mailbox_id = mailbox_id
        self.settings = settings
        self.mailbox = mailbox
        self.synced = frozenset(mailbox.labels)
        self._known = known
        self._pacer = QuotaPacer(units_per_s)
        # A session lent by the daemon (`shared_session`) is the daemon's to close;
        # without one the source makes its own and closes it in `aclose`.
        self._shared_session = session
        self._connections = connections  # the bound shared with the session's mailboxes
        self._session: aiohttp.ClientSession | None = None
        self._client: GmailClient | None = None
        # users.watch upkeep (watch.py); None without a topic (the mailbox is polled)
        self._watch: WatchKeeper | None = None
        if settings.topic is not None:
            self._watch = WatchKeeper(
                mailbox_id,
                settings.topic,
                mailbox.labels,
                record_watch,
                period_s=watch_renew_period_s,
            )
        # GmailClient's retry tunables (attempts, backoff), for tests and benchmarks
        self._client_options = dict(client_options or {})
        # The account's primary address (getProfile), read once per process: Gmail's
        # pushes name it, so an alias in `address` gets none of them
        self._primary: str | None = None

    # --- the contract ----------------------------------------------------------------------

    async def pages(self, cursor: str | None) -> AsyncGenerator[Page, None]:
        client = self._ensure_client()
        if self._watch is not None:
            await self._watch.renew_if_due(client)  # only when no schedule runs (poll mode)
        if cursor is None or cursor == RELIST_CURSOR:
            async for page in self._full_sync(client, reset=cursor == RELIST_CURSOR):
                yield page
            return
        if self._watch is not None and self._primary is None:  # 1 quota unit per process
            self._primary = (await client.get_profile()).email_address
        try:
            async for page in overlapped_pages(
                self._history_downloads(client, cursor), self._finish
            ):
                yield page
        except HistoryExpired as exc:
            raise CursorExpired(
                f"gmail history from {cursor} expired: {exc}", restart_from=RELIST_CURSOR
            ) from exc

    async def settle(self, page: Page, results: list[ItemResult]) -> None:
        """Nothing to do at Gmail: we never modify the mailbox."""

    async def fetch_attachment(self, item: MessageData, attachment: AttachmentData) -> bytes:
        raise NotImplementedError("format=raw carries every attachment")

    async def watch(self, ring: Callable[[], None]) -> None:
        """The push channel's upkeep for the runner (adapters/base.py): users.watch
        renewed on its own schedule (watch.py), with or without syncs; returns only
        when cancelled. Without a topic there is nothing to keep."""
        if self._watch is None:
            await anyio.sleep_forever()
            return
        await self._watch.run(self._ensure_client, ring)

    def degraded(self) -> tuple[str, bool] | None:
        """After a run that completed: users.watch failing (the runner puts it in the
        status; needs_attention when Gmail refuses the watch itself or it lapsed).
        Mail still arrives, but only by polling: in push mode the daily safety sync."""
        failing = self._watch.failing() if self._watch is not None else None
        if failing is not None:
            error, attention = failing
            return f"users.watch failing, no pushes (mail waits for polling): {error}", attention
        primary = self._primary
        if primary and primary.strip().lower() != self.mailbox.address.strip().lower():
            # Gmail's push names the primary address; the push route matches `address`
            return (
                f"address {self.mailbox.address} is an alias of {primary}: Gmail's pushes "
                f'name {primary} and are ignored (mail waits for polling); set address = "'
                f'{primary}"',
                False,
            )
        return None

    async def forget(self) -> None:
        """The mailbox was removed from the configuration: users.stop, so Gmail stops
        publishing its changes (Gmail push guide). Errors propagate to the caller."""
        if self._watch is None:  # no topic: nothing publishes
            return
        # after any renewal under way, and no renewal after it (watch.py)
        await self._watch.stop(self._ensure_client())

    async def aclose(self) -> None:
        """Close the HTTP session of its own (the runner calls this when it ends)."""
        if self._session is not None and self._session is not self._shared_session:
            await self._session.close()
        self._session = None
        self._client = None

    # --- first sync and reset --------------------------------------------------------------

    async def _full_sync(self, client: GmailClient, *, reset: bool) -> AsyncGenerator[Page, None]:
        profile = await client.get_profile()
        self._primary = profile.email_address
        async for page in overlapped_pages(
            self._list_downloads(client, profile, reset=reset), self._finish
        ):
            yield page

    async def _list_downloads(
        self, client: GmailClient, profile: Profile, *, reset: bool
    ) -> AsyncGenerator[_Downloaded, None]:
        """The synced labels' messages: within the backfill window at a first sync,
        all of them at a reset (module docstring); then the cursor page."""
        if reset or self.mailbox.backfill != "none":
            query = None if reset else self.mailbox.backfill_query
            seen: set[str] = set()
            for label in self.mailbox.labels:
                token: str | None = None
                while True:
                    listed = await client.list_messages([label], query=query, page_token=token)
                    wanted = {
                        ref.id: _Wanted(ref.thread_id, [label])
                        for ref in listed.messages
                        if ref.id not in seen
                    }
                    seen.update(wanted)
                    # A reset's finds are mail the application has not been told of
                    # (most arrived while the cursor was stale): one event per message,
                    # like history's, not a backfill's one event per batch.
                    page = Page(items=[], backfill=not reset)
                    yield await self._download(client, wanted, page)
                    token = listed.next_page_token
                    if token is None:
                        break
        yield _Downloaded(Page(items=[], cursor_after=profile.history_id, backfill=not reset))

    # --- incremental -----------------------------------------------------------------------

    async def _history_downloads(
        self, client: GmailClient, cursor: str
    ) -> AsyncGenerator[_Downloaded, None]:
        token: str | None = None
        while True:
            history = await client.list_history(cursor, HISTORY_TYPES, token)
            token = history.next_page_token
            yield await self._history_page(client, history, last=token is None)
            if token is None:
                return

    async def _history_page(
        self, client: GmailClient, history: HistoryPage, *, last: bool
    ) -> _Downloaded:
        added: dict[str, _Wanted] = {}
        labels: dict[str, list[str]] = {}
        deleted: set[str] = set()
        for record in history.records:
            for entry in record.get("messagesAdded", ()):
                message = _message(entry)
                if message is None:
                    continue
                gid, thread_id, current = message
                labels[gid] = current
                deleted.discard(gid)
                added[gid] = _Wanted(thread_id, current)
            for key in ("labelsAdded", "labelsRemoved"):
                for entry in record.get(key, ()):
                    message = _message(entry)
                    if message is None:
                        continue
                    gid, thread_id, current = message
                    labels[gid] = current
                    if gid not in added:
                        # labelled into a synced label: new to us if not stored
                        added[gid] = _Wanted(thread_id, current)
            for entry in record.get("messagesDeleted", ()):
                message = _message(entry)
                if message is not None:
                    deleted.add(message[0])
                    added.pop(message[0], None)
                    labels.pop(message[0], None)
        wanted = {gid: w for gid, w in added.items() if self.synced & set(w.labels)}
        removed = dict.fromkeys(deleted, "deleted")
        for gid, current in labels.items():
            if not self.synced & set(current):
                removed[gid] = "unlabelled"
        kept_labels = {gid: v for gid, v in labels.items() if gid not in removed}
        cursor_after = history.history_id if last else _last_record_id(history)
        page = Page(items=[], cursor_after=cursor_after, removed=removed, labels=kept_labels)
        return await self._download(client, wanted, page)

    # --- bodies ----------------------------------------------------------------------------

    async def _download(
        self, client: GmailClient, wanted: Mapping[str, _Wanted], page: Page
    ) -> _Downloaded:
        """The raw bodies of the `wanted` ids this mailbox does not store yet, with
        DOWNLOADS_IN_FLIGHT batch calls at once (the pacer keeps them in the quota)."""
        if not wanted:
            return _Downloaded(page)
        stored = await self._known(list(wanted))
        todo = [gid for gid in wanted if gid not in stored]
        batch = RawBatch()
        size = GMAIL_BATCH_SIZE
        chunks = iter([todo[i : i + size] for i in range(0, len(todo), size)])

        async def drain() -> None:
            for chunk in chunks:  # shared: each chunk is taken by one drainer
                part = await client.get_raw_batch(chunk)
                batch.raw.update(part.raw)
                batch.gone |= part.gone
                batch.rejected.update(part.rejected)

        await gather(*[drain] * min(DOWNLOADS_IN_FLIGHT, len(todo)))
        return _Downloaded(page, dict(wanted), todo, batch)

    async def _finish(self, downloaded: _Downloaded) -> Page:
        """The page of `downloaded`: its bodies parsed (in the process's parse
        workers), the ids Gmail no longer has or refused as dead items."""
        batch, wanted = downloaded.batch, downloaded.wanted
        fetched = [gid for gid in downloaded.todo if gid in batch.raw]
        parsed = await parse_in_workers(
            [batch.raw[gid] for gid in fetched], self.tenant_id, self.mailbox_id, PROVIDER
        )
        items: list[MessageData | DeadItem] = [
            self._as_gmail_copy(gid, wanted[gid], item)
            for gid, item in zip(fetched, parsed, strict=True)
        ]
        for gid in downloaded.todo:
            if gid in batch.gone:
                items.append(
                    DeadItem(
                        self.tenant_id,
                        self.mailbox_id,
                        gid,
                        "deleted_before_fetch",
                        "Gmail answered 404: the message was deleted before it was fetched",
                    )
                )
            elif gid in batch.rejected:
                items.append(
                    DeadItem(
                        self.tenant_id, self.mailbox_id, gid, "rejected", str(batch.rejected[gid])
                    )
                )
        downloaded.page.items = items
        return downloaded.page

    def _as_gmail_copy(
        self, gid: str, wanted: _Wanted, item: MessageData | DeadItem
    ) -> MessageData | DeadItem:
        if isinstance(item, DeadItem):
            return dataclasses.replace(item, external_id=gid)
        item.external_id = gid
        item.external_thread_id = wanted.thread_id
        item.labels = sorted(set(wanted.labels))
        if SENT_LABEL in wanted.labels:
            item.direction = "outbound"
        return item

    # --- plumbing --------------------------------------------------------------------------

    def _ensure_client(self) -> GmailClient:
        if self._client is None:
            self._session = self._shared_session or shared_session()
            tokens = AccessTokens(self.settings, self.mailbox, self._session)
            self._client = GmailClient(
                self.settings,
                self.mailbox,
                self._session,
                self._pacer,
                tokens,
                connections=self._connections,
                **self._client_options,
            )
        return self._client


def shared_session() -> aiohttp.ClientSession:
    """The Gmail door's HTTP session: its timeout, its bound per host, its keep-alive
    (adapters/http_fetch.py `SharedSessions` keeps one per process)."""
    return aiohttp.ClientSession(
        # no bound here: the door's limiter (`shared_connections`) bounds the requests
        # before their deadlines start; aiohttp's bound would count the wait in them
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
        timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S),
    )


def shared_connections() -> anyio.CapacityLimiter:
    """The Gmail door's bound on requests in flight, shared like its session."""
    return anyio.CapacityLimiter(CONNECTIONS_PER_HOST)


def _message(entry: object) -> tuple[str, str, list[str]] | None:
    """(id, threadId, labelIds) of a history entry's `message`, or None if malformed."""
    if not isinstance(entry, dict):
        return None
    message = entry.get("message")
    if not isinstance(message, dict):
        return None
    gid, thread_id = message.get("id"), message.get("threadId")
    if not isinstance(gid, str) or not isinstance(thread_id, str):
        return None
    label_ids = message.get("labelIds") or []
    return gid, thread_id, [x for x in label_ids if isinstance(x, str)]


def _last_record_id(history: HistoryPage) -> str | None:
    ids = [int(r["id"]) for r in history.records if str(r.get("id", "")).isdigit()]
    return str(max(ids)) if ids else None
