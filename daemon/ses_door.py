"""The SES door in the daemon: the SQS poller (adapters/ses/poller.py) wired to the
ingest queue, the routing table of the tenants' ses mailboxes, metrics and status.

    workers scope ─┬─ ingest workers
                   └─ doors ─┬─ SesDoor.run ─┬─ receive loops × pollers, heartbeat
                             │               └─ totals flush (every TOTALS_FLUSH_S)
                             └─ fleet (sync runners)

It stops receiving when the daemon's stop event is set and returns once the
messages in flight are stored and deleted (or released, if the drain deadline
cancels them); the ingest queue closes after it, so nothing it hands over is
dropped. SIGHUP swaps the routing table whole (`reload`).
"""

from __future__ import annotations

from datetime import UTC, datetime

import anyio
import asyncpg
import structlog
from anyio.abc import TaskStatus

from inboxd.adapters.ses import AwsClients, Router, SesMailbox, SesPoller, SesSettings, Unrouted
from inboxd.daemon.config.tenant import TenantConfig
from inboxd.daemon.metrics.registry import Metrics
from inboxd.daemon.ses_sns import SnsEnvelopeCheck
from inboxd.daemon.sync.queue import IngestQueue
from inboxd.pipeline.copies import known_copies
from inboxd.pipeline.errors import DATABASE_ERRORS
from inboxd.pipeline.ingest.stage import IngestBatch
from inboxd.pipeline.mailbox import scheduling
from inboxd.pipeline.outcomes import ItemResult, page_is_clean
from inboxd.pipeline.queue_doors import record_unrouted, write_totals

__all__ = ["SesDoor", "build_router"]

log = structlog.get_logger(__name__)

# The status table's counters are this fresh; one small upsert per interval.
TOTALS_FLUSH_S = 5.0
# The last flush at shutdown is bounded: the process must exit.
FINAL_FLUSH_TIMEOUT_S = 3.0
# A mailbox's last success is written at most this often (one UPDATE), however
# many batches it receives: `inboxd status` shows minutes, not milliseconds.
SUCCESS_EVERY_S = 5.0
# "Is the database back?" after a batch left messages: a healthy server answers
# SELECT 1 at once.
READY_PROBE_TIMEOUT_S = 2.0


def build_router(tenants: dict[str, TenantConfig]) -> Router:
    """The routing table of every configured ses mailbox."""
    return Router(
        (m.tenant_id, m.mailbox_id, SesMailbox.from_settings(m.settings))
        for t in tenants.values()
        for m in t.mailboxes
        if m.provider == "ses" and m.settings
    )


class SesDoor:
    """One daemon's SES poller set, with its counters (it is the poller's PollerEvents)."""

    def __init__(
        self,
        settings: SesSettings,
        tenants: dict[str, TenantConfig],
        *,
        pool: asyncpg.Pool,
        queue: IngestQueue,
        metrics: Metrics,
        owner: str,
    ) -> None:
        self.settings = settings
        self.door = f"ses:{settings.queue_name}"
        self.router = build_router(tenants)
        self._pool = pool
        self._queue = queue
        self._metrics = metrics
        self._owner = owner
        self._poller: SesPoller | None = None
        self.totals: dict[str, int] = {}
        self._succeeded: dict[tuple[str, str], float] = {}  # mailbox → last success write
        self.last_error: str | None = None
        self.last_error_at: datetime | None = None

    def reload(self, tenants: dict[str, TenantConfig]) -> None:
        self.router = build_router(tenants)
        if self._poller is not None:
            self._poller.router = self.router

    async def run(
        self, stop: anyio.Event, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        if not len(self.router):
            log.warning("ses_no_mailboxes", door=self.door)
        async with AwsClients(self.settings) as aws:
            self._poller = SesPoller(
                self.settings,
                aws,
                router=self.router,
                ingest=self._ingest,
                room=self._queue.wait_for_room,
                record_unrouted=self._record_unrouted,
                events=self,
                stored=self._stored,
                ready=self._database_ready,
                check_body=SnsEnvelopeCheck(self.settings.sns_topic_arns)
                if self.settings.verify_sns_signature
                else None,
            )
            log.info("ses_poller_started", door=self.door, pollers=self.settings.pollers)
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._flush_every)
                    task_status.started()
                    await self._poller.run(stop)
                    tg.cancel_scope.cancel()
            finally:
                self._poller = None
                with anyio.CancelScope(shield=True), anyio.move_on_after(FINAL_FLUSH_TIMEOUT_S):
                    await self._flush()
                log.info("ses_poller_stopped", door=self.door, **self.totals)

    # PollerEvents ------------------------------------------------------------------------

    def counted(self, what: str, n: int = 1) -> None:
        if n:
            self.totals[what] = self.totals.get(what, 0) + n
            self._metrics.queue_door_counted(self.door, what, n)

    def failed(self, error: str) -> None:
        self.last_error = error
        self.last_error_at = datetime.now(UTC)
        self._metrics.queue_door_failed(self.door)

    # ------------------------------------------------------------------------------------

    async def _record_unrouted(self, item: Unrouted) -> None:
        await record_unrouted(
            self._pool,
            self.door,
            item.external_id,
            item.reason,
            item.detail,
            item.body,
            item.recipients,
        )

    async def _ingest(self, batch: IngestBatch) -> list[ItemResult]:
        """The daemon's ingest queue; a mailbox whose batch settled has synced (its
        `last_success_at` in `inboxd status`), written at most every SUCCESS_EVERY_S."""
        results = await self._queue.ingest(batch)
        key = (batch.tenant_id, batch.mailbox_id)
        now = anyio.current_time()
        if page_is_clean(results) and now - self._succeeded.get(key, -SUCCESS_EVERY_S) >= (
            SUCCESS_EVERY_S
        ):
            self._succeeded[key] = now
            try:
                async with self._pool.acquire() as conn:
                    await scheduling.record_success(conn, *key)
            except DATABASE_ERRORS as exc:  # a view of health; the next batch writes it
                log.debug("ses_success_not_recorded", error=type(exc).__name__)
        return results

    async def _database_ready(self) -> bool:
        try:
            with anyio.fail_after(READY_PROBE_TIMEOUT_S):
                async with self._pool.acquire() as conn:
                    await conn.fetchval("SELECT 1")
        except DATABASE_ERRORS:  # TimeoutError (the probe's deadline) is one of them
            return False
        return True

    async def _stored(self, mailboxes: list[tuple[str, str]], external_id: str) -> bool:
        async with self._pool.acquire() as conn:
            for tenant, mailbox in mailboxes:
                if await known_copies(conn, tenant, mailbox, [external_id]):
                    return True
        return False

    async def _flush_every(self) -> None:
        while True:
            await self._flush()
            await anyio.sleep(TOTALS_FLUSH_S)

    async def _flush(self) -> None:
        try:
            await write_totals(
                self._pool,
                self.door,
                self._owner,
                self.totals,
                self.last_error,
                self.last_error_at,
            )
        except DATABASE_ERRORS as exc:  # status is a view; the next flush catches up
            log.debug("ses_totals_not_written", error=type(exc).__name__)
