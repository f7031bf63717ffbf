"""The operator's side of extraction: re-running a job on purpose, and the backlog.

`retry` is `inboxd extract retry --id`: a needs_review (or retry_wait) job runs
again now, with its attempts reset; a completed result is never overwritten (a
new schema_version re-extracts instead). `backlog` is what `inboxd status` and
/metrics show: per tenant and processor, the jobs not completed by state and
what is due now. `list_jobs` and `list_conflicts` are `inboxd extract list`:
what an operator reads to decide what to retry or review. The protocol itself:
pipeline/extraction/claims.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from inboxd.pipeline.extraction.claims import JobState
from inboxd.pipeline.extraction.keys import Executor


@dataclass(frozen=True, slots=True)
class RetryResult:
    """What `retry_job` found: the job's state before (None: no such job in the
    tenant) and whether it was re-queued."""

    previous: JobState | None
    retried: bool


async def retry_job(conn: Executor, tenant_id: str, job_id: int) -> RetryResult:
    """`inboxd extract retry --id`: run a needs_review or retry_wait job again, now.

    The job becomes PENDING, due now, with its attempts reset; a pending, running
    or completed job is left as it is (a completed result is never overwritten; a
    new schema_version re-extracts). One statement under the row's lock: a worker
    claiming the job at the same moment either went first or waits for it.
    """
    row = await conn.fetchrow(
        """
        WITH old AS (SELECT state FROM extraction_jobs
                      WHERE tenant_id = $1 AND job_id = $2 FOR UPDATE),
             upd AS (UPDATE extraction_jobs SET state = 'pending', next_attempt_at = now(),
                            attempts = 0, review_reason = NULL, updated_at = now()
                      WHERE tenant_id = $1 AND job_id = $2
                        AND state IN ('needs_review', 'retry_wait') RETURNING state)
        SELECT (SELECT state FROM old) AS previous, EXISTS (SELECT FROM upd) AS retried
        """,
        tenant_id,
        job_id,
    )
    previous = row["previous"] if row is not None else None
    return RetryResult(
        JobState(previous) if previous is not None else None, bool(row and row["retried"])
    )


async def retry_processor(conn: Executor, tenant_id: str, processor_id: str) -> int:
    """`inboxd extract retry --processor`: every needs_review and retry_wait job of
    one processor pending again, due now, attempts reset (after an outage, a fixed
    schema or URL); how many. Completed, pending and running jobs are left alone.
    One statement; rows a worker holds locked right now are skipped, not waited for."""
    return int(
        await conn.fetchval(
            """
            WITH picked AS (SELECT job_id FROM extraction_jobs
                             WHERE tenant_id = $1 AND processor_id = $2
                               AND state IN ('needs_review', 'retry_wait')
                               FOR UPDATE SKIP LOCKED),
                 upd AS (UPDATE extraction_jobs j
                            SET state = 'pending', next_attempt_at = now(), attempts = 0,
                                review_reason = NULL, updated_at = now()
                           FROM picked
                          WHERE j.tenant_id = $1 AND j.job_id = picked.job_id
                      RETURNING 1)
            SELECT count(*) FROM upd
            """,
            tenant_id,
            processor_id,
        )
    )


async def retry(conn: Executor, tenant_id: str, job_id: int) -> JobState | None:
    """`retry_job`, answered as one state: PENDING when the job was re-queued, else
    the state it was left in (pending, running, completed), None when there is no
    such job. A job already pending also answers PENDING: use `retry_job` to tell."""
    result = await retry_job(conn, tenant_id, job_id)
    return JobState.PENDING if result.retried else result.previous


@dataclass(frozen=True, slots=True)
class Backlog:
    """Jobs not completed of one tenant's processor, for `inboxd status` and /metrics."""

    tenant_id: str
    processor_id: str
    pending: int
    running: int
    retry_wait: int
    needs_review: int
    due: int  # claimable now (pending/retry_wait due, running with an expired lease)
    oldest_due_s: float  # how long the oldest due job has waited (0 when none)


_BACKLOG = """
SELECT tenant_id, processor_id,
       count(*) FILTER (WHERE state = 'pending') AS pending,
       count(*) FILTER (WHERE state = 'running') AS running,
       count(*) FILTER (WHERE state = 'retry_wait') AS retry_wait,
       count(*) FILTER (WHERE state = 'needs_review') AS needs_review,
       count(*) FILTER (WHERE state <> 'needs_review' AND next_attempt_at <= now()) AS due,
       coalesce(extract(epoch FROM now() - min(next_attempt_at)
                FILTER (WHERE state <> 'needs_review' AND next_attempt_at <= now())), 0)
           AS oldest_due_s
  FROM extraction_jobs
 WHERE tenant_id = ANY($1::text[]) AND state <> 'completed'
 GROUP BY tenant_id, processor_id
 ORDER BY tenant_id, processor_id
"""


async def backlog(conn: Executor, tenant_ids: Sequence[str]) -> list[Backlog]:
    """Per (tenant, processor) counts of jobs by state, with what is due now."""
    rows = await conn.fetch(_BACKLOG, list(tenant_ids))
    return [
        Backlog(
            tenant_id=r["tenant_id"],
            processor_id=r["processor_id"],
            pending=r["pending"],
            running=r["running"],
            retry_wait=r["retry_wait"],
            needs_review=r["needs_review"],
            due=r["due"],
            oldest_due_s=float(r["oldest_due_s"]),
        )
        for r in rows
    ]


@dataclass(frozen=True, slots=True)
class JobListing:
    """One job as `inboxd extract list` shows it (the result itself is not read)."""

    job_id: int
    processor_id: str
    schema_version: str
    message_id: int
    mailbox_id: str
    state: JobState
    attempts: int
    next_attempt_at: datetime  # due time; for a running job, its lease expiry
    last_error: str | None
    review_reason: str | None
    created_at: datetime
    updated_at: datetime


_JOBS_WHERE = """
  FROM extraction_jobs
 WHERE tenant_id = $1 AND ($2::text IS NULL OR state = $2)
   AND ($3::text IS NULL OR processor_id = $3)
"""


async def list_jobs(
    conn: Executor,
    tenant_id: str,
    *,
    state: JobState | None = None,
    processor_id: str | None = None,
    limit: int = 50,
) -> tuple[list[JobListing], int]:
    """The tenant's jobs, newest first (by job id), at most `limit`, optionally of
    one state and one processor; and how many match in all."""
    where = (tenant_id, state.value if state is not None else None, processor_id)
    total = await conn.fetchval("SELECT count(*)" + _JOBS_WHERE, *where)
    rows = await conn.fetch(
        "SELECT job_id, processor_id, schema_version, message_id, mailbox_id, state, attempts, "
        "next_attempt_at, last_error, review_reason, created_at, updated_at"
        + _JOBS_WHERE
        + " ORDER BY job_id DESC LIMIT $4",
        *where,
        limit,
    )
    jobs = [JobListing(**{**dict(r), "state": JobState(r["state"])}) for r in rows]
    return jobs, int(total)


@dataclass(frozen=True, slots=True)
class ConflictListing:
    """One unresolved payload conflict: a later message under a key a job already holds
    with another fingerprint (pipeline/extraction/enqueue.py)."""

    conflict_id: int
    job_id: int
    processor_id: str
    schema_version: str
    dedup_key: str
    existing_message_id: int
    new_message_id: int
    created_at: datetime


_CONFLICTS_WHERE = """
  FROM extraction_payload_conflicts c
  JOIN extraction_jobs j ON j.tenant_id = c.tenant_id AND j.job_id = c.job_id
 WHERE c.tenant_id = $1 AND c.resolved_at IS NULL AND ($2::text IS NULL OR j.processor_id = $2)
"""


async def list_conflicts(
    conn: Executor, tenant_id: str, *, processor_id: str | None = None, limit: int = 50
) -> tuple[list[ConflictListing], int]:
    """The tenant's unresolved payload conflicts, newest first, at most `limit`; and
    how many there are in all."""
    total = await conn.fetchval("SELECT count(*)" + _CONFLICTS_WHERE, tenant_id, processor_id)
    rows = await conn.fetch(
        "SELECT c.conflict_id, c.job_id, j.processor_id, j.schema_version, j.dedup_key, "
        "c.existing_message_id, c.new_message_id, c.created_at"
        + _CONFLICTS_WHERE
        + " ORDER BY c.conflict_id DESC LIMIT $3",
        tenant_id,
        processor_id,
        limit,
    )
    return [ConflictListing(**dict(r)) for r in rows], int(total)
