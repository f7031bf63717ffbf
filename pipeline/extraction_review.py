"""The operator's side of extraction: re-running a job on purpose, and the backlog.

`retry` is `inboxd extract retry --id`: a needs_review (or retry_wait) job runs
again now, with its attempts reset; a completed result is never overwritten (a
new schema_version re-extracts instead). `backlog` is what `inboxd status` and
/metrics show: per tenant and processor, the jobs not completed by state and
what is due now. The protocol itself: pipeline/extraction_claims.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from inboxd.pipeline.extraction_claims import JobState
from inboxd.pipeline.extraction_keys import Executor


async def retry(conn: Executor, tenant_id: str, job_id: int) -> JobState | None:
    """`inboxd extract retry --id`: run a needs_review or retry_wait job again, now.

    The job becomes PENDING, due now, with its attempts reset. Returns the state
    the job was in when it was not retried (pending, running, completed: a
    completed result is never overwritten; a new schema_version re-extracts),
    PENDING when it was, None when there is no such job.
    """
    row = await conn.fetchrow(
        """
        WITH old AS (SELECT state FROM extraction_jobs
                      WHERE tenant_id = $1 AND job_id = $2 FOR UPDATE),
             upd AS (UPDATE extraction_jobs SET state = 'pending', next_attempt_at = now(),
                            attempts = 0, review_reason = NULL, updated_at = now()
                      WHERE tenant_id = $1 AND job_id = $2
                        AND state IN ('needs_review', 'retry_wait') RETURNING state)
        SELECT coalesce((SELECT state FROM upd), (SELECT state FROM old)) AS state
        """,
        tenant_id,
        job_id,
    )
    state = row["state"] if row is not None else None
    return JobState(state) if state is not None else None


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
