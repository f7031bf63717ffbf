"""The ingest stage: one choke point that stores every email exactly once.

One call = one batch of one mailbox = one transaction:

  classify (cascade.py, ≤ 2 queries) → store bytes for items that need them
  (ingest_bytes.py: raw MIME, large HTML, attachments of new messages) →
  upsert threads → insert messages / copies / participants / attachments /
  conflicts / dead items (one set-based statement each) → promote outbound
  placeholders → recompute touched threads → outbox events + NOTIFY → commit.

Every item gets an Outcome. The batch either commits whole or writes nothing
(and then every item is retriable_failure): events are only ever seen for rows
that exist. A statement that fails on one item's data is isolated by bisecting
the batch, so one poison message becomes a dead item and never blocks its
neighbours. Object-store bytes are content-addressed and written before the
rows that point at them (ingest_bytes.py), so a crash leaves at worst an orphan
object, never a row pointing at nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import asyncpg
import structlog

from inboxd.pipeline import cascade, threads
from inboxd.pipeline.cascade import Decision
from inboxd.pipeline.errors import DATABASE_ERRORS, blames_the_data, db_fault, describe
from inboxd.pipeline.ingest_bytes import (
    AttachmentFetcher,
    AttachmentState,
    record_retried_attachments,
    store_dead_raw,
    store_message_bytes,
)
from inboxd.pipeline.message import DeadItem, MessageData
from inboxd.pipeline.objectstore import ObjectStore
from inboxd.pipeline.outbox import EventBuffer
from inboxd.pipeline.outcomes import ItemResult, Outcome
from inboxd.pipeline.rows import (
    PLACEHOLDER_RE,
    clean,
    clean_item,
    insert_attachments,
    insert_conflicts,
    insert_copies,
    insert_dead_items,
    insert_messages,
    insert_participants,
    promote_outbound,
)

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


@dataclass(slots=True)
class _Plan:
    """Working state of one batch inside its transaction."""

    items: list[MessageData]
    positions: list[int]  # batch index of each message item
    decisions: dict[int, Decision] = field(default_factory=dict)
    followers: dict[int, tuple[int, Outcome]] = field(default_factory=dict)
    message_ids: dict[int, int] = field(default_factory=dict)
    raw_keys: dict[int, str] = field(default_factory=dict)
    html_keys: dict[int, str] = field(default_factory=dict)
    att_state: dict[int, AttachmentState] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)


class IngestStage:
    """Turns batches of MessageData into rows; safe to call concurrently."""

    def __init__(self, pool: asyncpg.Pool, store: ObjectStore) -> None:
        self._pool = pool
        self._store = store
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
            return await self._ingest_once(batch)
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
        plan = _Plan(items=[it for _, it in messages], positions=[i for i, _ in messages])
        deads = [(i, it) for i, it in enumerate(batch.items) if isinstance(it, DeadItem)]
        for item in plan.items:
            clean_item(item)
        async with self._pool.acquire() as conn, conn.transaction():
            # JIT compiles the classify query anew on every large batch (+10 % time)
            await conn.execute("SET LOCAL jit = off")
            plan.decisions, plan.followers = await cascade.classify(
                conn, tenant, mailbox, plan.items
            )
            await self._mark_direction(conn, tenant, mailbox, plan.items)
            if (
                not deads
                and all(
                    d.outcome is Outcome.DUPLICATE and not d.retry_attachments
                    for d in plan.decisions.values()
                )
                and all(o is Outcome.DUPLICATE for _, o in plan.followers.values())
            ):
                return self._results_all_duplicate(batch, plan)
            await self._store_bytes(batch, plan)
            dead_keys = await store_dead_raw(self._store, tenant, deads)
            events = EventBuffer()
            touched = await self._write_messages(conn, batch, plan, events)
            await threads.recompute_threads(conn, tenant, touched)
            await conn.execute(  # placeholder threads emptied by promotion
                "DELETE FROM threads WHERE tenant_id = $1 AND thread_id = ANY($2::bigint[]) "
                "AND message_count = 0 AND external_thread_id ~ $3",
                tenant,
                sorted(touched),
                PLACEHOLDER_RE,
            )
            stored_dead = await insert_dead_items(conn, tenant, mailbox, deads, dead_keys)
            results = self._results(batch, plan, deads, stored_dead, dead_keys)
            self._add_backfill_event(batch, results, events)
            await events.flush(conn, tenant, mailbox)
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

    def _results_all_duplicate(self, batch: IngestBatch, plan: _Plan) -> list[ItemResult]:
        out: list[ItemResult] = []
        for k, pos in enumerate(plan.positions):
            lead = plan.followers[k][0] if k in plan.followers else k
            out.append(ItemResult(pos, Outcome.DUPLICATE, plan.decisions[lead].existing_id))
        return out

    async def _store_bytes(self, batch: IngestBatch, plan: _Plan) -> None:
        """Raw MIME, large HTML and attachments, only for items that need them."""
        stored = await store_message_bytes(
            self._store,
            batch.tenant_id,
            batch.fetch_attachment,
            plan.items,
            [self._outcome_of(plan, k) for k in range(len(plan.items))],
            plan.decisions,
        )
        plan.raw_keys, plan.html_keys = stored.raw_keys, stored.html_keys
        plan.att_state = stored.att_state
        plan.failures.update(stored.failures)

    def _outcome_of(self, plan: _Plan, k: int) -> Outcome:
        if k in plan.followers:
            _lead, outcome = plan.followers[k]
            return outcome
        return plan.decisions[k].outcome

    async def _write_messages(
        self, conn: asyncpg.Connection, batch: IngestBatch, plan: _Plan, events: EventBuffer
    ) -> set[int]:
        """All row writes for message items; returns the thread ids touched."""
        tenant, mailbox = batch.tenant_id, batch.mailbox_id
        fresh = [
            k
            for k, d in plan.decisions.items()
            if d.outcome in (Outcome.NEW, Outcome.CONFLICT) and k not in plan.failures
        ]
        # Insert in one global order (the unique keys' order), so two batches
        # carrying the same messages in different orders lock index entries in
        # the same order and cannot deadlock.
        fresh.sort(
            key=lambda k: (
                plan.items[k].message_id_norm or "",
                plan.items[k].content_fingerprint or "",
                plan.items[k].external_id,
            )
        )
        thread_subjects: dict[str, str] = {}
        for k in fresh:
            thread_subjects.setdefault(plan.items[k].thread_key, clean(plan.items[k].subject))
        thread_ids, created_threads = await threads.upsert_threads(
            conn, tenant, mailbox, thread_subjects
        )
        ids = (
            [
                r[0]
                for r in await conn.fetch(
                    "SELECT nextval(pg_get_serial_sequence('messages', 'message_id')) "
                    "FROM generate_series(1, $1)",
                    len(fresh),
                )
            ]
            if fresh
            else []
        )
        for k, new_id in zip(fresh, ids, strict=True):
            plan.message_ids[k] = new_id
        for k in fresh:  # in-batch conflicts point at their leader's new row
            d = plan.decisions[k]
            if d.outcome is Outcome.CONFLICT and d.leader is not None:
                d.existing_id = plan.message_ids.get(d.leader)
        inserted = await insert_messages(
            conn,
            tenant,
            mailbox,
            [(k, plan.items[k]) for k in fresh],
            plan.message_ids,
            {k: thread_ids[plan.items[k].thread_key] for k in fresh},
            plan.raw_keys,
            plan.html_keys,
            {
                k: plan.decisions[k].existing_id
                for k in fresh
                if plan.decisions[k].outcome is Outcome.CONFLICT
            },
        )
        await self._settle_race_losers(conn, tenant, mailbox, plan, fresh, inserted)
        fresh_ok = [k for k in fresh if k in inserted]
        await insert_participants(
            conn, tenant, [(plan.message_ids[k], plan.items[k]) for k in fresh_ok]
        )
        await insert_attachments(
            conn,
            tenant,
            [(plan.message_ids[k], plan.items[k], plan.att_state.get(k, [])) for k in fresh_ok],
        )
        await record_retried_attachments(conn, tenant, plan.decisions, plan.att_state)
        conflicts = [
            (plan.message_ids[k], plan.decisions[k].existing_id, plan.items[k].message_id_norm)
            for k in fresh_ok
            if plan.decisions[k].outcome is Outcome.CONFLICT
        ]
        await insert_conflicts(conn, tenant, conflicts)
        # copies: every new row, every merge, every in-batch follower that merged
        copies: list[tuple[int, MessageData, str | None]] = []
        for k in fresh_ok:
            copies.append((plan.message_ids[k], plan.items[k], plan.raw_keys.get(k)))
        merged = [
            k
            for k, d in plan.decisions.items()
            if d.outcome is Outcome.MERGED and k not in plan.failures
        ]
        for k in merged:
            merged_into = plan.decisions[k].existing_id
            assert merged_into is not None, "the cascade gives every MERGED decision its row"
            plan.message_ids[k] = merged_into
            copies.append((plan.message_ids[k], plan.items[k], plan.raw_keys.get(k)))
        for k, (lead, outcome) in sorted(plan.followers.items()):
            lead_id = plan.message_ids.get(lead) or plan.decisions[lead].existing_id
            if lead_id is None or lead in plan.failures or k in plan.failures:
                plan.failures.setdefault(k, "its in-batch original failed")
                continue
            plan.message_ids[k] = lead_id
            if outcome is Outcome.MERGED:
                copies.append((lead_id, plan.items[k], plan.raw_keys.get(k)))
        added = await insert_copies(conn, tenant, mailbox, copies)
        # A concurrent batch recorded this very copy after we classified it
        # (READ COMMITTED: each statement sees the latest commits): a duplicate.
        for k in merged:
            if plan.items[k].external_id not in added:
                plan.decisions[k].outcome = Outcome.DUPLICATE
                plan.decisions[k].promote = False
        merged = [k for k in merged if plan.decisions[k].outcome is Outcome.MERGED]
        promoted = [
            (plan.message_ids[k], plan.items[k], plan.raw_keys.get(k))
            for k in merged
            if plan.decisions[k].promote
        ]
        touched = set(thread_ids[plan.items[k].thread_key] for k in fresh_ok)
        touched |= await promote_outbound(conn, tenant, mailbox, promoted)
        # the application's placeholder had no participants or attachments
        promoted_keys = [k for k in merged if plan.decisions[k].promote]
        await insert_participants(
            conn, tenant, [(plan.message_ids[k], plan.items[k]) for k in promoted_keys]
        )
        await insert_attachments(
            conn,
            tenant,
            [
                (plan.message_ids[k], plan.items[k], plan.att_state.get(k, []))
                for k in promoted_keys
            ],
        )
        self._add_item_events(batch, plan, fresh_ok, merged, thread_ids, created_threads, events)
        return touched

    async def _settle_race_losers(
        self,
        conn: asyncpg.Connection,
        tenant: str,
        mailbox: str,
        plan: _Plan,
        fresh: list[int],
        inserted: set[int],
    ) -> None:
        """Tier 4: an insert lost to a concurrent batch; report the winner's row."""
        losers = [k for k in fresh if k not in inserted]
        for k in losers:
            item = plan.items[k]
            row = await conn.fetchrow(
                "SELECT message_id, mailbox_id = $2 AND external_id = $3 FROM messages "
                "WHERE tenant_id = $1 AND ((mailbox_id = $2 AND external_id = $3) "
                "OR (message_id_norm = $4 AND content_fingerprint = $5)) "
                "ORDER BY message_id LIMIT 1",
                tenant,
                mailbox,
                item.external_id,
                item.message_id_norm,
                item.content_fingerprint,
            )
            if row is None:  # vanished again (deleted concurrently): try next time
                plan.failures[k] = "lost an insert race and the winner is gone"
                continue
            same_copy = bool(row[1])
            plan.decisions[k] = Decision(Outcome.DUPLICATE if same_copy else Outcome.MERGED, row[0])
            plan.message_ids.pop(k, None)

    def _add_item_events(
        self,
        batch: IngestBatch,
        plan: _Plan,
        fresh_ok: list[int],
        merged: list[int],
        thread_ids: dict[str, int],
        created_threads: set[int],
        events: EventBuffer,
    ) -> None:
        if batch.backfill:
            return
        for tid in sorted(created_threads):
            events.add("thread.created", thread_id=tid)
        for k in fresh_ok:
            item, mid = plan.items[k], plan.message_ids[k]
            tid = thread_ids[item.thread_key]
            events.add(
                "message.created",
                thread_id=tid,
                message_id=mid,
                payload={"external_id": item.external_id},
            )
            if plan.decisions[k].outcome is Outcome.CONFLICT:
                events.add(
                    "ingest.conflict",
                    message_id=mid,
                    payload={
                        "existing_message_id": plan.decisions[k].existing_id,
                        "message_id_norm": item.message_id_norm,
                    },
                )
        for k in merged:
            kind = "message.synced" if plan.decisions[k].promote else "message.merged"
            events.add(
                kind,
                message_id=plan.message_ids[k],
                payload={"external_id": plan.items[k].external_id},
            )

    def _add_backfill_event(
        self, batch: IngestBatch, results: list[ItemResult], events: EventBuffer
    ) -> None:
        if not batch.backfill:
            return
        counts: dict[str, int] = {}
        for r in results:
            counts[r.outcome.value] = counts.get(r.outcome.value, 0) + 1
        if counts.get("new") or counts.get("merged") or counts.get("conflict"):
            events.add("mailbox.sync_completed", payload={"outcomes": counts})

    def _results(
        self,
        batch: IngestBatch,
        plan: _Plan,
        deads: list[tuple[int, DeadItem]],
        stored_dead: set[int],
        dead_keys: dict[int, str | None],
    ) -> list[ItemResult]:
        results: list[ItemResult | None] = [None] * len(batch.items)
        for k, pos in enumerate(plan.positions):
            if k in plan.failures:
                results[pos] = ItemResult(pos, Outcome.RETRIABLE_FAILURE, detail=plan.failures[k])
                continue
            outcome = self._outcome_of(plan, k)
            results[pos] = ItemResult(
                pos,
                outcome,
                plan.message_ids.get(k) or plan.decisions.get(k, Decision(outcome)).existing_id,
            )
        for i, dead in deads:
            if dead_keys.get(i) == "!failed":
                results[i] = ItemResult(
                    i, Outcome.RETRIABLE_FAILURE, detail="raw bytes of a dead item not stored"
                )
            else:
                results[i] = ItemResult(
                    i, Outcome.PERMANENT_FAILURE, detail=f"{dead.reason}: {dead.detail}"
                )
        return [r for r in results if r is not None]


def _sub(batch: IngestBatch, items: list[MessageData | DeadItem]) -> IngestBatch:
    return IngestBatch(
        batch.tenant_id, batch.mailbox_id, items, batch.backfill, batch.fetch_attachment
    )


def _one_line(exc: BaseException) -> str:
    return clean(describe(exc))
