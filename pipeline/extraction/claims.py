"""The extraction claim protocol: exactly one validated result per message identity.

A processor turns new mail into schema-validated JSON (an invoice's number and
total) by calling a parse backend. Parse APIs leave deduplication to the
caller; this module is that caller's bookkeeping, on `extraction_jobs` and
`extraction_payload_conflicts` only, with the database as the one coordinator
(the ideas of pipeline/mailbox/leases.py: a time-bounded lease from the database clock
and a fencing token every claim increments). docs/architecture.md §10.

Job states and transitions (one row per (tenant, processor, schema_version,
dedup_key); pipeline/extraction/keys.py derives the key)::

    pending ──claim_due──▶ running ──complete──▶ completed   (+ extraction.completed event)
       ▲  ▲                  │ │ │
       │  └── release ───────┘ │ └── fail_terminal / attempts exhausted ──▶ needs_review
       │   (lease expiry: any  │                                                │
       │    claim_due takes it) └── fail_retryable ──▶ retry_wait ──due──▶ (claim_due)
       └──────────────────── retry (`inboxd extract retry --id`) ◀──────────────┘

* **Claim = unique key.** `enqueue` (pipeline/extraction/enqueue.py) inserts
  with ON CONFLICT DO NOTHING: a key that already has a job with the same
  payload fingerprint is *linked*, a different fingerprint is a payload
  conflict for review. A pending or running job is never a result.
  `retry` and the backlog count are pipeline/extraction/review.py.
* **Fencing.** Every claim increments `lease_token`. `complete`, `renew`,
  `fail_retryable`, `fail_terminal` and `release` write only `WHERE state =
  'running' AND lease_token = token AND lease_expires_at > now()`: a worker
  whose lease expired, or was reclaimed, changes no row and learns so (False /
  None). Under READ COMMITTED an UPDATE re-checks its WHERE against the newest
  row version, so this holds however the transactions interleave.
* **Exactly once.** `complete` (pipeline/extraction/results.py) writes the
  result, the completed state and the `extraction.completed` outbox event (with
  the result) in one transaction.
* **Failures.** Retryable (network, timeout, 429, 5xx) → RETRY_WAIT with a
  full-jitter exponential backoff (tenacity's `wait_random_exponential`),
  never earlier than the server's Retry-After; after `max_attempts` claims →
  NEEDS_REVIEW. Terminal (the result does not validate, the endpoint answers a
  validation error) → NEEDS_REVIEW with the reason, not retried until `retry`.
  Operational failures are never duplicates or conflicts: those are decided
  only by `enqueue`, from keys and fingerprints.
* **Shutdown.** `release` hands a running job back (PENDING, due now, its
  attempt given back); a worker killed without it leaves the lease to expire.

Every time comes from the database clock. Call these in short transactions
(or autocommit): `now()` is the start of the caller's transaction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import cast

import asyncpg
from tenacity import RetryCallState, wait_random_exponential

from inboxd.pipeline.extraction.keys import Executor
from inboxd.pipeline.mailbox.leases import one_line

#: Claims of one job before it goes to needs_review (a crash, a lease expiry or a
#: retryable failure each costs one). With the backoff below, eight claims ride
#: out an endpoint outage of up to ~8 min (sum of the bounds 4 + 8 + … + 256 s =
#: 508 s); a longer one is an operator's call (`inboxd extract retry`). A judgement
#: call, not a measurement.
MAX_ATTEMPTS = 8
#: Backoff after the n-th claim failed retryably: uniform in [0, min(RETRY_MAX_S,
#: RETRY_BASE_S·2^(n-1))] ("full jitter", AWS Architecture Blog "Exponential Backoff
#: And Jitter"; tenacity's wait_random_exponential), i.e. ≤ 4, 8, 16, 32 s … .
RETRY_BASE_S = 4.0
#: Upper bound of one backoff step (10 min: a parse API's 5xx rarely lasts longer
#: than that, and a longer step would hide the job from a recovered endpoint).
RETRY_MAX_S = 600.0
#: A Retry-After longer than this is capped: a bogus header must not park a job for days.
RETRY_AFTER_MAX_S = 3600.0


class JobState(StrEnum):
    """`extraction_jobs.state` (module docstring)."""

    PENDING = "pending"
    RUNNING = "running"
    RETRY_WAIT = "retry_wait"
    COMPLETED = "completed"
    NEEDS_REVIEW = "needs_review"


@dataclass(frozen=True, slots=True)
class ClaimedJob:
    """A job leased to a worker; `token` fences every write it makes."""

    tenant_id: str
    job_id: int
    processor_id: str
    schema_version: str
    dedup_key: str
    message_id: int
    mailbox_id: str
    payload_fingerprint: str
    token: int
    attempts: int  # claims so far, this one included


def claimed_job(row: asyncpg.Record, *, attempts: int | None = None) -> ClaimedJob:
    """A ClaimedJob from an extraction_jobs row; `attempts` overrides the row's."""
    return ClaimedJob(
        tenant_id=row["tenant_id"],
        job_id=row["job_id"],
        processor_id=row["processor_id"],
        schema_version=row["schema_version"],
        dedup_key=row["dedup_key"],
        message_id=row["message_id"],
        mailbox_id=row["mailbox_id"],
        payload_fingerprint=row["payload_fingerprint"],
        token=row["lease_token"],
        attempts=row["attempts"] if attempts is None else attempts,
    )


# --- claims ------------------------------------------------------------------------------

# A running job's next_attempt_at is its lease expiry, so "due" is one condition
# over one partial index (schema.sql extraction_jobs_due_order_idx). A job whose claims
# are exhausted (its last holder died) goes to needs_review instead of running.
# New mail first: a backfill's jobs come after every due job of new mail (else
# 100k queued by `extract backfill` stood before the invoice that arrived next).
# ORDER BY backfill, next_attempt_at, the order the index gives: a job_id tiebreak made
# PostgreSQL sort every due job sharing the oldest timestamp before the LIMIT (an
# enqueue or a retry commits thousands with one now()). 300k due jobs with one
# timestamp (EXPLAIN ANALYZE): 192 ms per claim of 100 with it, 3-5 ms without.
# Ties are taken in index order; claim_due returns its jobs sorted by job_id.
_CLAIM_DUE = """
WITH due AS (
    SELECT tenant_id, job_id FROM extraction_jobs
     WHERE tenant_id = ANY($1::text[]) AND ($2::text IS NULL OR processor_id = $2)
       AND ($7::text IS NULL OR schema_version = $7)
       AND state IN ('pending', 'running', 'retry_wait') AND next_attempt_at <= now()
     ORDER BY backfill, next_attempt_at
     LIMIT $5
       FOR UPDATE SKIP LOCKED
)
UPDATE extraction_jobs j
   SET state = CASE WHEN j.attempts >= $6 THEN 'needs_review' ELSE 'running' END,
       review_reason = CASE WHEN j.attempts >= $6
           THEN format('attempts exhausted (%s); last error: %s', j.attempts,
                       coalesce(j.last_error, 'lease expired'))
           ELSE j.review_reason END,
       attempts = j.attempts + CASE WHEN j.attempts >= $6 THEN 0 ELSE 1 END,
       lease_token = j.lease_token + 1,
       lease_owner = CASE WHEN j.attempts >= $6 THEN NULL ELSE $3 END,
       lease_expires_at = CASE WHEN j.attempts >= $6 THEN NULL
                               ELSE now() + make_interval(secs => $4) END,
       next_attempt_at = CASE WHEN j.attempts >= $6 THEN j.next_attempt_at
                              ELSE now() + make_interval(secs => $4) END,
       updated_at = now()
  FROM due
 WHERE j.tenant_id = due.tenant_id AND j.job_id = due.job_id
RETURNING j.tenant_id, j.job_id, j.processor_id, j.schema_version, j.dedup_key, j.message_id,
          j.mailbox_id, j.payload_fingerprint, j.lease_token, j.attempts, j.state
"""

# The fencing condition of every write a claim holder makes ($1 tenant, $2 job, $3 token).
_HELD = (
    "tenant_id = $1 AND job_id = $2 AND state = 'running' AND lease_token = $3 "
    "AND lease_expires_at > now()"
)
#: SET clause of every write that ends a claim (complete, fail, release;
#: pipeline/extraction/results.py).
LEASE_CLEARED = "lease_owner = NULL, lease_expires_at = NULL, updated_at = now()"


async def claim_due(
    conn: Executor,
    tenant_ids: Sequence[str],
    owner: str,
    lease_s: float,
    limit: int,
    *,
    processor_id: str | None = None,
    schema_version: str | None = None,
    max_attempts: int = MAX_ATTEMPTS,
) -> list[ClaimedJob]:
    """Lease up to `limit` due jobs of these tenants (one processor's, or any) to `owner`.

    A runner passes its processor's `schema_version`: a job of another version is
    not its to run (its result would be stored under the other version's label);
    pipeline/extraction/versions.py carries such jobs over when the version changes.

    Due: pending or retry_wait with next_attempt_at ≤ now(), or running with an
    expired lease. One statement (`FOR UPDATE SKIP LOCKED`), so concurrent
    workers never claim one job twice; each claim increments the fencing
    token. A due job already claimed `max_attempts` times goes to
    needs_review instead and is not returned.
    """
    if not owner:
        raise ValueError("claim owner must be a non-empty string")
    if limit < 1 or max_attempts < 1:
        raise ValueError("limit and max_attempts must be at least 1")
    rows = await conn.fetch(
        _CLAIM_DUE,
        list(tenant_ids),
        processor_id,
        owner,
        _seconds("lease_s", lease_s),
        limit,
        max_attempts,
        schema_version,
    )
    return [
        claimed_job(r)
        for r in sorted(rows, key=lambda r: r["job_id"])
        if r["state"] == JobState.RUNNING
    ]


async def renew(conn: Executor, job: ClaimedJob, lease_s: float) -> bool:
    """Extend the claim to now() + lease_s; False: the lease was lost, stop working on it."""
    lease = _seconds("lease_s", lease_s)
    sql = (
        "UPDATE extraction_jobs SET lease_expires_at = now() + make_interval(secs => $4), "
        f"next_attempt_at = now() + make_interval(secs => $4), updated_at = now() "
        f"WHERE {_HELD} RETURNING true"
    )
    return bool(await conn.fetchval(sql, job.tenant_id, job.job_id, job.token, lease))


async def renew_many(conn: Executor, jobs: Sequence[ClaimedJob], lease_s: float) -> set[int]:
    """`renew` for many jobs of one tenant in one statement; the job ids still held."""
    if not jobs:
        return set()
    tenants = {job.tenant_id for job in jobs}
    if len(tenants) != 1:
        raise ValueError("renew_many takes the jobs of one tenant")
    rows = await conn.fetch(
        """
        UPDATE extraction_jobs j
           SET lease_expires_at = now() + make_interval(secs => $4),
               next_attempt_at = now() + make_interval(secs => $4), updated_at = now()
          FROM unnest($2::bigint[], $3::bigint[]) AS r(job_id, token)
         WHERE j.tenant_id = $1 AND j.job_id = r.job_id AND j.state = 'running'
           AND j.lease_token = r.token AND j.lease_expires_at > now()
        RETURNING j.job_id
        """,
        next(iter(tenants)),
        [job.job_id for job in jobs],
        [job.token for job in jobs],
        _seconds("lease_s", lease_s),
    )
    return {r["job_id"] for r in rows}


# --- failures ----------------------------------------------------------------------------

_FAIL_RETRYABLE = f"""
UPDATE extraction_jobs
   SET state = CASE WHEN attempts >= $6 THEN 'needs_review' ELSE 'retry_wait' END,
       next_attempt_at = now() + make_interval(secs => $5),
       review_reason = CASE WHEN attempts >= $6
           THEN format('retries exhausted (%s attempts): %s', attempts, $4::text)
           ELSE review_reason END,
       last_error = $4, {LEASE_CLEARED}
 WHERE {_HELD}
RETURNING state
"""


def backoff_s(attempts: int, retry_after_s: float | None = None) -> float:
    """Seconds to wait after the `attempts`-th claim failed retryably.

    Full-jitter exponential (tenacity's `wait_random_exponential`, bounded by
    RETRY_MAX_S), and never less than the server's Retry-After (capped at
    RETRY_AFTER_MAX_S).
    """
    state = cast(RetryCallState, _Attempt(max(1, attempts)))
    delay = float(wait_random_exponential(multiplier=RETRY_BASE_S, max=RETRY_MAX_S)(state))
    if retry_after_s is not None and math.isfinite(retry_after_s) and retry_after_s > 0:
        delay = max(delay, min(retry_after_s, RETRY_AFTER_MAX_S))
    return delay


async def fail_retryable(
    conn: Executor,
    job: ClaimedJob,
    error: str,
    *,
    retry_after_s: float | None = None,
    max_attempts: int = MAX_ATTEMPTS,
) -> JobState | None:
    """Hand the job back after a retryable failure (network, timeout, 429, 5xx).

    RETRY_WAIT, due after `backoff_s(job.attempts, retry_after_s)`; NEEDS_REVIEW
    once `max_attempts` claims have been spent. None: the claim was no longer
    held, nothing changed. `error` is one line, no secrets, no bodies.
    """
    state = await conn.fetchval(
        _FAIL_RETRYABLE,
        job.tenant_id,
        job.job_id,
        job.token,
        one_line(error),
        backoff_s(job.attempts, retry_after_s),
        max_attempts,
    )
    return JobState(state) if state is not None else None


async def fail_terminal(conn: Executor, job: ClaimedJob, reason: str) -> bool:
    """NEEDS_REVIEW with `reason` (the result does not validate, the endpoint
    refused the input): not claimed again until `retry`. False: not held, nothing changed."""
    sql = (
        "UPDATE extraction_jobs SET state = 'needs_review', review_reason = $4, "
        f"last_error = $4, {LEASE_CLEARED} WHERE {_HELD} RETURNING true"
    )
    return bool(await conn.fetchval(sql, job.tenant_id, job.job_id, job.token, one_line(reason)))


async def release(conn: Executor, job: ClaimedJob) -> bool:
    """Give a running job back (SIGTERM): PENDING, due now, its attempt returned.

    The token is kept, so the next claim still gets a larger one. False: the
    claim was no longer held (nothing to release)."""
    sql = (
        "UPDATE extraction_jobs SET state = 'pending', next_attempt_at = now(), "
        f"attempts = greatest(attempts - 1, 0), {LEASE_CLEARED} WHERE {_HELD} RETURNING true"
    )
    return bool(await conn.fetchval(sql, job.tenant_id, job.job_id, job.token))


# --- helpers -----------------------------------------------------------------------------


@dataclass(slots=True)
class _Attempt:
    """The one field of tenacity's RetryCallState its wait strategies read."""

    attempt_number: int


def _seconds(name: str, value: float) -> float:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)
