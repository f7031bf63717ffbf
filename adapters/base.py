"""The source contract: what every door (Gmail, Outlook, SES, IMAP, Maildir, import) does.

A *source* syncs one mailbox. It yields *pages*: a list of MessageData (or
DeadItem for what it could not turn into one) plus the cursor position that
is reached once the whole page is stored. The ingest stage
(`inboxd.pipeline.ingest.stage.IngestStage.ingest`) answers one ItemResult per item:

    new | merged | duplicate | conflict      settled: stored or already stored
    permanent_failure                          settled: recorded in dead_items
    retriable_failure                          NOT settled: nothing was written

When may the cursor move?
  * Only past a page whose every item is settled (`page_is_clean(results)`).
    A page with a retriable failure is retried (the cascade makes the retry
    idempotent); its cursor is not written, and neither is any later page's.
  * Only after the ingest transaction committed (ingest() returns after
    commit), or in the same transaction — never before.
  * Only forward, and only with the mailbox lease's fencing token: the write
    is `UPDATE mailboxes SET cursor = … WHERE lease_token = $token`, so a stale
    owner's write changes no row and the source must stop.
  * An expired cursor (Gmail 404, Graph 410/syncStateNotFound, IMAP
    UIDVALIDITY change): `pages` raises `CursorExpired` (pipeline/errors.py);
    the runner stores its `restart_from` as the cursor (None: no cursor) and
    calls `pages(restart_from)`, a resync that the cascade makes idempotent.
    `pages(None)` means a new mailbox's first sync, which `backfill` may window;
    a reset must instead cover everything since the last committed cursor, so a
    door whose first sync is windowed restarts from a cursor of its own that
    says "reset" (Gmail: RELIST_CURSOR, list every synced label in full).
    Being stored, it survives a crash mid-resync. Ids already stored are never
    downloaded again. Renewing a watch never moves the cursor.

Raw-MIME doors pass `raw` bytes (kept byte-exact in the object store) and no
thread id; provider doors pass the provider's thread id and message id, and
attachment descriptors with `provider_ref` instead of bytes, plus a
`fetch_attachment` callable on the batch: the stage calls it only for
messages whose outcome is new.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from inboxd.pipeline.message import AttachmentData, DeadItem, MessageData
from inboxd.pipeline.outcomes import ItemResult


@dataclass(slots=True)
class Page:
    """Items of one provider page and the cursor reached once all are settled.

    `context` is the source's own bookkeeping for `settle` (the Maildir door
    keeps the file paths of the page there). Doors that report changes to mail
    already stored put them in `removed` (provider id → reason: deleted,
    unlabelled, expunged) and `labels` (provider id → the copy's labels now);
    the runner records both (pipeline/copies.py) after the page's items are
    settled and before its cursor moves. `removed_from` scopes the removals to one
    label or folder (an Outlook folder's delta): a copy recorded in another one
    since is left alone, one with other labels only loses this one.
    """

    items: list[MessageData | DeadItem]
    cursor_after: str | None = None
    backfill: bool = False
    context: object = None
    removed: dict[str, str] = field(default_factory=dict)
    labels: dict[str, list[str]] = field(default_factory=dict)
    removed_from: str | None = None


class Source(Protocol):
    """One mailbox's sync loop, as seen by the daemon's supervisor.

    The supervisor calls `pages(cursor)` once per sync run, hands every page to
    the ingest stage, and after the results came back calls `settle(page,
    results)` then, if `page_is_clean(results)` and `page.cursor_after` is set,
    commits the cursor with the lease's fencing token. Between pages it checks
    the cancel flag; cancellation (SIGUSR1, shutdown) may arrive at any await,
    and a page whose results were not settled is simply produced again next run.
    """

    tenant_id: str
    mailbox_id: str
    provider: str

    def pages(self, cursor: str | None) -> AsyncGenerator[Page, None]:
        """Pages from `cursor` (None: from the beginning / full resync), in order.

        An async generator: the daemon closes it (`aclose`) when a run stops
        early, so the source's cleanup runs at once, not at garbage collection."""
        ...

    async def settle(self, page: Page, results: list[ItemResult]) -> None:
        """Source-side effects once a page's ingest committed (e.g. move files to cur/)."""
        ...

    async def fetch_attachment(self, item: MessageData, attachment: AttachmentData) -> bytes:
        """Bytes of an attachment the page did not include (provider doors only)."""
        ...


# Optional, beside the Source methods: a door with a push channel of its own that
# needs a live connection (IMAP IDLE) or upkeep on a schedule (Gmail's users.watch
# renewal) defines
#
#     async def watch(self, ring: Callable[[], None]) -> None
#
# which the runner runs for its whole life in push and auto mode: it calls ring()
# when the server says there is new mail (or pushes may have been lost), retries
# with backoff on its own, never moves the cursor, and returns only when
# cancelled. Polling on poll_interval_s goes on regardless.


AttachmentFetcher = Callable[[MessageData, AttachmentData], Awaitable[bytes]]
