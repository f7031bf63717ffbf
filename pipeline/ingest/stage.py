"""The ingest stage: one choke point that stores every email exactly once.

One call = one batch of one mailbox = one transaction:

  classify (cascade.py, ≤ 2 queries) → store bytes for items that need them
  (pipeline/ingest/objects.py: raw MIME, large HTML, attachments of new messages) →
  upsert threads → insert messages / copies / participants / attachments /
  conflicts (one set-based statement each) → promote outbound placeholders
  (pipeline/ingest/write.py) → recompute touched threads → dead items → results
  (write.py too) → outbox events + NOTIFY → commit.

Every item gets an Outcome. The batch either commits whole or writes nothing
(and then every item is retriable_failure): events are only ever seen for rows
that exist. A statement that fails on one item's data is isolated by bisecting
the batch, so one poison message becomes a dead item and never blocks its
neighbours. Object-store bytes are content-addressed and written before the
rows that point at them (pipeline/ingest/objects.py), so a crash leaves at worst an orphan
object, never a row pointing at nothing; small objects kept in PostgreSQL
(pipeline/objectstore/database_tier.py) are written in the batch's own transaction and
commit with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg
import structlog

from inboxd.pipeline import cascade, threads
from inboxd.pipeline.errors import DATABASE_ERRORS, blames_the_data, db_fault, describe
from inboxd.pipeline.extraction import inbox as extraction_inbox
from inboxd.pipeline.ingest.objects import AttachmentFetcher, store_dead_raw, store_message_bytes
from inboxd.pipeline.ingest.rows import PLACEHOLDER_RE, clean, clean_item, insert_dead_items
from inboxd.pipeline.ingest.write import (
    IngestPlan,
    add_backfill_event,
    assemble_results,
    results_all_duplicate,
    write_messages,
)
from inboxd.pipeline.message import DeadItem, MessageData
from inboxd.pipeline.objectstore.store import ObjectStore
from inboxd.pipeline.outbox import EventBuffer
from inboxd.pipeline.outcomes import ItemResult, Outcome
from inboxd.pipeline.statistics import IngestStatistics

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class IngestBatch:
    """Items of one mailbox, ingested in one transaction.

    `backfill`: write one mailbox.sync_completed event instead of one event per
    message (an initial sync of 100k messages should not flood the app).
    `fetch_attachment`: how a provider door fetches attachment bytes it did not
    include; called only for messages whose outcome is new.
    """

    tenant_id: str
    mailbox_id: str
    items: Sequence[MessageData | DeadItem]
    backfill: bool = False
    fetch_attachment: AttachmentFetcher | None = None


class IngestStage:
    """Turns batches of MessageData into rows; safe to call concurrently."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        store: ObjectStore,
        *,
        extraction: extraction_inbox.HandOff | None = None,
    ) -> None:
        self._pool = pool
        self._store = store
        self._extraction = extraction
        self._statistics = IngestStatistics(pool)
        # mailbox address per (tenant, mailbox); addresses change only with config
        self._addresses: dict[tuple[str, str], str] = {}

    async def ingest(self, batch: IngestBatch) -> list[ItemResult]:
        """Ingest one batch; returns one ItemResult per item, in batch order.

        Never raises for item content. Database trouble makes every item
        retriable_failure (nothing was written); cancellation propagates and
        rolls the transaction back.
        """
        if not batch.items:
            return []
        try:
            results = await self._ingest_once(batch)
        except DATABASE_ERRORS as exc:
            if blames_the_data(exc):
                return await self._isolate(batch, exc)
            # connection trouble, races, disk full, admin action, a bug: nothing to
            # do with any one item, so nothing may become a dead item because of it
            log.warning(
                "ingest_batch_retriable",
                tenant=batch.tenant_id,
                mailbox=batch.mailbox_id,
                size=len(batch.items),
                fault=db_fault(exc).value,
                error=type(exc).__name__,
                sqlstate=getattr(exc, "sqlstate", None),
            )
            return [
                ItemResult(i, Outcome.RETRIABLE_FAILURE, detail=_one_line(exc))
                for i in range(len(batch.items))
            ]
        await self._statistics.note_stored(sum(r.outcome is Outcome.NEW for r in results))
        handoff = self._extraction
        if handoff is not None and handoff.wants(batch.tenant_id) and _extracted_rows(results):
            handoff.noted()
        return results

    async def _isolate(self, batch: IngestBatch, exc: BaseException) -> list[ItemResult]:
        """A statement failed on the data: bisect to find the item that causes it."""
        items = list(batch.items)
        if len(items) == 1:
            item = items[0]
            log.error(
                "ingest_item_rejected",
                tenant=batch.tenant_id,
                mailbox=batch.mailbox_id,
                external_id=item.external_id,
                error=_one_line(exc),
            )
            dead = DeadItem(
                batch.tenant_id,
                batch.mailbox_id,
                item.external_id,
                "rejected",
                f"database rejected the item: {_one_line(exc)}",
                item.raw,
                item.raw_sha256,
            )
            if isinstance(item, DeadItem):
                return [ItemResult(0, Outcome.RETRIABLE_FAILURE, detail=_one_line(exc))]
            result = await self.ingest(_sub(batch, [dead]))
            return [
                ItemResult(
                    0,
                    result[0].outcome
                    if result[0].outcome is Outcome.RETRIABLE_FAILURE
                    else Outcome.PERMANENT_FAILURE,
                    detail=_one_line(exc),
                )
            ]
        mid = len(items) // 2
        left = await self.ingest(_sub(batch, items[:mid]))
        right = await self.ingest(_sub(batch, items[mid:]))
        for r in right:
            r.index += mid
        return left + right

    async def _ingest_once(self, batch: IngestBatch) -> list[ItemResult]:
        tenant, mailbox = batch.tenant_id, batch.mailbox_id
        messages = [(i, it) for i, it in enumerate(batch.items) if isinstance(it, MessageData)]
        plan = IngestPlan(items=[it for _, it in messages], positions=[i for i, _ in messages])
        deads = [(i, it) for i, it in enumerate(batch.items) if isinstance(it, DeadItem)]
        for item in plan.items:
            clean_item(item)
        async with self._pool.acquire() as conn, conn.transaction():
            # JIT compiles the classify query anew on every large batch (+10 % time).
            # The commit must be durable whatever the server's default: callers
            # acknowledge providers once ingest returns, and small objects' bytes
            # (pipeline/objectstore/database_tier.py) commit in this transaction.
            await conn.execute("SET LOCAL jit = off; SET LOCAL synchronous_commit = on")
            plan.decisions, plan.followers = await cascade.classify(
                conn, tenant, mailbox, plan.items
            )
            await self._mark_direction(conn, tenant, mailbox, plan.items)
            if not deads and plan.all_duplicate():
                return results_all_duplicate(plan)
            await self._store_bytes(conn, batch, plan)
            dead_keys = await store_dead_raw(self._store, tenant, deads, conn=conn)
            events = EventBuffer()
            touched = await write_messages(
                conn, tenant, mailbox, plan, events, backfill=batch.backfill
            )
            await threads.recompute_threads(conn, tenant, touched)
            if _promoted(plan):  # only a promotion takes a message out of its thread
                await conn.execute(  # placeholder threads emptied by promotion
                    "DELETE FROM threads WHERE tenant_id = $1 AND thread_id = ANY($2::bigint[]) "
                    "AND message_count = 0 AND external_thread_id ~ $3",
                    tenant,
                    sorted(touched),
                    PLACEHOLDER_RE,
                )
            await insert_dead_items(conn, tenant, mailbox, deads, dead_keys.keys, dead_keys.failed)
            results = assemble_results(len(batch.items), plan, deads, dead_keys)
            if batch.backfill:
                add_backfill_event(results, events)
            await events.flush(conn, tenant, mailbox)
            if self._extraction is not None and self._extraction.wants(tenant):
                await extraction_inbox.note_new(conn, tenant, _extracted_rows(results))
        return results

    async def _mark_direction(
        self, conn: asyncpg.Connection, tenant: str, mailbox: str, items: list[MessageData]
    ) -> None:
        """Mail from the mailbox's own address is outbound (sent from another client)."""
        key = (tenant, mailbox)
        if key not in self._addresses:
            self._addresses[key] = (
                await conn.fetchval(
                    "SELECT lower(address) FROM mailboxes WHERE tenant_id = $1 AND mailbox_id = $2",
                    tenant,
                    mailbox,
                )
                or ""
            )
        own = self._addresses[key]
        if own:
            for item in items:
                if item.from_ is not None and item.from_.email == own:
                    item.direction = "outbound"

    async def _store_bytes(
        self, conn: asyncpg.Connection, batch: IngestBatch, plan: IngestPlan
    ) -> None:
        """Raw MIME, large HTML and attachments, only for items that need them."""
        stored = await store_message_bytes(
            self._store,
            batch.tenant_id,
            batch.fetch_attachment,
            plan.items,
            [plan.outcome_of(k) for k in range(len(plan.items))],
            plan.decisions,
            conn=conn,
        )
        plan.raw_keys, plan.html_keys = stored.raw_keys, stored.html_keys
        plan.att_state = stored.att_state
        plan.failures.update(stored.failures)


#: Outcomes whose rows the extraction stage sees (pipeline/extraction/inbox.py). Merged
#: ones too: the copy may be the message's first in a mailbox, which is what a processor
#: scoped to that mailbox waits for; a processor that already has the message's job is
#: linked (the key is the message's), so nothing is extracted twice. Duplicates are
#: this very copy again: no new mailbox, nothing to hand over.
_EXTRACTED = frozenset({Outcome.NEW, Outcome.MERGED, Outcome.CONFLICT})


def _promoted(plan: IngestPlan) -> bool:
    """Some item took over an application's outbound placeholder (write.py
    _promote_placeholders). Without one, every touched thread holds the batch's new
    messages and none can be empty: the DELETE was a round trip and ~2.5 ms of
    server CPU per batch of 1,000 for nothing (bench/README.md, ingest.py)."""
    return any(d.promote and d.outcome is Outcome.MERGED for d in plan.decisions.values())


def _extracted_rows(results: list[ItemResult]) -> list[int]:
    return [r.message_id for r in results if r.outcome in _EXTRACTED and r.message_id is not None]


def _sub(batch: IngestBatch, items: list[MessageData | DeadItem]) -> IngestBatch:
    return IngestBatch(
        batch.tenant_id, batch.mailbox_id, items, batch.backfill, batch.fetch_attachment
    )


def _one_line(exc: BaseException) -> str:
    return clean(describe(exc))
