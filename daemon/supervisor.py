"""`inboxd run`: the supervised process (DESIGN.md §2, §4, §5).

Task tree (every task belongs to one of these groups; nothing is detached):

    delivery ─┬─ intake          group-commits webhook events (pipeline/delivery/intake.py)
              ├─ worker          applies stored events (pipeline/delivery/worker.py)
              └─ outer (below)   ends first, so in-flight webhooks still commit
    outer ─┬─ signals            SIGTERM/SIGINT stop, SIGHUP reload, SIGUSR1 cancel syncs
           ├─ http listener      /healthz /readyz /metrics /v1/… /hooks/esp/…
           └─ workers scope ─┬─ ingest workers × N   drain the bounded queue
                             └─ intake ─┬─ mailbox runners (one per configured mailbox)
                                        ├─ poll scanner     rings due mailboxes
                                        ├─ doorbell         LISTEN inboxd_doorbell
                                        └─ watchdog         sd_notify WATCHDOG=1

Shutdown (first SIGTERM/SIGINT): the intake group is cancelled — runners stop
producing and abandon pages whose results they have not settled, so no cursor
moves past uncommitted work — then the queue is closed and the workers drain
what is queued, within `shutdown_deadline_s`; then the listener stops and the
process exits 0. A second signal cancels the workers at once: their open
transactions roll back, and the pages are produced again on the next start.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import asyncpg
import structlog

from inboxd.adapters.base import Source
from inboxd.daemon import systemd
from inboxd.daemon.config import MainConfig, load_tenants
from inboxd.daemon.esp_hooks import build_hook_sources, confirm_subscription
from inboxd.daemon.http import HttpState, TokenTable, serve_http
from inboxd.daemon.http.hooks import HookTable, hook_routes
from inboxd.daemon.ingest_queue import IngestQueue
from inboxd.daemon.mailbox_runner import MailboxRunner, RunnerDeps
from inboxd.daemon.metrics import Metrics
from inboxd.daemon.sources import build_source
from inboxd.daemon.tenant_config import MailboxConfig, TenantConfig
from inboxd.pipeline import scheduling
from inboxd.pipeline.delivery.intake import DeliveryIntake
from inboxd.pipeline.delivery.worker import run_worker as run_delivery_worker
from inboxd.pipeline.doorbell import DOORBELL_CHANNEL, parse_doorbell
from inboxd.pipeline.ingest import IngestStage
from inboxd.pipeline.objectstore import ObjectStore
from inboxd.pipeline.tenancy import ensure_tenants

log = structlog.get_logger(__name__)

# Readiness probe: a healthy local or same-region PostgreSQL answers at once.
READY_PROBE_TIMEOUT_S = 2.0
# Reconnect delay of the doorbell LISTEN connection after it dropped.
DOORBELL_RECONNECT_S = 2.0
# Mailboxes one scanner claims per pass (more are left for the next pass or replica).
POLL_CLAIM_LIMIT = 100


@dataclass(slots=True)
class DaemonState:
    main: MainConfig
    tenants: dict[str, TenantConfig]
    runners: dict[tuple[str, str], MailboxRunner] = field(default_factory=dict)
    stopping: bool = False


class Daemon:
    """Builds the task tree above and runs it until a stop signal."""

    def __init__(
        self,
        main: MainConfig,
        tenants: dict[str, TenantConfig],
        *,
        pool: asyncpg.Pool,
        dsn: str,
        store: ObjectStore,
        metrics: Metrics | None = None,
        on_ready: Callable[[int], None] | None = None,
    ) -> None:
        self.state = DaemonState(main, dict(tenants))
        self.pool = pool
        self.dsn = dsn
        self.store = store
        self.metrics = metrics or Metrics()
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.queue = IngestQueue(
            IngestStage(pool, store),
            self.metrics,
            capacity_pages=max(1, main.queue_capacity // main.batch_size),
        )
        self._deps = RunnerDeps(pool, self.queue, self.metrics, self.owner, main.lease_ttl_s)
        self._on_ready = on_ready
        self._stop = anyio.Event()
        self._workers_scope = anyio.CancelScope()
        self._intake_tg: anyio.abc.TaskGroup | None = None
        self._log = log.bind(owner=self.owner)
        self._tokens = TokenTable(_api_tokens(self.state.tenants))
        self.intake = DeliveryIntake(pool)
        self.hooks = HookTable()
        self._load_hooks(self.state.tenants)

    # lifecycle ------------------------------------------------------------------------

    async def run(self) -> None:
        main = self.state.main
        # Tenant rows first: a webhook of a new tenant must find its row.
        await self._sync_mailbox_rows(self.state.tenants)
        # The delivery group outlives `outer`: at shutdown the listener finishes
        # its in-flight requests (SHUTDOWN_GRACE_S) while the intake still
        # commits their events, so verified events are answered 200, not 503.
        async with anyio.create_task_group() as delivery:
            await delivery.start(self.intake.run)
            await delivery.start(run_delivery_worker, self.pool, self.dsn)
            await self._serve(main)
            delivery.cancel_scope.cancel()
        self._log.info("daemon_stopped")

    async def _serve(self, main: MainConfig) -> None:
        async with anyio.create_task_group() as outer:
            outer.start_soon(self._signals)
            port = await outer.start(
                serve_http, main.listen_host, main.listen_port, self._http_state()
            )
            with self._workers_scope:
                async with anyio.create_task_group() as workers:
                    for _ in range(main.ingest_workers):
                        await workers.start(self.queue.run_worker)
                    async with anyio.create_task_group() as intake:
                        self._intake_tg = intake
                        for mailbox in _mailboxes(self.state.tenants):
                            await self._start_runner(mailbox)
                        intake.start_soon(self._poll_scanner)
                        await intake.start(self._doorbell)
                        intake.start_soon(systemd.run_watchdog, self._ready)
                        systemd.notify("READY=1")
                        self._log.info("daemon_ready", port=port, mailboxes=len(self.state.runners))
                        if self._on_ready is not None:
                            self._on_ready(port)
                        await self._stop.wait()
                        intake.cancel_scope.cancel()
                    self._intake_tg = None
                    self.queue.close()
            if self._workers_scope.cancelled_caught:
                self._log.warning("daemon_drain_abandoned")
            outer.cancel_scope.cancel()

    def request_stop(self, *, immediate: bool = False) -> None:
        if immediate or self.state.stopping:
            self._log.warning("daemon_stop_now")
            self._workers_scope.cancel()
        else:
            self._log.info("daemon_stopping", deadline_s=self.state.main.shutdown_deadline_s)
            systemd.notify("STOPPING=1")
            self._workers_scope.deadline = (
                anyio.current_time() + self.state.main.shutdown_deadline_s
            )
        self.state.stopping = True
        self._stop.set()

    async def _signals(self) -> None:
        wanted = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
        with anyio.open_signal_receiver(*wanted) as received:
            async for signum in received:
                if signum in (signal.SIGTERM, signal.SIGINT):
                    self.request_stop()
                elif signum == signal.SIGHUP:
                    try:
                        await self.reload()
                    except Exception:  # a reload problem must not stop a running daemon
                        self._log.exception("config_reload_failed")
                elif signum == signal.SIGUSR1:
                    self._log.info("syncs_cancel_requested", running=len(self.state.runners))
                    for runner in self.state.runners.values():
                        runner.cancel_sync()

    # mailboxes ------------------------------------------------------------------------

    async def reload(self) -> None:
        """SIGHUP: re-read tenant files; a broken file keeps its tenant's old config."""
        if self.state.stopping or self._intake_tg is None:
            return
        tenant_set = load_tenants(self.state.main, check_secrets=True)
        merged = dict(tenant_set.tenants)
        broken = tenant_set.problems_by_file
        for problem_file, problems in broken.items():
            for problem in problems:
                self._log.error("config_problem", problem=str(problem))
            for tenant_id, old in self.state.tenants.items():
                if old.source_file == problem_file:
                    merged[tenant_id] = old  # keep running what worked
        await self._sync_mailbox_rows(merged)
        wanted = {(m.tenant_id, m.mailbox_id): m for m in _mailboxes(merged)}
        for key, runner in list(self.state.runners.items()):
            if runner.finished:  # stopped for attention: a reload gives it another chance
                del self.state.runners[key]
            elif key not in wanted or runner.fingerprint != wanted[key]:
                runner.stop()
                del self.state.runners[key]
                if key not in wanted:
                    self.metrics.forget_mailbox(*key)
        for key, mailbox in wanted.items():
            if key not in self.state.runners:
                await self._start_runner(mailbox)
        self.state.tenants = merged
        self._load_hooks(merged)
        try:
            self._tokens.replace(_api_tokens(merged))
        except ValueError as exc:  # e.g. two tenants sharing a token: keep the old table
            self._log.error("api_tokens_not_reloaded", error=str(exc))
        self._log.info(
            "config_reloaded", tenants=len(merged), mailboxes=len(wanted), broken_files=len(broken)
        )

    def _load_hooks(self, tenants: dict[str, TenantConfig]) -> None:
        sources, problems = build_hook_sources(tenants)
        for problem in problems:
            self._log.error("delivery_source_not_served", problem=problem)
        self.hooks.replace(sources)

    async def _start_runner(self, mailbox: MailboxConfig) -> None:
        assert self._intake_tg is not None
        try:
            source: Source = build_source(mailbox, page_size=self.state.main.batch_size)
        except Exception as exc:
            self._log.error(
                "mailbox_not_started",
                tenant=mailbox.tenant_id,
                mailbox=mailbox.mailbox_id,
                error=str(exc),
            )
            try:
                async with self.pool.acquire() as conn:
                    await scheduling.record_failure(
                        conn, mailbox.tenant_id, mailbox.mailbox_id, str(exc), attention=True
                    )
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as db_exc:
                self._log.warning("failure_not_recorded", error=str(db_exc))
            return
        runner = MailboxRunner(source, self._deps, fingerprint=mailbox)
        self.state.runners[runner.key] = runner
        self.metrics.watch_mailbox(mailbox.tenant_id, mailbox.mailbox_id)
        await self._intake_tg.start(runner.run)
        runner.ring()  # first sync at start

    async def _sync_mailbox_rows(self, tenants: dict[str, TenantConfig]) -> None:
        rows = [
            scheduling.MailboxRow(
                m.tenant_id, m.mailbox_id, m.provider, m.address, m.sync_mode, m.poll_interval_s
            )
            for m in _mailboxes(tenants)
        ]
        async with self.pool.acquire() as conn:
            await scheduling.upsert_configured_mailboxes(conn, rows)
            await ensure_tenants(conn, list(tenants))  # webhook events need their tenant row

    async def _poll_scanner(self) -> None:
        interval_s = self.state.main.poll_scan_interval_s
        while True:
            await anyio.sleep(interval_s)
            polled = [
                key
                for key, r in self.state.runners.items()
                if r.fingerprint.sync_mode in ("poll", "auto")
            ]
            if not polled:
                continue
            try:
                async with self.pool.acquire() as conn:
                    due = await scheduling.claim_due(
                        conn,
                        self.owner,
                        mailboxes=polled,
                        cooldown_s=interval_s,
                        limit=POLL_CLAIM_LIMIT,
                    )
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                self._log.warning("poll_scan_failed", error=str(exc))
                continue
            for key in due:
                runner = self.state.runners.get(key)
                if runner is not None:
                    runner.ring()

    async def _doorbell(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """LISTEN for `inboxd sync now` (and later push handlers of other replicas)."""
        started = False
        while True:
            try:
                conn = await asyncpg.connect(self.dsn)
            except (OSError, asyncpg.PostgresError) as exc:
                self._log.warning("doorbell_connect_failed", error=str(exc))
                if not started:
                    task_status.started()
                    started = True
                await anyio.sleep(DOORBELL_RECONNECT_S)
                continue
            lost = anyio.Event()

            def on_ring(_conn: object, _pid: int, _channel: str, payload: str) -> None:
                key = parse_doorbell(payload)
                runner = self.state.runners.get(key) if key else None
                if runner is not None:
                    runner.ring()

            try:
                await conn.add_listener(DOORBELL_CHANNEL, on_ring)
                conn.add_termination_listener(lambda _c, ev=lost: ev.set())
                if not started:
                    task_status.started()
                    started = True
                await lost.wait()
                self._log.warning("doorbell_connection_lost")
            finally:
                with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                    await conn.close()
            await anyio.sleep(DOORBELL_RECONNECT_S)

    # http -----------------------------------------------------------------------------

    def _http_state(self) -> HttpState:
        return HttpState(
            pool=self.pool,
            dsn=self.dsn,
            store=self.store,
            metrics=self.metrics,
            tenant_for_token=self._tokens,
            ready=self._ready,
            max_body_bytes=self.state.main.max_body_bytes,
            extra_routes=hook_routes(self.hooks, self.intake, confirm_subscription),
            body_limit=self.hooks.body_limit,
            before_body=self.hooks.check_before_body,
        )

    async def _ready(self) -> bool:
        if self.state.stopping:
            return False
        try:
            with anyio.fail_after(READY_PROBE_TIMEOUT_S):
                async with self.pool.acquire() as conn:
                    await conn.fetchval("SELECT 1")
        except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            return False
        return True


def _api_tokens(tenants: dict[str, TenantConfig]) -> dict[str, str]:
    return {t.tenant_id: t.api_token.reveal() for t in tenants.values() if t.api_token is not None}


def _mailboxes(tenants: dict[str, TenantConfig]) -> list[MailboxConfig]:
    return [m for t in sorted(tenants.values(), key=lambda t: t.tenant_id) for m in t.mailboxes]
