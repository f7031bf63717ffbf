"""The door contracts: what every door (Gmail, Outlook, SES, IMAP, Maildir, import) does.

Two kinds of door: a *source* (`Source`, optionally `Watchable`) syncs one
mailbox and keeps a cursor; a *queue door* (`QueueDoor`, the SES door) receives
from a queue for many mailboxes and reaches the daemon through one `QueueSink`.

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

from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from inboxd.pipeline.message import AttachmentData, DeadItem, MessageData
from inboxd.pipeline.outcomes import ItemResult

if TYPE_CHECKING:  # annotations only: every adapter imports this module
    import anyio
    from anyio.abc import TaskStatus

    from inboxd.pipeline.ingest.stage import IngestBatch


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


@runtime_checkable
class Watchable(Protocol):
    """A Source with a push channel of its own, beside its Source methods.

    A door whose server pushes over a live connection (IMAP IDLE) or whose push
    needs upkeep on a schedule (Gmail's users.watch renewal) has `watch`; the
    runner (daemon/sync/runner.py) checks `isinstance(source, Watchable)` and runs
    it for its whole life in push and auto mode. Polling on poll_interval_s goes
    on regardless.
    """

    async def watch(self, ring: Callable[[], None]) -> None:
        """Call ring() when the server says there is new mail (or pushes may have
        been lost); retry with backoff on its own; never move the cursor; return
        only when cancelled."""
        ...


AttachmentFetcher = Callable[[MessageData, AttachmentData], Awaitable[bytes]]


# --- queue doors ------------------------------------------------------------------------
#
# A queue door (SES: SQS messages pointing at S3 objects) is not a Source: no mailbox
# of its own, no cursor, no lease. One door serves every mailbox configured for its
# provider, routing each message to the mailboxes of its recipients, and the queue
# itself is the position: a message is deleted from it only once every item it
# produced is settled (its rows committed, or recorded dead), so a crash anywhere
# redelivers it and the cascade answers `duplicate`. The daemon runs the door
# (QueueDoor) and hands it one QueueSink: everything the door needs of the daemon.


@dataclass(frozen=True, slots=True)
class QueueMailbox:
    """One configured mailbox a queue door routes to: ids and its `settings` as
    written in the tenant file (the door parses them)."""

    tenant_id: str
    mailbox_id: str
    settings: Mapping[str, object]


@dataclass(frozen=True, slots=True)
class Unrouted:
    """A queue message that belongs to no tenant (no recipient is ours, the pointer
    is unreadable, a forged envelope): kept with its body for replay."""

    external_id: str
    reason: str
    detail: str
    body: str
    recipients: tuple[str, ...] = ()


class QueueSink(Protocol):
    """What a queue door needs from the daemon that runs it (daemon/ses_door.py).

    Counters (`counted`) name what happened to messages: received, stored,
    duplicate, dead, unrouted, poison, left (for redelivery), released, deleted;
    `failed` keeps the last error. Both are the door's status: the daemon turns
    them into metrics and `inboxd status` rows."""

    async def ingest(self, batch: IngestBatch) -> list[ItemResult]:
        """Hand a batch to the ingest stage and wait for one result per item,
        returned after the ingest transaction committed (or failed)."""
        ...

    async def wait_for_room(self) -> None:
        """Return once a batch would be queued without waiting: the door receives
        nothing it could not hand over within the messages' visibility timeout."""
        ...

    async def record_unrouted(self, item: Unrouted) -> None:
        """Record a message that belongs to no tenant (repeats count attempts)."""
        ...

    async def stored_in(self, mailboxes: Sequence[tuple[str, str]], external_id: str) -> bool:
        """Whether a copy with this external id is stored in any (tenant, mailbox)."""
        ...

    async def database_ready(self) -> bool:
        """Whether the database answers now (after a batch left messages behind)."""
        ...

    def counted(self, what: str, n: int = 1) -> None: ...

    def failed(self, error: str) -> None: ...


class QueueDoor(Protocol):
    """One queue door, as the daemon runs it.

    `name` says which queue (`ses:<queue name>`): its status rows and metrics carry
    it. `provider` is the provider of the tenant mailboxes it serves; `reload`
    gets those mailboxes (at start through the constructor, at SIGHUP here) and
    swaps the routing whole: the next batch routes by it.
    """

    name: str
    provider: str

    async def run(
        self, sink: QueueSink, stop: anyio.Event, *, task_status: TaskStatus[None] = ...
    ) -> None:
        """Receive until `stop` is set (`task_status.started()` once connected);
        return once the messages in flight are settled and deleted, or released
        for another consumer if cancelled."""
        ...

    def reload(self, mailboxes: Iterable[QueueMailbox]) -> None: ...
