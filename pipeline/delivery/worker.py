"""Applying stored delivery events: evidence, suppressions, outbox events.

State machine of a `delivery_events` row:

    pending ──apply ok──▶ applied
       │  ▲
       │  └── apply failed, attempts < MAX_ATTEMPTS: next_attempt_at = now + backoff
       └───── apply failed, attempts = MAX_ATTEMPTS ──▶ dead
    applied / dead ──`inboxd events replay`──▶ pending (attempts reset)

`apply_due` claims due pending rows with `FOR UPDATE SKIP LOCKED`, so any
number of workers in any number of replicas share the queue without taking
the same row. In one transaction it correlates the events with outbound
messages (by Message-ID, else by the provider's message id recorded as
messages.esp_message_id), marks them applied, recomputes the evidence of
every key they touch (pipeline/delivery/evidence.py), upserts suppressions
(suppressions.py) and writes `delivery.updated` / `suppression.added` (or
`suppression.updated` when an earlier-occurred event takes a row over) outbox
events — so the application sees an effect exactly when it is committed.

Applying is idempotent: evidence is recomputed from the whole log and only a
changed row announces itself; suppressions only announce rows that are new.
Replaying applied events therefore changes nothing.

Failures: if the batch transaction fails for any reason but lost connection,
each row is retried alone; a row that still fails gets its attempt counted
and a backoff (exponential, capped, with full jitter so a poisoned batch of
many replicas does not retry in lockstep), and after MAX_ATTEMPTS it is dead —
never dropped. Connection trouble leaves the rows pending untouched: the run
loop backs off and tries again.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar

import anyio
import asyncpg
import structlog
from anyio.abc import TaskStatus

from inboxd.pipeline.delivery.evidence import EvidenceKey, recompute_evidence
from inboxd.pipeline.delivery.intake import DELIVERY_CHANNEL
from inboxd.pipeline.delivery.suppressions import apply_suppressions
from inboxd.pipeline.errors import DATABASE_ERRORS, DbFault, db_fault, describe
from inboxd.pipeline.outbox import EventBuffer

__all__ = [
    "APPLY_BATCH",
    "MAX_ATTEMPTS",
    "apply_due",
    "backoff_s",
    "prune_replay_tokens",
    "replay_events",
    "run_worker",
]

log = structlog.get_logger(__name__)

#: Rows one worker transaction applies. A burst of 500 events touches ≤ 500
#: evidence rows: one recompute statement of a few ms, one outbox insert.
APPLY_BATCH = 500
#: Attempts before a row is dead. With the backoff below the nine waits are at
#: most 30 s + 60 s + … + 3600 s ≈ 3.1 h, about 1.5 h on average (full jitter).
#: Database outages do not count: they leave rows pending untouched.
MAX_ATTEMPTS = 10
BACKOFF_BASE_S = 30.0
BACKOFF_CAP_S = 3600.0
#: Poll when no NOTIFY came (a replica's commit, a backoff coming due).
IDLE_POLL_S = 5.0
#: Pause after the database failed before trying again.
RETRY_PAUSE_S = 2.0
#: How long accepted replay tokens are remembered: the widest timestamp
#: tolerance a source may configure, both ways (2 × adapters/esp/base.py
#: MAX_TOLERANCE_S = 2 × 1800 s); after that the timestamp check refuses a
#: replay on its own.
REPLAY_TOKEN_KEEP_S = 3600.0

# Longest one apply or prune batch may hold up a shutdown (it normally takes ms).
BATCH_DEADLINE_S = 30.0
T = TypeVar("T")

_CLAIM = """
SELECT tenant_id, event_id FROM delivery_events
 WHERE state = 'pending' AND next_attempt_at <= now()
 ORDER BY next_attempt_at, event_id
 LIMIT $1
 FOR UPDATE SKIP LOCKED
"""

_CLAIM_GIVEN = """
SELECT tenant_id, event_id FROM delivery_events
 WHERE (tenant_id, event_id) IN (SELECT * FROM unnest($1::text[], $2::bigint[]))
   AND state = 'pending'
 FOR UPDATE SKIP LOCKED
"""

_MARK_APPLIED = """
UPDATE delivery_events e
   SET state = 'applied', applied_at = now(), attempts = e.attempts + 1, last_error = NULL,
       message_id = coalesce(e.message_id, (
           SELECT min(m.message_id) FROM messages m
            WHERE m.tenant_id = e.tenant_id AND m.message_id_norm = e.message_id_norm
              AND m.direction = 'outbound'), (
           SELECT min(m.message_id) FROM messages m
            WHERE m.tenant_id = e.tenant_id AND m.esp_message_id = e.provider_message_id
              AND m.direction = 'outbound'))
 WHERE (e.tenant_id, e.event_id) IN (SELECT * FROM unnest($1::text[], $2::bigint[]))
RETURNING e.tenant_id, e.event_id, e.source, e.message_key, e.recipient_hash
"""

_RECORD_FAILURE = """
UPDATE delivery_events
   SET attempts = attempts + 1, last_error = $3,
       state = CASE WHEN attempts + 1 >= $4 THEN 'dead' ELSE 'pending' END,
       next_attempt_at = now() + make_interval(secs => $5)
 WHERE tenant_id = $1 AND event_id = $2 AND state = 'pending'
RETURNING state
"""


def backoff_s(attempts: int, *, rng: random.Random | None = None) -> float:
    """Delay before the next attempt after `attempts` failures: full jitter over
    min(cap, base·2^(attempts-1)) (AWS architecture blog, "Exponential Backoff
    And Jitter"), never below one second."""
    ceiling = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** max(0, attempts - 1))
    return max(1.0, (rng or random).uniform(0, ceiling))


async def apply_due(pool: asyncpg.Pool, *, limit: int = APPLY_BATCH) -> int:
    """Apply one batch of due pending events; the number of rows claimed."""
    try:
        async with pool.acquire() as conn, conn.transaction():
            claimed = await conn.fetch(_CLAIM, limit)
            if claimed:
                await _apply(conn, claimed)
            return len(claimed)
    except Exception as exc:
        if _unavailable(exc):
            raise
        log.warning("delivery_batch_failed", error=describe(exc))
    return await _apply_one_by_one(pool, limit)


async def _apply_one_by_one(pool: asyncpg.Pool, limit: int) -> int:
    async with pool.acquire() as conn:
        due = await conn.fetch(
            "SELECT tenant_id, event_id, attempts FROM delivery_events "
            "WHERE state = 'pending' AND next_attempt_at <= now() "
            "ORDER BY next_attempt_at, event_id LIMIT $1",
            limit,
        )
    for row in due:
        key = (row["tenant_id"], row["event_id"])
        try:
            async with pool.acquire() as conn, conn.transaction():
                claimed = await conn.fetch(_CLAIM_GIVEN, [key[0]], [key[1]])
                if claimed:
                    await _apply(conn, claimed)
        except Exception as exc:
            if _unavailable(exc):
                raise
            await _record_failure(pool, key, row["attempts"] + 1, exc)
    return len(due)


async def _record_failure(
    pool: asyncpg.Pool, key: tuple[str, int], attempts: int, exc: Exception
) -> None:
    async with pool.acquire() as conn:
        state = await conn.fetchval(
            _RECORD_FAILURE, key[0], key[1], describe(exc), MAX_ATTEMPTS, backoff_s(attempts)
        )
    log.warning(
        "delivery_event_failed",
        tenant=key[0],
        event_id=key[1],
        attempts=attempts,
        state=state,
        error=describe(exc),
    )


async def _apply(conn: asyncpg.Connection, claimed: Sequence[asyncpg.Record]) -> None:
    applied = await conn.fetch(
        _MARK_APPLIED, [r["tenant_id"] for r in claimed], [r["event_id"] for r in claimed]
    )
    keys = {
        EvidenceKey(r["tenant_id"], r["source"], r["message_key"], r["recipient_hash"])
        for r in applied
        if r["message_key"] is not None
    }
    changed = await recompute_evidence(conn, keys)
    suppressed = await apply_suppressions(conn, [(r["tenant_id"], r["event_id"]) for r in applied])
    buffers: dict[str, EventBuffer] = {}
    for row in changed:
        buffers.setdefault(row["tenant_id"], EventBuffer()).add(
            "delivery.updated",
            message_id=row["message_id"],
            payload={
                "source": row["source"],
                "message_key": row["message_key"],
                "recipient_hash": row["recipient_hash"],
                "status": row["status"],
            },
        )
    for row in suppressed:
        # Taken over by an event that occurred earlier (arrival order is not event
        # order): the row's reason/event changed, and the application hears so.
        buffers.setdefault(row["tenant_id"], EventBuffer()).add(
            "suppression.added" if row["inserted"] else "suppression.updated",
            payload={
                "address_hash": row["address_hash"],
                "scope": row["scope"],
                "reason": row["reason"],
                "source": row["source"],
                "delivery_event_id": row["event_id"],
            },
        )
    # Tenant order: every worker takes the outbox locks in the same order.
    for tenant_id in sorted(buffers):
        await buffers[tenant_id].flush(conn, tenant_id, None)


async def replay_events(
    conn: asyncpg.Connection,
    *,
    tenant_id: str | None = None,
    dead_only: bool = False,
    since: datetime | None = None,
    source: str | None = None,
) -> int:
    """Re-queue applied (and dead) events, or only dead ones; the number re-queued.

    Safe at any time: re-applying an applied event changes nothing, and a row a
    worker holds right now is re-queued after that worker commits.
    """
    status = await conn.execute(
        "UPDATE delivery_events SET state = 'pending', attempts = 0, next_attempt_at = now(), "
        "last_error = NULL "
        "WHERE state = ANY($1::text[]) AND ($2::text IS NULL OR tenant_id = $2) "
        "AND ($3::timestamptz IS NULL OR received_at >= $3) "
        "AND ($4::text IS NULL OR source = $4)",
        ["dead"] if dead_only else ["dead", "applied"],
        tenant_id,
        since,
        source,
    )
    count = int(status.rsplit(" ", 1)[-1])
    if count:
        await conn.execute("SELECT pg_notify($1, '')", DELIVERY_CHANNEL)
    return count


async def prune_replay_tokens(conn: asyncpg.Connection) -> int:
    """Forget replay tokens older than REPLAY_TOKEN_KEEP_S; how many were removed."""
    status = await conn.execute(
        "DELETE FROM webhook_replay_tokens WHERE seen_at < now() - make_interval(secs => $1)",
        REPLAY_TOKEN_KEEP_S,
    )
    return int(status.rsplit(" ", 1)[-1])


async def run_worker(
    pool: asyncpg.Pool, dsn: str, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
) -> None:
    """Apply events as they come (NOTIFY) or come due (poll), until cancelled.

    No database error ends the loop: it is logged, and the loop pauses and
    goes on (the rows stay pending). A lost LISTEN connection is re-opened.
    """
    wake = anyio.Event()
    listener: asyncpg.Connection | None = None
    next_prune = anyio.current_time()

    def on_notify(*_args: object) -> None:
        wake.set()

    try:
        listener = await _listen(dsn, on_notify)
        task_status.started()
        while True:
            wake = anyio.Event()
            try:
                if listener is None or listener.is_closed():
                    listener = await _listen(dsn, on_notify)
                while await _finish_batch(apply_due(pool)) == APPLY_BATCH:
                    pass
                if anyio.current_time() >= next_prune:
                    async with pool.acquire() as conn:
                        await _finish_batch(prune_replay_tokens(conn))
                    next_prune = anyio.current_time() + REPLAY_TOKEN_KEEP_S / 4
            except Exception as exc:  # the worker outlives any database trouble
                log.warning("delivery_worker_failed", error=describe(exc))
                await anyio.sleep(RETRY_PAUSE_S)
                continue
            with anyio.move_on_after(IDLE_POLL_S):
                await wake.wait()
    finally:
        if listener is not None:
            with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                await listener.close()


async def _listen(dsn: str, on_notify: Callable[..., None]) -> asyncpg.Connection | None:
    """A connection LISTENing on the delivery channel; None when it cannot be had
    (polling every IDLE_POLL_S still finds the work)."""
    try:
        listener = await asyncpg.connect(dsn)
    except DATABASE_ERRORS as exc:
        log.warning("delivery_listen_failed", error=describe(exc))
        return None
    try:
        await listener.add_listener(DELIVERY_CHANNEL, on_notify)
    except DATABASE_ERRORS as exc:
        log.warning("delivery_listen_failed", error=describe(exc))
        listener.terminate()  # a close could raise too, before the worker reported started
        return None
    return listener


def _unavailable(exc: BaseException) -> bool:
    """The database is away: retrying event by event would only fail the same way
    (and count attempts against events that did nothing wrong)."""
    return isinstance(exc, DATABASE_ERRORS) and db_fault(exc) is DbFault.UNAVAILABLE


async def _finish_batch(work: Awaitable[T]) -> T:
    """One batch's short transaction, finished even when the worker is being
    cancelled (shutdown, or a start-up that failed): a transaction cancelled half
    way leaves asyncpg to reset its connection, logged as an error, for a batch
    that would have committed in milliseconds. Bounded by BATCH_DEADLINE_S."""
    with anyio.CancelScope(shield=True), anyio.fail_after(BATCH_DEADLINE_S):
        result = await work
    return result


_STATUS = """
SELECT tenant_id, source,
       count(*) FILTER (WHERE state = 'pending') AS pending,
       count(*) FILTER (WHERE state = 'applied') AS applied,
       count(*) FILTER (WHERE state = 'dead') AS dead,
       min(received_at) FILTER (WHERE state = 'pending') AS oldest_pending,
       (array_agg(last_error ORDER BY received_at DESC) FILTER (WHERE state = 'dead'))[1]
           AS last_dead_error
  FROM delivery_events
 WHERE $1::text IS NULL OR tenant_id = $1
 GROUP BY tenant_id, source
 ORDER BY tenant_id, source
"""


async def delivery_status(conn: asyncpg.Connection, tenant_id: str | None) -> list[dict[str, Any]]:
    """Per tenant and source, what the worker has: pending, applied and dead events,
    the oldest pending one's arrival and the newest dead one's error (`inboxd
    delivery status`); every tenant when `tenant_id` is None."""
    return [dict(r) for r in await conn.fetch(_STATUS, tenant_id)]
