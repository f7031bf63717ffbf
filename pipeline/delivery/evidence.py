"""Delivery evidence: one row per (source, message, recipient), derived from the event log.

The row is recomputed from *all* applied events of its key (applied once:
a replay that re-queues them does not take their effect away), never patched
with the one event at hand, so the result depends only on the set of events,
not on the order they arrived or were applied in. The rules, by occurred_at:

    accepted_at, delivered_at, bounced_at, complained_at,
    rejected_at, suppressed_at, unsubscribed_at      earliest of that type
    last_deferred_at, last_opened_at, last_clicked_at latest of that type
    bounce_type/subtype   of the earliest bounce; on a tie permanent before
                          transient before undetermined, then by dedup key
    status (transport outcome only; opens and clicks never change it):
        complained                     a complaint exists
        bounced                        a bounce, and no delivery after it
        delivered                      a delivery (a later deferral changes nothing)
        rejected / suppressed          the provider refused to send
        deferred / accepted / unknown

Concurrency: two workers applying events of one key in separate transactions
could each recompute without the other's uncommitted events. Each takes a
transaction-scoped advisory lock per key (in hash order, so they cannot
deadlock) before recomputing; under READ COMMITTED the recompute statement
then sees everything the other committed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import asyncpg

__all__ = ["EVIDENCE_LOCK_CLASS", "EvidenceKey", "recompute_evidence"]

#: First key of the per-evidence-row advisory lock (arbitrary; distinct from
#: the outbox lock 0x1B0CE and the migration lock).
EVIDENCE_LOCK_CLASS = 0x1B0CF


class EvidenceKey(NamedTuple):
    tenant_id: str
    source: str
    message_key: str
    recipient_hash: str


_RECOMPUTE = """
WITH keys AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[])
        AS k(tenant_id, source, message_key, recipient_hash)
), agg AS (
    SELECT e.tenant_id, e.source, e.message_key, e.recipient_hash,
           max(e.recipient) AS recipient,
           max(e.provider_message_id) AS provider_message_id,
           max(e.message_id_norm) AS message_id_norm,
           max(e.message_id) AS message_id,
           min(e.occurred_at) FILTER (WHERE e.event_type = 'accepted') AS accepted_at,
           max(e.occurred_at) FILTER (WHERE e.event_type = 'deferred') AS last_deferred_at,
           min(e.occurred_at) FILTER (WHERE e.event_type = 'delivered') AS delivered_at,
           min(e.occurred_at) FILTER (WHERE e.event_type = 'bounced') AS bounced_at,
           (array_agg(e.bounce_type ORDER BY e.occurred_at,
                      array_position(ARRAY['permanent', 'transient', 'undetermined'],
                                     e.bounce_type), e.dedup_key)
                FILTER (WHERE e.event_type = 'bounced'))[1] AS bounce_type,
           (array_agg(e.bounce_subtype ORDER BY e.occurred_at,
                      array_position(ARRAY['permanent', 'transient', 'undetermined'],
                                     e.bounce_type), e.dedup_key)
                FILTER (WHERE e.event_type = 'bounced'))[1] AS bounce_subtype,
           min(e.occurred_at) FILTER (WHERE e.event_type = 'complained') AS complained_at,
           min(e.occurred_at) FILTER (WHERE e.event_type = 'rejected') AS rejected_at,
           min(e.occurred_at) FILTER (WHERE e.event_type = 'suppressed') AS suppressed_at,
           min(e.occurred_at) FILTER (WHERE e.event_type = 'unsubscribed') AS unsubscribed_at,
           max(e.occurred_at) FILTER (WHERE e.event_type = 'opened') AS last_opened_at,
           max(e.occurred_at) FILTER (WHERE e.event_type = 'clicked') AS last_clicked_at
      FROM delivery_events e
      JOIN keys k USING (tenant_id, source, message_key, recipient_hash)
     -- applied_at, not state: an event re-queued by a replay keeps counting
     -- until it is applied again, so a replay never takes evidence back.
     WHERE e.applied_at IS NOT NULL
     GROUP BY e.tenant_id, e.source, e.message_key, e.recipient_hash
)
INSERT INTO delivery_evidence AS d (tenant_id, source, message_key, recipient_hash, recipient,
    provider_message_id, message_id_norm, message_id, status, accepted_at, last_deferred_at,
    delivered_at, bounced_at, bounce_type, bounce_subtype, complained_at, rejected_at,
    suppressed_at, unsubscribed_at, last_opened_at, last_clicked_at)
SELECT tenant_id, source, message_key, recipient_hash, recipient, provider_message_id,
       message_id_norm, message_id,
       CASE WHEN complained_at IS NOT NULL THEN 'complained'
            WHEN bounced_at IS NOT NULL
                 AND (delivered_at IS NULL OR bounced_at >= delivered_at) THEN 'bounced'
            WHEN delivered_at IS NOT NULL THEN 'delivered'
            WHEN rejected_at IS NOT NULL THEN 'rejected'
            WHEN suppressed_at IS NOT NULL THEN 'suppressed'
            WHEN last_deferred_at IS NOT NULL THEN 'deferred'
            WHEN accepted_at IS NOT NULL THEN 'accepted'
            ELSE 'unknown' END,
       accepted_at, last_deferred_at, delivered_at, bounced_at, bounce_type, bounce_subtype,
       complained_at, rejected_at, suppressed_at, unsubscribed_at, last_opened_at,
       last_clicked_at
  FROM agg
ON CONFLICT (tenant_id, source, message_key, recipient_hash) DO UPDATE SET
    recipient = EXCLUDED.recipient, provider_message_id = EXCLUDED.provider_message_id,
    message_id_norm = EXCLUDED.message_id_norm, message_id = EXCLUDED.message_id,
    status = EXCLUDED.status, accepted_at = EXCLUDED.accepted_at,
    last_deferred_at = EXCLUDED.last_deferred_at, delivered_at = EXCLUDED.delivered_at,
    bounced_at = EXCLUDED.bounced_at, bounce_type = EXCLUDED.bounce_type,
    bounce_subtype = EXCLUDED.bounce_subtype, complained_at = EXCLUDED.complained_at,
    rejected_at = EXCLUDED.rejected_at, suppressed_at = EXCLUDED.suppressed_at,
    unsubscribed_at = EXCLUDED.unsubscribed_at, last_opened_at = EXCLUDED.last_opened_at,
    last_clicked_at = EXCLUDED.last_clicked_at, updated_at = now()
WHERE (d.recipient, d.provider_message_id, d.message_id_norm, d.message_id, d.status,
       d.accepted_at, d.last_deferred_at, d.delivered_at, d.bounced_at, d.bounce_type,
       d.bounce_subtype, d.complained_at, d.rejected_at, d.suppressed_at, d.unsubscribed_at,
       d.last_opened_at, d.last_clicked_at)
   IS DISTINCT FROM
      (EXCLUDED.recipient, EXCLUDED.provider_message_id, EXCLUDED.message_id_norm,
       EXCLUDED.message_id, EXCLUDED.status, EXCLUDED.accepted_at, EXCLUDED.last_deferred_at,
       EXCLUDED.delivered_at, EXCLUDED.bounced_at, EXCLUDED.bounce_type,
       EXCLUDED.bounce_subtype, EXCLUDED.complained_at, EXCLUDED.rejected_at,
       EXCLUDED.suppressed_at, EXCLUDED.unsubscribed_at, EXCLUDED.last_opened_at,
       EXCLUDED.last_clicked_at)
RETURNING tenant_id, source, message_key, recipient_hash, message_id, status
"""


async def recompute_evidence(
    conn: asyncpg.Connection, keys: Iterable[EvidenceKey]
) -> list[asyncpg.Record]:
    """Recompute the evidence rows of `keys`; the rows that changed (inserted or updated).

    Call inside the transaction that marked the keys' new events applied.
    """
    ordered = sorted(set(keys))
    if not ordered:
        return []
    await conn.execute(
        # Locks are taken in hash order (volatile functions run after the sort),
        # so two workers can never wait on each other's locks in a cycle.
        "SELECT pg_advisory_xact_lock($1, h) "
        "FROM (SELECT DISTINCT hashtext(k) AS h FROM unnest($2::text[]) AS k) s ORDER BY h",
        EVIDENCE_LOCK_CLASS,
        ["\x1f".join(key) for key in ordered],
    )
    columns = [list(column) for column in zip(*ordered, strict=True)]
    rows: list[asyncpg.Record] = await conn.fetch(_RECOMPUTE, *columns)
    return rows
