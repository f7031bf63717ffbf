"""Claims held by a row lock, for backends that make no remote call (builtin rules).

A lease exists so that a claim outlives the transaction that took it: a parse
API answers in seconds, and no transaction should stay open that long. Rules
evaluated in-process answer in microseconds, so their claim can simply be the
row lock of one short transaction::

    BEGIN
      lock_due        SELECT … FOR UPDATE SKIP LOCKED   (due jobs of one processor)
      (the caller loads the messages and runs the rules)
      finish_locked   completed + result + extraction.completed event,
                      or needs_review / retry_wait with the reason
    COMMIT

Exactly once without a lease or a fencing token: a second worker skips the
locked rows, so nobody else extracts them meanwhile, and a crash (or a
cancellation) rolls the transaction back, leaving the jobs as they were —
nothing to release, nothing to expire. The rows' `lease_token` is left as it is,
so a leased claimer of the same job (pipeline/extraction/claims.py) still
fences correctly around it. Against a lease claim it saves one UPDATE of every
job (with its index entries) and the renewals: bench/extraction.py (b).

States and reasons are those of pipeline/extraction/claims.py; `attempts` counts this
attempt too, and a due job whose attempts are spent goes to needs_review.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg
import orjson

from inboxd.pipeline.extraction.claims import (
    MAX_ATTEMPTS,
    ClaimedJob,
    backoff_s,
    claimed_job,
)
from inboxd.pipeline.extraction.results import write_completed_events
from inboxd.pipeline.mailbox.leases import one_line

_LOCK_DUE = """
SELECT tenant_id, job_id, processor_id, schema_version, dedup_key, message_id, mailbox_id,
       payload_fingerprint, lease_token, attempts
  FROM extraction_jobs
 WHERE tenant_id = $1 AND processor_id = $2 AND ($5::text IS NULL OR schema_version = $5)
   AND state IN ('pending', 'running', 'retry_wait') AND next_attempt_at <= now()
   AND ($4::bigint[] IS NULL OR job_id = ANY($4::bigint[]))
 ORDER BY backfill, next_attempt_at
 LIMIT $3
   FOR UPDATE SKIP LOCKED
"""

_COMPLETE_LOCKED = """
UPDATE extraction_jobs j
   SET state = 'completed', result = r.result::jsonb, completed_at = now(),
       attempts = j.attempts + 1, last_error = NULL, lease_owner = NULL,
       lease_expires_at = NULL, updated_at = now()
  FROM unnest($2::bigint[], $3::text[]) AS r(job_id, result), messages m
 WHERE j.tenant_id = $1 AND j.job_id = r.job_id
   AND m.tenant_id = j.tenant_id AND m.message_id = j.message_id
RETURNING j.job_id, m.thread_id
"""

# $3 reason, $4 terminal, $5 backoff seconds, $6 max attempts
_FAIL_LOCKED = """
UPDATE extraction_jobs
   SET state = CASE WHEN $4::boolean OR attempts + 1 >= $6::integer
                    THEN 'needs_review' ELSE 'retry_wait' END,
       review_reason = CASE
           WHEN $4::boolean THEN $3::text
           WHEN attempts + 1 >= $6::integer
           THEN format('retries exhausted (%s attempts): %s', attempts + 1, $3::text)
           ELSE review_reason END,
       next_attempt_at = now() + make_interval(secs => $5::double precision),
       attempts = attempts + 1, last_error = $3::text, lease_owner = NULL,
       lease_expires_at = NULL, updated_at = now()
 WHERE tenant_id = $1 AND job_id = $2
RETURNING state
"""


@dataclass(frozen=True, slots=True)
class LockedFailure:
    """A failed attempt of a locked job: `terminal` → needs_review, else retry_wait."""

    reason: str
    terminal: bool
    retry_after_s: float | None = None


async def lock_due(
    tx: asyncpg.Connection,
    tenant_id: str,
    processor_id: str,
    limit: int,
    *,
    job_ids: Sequence[int] | None = None,
    schema_version: str | None = None,
) -> list[ClaimedJob]:
    """Lock up to `limit` due jobs of one processor (among `job_ids` when given; of
    one `schema_version` when given, as claims.claim_due) in the caller's
    transaction (others' locked rows are skipped); `attempts` counts the one about
    to be made."""
    if limit < 1:
        raise ValueError("limit must be at least 1")
    ids = list(job_ids) if job_ids is not None else None
    rows = await tx.fetch(_LOCK_DUE, tenant_id, processor_id, limit, ids, schema_version)
    return [
        claimed_job(r, attempts=r["attempts"] + 1) for r in sorted(rows, key=lambda r: r["job_id"])
    ]


async def finish_locked(
    tx: asyncpg.Connection,
    tenant_id: str,
    done: Sequence[tuple[ClaimedJob, object]],
    failed: Sequence[tuple[ClaimedJob, LockedFailure]] = (),
    *,
    max_attempts: int = MAX_ATTEMPTS,
) -> dict[int, str]:
    """Write the locked jobs' outcomes in the caller's transaction (the one that
    locked them): results with their events, failures with their reasons. Job id →
    the state it is left in."""
    states: dict[int, str] = {}
    if done:
        rows = await tx.fetch(
            _COMPLETE_LOCKED,
            tenant_id,
            [job.job_id for job, _ in done],
            [orjson.dumps(result).decode() for _, result in done],
        )
        threads = {r["job_id"]: r["thread_id"] for r in rows}
        await write_completed_events(tx, tenant_id, done, threads)
        states.update(dict.fromkeys(threads, "completed"))
    for job, failure in failed:
        state = await tx.fetchval(
            _FAIL_LOCKED,
            tenant_id,
            job.job_id,
            one_line(failure.reason),
            failure.terminal,
            backoff_s(job.attempts, failure.retry_after_s),
            max_attempts,
        )
        if state is not None:
            states[job.job_id] = state
    return states
