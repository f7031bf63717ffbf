"""One batch's message items inside the ingest transaction: its plan, its rows, its results.

`IngestPlan` is what a batch learns inside its transaction, per message item
(index `k` into `items`): the cascade's decision, or for an in-batch follower its
leader and outcome; the message row it ended on; where its bytes went
(pipeline/ingest/objects.py); and why it failed, if it did.

`write_messages` turns the plan into rows, after classification and the
object-store side, in this order:

  new and conflicting items: reserve message ids → upsert their threads →
  insert the messages (tier 4: an insert that lost to a concurrent batch
  reports the winner's row instead) → participants, attachments, conflicts →
  one mailbox copy per new row, merge and merging in-batch follower (a copy a
  concurrent batch recorded first makes the item a duplicate) → promote the
  application's outbound placeholders that merged items complete → per-item
  events (none in a backfill).

Rows go in one global order (the unique keys'), so two batches carrying the
same messages cannot deadlock. From the plan (and the batch's dead items) come
the per-item results, one per batch position, in batch order
(`assemble_results`), and the one mailbox.sync_completed event a backfill writes
instead of per-message events. pipeline/ingest/stage.py owns the transaction and
calls in here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import asyncpg

from inboxd.pipeline import threads
from inboxd.pipeline.cascade import Decision
from inboxd.pipeline.ingest.objects import (
    AttachmentState,
    DeadRawKeys,
    record_retried_attachments,
)
from inboxd.pipeline.ingest.rows import (
    clean,
    insert_attachments,
    insert_conflicts,
    insert_copies,
    insert_messages,
    insert_participants,
    promote_outbound,
)
from inboxd.pipeline.message import DeadItem, MessageData
from inboxd.pipeline.outbox import EventBuffer
from inboxd.pipeline.outcomes import ItemResult, Outcome


@dataclass(slots=True)
class IngestPlan:
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

    def outcome_of(self, k: int) -> Outcome:
        """Message item k's outcome: its own decision, or as its in-batch leader's follower."""
        if k in self.followers:
            _lead, outcome = self.followers[k]
            return outcome
        return self.decisions[k].outcome

    def all_duplicate(self) -> bool:
        """Every message item is a duplicate with nothing to retry: nothing to write."""
        return all(
            d.outcome is Outcome.DUPLICATE and not d.retry_attachments
            for d in self.decisions.values()
        ) and all(o is Outcome.DUPLICATE for _, o in self.followers.values())


async def write_messages(
    conn: asyncpg.Connection,
    tenant: str,
    mailbox: str,
    plan: IngestPlan,
    events: EventBuffer,
    *,
    backfill: bool,
) -> set[int]:
    """All row writes for message items; returns the thread ids touched."""
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
    await _settle_race_losers(conn, tenant, mailbox, plan, fresh, inserted)
    fresh_ok = [k for k in fresh if k in inserted]
    await _insert_details(conn, tenant, plan, fresh_ok)
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
    touched = set(thread_ids[plan.items[k].thread_key] for k in fresh_ok)
    touched |= await _promote_placeholders(conn, tenant, mailbox, plan, merged)
    if not backfill:
        _add_item_events(plan, fresh_ok, merged, thread_ids, created_threads, events)
    return touched


async def _promote_placeholders(
    conn: asyncpg.Connection, tenant: str, mailbox: str, plan: IngestPlan, merged: list[int]
) -> set[int]:
    """Merged items that complete an application's outbound placeholder take it over.

    Returns the thread ids the promotion touched.
    """
    promoted = [
        (plan.message_ids[k], plan.items[k], plan.raw_keys.get(k))
        for k in merged
        if plan.decisions[k].promote
    ]
    touched = await promote_outbound(conn, tenant, mailbox, promoted)
    # the application's placeholder had no participants or attachments
    promoted_keys = [k for k in merged if plan.decisions[k].promote]
    await _insert_details(conn, tenant, plan, promoted_keys)
    return touched


async def _insert_details(
    conn: asyncpg.Connection, tenant: str, plan: IngestPlan, keys: list[int]
) -> None:
    """Participants and attachments of the message rows items `keys` ended on."""
    await insert_participants(conn, tenant, [(plan.message_ids[k], plan.items[k]) for k in keys])
    await insert_attachments(
        conn,
        tenant,
        [(plan.message_ids[k], plan.items[k], plan.att_state.get(k, [])) for k in keys],
    )


async def _settle_race_losers(
    conn: asyncpg.Connection,
    tenant: str,
    mailbox: str,
    plan: IngestPlan,
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
    plan: IngestPlan,
    fresh_ok: list[int],
    merged: list[int],
    thread_ids: dict[str, int],
    created_threads: set[int],
    events: EventBuffer,
) -> None:
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


def results_all_duplicate(plan: IngestPlan) -> list[ItemResult]:
    """Results of a batch whose every item is a duplicate (`IngestPlan.all_duplicate`)."""
    out: list[ItemResult] = []
    for k, pos in enumerate(plan.positions):
        lead = plan.followers[k][0] if k in plan.followers else k
        out.append(ItemResult(pos, Outcome.DUPLICATE, plan.decisions[lead].existing_id))
    return out


def assemble_results(
    size: int,
    plan: IngestPlan,
    deads: list[tuple[int, DeadItem]],
    dead_keys: DeadRawKeys,
) -> list[ItemResult]:
    """One ItemResult per position of a batch of `size` items, in batch order."""
    results: list[ItemResult | None] = [None] * size
    for k, pos in enumerate(plan.positions):
        if k in plan.failures:
            results[pos] = ItemResult(pos, Outcome.RETRIABLE_FAILURE, detail=plan.failures[k])
            continue
        outcome = plan.outcome_of(k)
        results[pos] = ItemResult(
            pos,
            outcome,
            plan.message_ids.get(k) or plan.decisions.get(k, Decision(outcome)).existing_id,
        )
    for i, dead in deads:
        if i in dead_keys.failed:
            results[i] = ItemResult(
                i, Outcome.RETRIABLE_FAILURE, detail="raw bytes of a dead item not stored"
            )
        else:
            results[i] = ItemResult(
                i, Outcome.PERMANENT_FAILURE, detail=f"{dead.reason}: {dead.detail}"
            )
    return [r for r in results if r is not None]


def add_backfill_event(results: list[ItemResult], events: EventBuffer) -> None:
    """A backfill's one event instead of one per message, when it stored anything."""
    counts: dict[str, int] = {}
    for r in results:
        counts[r.outcome.value] = counts.get(r.outcome.value, 0) + 1
    if counts.get("new") or counts.get("merged") or counts.get("conflict"):
        events.add("mailbox.sync_completed", payload={"outcomes": counts})
