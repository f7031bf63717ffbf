"""One mailbox's life in the daemon: wait for a doorbell, take the lease, sync, repeat.

State machine of a runner:

    idle ──ring()──▶ leasing ──token──▶ syncing ──pages exhausted──▶ idle
      ▲                 │ held elsewhere        │ retriable failure / crash
      │                 ▼                       ▼
      └──────────── (skip run)            backoff recorded ──▶ idle
                                                │ auth/config problem
                                                ▼
                                          needs_attention (no more runs until reload)

- A run first waits for a turn (sync/turns.py: at most `[sync] max_syncs_at_once`
  runs of the process work at once; a run past 10 s goes on in one of half as
  many long turns, so polls are not kept waiting behind backfills).
- ring() during a run sets `pending`: the run is followed by exactly one more
  (notifications for a busy mailbox are coalesced).
- A ring while the mailbox is throttled (an earlier run failed) is kept for the
  throttle's end: the runner rings itself then, so a push (IMAP IDLE, a webhook)
  that came during the throttle is not lost until the next poll.
- syncing: pages come from the Source; each goes through the bounded ingest
  queue; after its results, the Source settles it, and the cursor moves only
  past a clean page, with the lease's fencing token (a stale owner stops).
  The cancel flag in the database is checked between pages.
- The lease is renewed every third of its TTL while syncing, with every other
  lease of the process, by its LeaseKeeper (sync/lease_keeper.py); losing it
  cancels the run at once.
- cancel_sync() (SIGUSR1) cancels the current run; stop() ends the runner
  (SIGHUP removed or changed the mailbox, or shutdown).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field

import anyio
import asyncpg
import structlog
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream

from inboxd.adapters.base import Page, Source, Watchable
from inboxd.daemon.config.tenant import MailboxConfig
from inboxd.daemon.metrics.registry import Metrics
from inboxd.daemon.sync.lease_keeper import LeaseKeeper
from inboxd.daemon.sync.pages import batch_of, read_ahead, unwrap_single
from inboxd.daemon.sync.presence import Presence
from inboxd.daemon.sync.queue import IngestQueue
from inboxd.daemon.sync.turns import DEFAULT_SYNCS_AT_ONCE, SyncTurns, Turn
from inboxd.pipeline import copies
from inboxd.pipeline.errors import (
    DATABASE_ERRORS,
    CursorExpired,
    Family,
    RetriableError,
    describe,
    family_of,
)
from inboxd.pipeline.mailbox import leases, scheduling
from inboxd.pipeline.outcomes import ItemResult, Outcome, page_is_clean

log = structlog.get_logger(__name__)

# Partial cursor resets in one run (one per expired part: an Outlook mailbox's
# folders expire independently); a full reset (restart_from None) ends the chain.
MAX_CURSOR_RESETS = 8
# Cleanup that must finish (lease release, failure record) gets this long even
# when the runner is being cancelled.
CLEANUP_DEADLINE_S = 5.0


class LeaseLost(RetriableError):
    """Another process holds the mailbox now; this run must stop writing."""


class PageNotClean(RetriableError):
    """A page had retriable failures; the cursor stays before it."""


@dataclass(frozen=True, slots=True)
class RunnerDeps:
    pool: asyncpg.Pool
    queue: IngestQueue
    metrics: Metrics
    keeper: LeaseKeeper  # renews the leases of every run; its owner and TTL are ours
    presence: Presence | None = None  # leases carry its key while it is held
    # how many runs of the process work at once ([sync] max_syncs_at_once)
    turns: SyncTurns = field(default_factory=lambda: SyncTurns(DEFAULT_SYNCS_AT_ONCE))

    @property
    def owner(self) -> str:
        return self.keeper.owner

    @property
    def lease_ttl_s(self) -> float:
        return self.keeper.ttl_s


class MailboxRunner:
    """Owns the sync runs of one mailbox inside this process."""

    def __init__(self, source: Source, deps: RunnerDeps, config: MailboxConfig) -> None:
        self.source = source
        self.deps = deps
        self.config = config  # what it was built from: SIGHUP restarts it when that changes
        self.key = (source.tenant_id, source.mailbox_id)
        self._wake = anyio.Event()
        self._pending = False
        self._claimed = False  # the pending run answers a poll claim
        self._running = False
        self._finished = False
        self._life = anyio.CancelScope()
        self._run_scope: anyio.CancelScope | None = None
        self._turn: Turn | None = None
        # a ring skipped by a throttle: seconds until the runner rings itself
        self._deferred_s = math.inf
        self._log = log.bind(tenant=source.tenant_id, mailbox=source.mailbox_id)

    @property
    def busy(self) -> bool:
        """A sync runs, or one is asked for: a poll now would only queue another run
        right after it (the poll scanner skips busy mailboxes)."""
        return self._running or self._pending

    def ring(self, *, claimed: bool = False) -> None:
        """Ask for a sync run; coalesced with any run already asked for or running.
        `claimed`: the poll scanner's claim asked for it; that run's start is then
        recorded as the claim's time, so the wait for a turn does not stretch the
        mailbox's poll period (leases.begin_run)."""
        self._pending = True
        self._claimed = self._claimed or claimed
        self._wake.set()

    def cancel_sync(self) -> None:
        """Cancel the current run gracefully; the next ring() starts a new one."""
        if self._run_scope is not None:
            self._run_scope.cancel()

    def stop(self) -> None:
        self._life.cancel()

    @property
    def finished(self) -> bool:
        """True once the runner returned (its mailbox needs an operator)."""
        return self._finished

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        # Every log line of this mailbox's tasks (its syncs, its door's watch, the door's
        # own lines) carries tenant and mailbox: tasks started here copy this context.
        with structlog.contextvars.bound_contextvars(tenant=self.key[0], mailbox=self.key[1]):
            await self._run(task_status)

    async def _run(self, task_status: TaskStatus[None]) -> None:
        try:
            with self._life:
                async with anyio.create_task_group() as tg:
                    if isinstance(self.source, Watchable) and self.config.sync_mode in (
                        "push",
                        "auto",
                    ):
                        # the door's own push channel (IMAP IDLE) rings this runner
                        tg.start_soon(self.source.watch, self.ring)
                    task_status.started()
                    await self._serve()
                    tg.cancel_scope.cancel()
        finally:
            self._finished = True
            await self._close_source()

    async def _serve(self) -> None:
        """Runs, one per doorbell (coalesced), until the mailbox needs an operator."""
        while True:
            with anyio.move_on_after(self._deferred_s):
                await self._wake.wait()
            if not self._wake.is_set():
                self._pending = True  # the throttle that skipped a ring has ended
            self._deferred_s = math.inf
            self._wake = anyio.Event()
            while self._pending:
                self._pending = False
                if await self._one_run():
                    return

    async def _close_source(self) -> None:
        """A source holding connections (provider doors) releases them with the runner."""
        aclose = getattr(self.source, "aclose", None)
        if aclose is None:
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(CLEANUP_DEADLINE_S):
            try:
                await aclose()
            except Exception as exc:  # closing must not mask how the runner ended
                self._log.warning("source_close_failed", error=describe(exc))

    async def _one_run(self) -> bool:
        """One guarded sync run; returns True when the mailbox needs an operator."""
        provider = self.source.provider
        self.deps.metrics.sync_started(provider)
        started = anyio.current_time()
        failed = False
        # every log line of this run carries its id (CONTRIBUTING.md rule 11)
        self._log = log.bind(tenant=self.key[0], mailbox=self.key[1], run=secrets.token_hex(4))
        try:
            with anyio.CancelScope() as scope:
                self._run_scope = scope
                await self._sync()
            if scope.cancelled_caught:
                self._log.info("sync_cancelled")
            return False
        except LeaseLost as exc:
            # the new owner carries on; a failure recorded now would throttle it
            self._log.warning("sync_lease_lost", error=str(exc))
            return False
        except Exception as exc:  # any failure of one mailbox: never the process's end
            failed = True
            family = family_of(exc)
            if family is Family.ATTENTION:
                self._log.error("sync_needs_attention", error=str(exc))
                await self._record_failure(str(exc), attention=True)
                return True
            if family is Family.CRASH:
                self._log.exception("sync_crashed")
            else:
                self._log.warning("sync_failed", error=describe(exc), kind=type(exc).__name__)
            # a provider's Retry-After (429, rateLimitExceeded) becomes the throttle
            retry_after = getattr(exc, "retry_after_s", None)
            await self._record_failure(
                f"{type(exc).__name__}: {describe(exc)}",
                retry_after_s=retry_after
                if isinstance(retry_after, int | float) and retry_after >= 0
                else None,
            )
            return False
        finally:
            self._run_scope = None
            self.deps.metrics.sync_finished(
                provider, duration_s=anyio.current_time() - started, failed=failed
            )

    async def _sync(self) -> None:
        """One run in its turn (sync/turns.py): waiting for one counts as busy, or the
        poll scanner would claim the mailbox again and queue a second run after it."""
        self._running = True
        try:
            async with self.deps.turns.turn() as turn:
                self._turn = turn
                await self._sync_in_turn()
        finally:
            self._turn = None
            self._running = False

    async def _sync_in_turn(self) -> None:
        tenant, mailbox = self.key
        pool = self.deps.pool
        presence = self.deps.presence
        async with pool.acquire() as conn:
            # throttle check, lease and cursor: one statement (a poll at 10,000
            # mailboxes is a handful of statements, each counts: issue 25)
            claimed, self._claimed = self._claimed, False
            start = await leases.begin_run(
                conn,
                tenant,
                mailbox,
                self.deps.owner,
                self.deps.lease_ttl_s,
                session_key=presence.session_key if presence is not None else None,
                from_claim=claimed,
            )
        if start.throttled_for_s is not None:
            self._log.debug("sync_skipped_throttled", for_s=start.throttled_for_s)
            self._deferred_s = start.throttled_for_s  # this ring is run when the throttle ends
            return
        if start.token is None:
            self._log.debug("sync_skipped_leased_elsewhere")
            return
        token, cursor = start.token, start.cursor
        released = False
        try:
            # anyio wraps what the sync raised (renew + page reader groups); the
            # handlers in _one_run need the error itself
            completed = await unwrap_single(self._sync_pages(token, cursor))
            if completed:
                # a door that skipped a part it could not read (an IMAP folder gone)
                # says so: the status names it, the rest of the mailbox keeps syncing
                degraded = getattr(self.source, "degraded", None)
                problem = degraded() if degraded is not None else None
                async with pool.acquire() as conn:
                    if problem is None:  # recorded clean and released: one statement
                        released = await leases.finish_run(
                            conn, tenant, mailbox, self.deps.owner, token
                        )
                        if not released:
                            raise LeaseLost("the mailbox lease moved to another process")
                    else:
                        self._log.warning("sync_degraded", error=problem[0])
                        await scheduling.record_partial_success(
                            conn, tenant, mailbox, problem[0], attention=problem[1]
                        )
                # caught up with the source: nothing left behind the cursor
                self.deps.metrics.mark_caught_up(tenant, mailbox)
        finally:
            if not released:
                await self._release(token)

    async def _release(self, token: int) -> None:
        """Give the lease back however the run ended (bounded, even when cancelled)."""
        tenant, mailbox = self.key
        with anyio.CancelScope(shield=True), anyio.move_on_after(CLEANUP_DEADLINE_S):
            try:
                async with self.deps.pool.acquire() as conn:
                    await leases.release_lease(conn, tenant, mailbox, self.deps.owner, token)
            except DATABASE_ERRORS as exc:  # the lease expires by itself
                self._log.warning("lease_not_released", error=describe(exc))

    async def _sync_pages(self, token: int, cursor: str | None) -> bool:
        """The pages, with the lease renewed by the process's keeper meanwhile."""
        with self.deps.keeper.holding(self.key, token, self._lease_lost):
            return await self._pages(token, cursor)

    def _lease_lost(self) -> None:
        """The keeper found the lease gone: another process syncs now; stop at once."""
        if self._run_scope is not None:
            self._run_scope.cancel()

    async def _pages(self, token: int, cursor: str | None) -> bool:
        """Sync every page from `cursor` (the lease's, read when it was taken); True
        when the source is exhausted, False when stopped early."""
        tenant, mailbox = self.key
        pool = self.deps.pool
        for _ in range(MAX_CURSOR_RESETS):
            try:
                return await unwrap_single(self._read_from(token, cursor))
            except CursorExpired as exc:
                if exc.restart_from == cursor:
                    raise  # nothing to restart from (a source expired what it was not given)
                self._log.warning("sync_cursor_expired", error=describe(exc))
                cursor = exc.restart_from
                async with pool.acquire() as conn:
                    if not await leases.reset_cursor(
                        conn, tenant, mailbox, token, describe(exc), restart_from=cursor
                    ):
                        raise LeaseLost("the mailbox lease moved to another process") from exc
        return await unwrap_single(self._read_from(token, cursor))

    async def _read_from(self, token: int, cursor: str | None) -> bool:
        async with read_ahead(self.source, cursor) as pages:
            return await self._each_page(token, pages)

    async def _each_page(self, token: int, pages: MemoryObjectReceiveStream[Page]) -> bool:
        tenant, mailbox = self.key
        pool = self.deps.pool
        async for page in pages:
            # a poll that found nothing new has no items: no turn in the ingest queue,
            # where it would wait behind backfill pages
            results = (
                await self.deps.queue.ingest(batch_of(self.source, page)) if page.items else []
            )
            self._log_dead_items(page, results)
            await self.source.settle(page, results)
            if not page_is_clean(results):
                failed = [r for r in results if r.outcome.value == "retriable_failure"]
                # the first failure's own words (an object store's OS error and path, a
                # database error) are what the operator acts on, in the last error
                why = next((r.detail for r in failed if r.detail), None)
                raise PageNotClean(
                    f"{len(failed)} items failed retriably"
                    + (f" ({why})" if why else "")
                    + "; the page will be read again"
                )
            async with pool.acquire() as conn:
                await _record_changes(conn, tenant, mailbox, page)
                # the cursor and the cancel flag: one statement, fenced
                cancel = await leases.commit_page(conn, tenant, mailbox, token, page.cursor_after)
                if cancel is None:
                    raise LeaseLost("the mailbox lease moved to another process")
                if cancel:
                    self._log.info("sync_cancel_flag_honoured")
                    return False
            self._log.info("sync_page_committed", items=len(page.items))
            if self._turn is not None:
                await self._turn.at_page_end()  # a long run goes on in a long turn
        return True

    def _log_dead_items(self, page: Page, results: list[ItemResult]) -> None:
        """Each dead item once, with its reason: /metrics alone hides which one and why."""
        for result in results:
            if result.outcome is Outcome.PERMANENT_FAILURE:
                self._log.warning(
                    "dead_item",
                    external_id=page.items[result.index].external_id,
                    reason=result.detail,
                )

    async def _record_failure(
        self, error: str, *, attention: bool = False, retry_after_s: float | None = None
    ) -> None:
        tenant, mailbox = self.key
        with anyio.CancelScope(shield=True), anyio.move_on_after(CLEANUP_DEADLINE_S):
            try:
                async with self.deps.pool.acquire() as conn:
                    await scheduling.record_failure(
                        conn,
                        tenant,
                        mailbox,
                        error,
                        attention=attention,
                        retry_after_s=retry_after_s,
                    )
            except DATABASE_ERRORS as exc:
                self._log.warning("failure_not_recorded", error=describe(exc))


async def _record_changes(conn: asyncpg.Connection, tenant: str, mailbox: str, page: Page) -> None:
    """What the page says changed on copies already stored (adapters/base.py Page)."""
    if page.labels:
        await copies.update_labels(conn, tenant, mailbox, page.labels)
    by_reason: dict[str, list[str]] = {}
    for external_id, reason in page.removed.items():
        by_reason.setdefault(reason, []).append(external_id)
    for reason, external_ids in by_reason.items():
        await copies.record_removed(
            conn, tenant, mailbox, external_ids, reason, only_from=page.removed_from
        )
