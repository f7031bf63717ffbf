"""Suppressions: addresses the application must not mail, derived from applied events.

Rules (a transient or undetermined bounce never suppresses; inboxd never
sends mail in response to an event):

    bounced with bounce_type permanent  → scope all, reason hard_bounce
    suppressed with bounce_type permanent (the provider refused to send to an
      address on its own list, e.g. SES OnAccountSuppressionList)
                                        → scope all, reason hard_bounce
    complained                          → scope all, reason complaint
    unsubscribed with a list id         → scope list:<source>:<list id>, reason unsubscribe
    unsubscribed without one            → scope source:<source>, reason unsubscribe

One row per (tenant, address hash, scope). The row records the event that
created it: the earliest qualifying event by (occurred_at, source, dedup
key), whatever order events arrive or are replayed in — a later-applied but
earlier-occurred event takes the row over, a replay changes nothing. Only a
row that did not exist before yields a `suppression.added` event.
"""

from __future__ import annotations

from collections.abc import Sequence

import asyncpg

__all__ = ["apply_suppressions"]

_UPSERT = """
WITH candidates AS (
    SELECT DISTINCT ON (e.tenant_id, e.recipient_hash, scope)
           e.tenant_id, e.recipient_hash, scope, e.recipient, reason, e.source, e.event_id,
           e.occurred_at, e.dedup_key
      FROM delivery_events e
      CROSS JOIN LATERAL (SELECT
            CASE WHEN e.event_type IN ('bounced', 'suppressed', 'complained') THEN 'all'
                 WHEN e.list_id IS NOT NULL THEN 'list:' || e.source || ':' || e.list_id
                 ELSE 'source:' || e.source END AS scope,
            CASE e.event_type WHEN 'complained' THEN 'complaint'
                              WHEN 'unsubscribed' THEN 'unsubscribe'
                              ELSE 'hard_bounce' END AS reason) r
     WHERE (e.tenant_id, e.event_id) IN (SELECT * FROM unnest($1::text[], $2::bigint[]))
       AND e.recipient_hash <> ''
       AND ((e.event_type IN ('bounced', 'suppressed') AND e.bounce_type = 'permanent')
            OR e.event_type IN ('complained', 'unsubscribed'))
     ORDER BY e.tenant_id, e.recipient_hash, scope, e.occurred_at, e.source, e.dedup_key
)
INSERT INTO suppressions AS s (tenant_id, address_hash, scope, address, reason, source,
                               event_id, occurred_at)
SELECT tenant_id, recipient_hash, scope, recipient, reason, source, event_id, occurred_at
  FROM candidates
 ORDER BY tenant_id, recipient_hash, scope
ON CONFLICT (tenant_id, address_hash, scope) DO UPDATE SET
    address = coalesce(EXCLUDED.address, s.address), reason = EXCLUDED.reason,
    source = EXCLUDED.source, event_id = EXCLUDED.event_id, occurred_at = EXCLUDED.occurred_at
WHERE (EXCLUDED.occurred_at, EXCLUDED.source,
       (SELECT dedup_key FROM delivery_events
         WHERE tenant_id = EXCLUDED.tenant_id AND event_id = EXCLUDED.event_id))
    < (s.occurred_at, s.source,
       (SELECT dedup_key FROM delivery_events
         WHERE tenant_id = s.tenant_id AND event_id = s.event_id))
RETURNING tenant_id, address_hash, scope, reason, source, event_id, (xmax = 0) AS inserted
"""


async def apply_suppressions(
    conn: asyncpg.Connection, events: Sequence[tuple[str, int]]
) -> list[asyncpg.Record]:
    """Upsert the suppressions the given (tenant_id, event_id) events call for.

    Returns the rows inserted or taken over; `inserted` tells new rows apart.
    """
    if not events:
        return []
    tenants = [t for t, _ in events]
    ids = [e for _, e in events]
    rows: list[asyncpg.Record] = await conn.fetch(_UPSERT, tenants, ids)
    return rows
