"""`inboxd run`: the supervised process, wired from its parts (docs/architecture.md).

Task tree (every task belongs to one of these groups; nothing is detached):

    delivery ─┬─ intake          group-commits webhook events (pipeline/delivery/intake.py)
              ├─ worker          applies stored events (pipeline/delivery/worker.py)
              └─ outer (below)   ends first, so in-flight webhooks still commit
    outer ─┬─ signals            SIGTERM/SIGINT stop, SIGHUP reload, SIGUSR1 cancel syncs
           ├─ http listener      /healthz /readyz /metrics /v1/… /hooks/… /push/gmail/…
           │                     /push/outlook/… (daemon/http/, daemon/webhooks/,
           │                     the doors' push routes in adapters/gmail/, adapters/outlook/)
           └─ workers scope ─┬─ ingest workers × N   drain the bounded queue (sync/queue.py)
                             ├─ SES poller          SQS receive loops (daemon/ses_door.py),
                             │                      stops receiving at the stop signal
                             ├─ fleet               presence, runners, poll scanner,
                             │                      doorbell (sync/)
                             ├─ extraction          inbox feeder + one runner per
                             │                      processor (daemon/extraction/)
                             ├─ attachment sweep    re-derives failed attachments
                             │                      (pipeline/reprocess/attachments.py)
                             ├─ attention gauge     (daemon/metrics/attention.py)
                             ├─ extraction gauges   (daemon/metrics/extraction.py)
                             └─ watchdog            sd_notify WATCHDOG=1

Shutdown (first SIGTERM/SIGINT): the fleet is cancelled — runners stop
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

import anyio
import asyncpg
import structlog

from inboxd.adapters.gmail.push_route import GmailPush, GmailPushTable
from inboxd.adapters.outlook.notifications import OutlookPush, OutlookPushTable
from inboxd.adapters.webhook_routes import RouteContext
from inboxd.daemon import systemd
from inboxd.daemon.config.main import MainConfig, load_tenants
from inboxd.daemon.config.tenant import QUEUE_PROVIDERS, MailboxConfig, TenantConfig
from inboxd.daemon.extraction.stage import ExtractionStage
from inboxd.daemon.http import HttpState, TokenTable, serve_http
from inboxd.daemon.metrics.attention import refresh_attention
from inboxd.daemon.metrics.extraction import refresh_extraction_backlog
from inboxd.daemon.metrics.registry import Metrics
from inboxd.daemon.ses_door import ses_door
from inboxd.daemon.sync.fleet import MailboxFleet
from inboxd.daemon.sync.lease_keeper import LeaseKeeper
from inboxd.daemon.sync.presence import Presence
from inboxd.daemon.sync.queue import IngestQueue
from inboxd.daemon.sync.runner import RunnerDeps
from inboxd.daemon.sync.turns import SyncTurns
from inboxd.daemon.webhooks import Webhooks
from inboxd.daemon.webhooks.esp import EspHooks, HookTable
from inboxd.daemon.webhooks.esp_config import build_delivery_hooks, confirm_subscription
from inboxd.daemon.webhooks.gmail_config import build_gmail_push
from inboxd.daemon.webhooks.outlook_config import build_outlook_push
from inboxd.pipeline.delivery.intake import DeliveryIntake
from inboxd.pipeline.delivery.worker import run_worker as run_delivery_worker
from inboxd.pipeline.errors import DATABASE_ERRORS
from inboxd.pipeline.ingest.stage import IngestStage
from inboxd.pipeline.mailbox import scheduling
from inboxd.pipeline.objectstore.store import ObjectStore
from inboxd.pipeline.reprocess.attachments import AttachmentSweeper
from inboxd.pipeline.tenancy import ensure_tenants

log = structlog.get_logger(__name__)

# Readiness probe: a healthy local or same-region PostgreSQL answers at once.
READY_PROBE_TIMEOUT_S = 2.0


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
        self.main = main
        self.tenants = dict(tenants)
        self.stopping = False
        # Set once every configured mailbox has its runner and `sync now` is listened
        # for: /readyz says 503 before, so no load balancer or operator believes a
        # daemon that would drop a doorbell.
        self.fleet_ready = False
        self.pool = pool
        self.dsn = dsn
        self.store = store
        self.metrics = metrics or Metrics()
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.extraction = ExtractionStage(
            pool,
            store,
            tenants,
            owner=self.owner,
            lease_s=main.lease_ttl_s,
            metrics=self.metrics,
        )
        self.queue = IngestQueue(
            IngestStage(pool, store, extraction=self.extraction.handoff),
            self.metrics,
            capacity_pages=max(1, main.queue_capacity // main.batch_size),
        )
        deps = RunnerDeps(
            pool,
            self.queue,
            self.metrics,
            LeaseKeeper(dsn, self.owner, main.lease_ttl_s),
            presence=Presence(dsn, self.owner),
            turns=SyncTurns(main.max_syncs_at_once),
        )
        self.fleet = MailboxFleet(
            deps,
            dsn=dsn,
            page_size=main.batch_size,
            poll_scan_interval_s=main.poll_scan_interval_s,
            push_quiet_after_s=main.push_quiet_after_s,
            max_imap_idle=main.max_imap_idle,
        )
        self.ses = (
            ses_door(
                main.ses,
                tenants,
                pool=pool,
                queue=self.queue,
                metrics=self.metrics,
                owner=self.owner,
            )
            if main.ses is not None
            else None
        )
        self.intake = DeliveryIntake(pool)
        self.hooks = HookTable()
        self.gmail_push = GmailPushTable()
        self.outlook_push = OutlookPushTable()
        self._tokens = TokenTable(_api_tokens(self.tenants))
        self._on_ready = on_ready
        self._stop = anyio.Event()
        self._workers_scope = anyio.CancelScope()
        self._fleet_scope: anyio.CancelScope | None = None
        self._log = log.bind(owner=self.owner)
        self._load_hooks(self.tenants)
        if self.ses is None and any(m.provider == "ses" for m in _mailboxes(self.tenants)):
            self._log.warning(
                "ses_mailboxes_without_poller",
                hint="the main file has no [ses] table: nothing reads these mailboxes' queue",
            )

    # lifecycle ------------------------------------------------------------------------

    async def run(self) -> None:
        # Tenant rows first: a webhook of a new tenant must find its row.
        await self._sync_mailbox_rows(self.tenants)
        # The delivery group outlives `outer`: at shutdown the listener finishes
        # its in-flight requests (SHUTDOWN_GRACE_S) while the intake still
        # commits their events, so verified events are answered 200, not 503.
        async with anyio.create_task_group() as delivery:
            await delivery.start(self.intake.run)
            await delivery.start(run_delivery_worker, self.pool, self.dsn)
            await self._serve()
            delivery.cancel_scope.cancel()
        self._log.info("daemon_stopped")

    async def _serve(self) -> None:
        main = self.main
        async with anyio.create_task_group() as outer:
            outer.start_soon(self._signals)
            port = await outer.start(
                serve_http, main.listen_host, main.listen_port, self._http_state()
            )
            with self._workers_scope:
                async with anyio.create_task_group() as workers:
                    for _ in range(main.ingest_workers):
                        await workers.start(self.queue.run_worker)
                    # the queue's producers; it closes once they all returned
                    async with anyio.create_task_group() as doors:
                        if self.ses is not None:
                            await doors.start(self.ses.run, self._stop)
                        await self._run_fleet(port)
                    self.queue.close()
            if self._workers_scope.cancelled_caught:
                self._log.warning("daemon_drain_abandoned")
            outer.cancel_scope.cancel()

    async def _run_fleet(self, port: int) -> None:
        """Runners, scanner, doorbell and watchdog until the stop signal."""
        with anyio.CancelScope() as self._fleet_scope:
            async with anyio.create_task_group() as tg:
                await tg.start(self.fleet.run, _synced(self.tenants))
                await tg.start(self.extraction.run)
                tg.start_soon(AttachmentSweeper(self.pool, self.store).run)
                await tg.start(refresh_attention, self.pool, self.metrics)
                await tg.start(
                    refresh_extraction_backlog,
                    self.pool,
                    self.metrics,
                    lambda: [t for t, c in self.tenants.items() if c.processors],
                    lambda: [(t, p.id) for t, c in self.tenants.items() for p in c.processors],
                )
                tg.start_soon(systemd.run_watchdog, self._ready)
                self.fleet_ready = True
                systemd.notify("READY=1")
                self._log.info("daemon_ready", port=port, mailboxes=len(self.fleet.runners))
                if self._on_ready is not None:
                    self._on_ready(port)
                await self._stop.wait()
                tg.cancel_scope.cancel()
        self._fleet_scope = None

    def request_stop(self, *, immediate: bool = False) -> None:
        if immediate or self.stopping:
            self._log.warning("daemon_stop_now")
            self._workers_scope.cancel()
        else:
            self._log.info("daemon_stopping", deadline_s=self.main.shutdown_deadline_s)
            systemd.notify("STOPPING=1")
            self._workers_scope.deadline = anyio.current_time() + self.main.shutdown_deadline_s
        self.stopping = True
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
                    self.fleet.cancel_syncs()

    # configuration --------------------------------------------------------------------

    async def reload(self) -> None:
        """SIGHUP: re-read tenant files; a broken file keeps its tenant's old config."""
        if self.stopping or self._fleet_scope is None:
            return
        tenant_set = load_tenants(self.main, check_secrets=True)
        merged = dict(tenant_set.tenants)
        broken = tenant_set.problems_by_file
        for problem_file, problems in broken.items():
            for problem in problems:
                self._log.error("config_problem", problem=str(problem))
            for tenant_id, old in self.tenants.items():
                if old.source_file == problem_file:
                    merged[tenant_id] = old  # keep running what worked
        await self._sync_mailbox_rows(merged)
        mailboxes = _synced(merged)
        # routes first: a runner started by reconcile creates Graph subscriptions at
        # once, and Graph validates them against this tenant's notification URLs
        self._load_hooks(merged)
        if self.ses is not None:
            self.ses.reload(merged)
        await self.fleet.reconcile(mailboxes)
        self.extraction.reload(merged)
        self.tenants = merged
        try:
            self._tokens.replace(_api_tokens(merged))
        except ValueError as exc:  # e.g. two tenants sharing a token: keep the old table
            self._log.error("api_tokens_not_reloaded", error=str(exc))
        self._log.info(
            "config_reloaded",
            tenants=len(merged),
            mailboxes=len(mailboxes),
            broken_files=len(broken),
        )

    def _load_hooks(self, tenants: dict[str, TenantConfig]) -> None:
        hooks, problems = build_delivery_hooks(tenants)
        for problem in problems:
            self._log.error("delivery_source_not_served", problem=problem)
        self.hooks.replace(hooks)
        pushes, problems = build_gmail_push(tenants)
        for problem in problems:
            self._log.error("gmail_push_not_served", problem=str(problem))
        self.gmail_push.replace(pushes)
        graph, problems = build_outlook_push(tenants)
        for problem in problems:
            self._log.error("outlook_push_not_served", problem=str(problem))
        self.outlook_push.replace(graph)

    async def _sync_mailbox_rows(self, tenants: dict[str, TenantConfig]) -> None:
        rows = [
            scheduling.MailboxRow(
                m.tenant_id, m.mailbox_id, m.provider, m.address, m.sync_mode, m.poll_interval_s
            )
            for m in _mailboxes(tenants)
        ]
        async with self.pool.acquire() as conn:
            await scheduling.upsert_configured_mailboxes(conn, rows)
            # webhook events need their tenant row; the name is the tenant file's `name`
            await ensure_tenants(conn, {t.tenant_id: t.name for t in tenants.values()})

    # http -----------------------------------------------------------------------------

    def _http_state(self) -> HttpState:
        routes = RouteContext(pool=self.pool, metrics=self.metrics)
        return HttpState(
            pool=self.pool,
            dsn=self.dsn,
            store=self.store,
            metrics=self.metrics,
            tenant_for_token=self._tokens,
            ready=self._ready,
            max_body_bytes=self.main.max_body_bytes,
            trusted_proxies=self.main.trusted_proxies,
            forwarded_header=self.main.forwarded_header,
            webhooks=Webhooks(
                EspHooks(self.hooks, self.intake, confirm_subscription),
                GmailPush(self.gmail_push, routes),
                OutlookPush(self.outlook_push, routes),
            ),
        )

    async def _ready(self) -> bool:
        if self.stopping or not self.fleet_ready:
            return False
        try:
            with anyio.fail_after(READY_PROBE_TIMEOUT_S):
                async with self.pool.acquire() as conn:
                    await conn.fetchval("SELECT 1")
        except DATABASE_ERRORS:
            return False
        return True


def _api_tokens(tenants: dict[str, TenantConfig]) -> dict[str, str]:
    return {t.tenant_id: t.api_token.reveal() for t in tenants.values() if t.api_token is not None}


def _mailboxes(tenants: dict[str, TenantConfig]) -> list[MailboxConfig]:
    """Every configured mailbox (their rows must exist, whoever feeds them)."""
    return [m for t in sorted(tenants.values(), key=lambda t: t.tenant_id) for m in t.mailboxes]


def _synced(tenants: dict[str, TenantConfig]) -> list[MailboxConfig]:
    """The mailboxes a sync runner serves; queue doors (ses) feed theirs themselves."""
    return [m for m in _mailboxes(tenants) if m.provider not in QUEUE_PROVIDERS]
