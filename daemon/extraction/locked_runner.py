"""A builtin processor's workers: each round one transaction that locks due jobs,
runs the rules and writes the outcomes (pipeline/extraction/locked.py).

    round:  BEGIN → lock_due ≤ ROUND_JOBS → load_messages (what the rules read)
            → rules → finish_locked (results + events, failures) → COMMIT

LOCKED_ROUNDS rounds run side by side, so one round's rules run while another's
statements wait on PostgreSQL. The rules of each message run in a worker thread
with a time limit per rule (adapters/extraction/builtin.py RULE_TIMEOUT_S), so a
pattern that backtracks on a hostile mail costs that job a terminal failure,
never the event loop: ingest, other tenants and SIGTERM go on meanwhile. No
lease, no renewal, nothing to release: a cancelled round (SIGTERM, reload) rolls
back and its jobs are due again as they were. Outcomes are those of
outcomes.py; a round the database refuses for its data (a value a column cannot
hold) is redone one job per transaction, and the job that still fails goes to
needs_review with the database's reason, so one bad value never holds up the
others. A round that fails otherwise (a parse worker
killed, a bug) charges its jobs a retryable failure, so a message that kills its
round ends in needs_review instead of a loop. A database or store outage is
logged once and the round tried again after a pause.
"""

from __future__ import annotations

import threading

import anyio
import anyio.abc
import anyio.to_thread
import asyncpg
import structlog

from inboxd.adapters.extraction import BuiltinBackend
from inboxd.daemon.extraction.outcomes import (
    Done,
    Failed,
    Outcome,
    Release,
    attempt_blocking,
)
from inboxd.daemon.extraction.processors import Processor
from inboxd.daemon.metrics.registry import Metrics
from inboxd.pipeline.errors import DATABASE_ERRORS, StoreUnavailableError, blames_the_data, describe
from inboxd.pipeline.extraction.claims import ClaimedJob
from inboxd.pipeline.extraction.locked import LockedFailure, finish_locked, lock_due
from inboxd.pipeline.extraction.messages import load_messages
from inboxd.pipeline.message import MessageData
from inboxd.pipeline.objectstore.store import ObjectStore

log = structlog.get_logger(__name__)

#: Jobs one round locks: a load_messages batch (one statement for rows, one for raw
#: bytes) and one commit; 200 kept a round at ~50 ms (bench/extraction.py (b)).
ROUND_JOBS = 200
#: Rounds at once per processor: two, so one round's rules overlap the other's
#: database work; more only queue on PostgreSQL's two cores here.
LOCKED_ROUNDS = 2
#: Rounds at once in the whole stage, whatever the number of builtin processors: a
#: round holds its transaction's connection while it loads messages on a second
#: one, so unbounded rounds (processors × LOCKED_ROUNDS) could hold every pooled
#: connection and each wait for one more. Two holders leave the daemon's pool
#: (≥ 10 connections) room for everyone else, and the loads always a connection.
LOCKED_ROUNDS_AT_ONCE = 2
#: An idle processor looks for due jobs this often without being rung.
IDLE_POLL_S = 1.0
#: After a database or store error the round is tried again this much later.
RETRY_S = 2.0
#: What pauses a round instead of failing it: the database or the store not answering.
OUTAGE_ERRORS: tuple[type[BaseException], ...] = (*DATABASE_ERRORS, StoreUnavailableError)

_STATE_COUNTS = {"completed": "completed", "needs_review": "needs_review", "retry_wait": "retry"}


class LockedRunner:
    """Runs one builtin processor until cancelled (module docstring)."""

    def __init__(
        self,
        processor: Processor,
        pool: asyncpg.Pool,
        store: ObjectStore,
        *,
        metrics: Metrics,
        rounds: anyio.CapacityLimiter | None = None,
        in_thread: bool = False,
    ) -> None:
        self.processor = processor
        # shared by the stage's locked runners (LOCKED_ROUNDS_AT_ONCE)
        self._rounds_at_once = rounds or anyio.CapacityLimiter(LOCKED_ROUNDS)
        self._pool = pool
        self._store = store
        self._metrics = metrics
        self._in_thread = in_thread
        self._bell = anyio.Event()
        self._failing = False
        self._log = log.bind(tenant=processor.tenant_id, processor=processor.config.id)
        # only this version's jobs are its to run (pipeline/extraction/versions.py)
        self._version = str(processor.config.schema_version)

    def ring(self) -> None:
        """New jobs may be due: look now instead of at the next poll."""
        self._bell.set()

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        async with anyio.create_task_group() as tg:
            for _ in range(LOCKED_ROUNDS):
                tg.start_soon(self._rounds)
            task_status.started()

    async def _rounds(self) -> None:
        while True:
            bell = self._bell
            try:
                done = await self.round()
            except OUTAGE_ERRORS as exc:
                if not self._failing:
                    self._log.warning("extraction_round_unavailable", error=type(exc).__name__)
                self._failing = True
                await anyio.sleep(RETRY_S)
                continue
            if self._failing:
                self._log.info("extraction_round_recovered")
                self._failing = False
            if done < ROUND_JOBS:
                if bell.is_set():
                    self._bell = anyio.Event()
                    continue  # rung during the round: there may be more
                with anyio.move_on_after(IDLE_POLL_S):
                    await bell.wait()
                if bell.is_set() and self._bell is bell:
                    self._bell = anyio.Event()

    async def round(self) -> int:
        """One round; how many jobs it locked."""
        locked: list[int] = []
        try:
            return await self._round(ROUND_JOBS, locked)
        except asyncpg.PostgresError as exc:
            if not blames_the_data(exc):
                raise
        except OUTAGE_ERRORS:
            raise
        except Exception as exc:  # a parse worker killed, a bug: charged, so bounded
            self._log.exception("extraction_round_failed", jobs=len(locked))
            reason = f"the round failed: {type(exc).__name__}"
            for job_id in locked:
                await self._write_failure(job_id, LockedFailure(reason, terminal=False))
            return len(locked)
        # a value the database refuses: the round's jobs again, one per transaction
        for job_id in locked:
            try:
                await self._round(1, [], job_ids=[job_id])
            except asyncpg.PostgresError as exc:
                if not blames_the_data(exc):
                    raise
                reason = f"the database refused the result: {describe(exc)}"
                await self._write_failure(job_id, LockedFailure(reason, terminal=True))
        return len(locked)

    async def _round(
        self, limit: int, locked: list[int], *, job_ids: list[int] | None = None
    ) -> int:
        tenant, processor_id = self.processor.key
        async with (
            self._rounds_at_once,
            self._pool.acquire() as conn,
            conn.transaction(),
        ):
            jobs = await lock_due(
                conn, tenant, processor_id, limit, job_ids=job_ids, schema_version=self._version
            )
            locked.extend(job.job_id for job in jobs)
            if not jobs:
                return 0
            messages = await load_messages(
                self._pool,
                self._store,
                tenant,
                [job.message_id for job in jobs],
                reads=self.processor.backend.reads,
                in_thread=self._in_thread,
            )
            outcomes = await self._attempt_round([messages.get(j.message_id) for j in jobs])
            done: list[tuple[ClaimedJob, object]] = []
            failed: list[tuple[ClaimedJob, LockedFailure]] = []
            for job, outcome in zip(jobs, outcomes, strict=True):
                if isinstance(outcome, Done):
                    done.append((job, outcome.result))
                elif isinstance(outcome, Failed):
                    failed.append(
                        (
                            job,
                            LockedFailure(outcome.reason, outcome.terminal, outcome.retry_after_s),
                        )
                    )
                elif isinstance(outcome, Release):  # no builtin rule says this; be safe
                    failed.append((job, LockedFailure(outcome.reason, terminal=False)))
            states = await finish_locked(conn, tenant, done, failed)
        for state in states.values():
            self._count(_STATE_COUNTS.get(state, "lost"))
        return len(jobs)

    async def _attempt_round(self, messages: list[MessageData | None]) -> list[Outcome]:
        """Each message's outcome, the round's rules in one worker thread (one hop
        per message cost more than the rules, bench/README.md extraction.py).
        Cancelled (SIGTERM, reload): the round rolls back at once and the thread
        stops after the message under way."""
        backend = self.processor.backend
        assert isinstance(backend, BuiltinBackend)  # the stage runs only builtin rules here
        cancelled = threading.Event()

        def attempt_all() -> list[Outcome]:
            out: list[Outcome] = []
            for message in messages:
                if cancelled.is_set():
                    break
                out.append(attempt_blocking(backend, message))
            return out

        try:
            return await anyio.to_thread.run_sync(attempt_all, abandon_on_cancel=True)
        finally:
            cancelled.set()

    async def _write_failure(self, job_id: int, failure: LockedFailure) -> None:
        """`failure` for one job, in a transaction of its own (its round rolled back)."""
        tenant, processor_id = self.processor.key
        async with self._pool.acquire() as conn, conn.transaction():
            jobs = await lock_due(
                conn, tenant, processor_id, 1, job_ids=[job_id], schema_version=self._version
            )
            states = await finish_locked(conn, tenant, [], [(job, failure) for job in jobs])
        for state in states.values():
            self._count(_STATE_COUNTS.get(state, "lost"))

    def _count(self, outcome: str, n: int = 1) -> None:
        if n:
            tenant, processor = self.processor.key
            self._metrics.extraction_finished(tenant, processor, outcome, n)
