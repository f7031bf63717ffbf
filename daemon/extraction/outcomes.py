"""What one extraction attempt came to, and how each is written.

    Done(result)      → complete (result + extraction.completed event, fenced)
    Failed(terminal)  → fail_terminal: needs_review with the reason
    Failed(retryable) → fail_retryable: retry_wait with backoff and Retry-After
    Release           → release: pending again, the attempt not charged; with
                        `pause_s` when the endpoint refused our token (401/403)
                        or the URL is wrong (3xx, 404, 405): the processor
                        pauses, the backlog is not walked into it

`attempt` makes one backend call and maps its answer (adapters/extraction/
errors.py) onto these; an unexpected exception (a backend bug) is retryable, so
the claim's MAX_ATTEMPTS bounds it.
`write_outcomes` writes a committer's batch: the results in one transaction, each
failure in one statement; a result the database refuses for its content (a
data error) is retried alone and, if it still fails, becomes needs_review, so
one bad value never holds up the others' commit — a batch that failed whole
would leave every lease to expire and every paid call to be made again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg
import orjson
import structlog

from inboxd.adapters.extraction import (
    BuiltinBackend,
    ExtractionMisconfigured,
    ExtractionRetryable,
    ExtractionTerminal,
)
from inboxd.daemon.extraction.processors import Backend
from inboxd.pipeline.errors import blames_the_data, describe
from inboxd.pipeline.extraction import claims, results
from inboxd.pipeline.extraction.claims import ClaimedJob, JobState
from inboxd.pipeline.extraction.messages import Reads
from inboxd.pipeline.message import MessageData

log = structlog.get_logger(__name__)

#: What became of a job, as inboxd_extractions_total counts it (daemon/metrics/registry.py).
COMPLETED, RETRY, NEEDS_REVIEW, RELEASED, LOST = (
    "completed",
    "retry",
    "needs_review",
    "released",
    "lost",
)


@dataclass(frozen=True, slots=True)
class Done:
    result: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Failed:
    reason: str
    terminal: bool
    retry_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class Release:
    reason: str
    pause_s: float = 0.0  # the endpoint is misconfigured: pause the processor this long


Outcome = Done | Failed | Release


async def attempt(backend: Backend, message: MessageData | None) -> Outcome:
    """One call of `backend` for `message`, as an outcome (only cancellation raises)."""
    early = unattemptable(backend.reads, message)
    if early is not None:
        return early
    assert message is not None
    try:
        return outcome_of(await backend.extract(message))
    except Exception as exc:
        return failure_from(exc)


def attempt_blocking(backend: BuiltinBackend, message: MessageData | None) -> Outcome:
    """`attempt` of builtin rules in the caller's worker thread: a locked round runs
    all its messages in one thread hop (one hop per message cost 0.47 ms of a 0.2 ms
    extraction, bench/README.md extraction.py)."""
    early = unattemptable(backend.reads, message)
    if early is not None:
        return early
    assert message is not None
    try:
        return outcome_of(backend.extract_blocking(message))
    except Exception as exc:
        return failure_from(exc)


def unattemptable(reads: Reads, message: MessageData | None) -> Failed | None:
    """Why `message` cannot be attempted at all, or None."""
    if message is None:
        return Failed("the message row is gone", terminal=True)
    if message.raw is None and reads is Reads.PARSED:
        # the rules read attachment bytes, which only the raw MIME holds
        return Failed("the raw MIME is not in the object store", terminal=True)
    return None


def failure_from(exc: Exception) -> Outcome:
    """The outcome of a backend call that raised `exc`."""
    if isinstance(exc, ExtractionMisconfigured):
        # an operator's problem, not the message's: not charged (module docstring)
        return Release(exc.reason, pause_s=exc.retry_after_s or 0.0)
    if isinstance(exc, ExtractionTerminal | ExtractionRetryable):
        return failure_of(exc)
    # a backend bug: retryable, so MAX_ATTEMPTS bounds it
    log.error("extraction_backend_crashed", exc_info=exc)
    return Failed(f"internal error: {type(exc).__name__}", terminal=False)


def outcome_of(result: dict[str, Any]) -> Outcome:
    """A validated result, unless it cannot be stored: a value orjson cannot write
    (the backends refuse numbers it cannot, adapters/extraction/schema.py; this is
    the last word), or a NUL character (U+0000), which jsonb has not, so a result
    holding one would fail its whole commit."""
    try:
        document = orjson.dumps(result)
    except orjson.JSONEncodeError as exc:
        return Failed(f"result cannot be stored as JSON: {exc}", terminal=True)
    if b"\\u0000" in document:
        return Failed("result holds a NUL character (U+0000), which jsonb cannot store", True)
    return Done(result)


def failure_of(exc: ExtractionTerminal | ExtractionRetryable) -> Failed:
    if isinstance(exc, ExtractionTerminal):
        return Failed(exc.reason, terminal=True)
    return Failed(exc.reason, terminal=False, retry_after_s=exc.retry_after_s)


async def write_outcomes(
    pool: asyncpg.Pool, batch: Sequence[tuple[ClaimedJob, Outcome]]
) -> dict[tuple[int, int], str]:
    """Write `batch` (module docstring); what became of each (job id, token).

    A job whose lease was lost changes no row (the writes are fenced) and is LOST.
    Two outcomes of one job (a stale claim's and the reclaim's) keep the newest
    claim's; the other is LOST. Database trouble that is not the data's raises."""
    newest: dict[int, tuple[ClaimedJob, Outcome]] = {}
    fates: dict[tuple[int, int], str] = {}
    for job, outcome in batch:
        kept = newest.get(job.job_id)
        if kept is None or job.token > kept[0].token:
            if kept is not None:
                fates[(kept[0].job_id, kept[0].token)] = LOST
            newest[job.job_id] = (job, outcome)
        else:
            fates[(job.job_id, job.token)] = LOST
    items = list(newest.values())
    done = [(job, o.result) for job, o in items if isinstance(o, Done)]
    try:
        won = await results.complete_many(pool, done)
    except asyncpg.PostgresError as exc:
        if not blames_the_data(exc):
            raise
        won = await _complete_one_by_one(pool, done, fates)
    for job, _ in done:
        fates.setdefault((job.job_id, job.token), COMPLETED if job.job_id in won else LOST)
    for job, outcome in items:
        if isinstance(outcome, Failed):
            fates[(job.job_id, job.token)] = await _fail(pool, job, outcome)
        elif isinstance(outcome, Release):
            released = await claims.release(pool, job)
            fates[(job.job_id, job.token)] = RELEASED if released else LOST
    return fates


async def _complete_one_by_one(
    pool: asyncpg.Pool,
    done: list[tuple[ClaimedJob, dict[str, Any]]],
    fates: dict[tuple[int, int], str],
) -> set[int]:
    won: set[int] = set()
    for job, result in done:
        try:
            won |= await results.complete_many(pool, [(job, result)])
        except asyncpg.PostgresError as exc:
            if not blames_the_data(exc):
                raise
            reason = f"the database refused the result: {describe(exc)}"
            held = await claims.fail_terminal(pool, job, reason)
            fates[(job.job_id, job.token)] = NEEDS_REVIEW if held else LOST
    return won


async def _fail(pool: asyncpg.Pool, job: ClaimedJob, outcome: Failed) -> str:
    if outcome.terminal:
        return NEEDS_REVIEW if await claims.fail_terminal(pool, job, outcome.reason) else LOST
    state = await claims.fail_retryable(
        pool, job, outcome.reason, retry_after_s=outcome.retry_after_s
    )
    if state is None:
        return LOST
    return NEEDS_REVIEW if state is JobState.NEEDS_REVIEW else RETRY
