"""The mailbox runners of one process, and the two things that ring them.

    fleet task group ─┬─ presence lock                 (sync/presence.py)
                      ├─ lease keeper                  (sync/lease_keeper.py)
                      ├─ runner × configured mailbox   (sync/runner.py)
                      ├─ poll scanner                  (sync/scanner.py)
                      └─ doorbell listener             (sync/doorbell.py)

`run()` owns that group until cancelled (shutdown cancels it first, so no
runner produces while the queue drains). `reconcile()` is SIGHUP's half for
mailboxes: runners of removed or changed mailboxes stop (a run in progress is
cancelled between awaits; nothing unsettled moves a cursor), new and changed
ones start and sync at once. A mailbox whose adapter cannot be built is
recorded as needing attention and gets no runner; one that is not connected
yet (no credential: valid configuration) is recorded as needs_connect, with the
command that connects it, and gets its runner at the reload that adds one.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import structlog
from anyio.abc import TaskGroup, TaskStatus

from inboxd.adapters.base import Source
from inboxd.adapters.http_fetch import SharedSessions
from inboxd.adapters.imap.idle_slots import IdleSlots
from inboxd.daemon.config.tenant import MailboxConfig
from inboxd.daemon.sync.doorbell import listen_doorbell
from inboxd.daemon.sync.registry import SourceDeps, build_source
from inboxd.daemon.sync.runner import MailboxRunner, RunnerDeps
from inboxd.daemon.sync.scanner import run_poll_scanner
from inboxd.pipeline.errors import DATABASE_ERRORS, NotConnected, describe
from inboxd.pipeline.mailbox import scheduling

log = structlog.get_logger(__name__)

Key = tuple[str, str]
# Mailboxes started at once when the fleet starts: each start is a few awaits (its
# runner's task, a row write when it cannot run), so the bound keeps a large fleet
# from asking the pool for hundreds of connections in the same instant.
MAILBOX_STARTS_AT_ONCE = 32
# A removed mailbox's provider clean-up (users.stop) gets this long during a reload.
FORGET_DEADLINE_S = 10.0
# Closing the doors' shared HTTP sessions at stop: aiohttp closes its connections at
# once; the bound is for a peer that never answers a TLS close.
SESSIONS_CLOSE_DEADLINE_S = 5.0
# Sync modes the scanner considers: poll on poll_interval_s, auto when push has been
# quiet, push for its daily safety sync (pipeline/mailbox/scheduling.py claim_due).
POLLED_MODES = ("poll", "auto", "push")


class MailboxFleet:
    """Runners by (tenant, mailbox); every one a task of the fleet's task group."""

    def __init__(
        self,
        deps: RunnerDeps,
        *,
        dsn: str,
        page_size: int,
        poll_scan_interval_s: float,
        push_quiet_after_s: float = 0.0,
        max_imap_idle: int | None = None,
    ) -> None:
        self.deps = deps
        self.dsn = dsn
        self.page_size = page_size
        # One bound for every IMAP mailbox of this process (None: unbounded, tests).
        self.imap_idle = IdleSlots(max_imap_idle) if max_imap_idle is not None else None
        # One HTTP session per door for all its mailboxes (issue 25), closed in `run`.
        self.http = SharedSessions()
        self.poll_scan_interval_s = poll_scan_interval_s
        self.push_quiet_after_s = push_quiet_after_s
        self.runners: dict[Key, MailboxRunner] = {}
        self._tg: TaskGroup | None = None

    async def run(
        self,
        mailboxes: Sequence[MailboxConfig],
        *,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Start a runner per mailbox, the scanner and the doorbell; serve until cancelled."""
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                if self.deps.presence is not None:  # before any lease is taken
                    await tg.start(self.deps.presence.run)
                await tg.start(self.deps.keeper.run)
                # Side by side: one after another took 11-19 s at 1,000 mailboxes.
                limiter = anyio.CapacityLimiter(MAILBOX_STARTS_AT_ONCE)
                async with anyio.create_task_group() as starting:
                    for mailbox in mailboxes:
                        starting.start_soon(self._start_limited, mailbox, limiter)
                tg.start_soon(
                    run_poll_scanner,
                    self.deps.pool,
                    self.deps.owner,
                    self.poll_scan_interval_s,
                    self.polled,
                    self.ring_claimed,
                    self.push_quiet_after_s,
                )
                await tg.start(listen_doorbell, self.dsn, self.ring)
                task_status.started()
                await anyio.sleep_forever()
        finally:
            self._tg = None
            # the runners are gone: nothing uses the sessions; closing is quick, but a
            # stop must not wait on it without a bound (CONTRIBUTING.md rule 6)
            with anyio.CancelScope(shield=True), anyio.move_on_after(SESSIONS_CLOSE_DEADLINE_S):
                await self.http.aclose()

    def ring(self, key: Key) -> None:
        """Ask the mailbox's runner for a sync run; unknown mailboxes are ignored."""
        runner = self.runners.get(key)
        if runner is not None:
            runner.ring()

    def ring_claimed(self, key: Key) -> None:
        """The poll scanner's ring: the run it asks for answers a claim, so the next
        poll falls due an interval after the claim (MailboxRunner.ring)."""
        runner = self.runners.get(key)
        if runner is not None:
            runner.ring(claimed=True)

    def polled(self) -> list[tuple[Key, float]]:
        """The mailboxes the poll scanner may claim, with the seconds between their
        polls: in a polled mode, and not busy — claiming one whose (first) sync this
        process is running made it sync twice in a row (3,500 page commits for 3,000
        pages, issue 25). A push mailbox's poll is the daily safety sync."""
        return [
            (key, scheduling.poll_every_s(r.config.sync_mode, r.config.poll_interval_s))
            for key, r in self.runners.items()
            if r.config.sync_mode in POLLED_MODES and not r.busy
        ]

    def cancel_syncs(self) -> None:
        """SIGUSR1: cancel every running sync; they resume on the next doorbell."""
        log.info("syncs_cancel_requested", running=len(self.runners))
        for runner in self.runners.values():
            runner.cancel_sync()

    async def reconcile(self, mailboxes: Sequence[MailboxConfig]) -> None:
        """Make the runners match `mailboxes` (SIGHUP); see the module docstring."""
        if self._tg is None:
            return
        wanted = {(m.tenant_id, m.mailbox_id): m for m in mailboxes}
        for key, runner in list(self.runners.items()):
            if runner.finished:  # stopped for attention: a reload gives it another chance
                del self.runners[key]
            elif key not in wanted or runner.config != wanted[key]:
                if key not in wanted:
                    await _forget(runner)
                runner.stop()
                del self.runners[key]
                if key not in wanted:
                    self.deps.metrics.forget_mailbox(*key)
        for key, mailbox in wanted.items():
            if key not in self.runners:
                await self._start(mailbox)

    async def _start_limited(self, mailbox: MailboxConfig, limiter: anyio.CapacityLimiter) -> None:
        async with limiter:
            await self._start(mailbox)

    async def _start(self, mailbox: MailboxConfig) -> None:
        assert self._tg is not None
        try:
            source: Source = build_source(
                mailbox,
                SourceDeps(pool=self.deps.pool, imap_idle=self.imap_idle, http=self.http),
                page_size=self.page_size,
            )
        except NotConnected as exc:  # configured, waiting for `inboxd connect`
            log.info("mailbox_needs_connect", tenant=mailbox.tenant_id, mailbox=mailbox.mailbox_id)
            await self._record_needs_connect(mailbox, str(exc))
            return
        except Exception as exc:  # any adapter's construction problem is the operator's
            log.error(
                "mailbox_not_started",
                tenant=mailbox.tenant_id,
                mailbox=mailbox.mailbox_id,
                error=str(exc),
            )
            await self._record_attention(mailbox, str(exc))
            return
        runner = MailboxRunner(source, self.deps, mailbox)
        self.runners[runner.key] = runner
        self.deps.metrics.watch_mailbox(mailbox.tenant_id, mailbox.mailbox_id)
        await self._tg.start(runner.run)
        runner.ring()  # first sync at start

    async def _record_needs_connect(self, mailbox: MailboxConfig, how: str) -> None:
        try:
            async with self.deps.pool.acquire() as conn:
                await scheduling.record_needs_connect(
                    conn, mailbox.tenant_id, mailbox.mailbox_id, how
                )
        except DATABASE_ERRORS as exc:
            log.warning("failure_not_recorded", error=describe(exc))

    async def _record_attention(self, mailbox: MailboxConfig, error: str) -> None:
        try:
            async with self.deps.pool.acquire() as conn:
                await scheduling.record_failure(
                    conn, mailbox.tenant_id, mailbox.mailbox_id, error, attention=True
                )
        except DATABASE_ERRORS as exc:
            log.warning("failure_not_recorded", error=describe(exc))


async def _forget(runner: MailboxRunner) -> None:
    """A removed mailbox's source may tell its provider to stop pushing (Gmail's
    users.stop); bounded, and a failure only logged: the push route ignores
    unknown mailboxes anyway."""
    forget = getattr(runner.source, "forget", None)
    if forget is None:
        return
    with anyio.move_on_after(FORGET_DEADLINE_S):
        try:
            await forget()
            log.info("mailbox_forgotten", tenant=runner.key[0], mailbox=runner.key[1])
        except Exception as exc:  # any provider trouble: the mailbox is removed all the same
            log.warning("mailbox_not_forgotten", mailbox=runner.key[1], error=describe(exc))
