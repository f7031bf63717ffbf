"""Transactional outbox: events rows written in the ingest transaction, then NOTIFY.

An application reads `events` in event_id order per tenant (or listens on the
`inboxd_events` channel, whose payload names the tenant and the newest id, and
then reads). Because the rows are written in the same transaction as the
messages they announce, a rolled-back batch leaves no event, and a committed
one always has its events. NOTIFY is delivered at commit, never before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import asyncpg
import orjson

NOTIFY_CHANNEL = "inboxd_events"
# First key of the per-tenant advisory lock that orders event commits (arbitrary,
# distinct from the migration lock in pipeline/schema.py).
EVENTS_LOCK_CLASS = 0x1B0CE

_INSERT = """
INSERT INTO events (tenant_id, kind, mailbox_id, thread_id, message_id, payload)
SELECT $1, e.kind, $2, e.thread_id, e.message_id, e.payload::jsonb
  FROM unnest($3::text[], $4::bigint[], $5::bigint[], $6::text[])
       AS e(kind, thread_id, message_id, payload)
RETURNING event_id
"""


@dataclass(slots=True)
class EventBuffer:
    """Events of one batch, flushed inside its transaction."""

    kinds: list[str] = field(default_factory=list)
    thread_ids: list[int | None] = field(default_factory=list)
    message_ids: list[int | None] = field(default_factory=list)
    payloads: list[str] = field(default_factory=list)

    def add(
        self,
        kind: str,
        *,
        thread_id: int | None = None,
        message_id: int | None = None,
        payload: dict[str, object] | None = None,
    ) -> None:
        self.kinds.append(kind)
        self.thread_ids.append(thread_id)
        self.message_ids.append(message_id)
        self.payloads.append(orjson.dumps(payload or {}).decode())

    async def flush(self, conn: asyncpg.Connection, tenant_id: str, mailbox_id: str | None) -> None:
        """Insert the events and queue the NOTIFY (sent by PostgreSQL at commit)."""
        if not self.kinds:
            return
        # Ids come from a sequence before commit, so two transactions of one
        # tenant could commit out of id order and a reader resuming "after id N"
        # would skip the slower one for good. Serialising the tenant's event
        # writes from here to commit makes commit order = id order.
        await conn.execute(
            "SELECT pg_advisory_xact_lock($1, hashtext($2))", EVENTS_LOCK_CLASS, tenant_id
        )
        ids = await conn.fetch(
            _INSERT,
            tenant_id,
            mailbox_id,
            self.kinds,
            self.thread_ids,
            self.message_ids,
            self.payloads,
        )
        last = max(r[0] for r in ids)
        await conn.execute(
            "SELECT pg_notify($1, $2)",
            NOTIFY_CHANNEL,
            orjson.dumps({"tenant": tenant_id, "last_event_id": last}).decode(),
        )


# --- reading the outbox (GET /v1/events) --------------------------------------------------

_EVENTS_AFTER = """
SELECT event_id, kind, mailbox_id, thread_id, message_id, payload::text AS payload,
       created_at, payload->>'client_id' AS client_id
  FROM events
 WHERE tenant_id = $1 AND event_id > $2
 ORDER BY event_id
 LIMIT $3
"""


async def events_after(
    conn: asyncpg.Connection | asyncpg.Pool, tenant_id: str, after: int, limit: int
) -> list[asyncpg.Record]:
    """The tenant's next `limit` events after `after`, oldest first; the payload as
    JSON text and its `client_id` beside it (the stream may leave a client's own out)."""
    rows: list[asyncpg.Record] = await conn.fetch(_EVENTS_AFTER, tenant_id, after, limit)
    return rows


async def last_event_id(conn: asyncpg.Connection | asyncpg.Pool, tenant_id: str) -> int:
    """The tenant's newest event id, 0 when it has none: where a new stream starts."""
    return int(
        await conn.fetchval(
            "SELECT coalesce(max(event_id), 0) FROM events WHERE tenant_id = $1", tenant_id
        )
    )
