"""Queuing a tenant's existing messages for a processor (`inboxd extract backfill`).

The live path queues new mail only (pipeline/extraction/inbox.py); a processor
added later, or a new `schema_version` (a new key, so a deliberate
re-extraction: docs/architecture.md §10), needs the history queued too::

    batch after batch, in message_id order, each its own transaction:
      the next ≤ n message ids of the scope after `after_id`
      load_filter_fields → the processor's filter (the caller's `select`)
      enqueue the matches (pipeline/extraction/enqueue.py)
      commit; `last_message_id` is where the next batch (or a resumed run) starts

* The filter reads the same fields the live path's feeder reads, so a backfill
  selects the history the live path would have selected.
* `enqueue` is idempotent (same key and fingerprint: linked), so a batch run
  twice, an interrupted run resumed from the start, or a backfill overlapping
  the live path queues each message identity once; a message whose key already
  has a job with another fingerprint is a payload conflict row, as live.
* Messages the application recorded (`send_status` set: mail it sends) are not
  in scope: the live path never extracts them either (their provider copy
  syncing back is a merged outcome, but `load_filter_fields` leaves them out).
* The scope's mailbox takes every message with a copy in it (`message_copies`),
  not only those whose primary copy is there: a processor's `mailboxes` list is
  matched against every copy's mailbox too (FilterFields.mailbox_ids), so mail
  that reached the mailbox through a second door is part of its history.

This module decides nothing about processors: `select` is the processor's
filter (adapters.extraction.matches_fields), passed in by the daemon.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from inboxd.pipeline.extraction.enqueue import enqueue
from inboxd.pipeline.extraction.inbox import FilterFields, load_filter_fields
from inboxd.pipeline.extraction.keys import Executor, transaction


@dataclass(frozen=True, slots=True)
class BackfillScope:
    """Whose messages, for which processor and schema_version; `mailbox_id`: only
    messages with a copy in that mailbox (None: all)."""

    tenant_id: str
    processor_id: str
    schema_version: str
    mailbox_id: str | None = None


@dataclass(slots=True)
class BackfillReport:
    """Counts of messages examined, by what became of them; `last_message_id` is the
    last one examined (None before the first)."""

    examined: int = 0
    queued: int = 0  # a new job
    linked: int = 0  # the key already had a job with the same fingerprint
    conflicts: int = 0  # same key, another fingerprint: a payload conflict row
    not_matching: int = 0  # the processor's mailboxes or filter do not take it
    missing: int = 0  # deleted between the listing and the enqueue
    last_message_id: int | None = None

    def merge(self, batch: BackfillReport) -> None:
        """Add a later batch's counts; its last message id becomes the report's."""
        self.examined += batch.examined
        self.queued += batch.queued
        self.linked += batch.linked
        self.conflicts += batch.conflicts
        self.not_matching += batch.not_matching
        self.missing += batch.missing
        if batch.last_message_id is not None:
            self.last_message_id = batch.last_message_id


# message_id order on the primary key (tenant_id, message_id): each batch is one
# index range scan, however large the tenant. A mailbox scope checks each message's
# copies through message_copies_message_idx; the primary copy's mailbox is compared
# first, so a message whose primary copy is there reads no copy row.
_SCOPE = """
  FROM messages m
 WHERE m.tenant_id = $1 AND m.message_id > $2 AND m.send_status IS NULL
   AND ($3::text IS NULL OR m.mailbox_id = $3
        OR EXISTS (SELECT 1 FROM message_copies c
                    WHERE c.tenant_id = m.tenant_id AND c.message_id = m.message_id
                      AND c.mailbox_id = $3))
"""


async def count_scope(conn: Executor, scope: BackfillScope, after_id: int) -> int:
    """Messages in scope after `after_id` (for a progress bar)."""
    count = await conn.fetchval(
        "SELECT count(*)" + _SCOPE, scope.tenant_id, after_id, scope.mailbox_id
    )
    return int(count)


async def backfill_batch(
    conn: Executor,
    scope: BackfillScope,
    after_id: int,
    limit: int,
    select: Callable[[FilterFields], bool],
) -> BackfillReport:
    """Queue the next ≤ `limit` messages of `scope` after `after_id` that `select`
    takes, in one transaction; an empty report (examined 0) when none is left."""
    report = BackfillReport()
    async with transaction(conn) as tx:
        ids = [
            r["message_id"]
            for r in await tx.fetch(
                "SELECT m.message_id" + _SCOPE + " ORDER BY m.message_id LIMIT $4",
                scope.tenant_id,
                after_id,
                scope.mailbox_id,
                limit,
            )
        ]
        if not ids:
            return report
        fields = await load_filter_fields(tx, scope.tenant_id, ids)
        chosen = [f.message_id for f in fields if select(f)]
        result = await enqueue(
            tx, scope.tenant_id, scope.processor_id, scope.schema_version, chosen, backfill=True
        )
    report.examined = len(ids)
    report.queued = len(result.queued)
    report.linked = len(result.linked)
    report.conflicts = len(result.conflicts)
    report.not_matching = len(fields) - len(chosen)
    report.missing = len(ids) - len(fields) + len(result.missing)
    report.last_message_id = ids[-1]
    return report
