"""One processor's workers: claim → load → call the backend → commit, as a pipeline.

    claimer ─(jobs)─▶ loader ─(job, message)─▶ callers × concurrency ─(job, outcome)─▶ committer
    claim_due ≤ room   load_messages          backend.extract:                  complete_many /
                       (as much as the        one attempt                       fail_* / release,
                       backend reads)                                           one transaction
       └──────────── renewer: renew_many of every held job, every lease/3 ──────────┘

Every claimed job is *held* from its claim until its outcome is written. The
claimer claims while fewer than `prefetch` jobs wait for a call (and the
committer is not far behind), and the next claim runs while the loader reads a
batch, so the callers never wait for a claim: an http endpoint answering in
50 ms keeps `concurrency` requests in flight (throughput = concurrency /
latency), and a stalled endpoint holds few leases. Every write is fenced by the job's token
(pipeline/extraction_claims.py): a job whose lease was lost — the renewer finds
it gone, or the process was paused past it — changes no row when its outcome
arrives, and the reclaimer's result stands.

Outcomes, from the backend's exception tree (adapters/extraction/errors.py):
a result → complete (with its `extraction.completed` event); ExtractionTerminal
→ needs_review with the reason; ExtractionRetryable → retry_wait with backoff
and Retry-After; ExtractionUnauthorized (the endpoint refused our token) →
the job is released, not charged, and the processor pauses for the server's
wait: a revoked token must not walk the backlog into needs_review; an
unexpected exception in a backend (a bug) → retryable, so attempts bound it.

Cancellation (SIGTERM, reload): outcomes already computed are committed, every
other held job is released (pending, due now, its attempt given back), shielded
and bounded by RELEASE_TIMEOUT_S; a process killed outright leaves the leases to
expire, and another worker reclaims them with a larger token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import anyio
import asyncpg
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from inboxd.adapters.extraction import (
    ExtractionRetryable,
    ExtractionTerminal,
    ExtractionUnauthorized,
)
from inboxd.daemon.extraction.processors import Processor
from inboxd.daemon.metrics import Metrics
from inboxd.pipeline import extraction_claims as claims
from inboxd.pipeline.errors import DATABASE_ERRORS, StoreUnavailableError
from inboxd.pipeline.extraction_claims import ClaimedJob
from inboxd.pipeline.extraction_messages import load_messages
from inboxd.pipeline.message import MessageData
from inboxd.pipeline.objectstore import ObjectStore

log = structlog.get_logger(__name__)

#: What makes the claimer wait and try again: the database or the object store
#: not answering (the claims are released, or expire).
CLAIM_ERRORS: tuple[type[BaseException], ...] = (*DATABASE_ERRORS, StoreUnavailableError)

#: Jobs claimed in one statement at most: one load_messages batch, parsed in chunks of
#: 50 on every core (pipeline/parsing.py), so 100 keeps both parse workers busy.
CLAIM_BATCH_MAX = 100
#: Claimed jobs a builtin processor has waiting for its rules at most: two claim
#: batches, so one is loaded while the other is extracted.
BUILTIN_PREFETCH = 2 * CLAIM_BATCH_MAX
#: An http processor has this many per caller waiting for a call: one in the call,
#: one ready, so a caller never waits for a claim, and a stalled endpoint holds few
#: leases.
HTTP_PREFETCH_PER_CALLER = 2
#: Outcomes written in one transaction at most (one UPDATE and one event insert).
COMMIT_BATCH_MAX = 200
#: The committer gathers outcomes this long before a commit: a commit cost 16 ms
#: (its fsync) and carried ~33 builtin results without it, ~100 with it
#: (bench/extraction.py (b)); an http result waits 5 ms more for its commit, which
#: no caller waits for.
COMMIT_LINGER_S = 0.005
#: Outcomes computed but not yet committed at most before the claimer waits: bounds
#: what a slow database lets pile up (and what a crash would make be redone).
MAX_UNCOMMITTED = 2 * COMMIT_BATCH_MAX
#: An idle processor looks for due jobs this often without being rung (retry_wait
#: jobs coming due, jobs another process queued): one indexed query.
CLAIM_POLL_S = 1.0
#: After a database error the claimer waits this long before claiming again.
DATABASE_RETRY_S = 2.0
#: A commit of finished outcomes may take this long at shutdown; past it the
#: transaction rolls back and the jobs' leases expire.
COMMIT_TIMEOUT_S = 10.0
#: Releasing held jobs at shutdown takes at most this long; past it their leases expire.
RELEASE_TIMEOUT_S = 5.0


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


Outcome = Done | Failed | Release
Work = tuple[ClaimedJob, MessageData | None]


class ProcessorRunner:
    """Runs one processor until cancelled (module docstring)."""

    def __init__(
        self,
        processor: Processor,
        pool: asyncpg.Pool,
        store: ObjectStore,
        *,
        owner: str,
        lease_s: float,
        metrics: Metrics,
        in_thread: bool = False,
    ) -> None:
        self.processor = processor
        self._pool = pool
        self._store = store
        self._owner = owner
        self._lease_s = lease_s
        self._metrics = metrics
        self._in_thread = in_thread
        config = processor.config
        self._concurrency = config.concurrency
        self._prefetch = (
            BUILTIN_PREFETCH
            if config.backend == "builtin"
            else HTTP_PREFETCH_PER_CALLER * config.concurrency
        )
        self.held: dict[int, ClaimedJob] = {}  # claimed, outcome not yet written
        self._unattempted = 0  # of those, not yet through a backend call
        self._bell = anyio.Event()
        self._room = anyio.Event()
        self._paused_until = -math.inf
        self._log = log.bind(tenant=processor.tenant_id, processor=config.id)

    def ring(self) -> None:
        """New jobs may be due: claim now instead of at the next poll."""
        self._bell.set()

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        work_send, work_receive = anyio.create_memory_object_stream[Work](self._prefetch)
        done_send, done_receive = anyio.create_memory_object_stream[tuple[ClaimedJob, Outcome]](
            math.inf
        )
        batches_send, batches_receive = anyio.create_memory_object_stream[list[ClaimedJob]](1)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._claim, batches_send)
                tg.start_soon(self._load_batches, batches_receive, work_send)
                for _ in range(self._concurrency):
                    tg.start_soon(self._call, work_receive.clone(), done_send.clone())
                work_receive.close()
                done_send.close()
                tg.start_soon(self._commit, done_receive)
                tg.start_soon(self._renew)
                task_status.started()
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_TIMEOUT_S):
                await self._wind_down(done_receive)
            done_receive.close()

    # claimer ------------------------------------------------------------------------

    async def _claim(self, batches: MemoryObjectSendStream[list[ClaimedJob]]) -> None:
        async with batches:
            while True:
                await self._wait_for_room()
                await self._wait_out_pause()
                bell = self._bell = anyio.Event()
                room = min(self._prefetch - self._unattempted, CLAIM_BATCH_MAX)
                try:
                    jobs = await self._claim_due(room)
                except DATABASE_ERRORS as exc:
                    self._log.warning("extraction_claim_failed", error=type(exc).__name__)
                    await anyio.sleep(DATABASE_RETRY_S)
                    continue
                if not jobs:
                    with anyio.move_on_after(CLAIM_POLL_S):
                        await bell.wait()
                    continue
                self._unattempted += len(jobs)
                # the next claim runs while this batch is loaded (one batch waits at most)
                await batches.send(jobs)

    async def _load_batches(
        self,
        batches: MemoryObjectReceiveStream[list[ClaimedJob]],
        work: MemoryObjectSendStream[Work],
    ) -> None:
        async with batches, work:
            async for jobs in batches:
                try:
                    messages = await self._load(jobs)
                except CLAIM_ERRORS as exc:  # the claims were given back by _load
                    self._log.warning("extraction_load_failed", error=type(exc).__name__)
                    self._attempted(len(jobs))
                    await anyio.sleep(DATABASE_RETRY_S)
                    continue
                for job in jobs:
                    await work.send((job, messages.get(job.message_id)))

    async def _claim_due(self, limit: int) -> list[ClaimedJob]:
        jobs = await claims.claim_due(
            self._pool,
            [self.processor.tenant_id],
            self._owner,
            self._lease_s,
            limit,
            processor_id=self.processor.config.id,
        )
        for job in jobs:
            self.held[job.job_id] = job
        return jobs

    async def _load(self, jobs: list[ClaimedJob]) -> dict[int, MessageData]:
        if not jobs:
            return {}
        try:
            return await load_messages(
                self._pool,
                self._store,
                self.processor.tenant_id,
                [job.message_id for job in jobs],
                reads=self.processor.backend.reads,
                in_thread=self._in_thread,
            )
        except BaseException:
            # nothing was handed to a caller: give the claims back (or let them expire)
            with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_TIMEOUT_S):
                await self._release(jobs)
            raise

    async def _wait_for_room(self) -> None:
        """Until fewer than `prefetch` claimed jobs wait for their call, and the
        committer is not more than MAX_UNCOMMITTED behind."""
        while (
            self._unattempted >= self._prefetch
            or len(self.held) - self._unattempted >= MAX_UNCOMMITTED
        ):
            self._room = anyio.Event()
            await self._room.wait()

    def _attempted(self, n: int = 1) -> None:
        self._unattempted -= n
        self._room.set()

    async def _wait_out_pause(self) -> None:
        wait = self._paused_until - anyio.current_time()
        if wait > 0:
            await anyio.sleep(wait)

    # callers ------------------------------------------------------------------------

    async def _call(
        self,
        work: MemoryObjectReceiveStream[Work],
        done: MemoryObjectSendStream[tuple[ClaimedJob, Outcome]],
    ) -> None:
        async with work, done:
            async for job, message in work:
                if job.job_id not in self.held:
                    self._attempted()
                    continue  # its lease was lost while it waited: another worker has it
                try:
                    outcome = await self._attempt(message)
                finally:
                    self._attempted()
                await done.send((job, outcome))

    async def _attempt(self, message: MessageData | None) -> Outcome:
        if anyio.current_time() < self._paused_until:
            return Release("processor paused: the endpoint refused the token")
        if message is None:
            return Failed("the message row is gone", terminal=True)
        try:
            return Done(await self.processor.backend.extract(message))
        except ExtractionUnauthorized as exc:
            wait = exc.retry_after_s or 0.0
            if anyio.current_time() >= self._paused_until:
                self._log.error("extraction_unauthorized", reason=exc.reason, pause_s=wait)
            self._paused_until = max(self._paused_until, anyio.current_time() + wait)
            return Release(exc.reason)
        except ExtractionTerminal as exc:
            return Failed(exc.reason, terminal=True)
        except ExtractionRetryable as exc:
            return Failed(exc.reason, terminal=False, retry_after_s=exc.retry_after_s)
        except Exception as exc:  # a backend bug: retryable, so MAX_ATTEMPTS bounds it
            self._log.exception("extraction_backend_crashed")
            return Failed(f"internal error: {type(exc).__name__}", terminal=False)

    # committer ----------------------------------------------------------------------

    async def _commit(self, done: MemoryObjectReceiveStream[tuple[ClaimedJob, Outcome]]) -> None:
        # not `async with done`: at cancellation _wind_down still reads what is left
        async for first in done:
            batch = [first]
            # a fast backend's outcomes arrive a few at a time: waiting a moment lets
            # one commit (one fsync) carry a claim batch instead of one per handful
            await anyio.sleep(COMMIT_LINGER_S)
            while len(batch) < COMMIT_BATCH_MAX:
                try:
                    batch.append(done.receive_nowait())
                except anyio.WouldBlock:
                    break
            # shielded: a result computed (an http call paid for) is committed even
            # when shutdown comes meanwhile, instead of waiting for its lease to expire
            with anyio.CancelScope(shield=True), anyio.move_on_after(COMMIT_TIMEOUT_S):
                await self._write(batch)

    async def _write(self, batch: list[tuple[ClaimedJob, Outcome]]) -> None:
        try:
            results = [(job, o.result) for job, o in batch if isinstance(o, Done)]
            won = await claims.complete_many(self._pool, results)
            self._count("completed", len(won))
            if len(won) < len(results):
                # a lease ran out under us (a paused process): the rows were not touched
                self._log.warning(
                    "extraction_results_fenced_out",
                    jobs=sorted(j.job_id for j, _ in results if j.job_id not in won),
                )
                self._count("lost", len(results) - len(won))
            for job, outcome in batch:
                if isinstance(outcome, Failed):
                    await self._fail(job, outcome)
                elif isinstance(outcome, Release):
                    self._count("released" if await claims.release(self._pool, job) else "lost")
        except DATABASE_ERRORS as exc:
            # the claims stay in the table: their leases expire and they are claimed again
            self._log.warning("extraction_commit_failed", error=type(exc).__name__, jobs=len(batch))
        finally:
            for job, _ in batch:
                self._drop(job)

    async def _fail(self, job: ClaimedJob, outcome: Failed) -> None:
        if outcome.terminal:
            held = await claims.fail_terminal(self._pool, job, outcome.reason)
            self._count("needs_review" if held else "lost")
            return
        state = await claims.fail_retryable(
            self._pool, job, outcome.reason, retry_after_s=outcome.retry_after_s
        )
        if state is None:
            self._count("lost")
        else:
            self._count("needs_review" if state is claims.JobState.NEEDS_REVIEW else "retry")

    # renewer ------------------------------------------------------------------------

    async def _renew(self) -> None:
        while True:
            await anyio.sleep(self._lease_s / 3)
            jobs = list(self.held.values())
            if not jobs:
                continue
            try:
                kept = await claims.renew_many(self._pool, jobs, self._lease_s)
            except DATABASE_ERRORS as exc:
                self._log.warning("extraction_renew_failed", error=type(exc).__name__)
                continue
            for job in jobs:
                if job.job_id not in kept and self.held.get(job.job_id) is job:
                    self._log.warning("extraction_lease_lost", job=job.job_id)
                    self._drop(job)
                    self._count("lost")

    # shutdown -----------------------------------------------------------------------

    async def _wind_down(self, done: MemoryObjectReceiveStream[tuple[ClaimedJob, Outcome]]) -> None:
        """Commit what was already computed, release the rest."""
        finished: list[tuple[ClaimedJob, Outcome]] = []
        while True:
            try:
                finished.append(done.receive_nowait())
            except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.EndOfStream):
                break
        if finished:
            await self._write(finished)
        rest = list(self.held.values())
        if rest:
            await self._release(rest)

    async def _release(self, jobs: list[ClaimedJob]) -> None:
        try:
            for job in jobs:
                self._count("released" if await claims.release(self._pool, job) else "lost")
        except DATABASE_ERRORS as exc:  # the leases expire instead
            self._log.warning("extraction_release_failed", error=type(exc).__name__)
        finally:
            for job in jobs:
                self._drop(job)

    # helpers ------------------------------------------------------------------------

    def _drop(self, job: ClaimedJob) -> None:
        if self.held.get(job.job_id) is job:
            del self.held[job.job_id]
            self._room.set()

    def _count(self, outcome: str, n: int = 1) -> None:
        if n:
            tenant, processor = self.processor.key
            self._metrics.extraction_finished(tenant, processor, outcome, n)
