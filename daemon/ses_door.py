"""The SES door in the daemon: the door (adapters/ses/door.py, a QueueDoor) run with
this daemon's QueueSink — the ingest queue, the database, metrics and status.

    workers scope ─┬─ ingest workers
                   └─ doors ─┬─ QueueDoorHost.run ─┬─ SesDoor.run (receive loops, heartbeat)
                             │                     └─ totals flush (every TOTALS_FLUSH_S)
                             └─ fleet (sync runners)

The door stops receiving when the daemon's stop event is set and returns once the
messages in flight are stored and deleted (or released, if the drain deadline
cancels them); the ingest queue closes after it, so nothing it hands over is
dropped. SIGHUP gives the door its mailboxes again (`reload`). The SNS envelope
check joins the door to the SNS webhooks' verification (adapters/esp/sns.py):
two adapters, so the daemon hands one to the other (`SnsVerifier`).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

import anyio
import asyncpg
import structlog
from anyio.abc import TaskStatus

from inboxd.adapters.base import QueueDoor, QueueMailbox, Unrouted
from inboxd.adapters.esp.base import VerificationFailed, VerificationUnavailable
from inboxd.adapters.esp.sns import verify_sns_message
from inboxd.adapters.esp.sns_certificates import CertificateCache
from inboxd.adapters.ses.config import SesSettings
from inboxd.adapters.ses.door import SesDoor
from inboxd.adapters.ses.envelope import EnvelopeRejected, EnvelopeUnverifiable
from inboxd.adapters.ses.tables import record_unrouted, write_totals
from inboxd.daemon.config.tenant import TenantConfig
from inboxd.daemon.metrics.registry import Metrics
from inboxd.daemon.sync.queue import IngestQueue
from inboxd.pipeline.copies import known_copies
from inboxd.pipeline.errors import DATABASE_ERRORS
from inboxd.pipeline.ingest.stage import IngestBatch
from inboxd.pipeline.mailbox import scheduling
from inboxd.pipeline.outcomes import ItemResult, page_is_clean

__all__ = ["DoorSink", "QueueDoorHost", "SnsVerifier", "queue_mailboxes", "ses_door"]

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


def ses_door(
    settings: SesSettings,
    tenants: dict[str, TenantConfig],
    *,
    pool: asyncpg.Pool,
    queue: IngestQueue,
    metrics: Metrics,
    owner: str,
) -> QueueDoorHost:
    """The `[ses]` door of the main file, ready for the supervisor to run."""
    door = SesDoor(
        settings,
        queue_mailboxes(tenants, SesDoor.provider),
        verify_envelope=SnsVerifier() if settings.verify_sns_signature else None,
    )
    return QueueDoorHost(door, pool=pool, queue=queue, metrics=metrics, owner=owner)


def queue_mailboxes(tenants: dict[str, TenantConfig], provider: str) -> list[QueueMailbox]:
    """Every configured mailbox of `provider`, as a queue door routes to them."""
    return [
        QueueMailbox(m.tenant_id, m.mailbox_id, m.settings)
        for t in tenants.values()
        for m in t.mailboxes
        if m.provider == provider and m.settings
    ]


class SnsVerifier:
    """The SES door's VerifyEnvelope: the SNS webhooks' verification, its errors in
    the door's words. One certificate cache for every check (one fetch per signing
    certificate); tests pass one that serves a test certificate."""

    def __init__(self, certificates: CertificateCache | None = None) -> None:
        self._certificates = certificates or CertificateCache()

    async def __call__(self, body: bytes, topic_arns: frozenset[str]) -> None:
        try:
            await verify_sns_message(body, topic_arns=topic_arns, certificates=self._certificates)
        except VerificationFailed as exc:  # names the check that failed, never a secret
            raise EnvelopeRejected(str(exc)) from exc
        except VerificationUnavailable as exc:
            raise EnvelopeUnverifiable(str(exc)) from exc


class QueueDoorHost:
    """Runs one queue door with its sink, and flushes the sink's totals for
    `inboxd status` while it runs and once after."""

    def __init__(
        self,
        door: QueueDoor,
        *,
        pool: asyncpg.Pool,
        queue: IngestQueue,
        metrics: Metrics,
        owner: str,
    ) -> None:
        self.door = door
        self.sink = DoorSink(door.name, pool=pool, queue=queue, metrics=metrics, owner=owner)

    def reload(self, tenants: dict[str, TenantConfig]) -> None:
        self.door.reload(queue_mailboxes(tenants, self.door.provider))

    async def run(
        self, stop: anyio.Event, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.sink.flush_every)
                await self.door.run(self.sink, stop, task_status=task_status)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(FINAL_FLUSH_TIMEOUT_S):
                await self.sink.flush()
            # bench/ses.py reads the totals from this line
            log.info("ses_poller_stopped", door=self.door.name, **self.sink.totals)


class DoorSink:
    """This daemon's QueueSink for one door (adapters/base.py): the ingest queue, the
    door's tables (adapters/ses/tables.py), metrics, and the counters `inboxd status`
    shows."""

    def __init__(
        self,
        door: str,
        *,
        pool: asyncpg.Pool,
        queue: IngestQueue,
        metrics: Metrics,
        owner: str,
    ) -> None:
        self.door = door
        self._pool = pool
        self._queue = queue
        self._metrics = metrics
        self._owner = owner
        self.totals: dict[str, int] = {}
        self._succeeded: dict[tuple[str, str], float] = {}  # mailbox → last success write
        self.last_error: str | None = None
        self.last_error_at: datetime | None = None

    async def ingest(self, batch: IngestBatch) -> list[ItemResult]:
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

    async def wait_for_room(self) -> None:
        await self._queue.wait_for_room()

    async def record_unrouted(self, item: Unrouted) -> None:
        await record_unrouted(
            self._pool,
            self.door,
            item.external_id,
            item.reason,
            item.detail,
            item.body,
            item.recipients,
        )

    async def stored_in(self, mailboxes: Sequence[tuple[str, str]], external_id: str) -> bool:
        async with self._pool.acquire() as conn:
            for tenant, mailbox in mailboxes:
                if await known_copies(conn, tenant, mailbox, [external_id]):
                    return True
        return False

    async def database_ready(self) -> bool:
        try:
            with anyio.fail_after(READY_PROBE_TIMEOUT_S):
                async with self._pool.acquire() as conn:
                    await conn.fetchval("SELECT 1")
        except DATABASE_ERRORS:  # TimeoutError (the probe's deadline) is one of them
            return False
        return True

    def counted(self, what: str, n: int = 1) -> None:
        if n:
            self.totals[what] = self.totals.get(what, 0) + n
            self._metrics.queue_door_counted(self.door, what, n)

    def failed(self, error: str) -> None:
        self.last_error = error
        self.last_error_at = datetime.now(UTC)
        self._metrics.queue_door_failed(self.door)

    async def flush_every(self) -> None:
        while True:
            await self.flush()
            await anyio.sleep(TOTALS_FLUSH_S)

    async def flush(self) -> None:
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
