"""The durable hand-off from ingest to the extraction stage.

New mail must reach the processors exactly once, crash or not, without the
ingest transaction doing extraction's work::

    ingest transaction                       feeder transaction (daemon/extraction/feeder.py)
      rows written, outcome new/conflict/      take ≤ n inbox rows of the tenants it has
        merged                                   processors for (deleted, SKIP LOCKED)
      note_new ──▶ extraction_inbox ─────────▶ load_filter_fields → each processor's filter
      commit                                   enqueue the matches (pipeline/extraction/enqueue.py)
                                               commit: rows gone and jobs queued together

* `note_new` is one set-based INSERT inside the ingest transaction, only for
  tenants that have processors (the caller says which): the inbox rows commit
  with the message rows, so a message the application sees is one the stage
  will see. Merged outcomes are noted too: the copy may be the message's first
  in a mailbox, and a processor scoped to that mailbox (`mailboxes = ["x"]`)
  has not seen it yet. That extracts nothing twice: the job key is the
  message's, not the copy's (pipeline/extraction/keys.py), so a processor that
  already has a job for the message is linked. Duplicate outcomes (this very
  copy again) are never noted: they bring no new mailbox.
* The feeder deletes what it takes in the same transaction as the jobs it
  queues; a feeder killed halfway rolls both back and the rows are taken again.
  `enqueue` is idempotent (same key and fingerprint → linked), so even a row
  taken twice queues one job.
* A feeder takes only the rows of the tenants it has processors for: a row
  noted for another tenant (an import that ran before this daemon's SIGHUP
  added the processor, a daemon with other tenant files) stays for the
  daemon that has them.
* The filter runs on what the database holds of the message (every mailbox it
  has a copy in, sender, To/Cc/Bcc addresses, subject, attachment content
  types), the same fields `adapters.extraction.matches` reads from a parsed
  message, so a processor added later (`inboxd extract backfill`) selects
  the same history the live path would have.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import asyncpg

from inboxd.pipeline.extraction.keys import Executor


def _nothing() -> None:
    return None


@dataclass(frozen=True, slots=True)
class HandOff:
    """How the ingest stage hands new rows over: `wants(tenant)` says whether the
    tenant has processors (the daemon's current config), `noted()` is called after
    a commit that noted rows (it wakes the feeder; never blocks)."""

    wants: Callable[[str], bool]
    noted: Callable[[], None] = field(default=_nothing)


@dataclass(frozen=True, slots=True)
class FilterFields:
    """What a processor's mail filter reads of one stored message."""

    tenant_id: str
    message_id: int
    # every mailbox the message has a copy in, the primary copy's first: a copy in a
    # processor's mailbox is mail of that mailbox, whichever door saw it first
    mailbox_ids: tuple[str, ...]
    sender: str
    recipients: tuple[str, ...]  # To, Cc, Bcc addresses, lower-cased
    subject: str
    attachment_types: tuple[str, ...]  # declared content types, in message order


async def note_new(conn: asyncpg.Connection, tenant_id: str, message_ids: Sequence[int]) -> None:
    """Hand new message rows to the extraction stage, in the caller's transaction."""
    if message_ids:
        await conn.execute(
            "INSERT INTO extraction_inbox (tenant_id, message_id) "
            "SELECT $1, unnest($2::bigint[]) ON CONFLICT DO NOTHING",
            tenant_id,
            list(message_ids),
        )


# Oldest first along extraction_inbox_created_idx (schema.sql), whose columns are the
# ORDER BY: a round reads `limit` index entries instead of sorting the whole inbox.
# The rows are deleted by the ctid the locking scan returned: joined back by key, the
# planner hashed the whole inbox to find them. A round of 2,000 of 300k rows (EXPLAIN
# ANALYZE): 275 ms sorting, 55 ms with the index and the key join, 3-5 ms as here.
# The ctid is stable: the rows stay locked until commit, and inbox rows are only
# ever inserted and deleted, never updated.
_TAKE = """
DELETE FROM extraction_inbox
 WHERE ctid = ANY(ARRAY(
       SELECT ctid FROM extraction_inbox
        WHERE tenant_id = ANY($2::text[])
        ORDER BY created_at, tenant_id, message_id
        LIMIT $1 FOR UPDATE SKIP LOCKED))
RETURNING tenant_id, message_id
"""


async def take(
    conn: asyncpg.Connection, limit: int, *, tenant_ids: Sequence[str]
) -> dict[str, list[int]]:
    """Delete up to `limit` of the oldest inbox rows of `tenant_ids`; message ids by tenant.

    Call inside the transaction that queues their jobs: a rollback gives the
    rows back. Rows another feeder holds are skipped, not waited for; rows of
    other tenants are left for a feeder that has processors for them."""
    rows = await conn.fetch(_TAKE, limit, list(tenant_ids))
    taken: dict[str, list[int]] = {}
    for r in rows:
        taken.setdefault(r["tenant_id"], []).append(r["message_id"])
    return {tenant: sorted(ids) for tenant, ids in sorted(taken.items())}


# The copies' mailboxes through message_copies_message_idx, the primary copy's first.
# Rows the application recorded (send_status set: mail it sends) are left out: their
# provider copy syncing back is a merged outcome, noted like any other, but the
# application's own mail is not extracted (nor backfilled: pipeline/extraction/backfill.py).
_FIELDS = """
SELECT m.message_id, m.from_address, m.subject,
       ARRAY[m.mailbox_id]
         || coalesce((SELECT array_agg(DISTINCT c.mailbox_id ORDER BY c.mailbox_id)
                        FROM message_copies c
                       WHERE c.tenant_id = m.tenant_id AND c.message_id = m.message_id
                         AND c.mailbox_id <> m.mailbox_id), '{}') AS mailbox_ids,
       coalesce((SELECT array_agg(p.address ORDER BY p.role, p.position)
                   FROM message_participants p
                  WHERE p.tenant_id = m.tenant_id AND p.message_id = m.message_id
                    AND p.role IN ('to', 'cc', 'bcc') AND p.address <> ''), '{}') AS recipients,
       coalesce((SELECT array_agg(a.content_type ORDER BY a.position)
                   FROM attachments a
                  WHERE a.tenant_id = m.tenant_id AND a.message_id = m.message_id), '{}')
           AS attachment_types
  FROM messages m
 WHERE m.tenant_id = $1 AND m.message_id = ANY($2::bigint[]) AND m.send_status IS NULL
 ORDER BY m.message_id
"""


async def load_filter_fields(
    conn: Executor, tenant_id: str, message_ids: Sequence[int]
) -> list[FilterFields]:
    """The filter fields of the tenant's received messages among `message_ids`, in id
    order (one statement; ids that are not the tenant's messages, or are mail the
    application recorded, are left out)."""
    if not message_ids:
        return []
    rows = await conn.fetch(_FIELDS, tenant_id, sorted(set(message_ids)))
    return [
        FilterFields(
            tenant_id=tenant_id,
            message_id=r["message_id"],
            mailbox_ids=tuple(r["mailbox_ids"]),
            sender=r["from_address"],
            recipients=tuple(r["recipients"]),
            subject=r["subject"],
            attachment_types=tuple(r["attachment_types"]),
        )
        for r in rows
    ]


async def inbox_depth(conn: Executor, tenant_ids: Sequence[str]) -> dict[str, tuple[int, float]]:
    """Per tenant: inbox rows not yet fed, and the oldest one's age in seconds."""
    rows = await conn.fetch(
        "SELECT tenant_id, count(*) AS n, extract(epoch FROM now() - min(created_at)) AS age "
        "FROM extraction_inbox WHERE tenant_id = ANY($1::text[]) GROUP BY tenant_id",
        list(tenant_ids),
    )
    return {r["tenant_id"]: (r["n"], float(r["age"] or 0.0)) for r in rows}
