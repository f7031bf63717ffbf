"""The SES door's tables: `unrouted_items` and `queue_pollers` (schema.sql), the
tenant-less bookkeeping of a queue door: what belongs to no tenant, and what each
daemon's poller did.

    record_unrouted   a queue message that routes to no tenant (unreadable pointer,
                      no configured recipient): one row per (door, external id),
                      repeats count `attempts`; the pointer body is kept for replay
    write_totals      a poller's counters since it started, upserted every few
                      seconds per (door, owner) so `inboxd status` in another
                      process shows them
    queue_summary     both, for `inboxd status`

These are the only tables without a tenant column: they hold what the daemon
could not (yet) attribute to one, and no tenant API reads them. The daemon's
QueueSink (daemon/ses_door.py) writes them; `inboxd status` reads them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from inboxd.pipeline.ingest.rows import clean

__all__ = ["PollerRow", "queue_summary", "record_unrouted", "write_totals"]

# Pollers that have not written for this long are gone (crashed or stopped); the
# status shows live ones. Pollers write every few seconds (daemon/ses_door.py).
LIVE_POLLER_S = 120


async def record_unrouted(
    pool: asyncpg.Pool,
    door: str,
    external_id: str,
    reason: str,
    detail: str,
    body: str,
    recipients: Sequence[str],
) -> None:
    async with pool.acquire() as conn:
        await conn.execute(
            "INSERT INTO unrouted_items (door, external_id, reason, detail, body, recipients) "
            "VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (door, external_id) DO UPDATE SET "
            "attempts = unrouted_items.attempts + 1, last_seen_at = now(), "
            "reason = EXCLUDED.reason, detail = EXCLUDED.detail",
            door,
            clean(external_id),
            reason,
            clean(detail),
            clean(body),
            [clean(r) for r in recipients],
        )


async def write_totals(
    pool: asyncpg.Pool,
    door: str,
    owner: str,
    totals: Mapping[str, int],
    last_error: str | None,
    last_error_at: datetime | None,
) -> None:
    async with pool.acquire() as conn:
        await conn.execute(
            "INSERT INTO queue_pollers (door, owner, received, stored, duplicates, dead, "
            "unrouted, left_for_retry, last_error, last_error_at) "
            "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) "
            "ON CONFLICT (door, owner) DO UPDATE SET received = EXCLUDED.received, "
            "stored = EXCLUDED.stored, duplicates = EXCLUDED.duplicates, dead = EXCLUDED.dead, "
            "unrouted = EXCLUDED.unrouted, left_for_retry = EXCLUDED.left_for_retry, "
            "last_error = EXCLUDED.last_error, last_error_at = EXCLUDED.last_error_at, "
            "updated_at = now()",
            door,
            owner,
            *(
                totals.get(k, 0)
                for k in ("received", "stored", "duplicate", "dead", "unrouted", "left")
            ),
            None if last_error is None else clean(last_error),
            last_error_at,
        )


@dataclass(frozen=True, slots=True)
class PollerRow:
    door: str
    owner: str
    received: int
    stored: int
    duplicates: int
    dead: int
    unrouted: int
    left_for_retry: int
    last_error: str | None
    last_error_at: datetime | None
    updated_at: datetime
    unrouted_open: int  # unresolved unrouted items of this door, all owners


async def queue_summary(conn: asyncpg.Connection) -> list[PollerRow]:
    """Live pollers, each with its door's count of unresolved unrouted items."""
    rows = await conn.fetch(
        "SELECT p.*, (SELECT count(*) FROM unrouted_items u WHERE u.door = p.door "
        "AND u.resolved_at IS NULL) AS unrouted_open FROM queue_pollers p "
        "WHERE p.updated_at > now() - make_interval(secs => $1) ORDER BY p.door, p.owner",
        LIVE_POLLER_S,
    )
    return [
        PollerRow(
            door=r["door"],
            owner=r["owner"],
            received=r["received"],
            stored=r["stored"],
            duplicates=r["duplicates"],
            dead=r["dead"],
            unrouted=r["unrouted"],
            left_for_retry=r["left_for_retry"],
            last_error=r["last_error"],
            last_error_at=r["last_error_at"],
            updated_at=r["updated_at"],
            unrouted_open=r["unrouted_open"],
        )
        for r in rows
    ]
