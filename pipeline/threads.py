"""Thread rows: upsert by (mailbox, thread key), recompute metadata set-based.

The thread key is the provider's thread id (Gmail threadId, Graph
conversationId); raw-MIME doors derive one from headers (MessageData). Metadata
(count, first/last time, latest message, participant count, subject) is never
maintained incrementally: every batch recomputes it for every thread it
touched, from the messages themselves, so arrivals in any order leave it right.
"""

from __future__ import annotations

import asyncpg

_INSERT = """
INSERT INTO threads (tenant_id, mailbox_id, external_thread_id, subject)
SELECT $1, $2, k.key, k.subject
  FROM unnest($3::text[], $4::text[]) AS k(key, subject)
ON CONFLICT (tenant_id, mailbox_id, external_thread_id) DO NOTHING
RETURNING thread_id, external_thread_id
"""

_SELECT = """
SELECT t.thread_id, t.external_thread_id
  FROM threads t
 WHERE t.tenant_id = $1 AND t.mailbox_id = $2 AND t.external_thread_id = ANY($3::text[])
"""

# Correlated sub-selects per touched thread run as index scans on
# messages_thread_idx and message_participants' key; a CTE join scanned every
# message of the tenant per batch (O(table), bench/README.md).
_RECOMPUTE = """
UPDATE threads t
   SET (message_count, first_message_at, last_message_at, latest_message_id, subject) = (
           SELECT count(*),
                  min(coalesce(m.sent_at, m.received_at)),
                  max(coalesce(m.sent_at, m.received_at)),
                  (array_agg(m.message_id ORDER BY coalesce(m.sent_at, m.received_at) DESC,
                             m.message_id DESC))[1],
                  coalesce((array_agg(m.subject ORDER BY coalesce(m.sent_at, m.received_at),
                                      m.message_id))[1], t.subject)
             FROM messages m
            WHERE m.tenant_id = t.tenant_id AND m.thread_id = t.thread_id),
       participant_count = (
           SELECT count(DISTINCT p.address)
             FROM messages m
             JOIN message_participants p
               ON p.tenant_id = m.tenant_id AND p.message_id = m.message_id
            WHERE m.tenant_id = t.tenant_id AND m.thread_id = t.thread_id AND p.address <> ''),
       updated_at = now()
 WHERE t.tenant_id = $1 AND t.thread_id = ANY($2::bigint[])
"""


async def upsert_threads(
    conn: asyncpg.Connection, tenant_id: str, mailbox_id: str, keys: dict[str, str]
) -> tuple[dict[str, int], set[int]]:
    """Thread id for every key ({key: subject}); creates missing threads.

    Returns ({key: thread_id}, ids of threads created by this call). Keys are
    inserted in sorted order so concurrent batches lock in the same order and
    cannot deadlock.
    """
    if not keys:
        return {}, set()
    ordered = sorted(keys)
    created = await conn.fetch(_INSERT, tenant_id, mailbox_id, ordered, [keys[k] for k in ordered])
    ids = {key: tid for tid, key in created}
    missing = [k for k in ordered if k not in ids]
    if missing:
        for tid, key in await conn.fetch(_SELECT, tenant_id, mailbox_id, missing):
            ids[key] = tid
    return ids, {tid for tid, _ in created}


async def recompute_threads(conn: asyncpg.Connection, tenant_id: str, thread_ids: set[int]) -> None:
    """Recompute count, first/last, latest message, subject, participants."""
    if thread_ids:
        await conn.execute(_RECOMPUTE, tenant_id, sorted(thread_ids))
