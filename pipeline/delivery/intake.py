"""Persist-first intake of verified delivery events, with group commit.

A webhook handler calls `DeliveryIntake.submit(...)` with the events of one
verified request and awaits it; it answers the provider only after that
returns, i.e. after the events are committed. Between submit and commit:

    submit ── prepare rows (dedup key, minimised payload, hashed recipient;
             intake_rows.py)
          ── put on the intake stream, wait for the outcome
    writer ── take one submission, then every other already waiting (≤ MAX_GROUP)
          ── one statement (its own transaction; intake_write.py): replay
             tokens → events (ON CONFLICT DO NOTHING) → NOTIFY inboxd_delivery
          ── wake every waiter with its own outcome

`WRITERS` writers share the stream, so while one group commits the next one
gathers: under load many requests share one commit (and one fsync), and
alone a request commits at once — grouping never waits for company.

Each request is still all-or-nothing: its rows commit together or not at
all. A request whose replay token is already known (Mailgun) is refused
(`ReplayedToken`) and writes nothing, while the rest of its group commits. If
a group fails on something one request's content could cause (a data-class
SQLSTATE), it is split in halves until the bad request fails alone and the
others commit. Connection trouble fails the whole group: the handlers answer 503, the
providers retry, and nothing was half-written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import asyncpg
import structlog
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_random

from inboxd.pipeline.delivery.intake_rows import SourcePolicy, prepare_rows, replay_token_hash
from inboxd.pipeline.delivery.intake_write import write_group
from inboxd.pipeline.delivery.model import DeliveryEvent
from inboxd.pipeline.errors import DATABASE_ERRORS, DbFault, blames_the_data, db_fault, describe

__all__ = [
    "DELIVERY_CHANNEL",
    "DeliveryIntake",
    "IntakeUnavailable",
    "ReplayedToken",
    "SourcePolicy",
    "Stored",
]

log = structlog.get_logger(__name__)

#: NOTIFY channel that wakes the event workers after a commit with new rows.
DELIVERY_CHANNEL = "inboxd_delivery"
#: Concurrent writer statements: one group committing while the next gathers.
#: bench/webhooks.py, 1/2/3/6 writers: one event per request 7,777/7,165/6,616/
#: 6,374 req/s (fewer, larger groups cost PostgreSQL less), SendGrid batches p99
#: 21.1/13.0/12.5/15.1 ms (one writer serialises big groups) — two is the balance.
WRITERS = 2
#: Most requests in one group: bounds one statement's arrays (256 SendGrid
#: batches of a few hundred events stay within a few MB).
MAX_GROUP = 256
#: Requests waiting for a writer before submit pushes back (then 503).
QUEUE_CAPACITY = 4096
#: Bound on taking a connection and on a group's statement: a request then waits
#: about 2-3 × this at most for its answer (the group before, its own), more only
#: while a group is split after a data error (~2·log2(group) statements). Providers
#: time out after 10–30 s (SNS 15 s), so the 503 usually comes first.
COMMIT_TIMEOUT_S = 3.0

#: Tries of a group that lost a race between concurrent transactions (DbFault.RACE),
#: and the jitter before the retry (seconds; short: a request is waiting, and the
#: race is already resolved).
RACE_ATTEMPTS = 2
RACE_RETRY_JITTER_S = 0.05


class ReplayedToken(Exception):
    """The request's single-use token was accepted before: a replay."""


class IntakeUnavailable(Exception):
    """The events could not be committed in time (database down, intake stopped)."""


@dataclass(frozen=True, slots=True)
class Stored:
    """Outcome of one request: rows new to the table, rows already there."""

    new: int
    duplicates: int


@dataclass(slots=True)
class _Submission:
    tenant_id: str
    source: str
    rows: list[tuple[Any, ...]]
    token_hash: str | None
    token_scope: str
    done: anyio.Event = field(default_factory=anyio.Event)
    outcome: Stored | None = None
    error: BaseException | None = None

    def finish(self, outcome: Stored | None = None, error: BaseException | None = None) -> None:
        if self.done.is_set():
            return  # settled once; a later path (cleanup) must not overwrite it
        self.outcome, self.error = outcome, error
        self.done.set()


class DeliveryIntake:
    """Group-committing writer of delivery events. Run `run` in a task group."""

    def __init__(
        self, pool: asyncpg.Pool, *, writers: int = WRITERS, max_group: int = MAX_GROUP
    ) -> None:
        self._pool = pool
        self._writers = writers
        self._max_group = max_group
        send, receive = anyio.create_memory_object_stream[_Submission](QUEUE_CAPACITY)
        self._send: MemoryObjectSendStream[_Submission] = send
        self._receive: MemoryObjectReceiveStream[_Submission] = receive
        self.running = False

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Commit submissions until cancelled. Waiting submitters then get IntakeUnavailable."""
        try:
            async with anyio.create_task_group() as tg:
                for _ in range(self._writers):
                    tg.start_soon(self._write_loop)
                self.running = True
                task_status.started()
        finally:
            self.running = False
            self._fail_waiting()
            self._send.close()  # an intake runs once; a later submit gets IntakeUnavailable
            self._receive.close()

    async def submit(
        self,
        tenant_id: str,
        source: str,
        provider: str,
        events: Sequence[DeliveryEvent],
        policy: SourcePolicy,
        *,
        received_at: float,
        replay_token: str | None = None,
        replay_scope: str | None = None,
    ) -> Stored:
        """Store the events of one verified request; returns after commit.

        Raises ReplayedToken (nothing stored), IntakeUnavailable (nothing
        stored, try again), or the database error of a request that failed
        on its own.
        """
        rows = prepare_rows(tenant_id, source, provider, events, policy, received_at)
        # A token is single-use within its scope: the signing key's fingerprint
        # when the adapter gives one (every source sharing a Mailgun key), else
        # the source.
        scope = replay_scope or source
        token_hash = replay_token_hash(scope, replay_token) if replay_token is not None else None
        if not rows and token_hash is None:
            return Stored(0, 0)
        if not self.running:
            raise IntakeUnavailable("intake is not running")
        item = _Submission(tenant_id, source, rows, token_hash, scope)
        try:
            self._send.send_nowait(item)
        except anyio.WouldBlock:
            raise IntakeUnavailable("intake queue is full") from None
        except anyio.ClosedResourceError:
            raise IntakeUnavailable("intake has stopped") from None
        # No cancel scope here (it costs ~10 µs a request): the writer finishes every
        # item it takes, its statements bounded by COMMIT_TIMEOUT_S, and `run`
        # finishes what is left when it stops.
        await item.done.wait()
        if item.error is not None:
            raise item.error
        assert item.outcome is not None
        return item.outcome

    # writers ------------------------------------------------------------------------

    async def _write_loop(self) -> None:
        receive = self._receive.clone()
        async with receive:
            async for first in receive:
                group = [first]
                while len(group) < self._max_group:
                    try:
                        group.append(receive.receive_nowait())
                    except anyio.WouldBlock:
                        break
                await self._commit_group(group)

    async def _commit_group(self, group: list[_Submission]) -> None:
        """Write `group` and settle every submission in it, whatever happens."""
        try:
            await self._commit_or_isolate(group)
        finally:
            for item in group:  # cancelled part-way, or a bug: never leave a waiter
                item.finish(error=IntakeUnavailable("daemon stopping"))

    async def _commit_or_isolate(self, group: list[_Submission]) -> None:
        try:
            # Rows are written in key order, so two groups cannot wait on each
            # other; a deadlock or serialization failure can still come from
            # another writer of the table (a replay). Once more, then 503.
            async for attempt in AsyncRetrying(
                retry=retry_if_exception(_lost_race),
                stop=stop_after_attempt(RACE_ATTEMPTS),
                wait=wait_random(0, RACE_RETRY_JITTER_S),
                reraise=True,
            ):
                with attempt:
                    outcomes = await self._write(group)
        except Exception as exc:
            if len(group) > 1 and blames_the_data(exc):
                # Halves until the culprit stands alone: ~2·log2(n) statements
                # for one bad request among n, and the others commit.
                middle = len(group) // 2
                await self._commit_or_isolate(group[:middle])
                await self._commit_or_isolate(group[middle:])
                return
            log.warning("delivery_intake_failed", requests=len(group), error=describe(exc))
            failure = exc if blames_the_data(exc) else IntakeUnavailable(describe(exc))
            for item in group:
                item.finish(error=failure)
            return
        for item, outcome in zip(group, outcomes, strict=True):
            if isinstance(outcome, Stored):
                item.finish(outcome)
            else:
                item.finish(error=outcome)

    async def _write(self, group: list[_Submission]) -> list[Stored | Exception]:
        written = await write_group(
            self._pool, group, channel=DELIVERY_CHANNEL, bound_s=COMMIT_TIMEOUT_S
        )
        return [
            ReplayedToken("token already used")
            if new is None
            else Stored(new, len(item.rows) - new)
            for item, new in zip(group, written, strict=True)
        ]

    def _fail_waiting(self) -> None:
        while True:
            try:
                item = self._receive.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                return
            item.finish(error=IntakeUnavailable("daemon stopping"))


def _lost_race(exc: BaseException) -> bool:
    """A deadlock or serialization failure: worth one more try, soon."""
    return isinstance(exc, DATABASE_ERRORS) and db_fault(exc) is DbFault.RACE
