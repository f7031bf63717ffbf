"""Committing a claim's result: step 5 of the protocol (pipeline/extraction/claims.py).

The validated result, the job's `completed` state and an `extraction.completed`
outbox event carrying the result commit in one transaction, or none of them. The
write is fenced by the claim's token (claims._HELD's condition, per job): a
holder whose lease expired or was taken over changes no row and gets no event, and
the reclaimer's result stands. Locked rounds (pipeline/extraction/locked.py) hold
their claim as a row lock instead and reuse `write_completed_events`.
"""

from __future__ import annotations

from collections.abc import Sequence

import asyncpg
import orjson

from inboxd.pipeline.extraction.claims import LEASE_CLEARED, ClaimedJob
from inboxd.pipeline.extraction.keys import Executor, transaction
from inboxd.pipeline.outbox import EventBuffer

__all__ = ["COMPLETED_EVENT", "complete", "complete_many", "write_completed_events"]

#: The outbox event written with a result.
COMPLETED_EVENT = "extraction.completed"

_COMPLETE = f"""
WITH r AS (
    SELECT * FROM unnest($2::bigint[], $3::bigint[], $4::text[]) AS r(job_id, token, result)
)
UPDATE extraction_jobs j
   SET state = 'completed', result = r.result::jsonb, completed_at = now(), last_error = NULL,
       {LEASE_CLEARED}
  FROM r, messages m
 WHERE j.tenant_id = $1 AND j.job_id = r.job_id AND j.state = 'running'
   AND j.lease_token = r.token AND j.lease_expires_at > now()
   AND m.tenant_id = j.tenant_id AND m.message_id = j.message_id
RETURNING j.job_id, m.thread_id
"""


async def complete(conn: Executor, job: ClaimedJob, result: object) -> bool:
    """Commit the validated `result` with its `extraction.completed` event; True: it won.

    One transaction: the job becomes completed with the result, and the event
    (job, processor, schema_version, dedup key, message and the result) is
    written to the outbox, or neither. False when the claim is no longer held
    (lease expired, reclaimed, released): no row changed, the result is dropped.
    Validating `result` against the processor's JSON Schema is the caller's
    duty, before this call (an invalid one is `fail_terminal`).
    """
    return bool(await complete_many(conn, [(job, result)]))


async def complete_many(conn: Executor, done: Sequence[tuple[ClaimedJob, object]]) -> set[int]:
    """`complete` for many jobs of one tenant in one transaction; the job ids that won.

    Each job is fenced by its own token: a job whose claim is no longer held
    changes nothing and gets no event, whatever the others do. One UPDATE and
    one event insert per mailbox, so a fast backend's results cost one commit
    per batch instead of one per message.
    """
    if not done:
        return set()
    tenants = {job.tenant_id for job, _ in done}
    if len(tenants) != 1:
        raise ValueError("complete_many takes the jobs of one tenant")
    if len({job.job_id for job, _ in done}) != len(done):
        raise ValueError("complete_many takes each job once")
    (tenant,) = tenants
    async with transaction(conn) as tx:
        rows = await tx.fetch(
            _COMPLETE,
            tenant,
            [job.job_id for job, _ in done],
            [job.token for job, _ in done],
            [orjson.dumps(result).decode() for _, result in done],
        )
        threads = {r["job_id"]: r["thread_id"] for r in rows}
        await write_completed_events(tx, tenant, done, threads)
    return set(threads)


async def write_completed_events(
    tx: asyncpg.Connection,
    tenant: str,
    done: Sequence[tuple[ClaimedJob, object]],
    threads: dict[int, int],
) -> None:
    """The `extraction.completed` events of the jobs in `threads` (job id → thread),
    in the caller's transaction: one event insert per mailbox."""
    by_mailbox: dict[str, EventBuffer] = {}
    for job, result in done:
        if job.job_id not in threads:
            continue
        by_mailbox.setdefault(job.mailbox_id, EventBuffer()).add(
            COMPLETED_EVENT,
            thread_id=threads[job.job_id],
            message_id=job.message_id,
            payload={
                "job_id": job.job_id,
                "processor": job.processor_id,
                "schema_version": job.schema_version,
                "dedup_key": job.dedup_key,
                "result": result,
            },
        )
    for mailbox, events in sorted(by_mailbox.items()):
        await events.flush(tx, tenant, mailbox)
