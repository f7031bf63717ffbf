"""An http processor's workers: claim → load → call the backend → commit, as a pipeline
(builtin rules need no lease: locked_runner.py).

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
latency), and a stalled endpoint holds few leases. Every write is fenced by
the job's token (pipeline/extraction/claims.py): a job whose lease was lost —
the renewer finds it gone, or the process was paused past it — changes no row
when its outcome arrives, and the reclaimer's result stands. What an attempt
comes to and how it is written: outcomes.py; when the endpoint, not the mail, is
failing (401/403, a wrong URL, failures in a row), gate.py pauses this processor.
A load that fails for the database or the store gives the jobs back uncharged;
one that fails otherwise (a parse worker killed) charges them, so a message
that kills its loader ends in needs_review instead of a loop.

Cancellation (SIGTERM, reload): outcomes already computed are committed, every
other held job is released (pending, due now, its attempt given back), shielded
and bounded by RELEASE_TIMEOUT_S; a process killed outright leaves the leases to
expire, and another worker reclaims them with a larger token.
"""

from __future__ import annotations

import math

import anyio
import asyncpg
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from inboxd.daemon.extraction.gate import EndpointGate
from inboxd.daemon.extraction.outcomes import (
    LOST,
    RETRY,
    Outcome,
    attempt,
    write_outcomes,
)
from inboxd.daemon.extraction.processors import Processor
from inboxd.daemon.metrics.registry import Metrics
from inboxd.pipeline.errors import DATABASE_ERRORS, StoreUnavailableError
from inboxd.pipeline.extraction import claims
from inboxd.pipeline.extraction.claims import ClaimedJob
from inboxd.pipeline.extraction.messages import load_messages
from inboxd.pipeline.message import MessageData
from inboxd.pipeline.objectstore.store import ObjectStore

log = structlog.get_logger(__name__)

#: What makes the claimer wait and try again: the database or the object store
#: not answering (the claims are released, or expire).
CLAIM_ERRORS: tuple[type[BaseException], ...] = (*DATABASE_ERRORS, StoreUnavailableError)

#: Jobs claimed in one statement at most: one load_messages batch.
CLAIM_BATCH_MAX = 100
#: An http processor has this many per caller waiting for a call: one in the call,
#: one ready, so a caller never waits for a claim, and a stalled endpoint holds few
#: leases.
HTTP_PREFETCH_PER_CALLER = 2
#: Outcomes written in one transaction at most (one UPDATE and one event insert).
COMMIT_BATCH_MAX = 200
#: The committer gathers outcomes this long before a commit: a commit costs 16-25 ms
#: (its fsync), so results arriving a few at a time share one; a result waits 5 ms
#: more for its commit, which no caller waits for.
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
        self._prefetch = HTTP_PREFETCH_PER_CALLER * config.concurrency
        self.held: dict[int, ClaimedJob] = {}  # claimed, outcome not yet written
        self._unattempted = 0  # of those, not yet through a backend call
        self._committing: set[int] = set()  # job ids in the committer's transaction
        self._bell = anyio.Event()
        self._room = anyio.Event()
        self._failing = False  # the database is not answering the claimer
        self._log = log.bind(tenant=processor.tenant_id, processor=config.id)
        self._gate = EndpointGate(self._log)

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

    # claimer and loader -------------------------------------------------------------

    async def _claim(self, batches: MemoryObjectSendStream[list[ClaimedJob]]) -> None:
        async with batches:
            while True:
                await self._wait_for_room()
                await self._gate.wait_out()
                bell = self._bell = anyio.Event()
                room = min(self._prefetch - self._unattempted, CLAIM_BATCH_MAX)
                try:
                    jobs = await self._claim_due(room)
                except DATABASE_ERRORS as exc:
                    self._note_failure("extraction_claim_unavailable", exc)
                    await anyio.sleep(DATABASE_RETRY_S)
                    continue
                self._note_recovery()
                if not jobs:
                    with anyio.move_on_after(CLAIM_POLL_S):
                        await bell.wait()
                    continue
                self._unattempted += len(jobs)
                # the next claim runs while this batch is loaded (one batch waits at most)
                await batches.send(jobs)

    async def _claim_due(self, limit: int) -> list[ClaimedJob]:
        jobs = await claims.claim_due(
            self._pool,
            [self.processor.tenant_id],
            self._owner,
            self._lease_s,
            limit,
            processor_id=self.processor.config.id,
            schema_version=str(self.processor.config.schema_version),
        )
        for job in jobs:
            self.held[job.job_id] = job
        return jobs

    async def _load_batches(
        self,
        batches: MemoryObjectReceiveStream[list[ClaimedJob]],
        work: MemoryObjectSendStream[Work],
    ) -> None:
        async with batches, work:
            async for jobs in batches:
                try:
                    messages = await self._load(jobs)
                except CLAIM_ERRORS as exc:  # not the messages' fault: given back uncharged
                    self._note_failure("extraction_load_unavailable", exc)
                    await self._give_back(jobs, charge=None)
                    await anyio.sleep(DATABASE_RETRY_S)
                    continue
                except Exception as exc:  # a parse worker died, a bug: charged, so bounded
                    self._log.exception("extraction_load_failed", jobs=len(jobs))
                    await self._give_back(jobs, charge=f"loading failed: {type(exc).__name__}")
                    continue
                for job in jobs:
                    await work.send((job, messages.get(job.message_id)))

    async def _load(self, jobs: list[ClaimedJob]) -> dict[int, MessageData]:
        try:
            return await load_messages(
                self._pool,
                self._store,
                self.processor.tenant_id,
                [job.message_id for job in jobs],
                reads=self.processor.backend.reads,
                in_thread=self._in_thread,
            )
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_TIMEOUT_S):
                await self._give_back(jobs, charge=None)
            raise

    async def _give_back(self, jobs: list[ClaimedJob], *, charge: str | None) -> None:
        """Jobs that never reached a caller: released (charge None) or failed
        retryably with `charge` as the reason; either way no longer held here."""
        try:
            for job in jobs:
                if charge is None:
                    self._count("released" if await claims.release(self._pool, job) else LOST)
                else:
                    state = await claims.fail_retryable(self._pool, job, charge)
                    self._count(LOST if state is None else RETRY)
        except DATABASE_ERRORS as exc:  # the leases expire instead
            self._log.warning("extraction_give_back_failed", error=type(exc).__name__)
        finally:
            for job in jobs:
                self._drop(job)
            self._attempted(len(jobs))

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

    # callers ------------------------------------------------------------------------

    async def _call(
        self,
        work: MemoryObjectReceiveStream[Work],
        done: MemoryObjectSendStream[tuple[ClaimedJob, Outcome]],
    ) -> None:
        async with work, done:
            async for job, message in work:
                if self.held.get(job.job_id) is not job:
                    self._attempted()
                    continue  # its lease was lost while it waited: another claim has it
                try:
                    outcome = await self._attempt(message)
                finally:
                    self._attempted()
                await done.send((job, outcome))

    async def _attempt(self, message: MessageData | None) -> Outcome:
        return await self._gate.attempt(lambda: attempt(self.processor.backend, message))

    # committer ----------------------------------------------------------------------

    async def _commit(self, done: MemoryObjectReceiveStream[tuple[ClaimedJob, Outcome]]) -> None:
        # not `async with done`: at cancellation _wind_down still reads what is left
        async for first in done:
            # shielded from here: an outcome taken (an http call paid for) is committed
            # even when shutdown comes meanwhile, instead of waiting for its lease
            with anyio.CancelScope(shield=True), anyio.move_on_after(COMMIT_TIMEOUT_S):
                # a fast backend's outcomes arrive a few at a time: waiting a moment lets
                # one commit (one fsync) carry a claim batch instead of one per handful
                await anyio.sleep(COMMIT_LINGER_S)
                batch = [first]
                while len(batch) < COMMIT_BATCH_MAX:
                    try:
                        batch.append(done.receive_nowait())
                    except anyio.WouldBlock:
                        break
                await self._write(batch)

    async def _write(self, batch: list[tuple[ClaimedJob, Outcome]]) -> None:
        ids = {job.job_id for job, _ in batch}
        self._committing |= ids
        fates: dict[tuple[int, int], str] = {}
        try:
            fates = await write_outcomes(self._pool, batch)
        except DATABASE_ERRORS as exc:
            # the claims stay in the table: their leases expire and they are claimed again
            self._log.warning("extraction_commit_failed", error=type(exc).__name__, jobs=len(batch))
        except Exception:  # a bug must not stop the daemon; the leases expire
            self._log.exception("extraction_commit_crashed", jobs=len(batch))
        finally:
            self._committing -= ids
            fenced = []
            for job, _ in batch:
                fate = fates.get((job.job_id, job.token))
                if fate == LOST:
                    fenced.append(job.job_id)
                # counted once: a job the renewer already found lost was counted there
                if self._drop(job) and fate is not None:
                    self._count(fate)
            if fenced:
                # a lease ran out under us (a paused process): the rows were not touched
                self._log.warning("extraction_results_fenced_out", jobs=sorted(fenced))

    # renewer ------------------------------------------------------------------------

    async def _renew(self) -> None:
        while True:
            await anyio.sleep(self._lease_s / 3)
            jobs = [j for j in self.held.values() if j.job_id not in self._committing]
            if not jobs:
                continue
            try:
                kept = await claims.renew_many(self._pool, jobs, self._lease_s)
            except DATABASE_ERRORS as exc:
                self._log.warning("extraction_renew_failed", error=type(exc).__name__)
                continue
            for job in jobs:
                if job.job_id in kept or job.job_id in self._committing:
                    continue  # a job the committer took meanwhile is its to count
                if self._drop(job):
                    self._log.warning("extraction_lease_lost", job=job.job_id)
                    self._count(LOST)

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
            await self._give_back(rest, charge=None)
            self._unattempted = 0  # nothing runs any more

    # helpers ------------------------------------------------------------------------

    def _drop(self, job: ClaimedJob) -> bool:
        """Forget `job` (this claim of it); False when it was not held any more."""
        if self.held.get(job.job_id) is not job:
            return False
        del self.held[job.job_id]
        self._room.set()
        return True

    def _count(self, outcome: str, n: int = 1) -> None:
        if n:
            tenant, processor = self.processor.key
            self._metrics.extraction_finished(tenant, processor, outcome, n)

    def _note_failure(self, event: str, exc: BaseException) -> None:
        if not self._failing:
            self._log.warning(event, error=type(exc).__name__)
        self._failing = True

    def _note_recovery(self) -> None:
        if self._failing:
            self._log.info("extraction_database_recovered")
        self._failing = False
