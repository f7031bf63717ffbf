"""The feeder: extraction_inbox rows → each matching processor's jobs.

Ingest notes every new, conflict or merged row of a tenant with processors in
`extraction_inbox`, in its own transaction (pipeline/extraction/inbox.py), and
rings the feeder. The feeder, in one transaction per round of at most
FEED_BATCH rows: takes the rows (deleting them), reads their filter fields,
and queues a job for every processor whose mailboxes and filter take the
message (`enqueue`: same key and fingerprint → linked, other fingerprint →
payload conflict). Commit makes the rows gone and the jobs queued together;
a crash before it gives the rows back. Only rows of tenants that have
processors here are taken: another tenant's rows wait for a daemon (or a
reload) that has them — `inboxd import` may have noted them from a tenant file
that was edited before this daemon was told.

It then rings the tenant's processor runners. Unrung, it looks every
FEED_POLL_S: rows noted by another process (`inboxd import`, a second daemon).
A database error is logged and the round tried again after FEED_RETRY_S: the
rows stay in the table meanwhile, so nothing is lost and ingest never waits.
As jobs pile up it ANALYZEs the extraction tables (pipeline/statistics.py: the
claim and enqueue plans made on an empty table scan it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import anyio
import anyio.abc
import asyncpg
import structlog

from inboxd.adapters.extraction import ProcessorConfig, matches_fields
from inboxd.pipeline.errors import DATABASE_ERRORS
from inboxd.pipeline.extraction.enqueue import enqueue
from inboxd.pipeline.extraction.inbox import load_filter_fields, take
from inboxd.pipeline.statistics import EXTRACTION_TABLES, IngestStatistics

log = structlog.get_logger(__name__)

#: Inbox rows per feeder transaction at most: a round's statements cost mostly their
#: fixed part, so a backlog drains in rounds of 2,000 (~0.1 s each; the same figure
#: as `inboxd extract backfill`'s batches, bench/extraction.py (c)); new mail is fed
#: as it comes, a round taking whatever is there.
FEED_BATCH = 2000
#: How often an unrung feeder looks at the inbox (rows another process noted).
FEED_POLL_S = 2.0
#: Wait after a database error before the next round.
FEED_RETRY_S = 2.0


class Feeder:
    """Moves inbox rows to jobs; `ring()` after a commit that noted rows."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        processors_of: Callable[[str], Sequence[ProcessorConfig]],
        on_queued: Callable[[str], None],
        *,
        tenants: Callable[[], Sequence[str]],
    ) -> None:
        self._pool = pool
        self._processors_of = processors_of
        self._tenants = tenants
        self._on_queued = on_queued
        self._bell = anyio.Event()
        self._statistics = IngestStatistics(
            pool, tables=EXTRACTION_TABLES, counted="extraction_jobs"
        )

    def ring(self) -> None:
        self._bell.set()

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        failing = False
        while True:
            bell = self._bell = anyio.Event()  # a ring from here on means another round
            try:
                fed = await self.feed_once()
            except DATABASE_ERRORS as exc:
                if not failing:
                    log.warning("extraction_feed_unavailable", error=type(exc).__name__)
                failing = True
                await anyio.sleep(FEED_RETRY_S)
                continue
            if failing:
                log.info("extraction_feed_recovered")
                failing = False
            if fed >= FEED_BATCH:
                continue  # more rows are waiting
            with anyio.move_on_after(FEED_POLL_S):
                await bell.wait()

    async def feed_once(self) -> int:
        """One round; how many inbox rows it took."""
        queued: set[str] = set()
        queued_jobs = taken_rows = 0
        tenants = self._tenants()
        if not tenants:
            return 0
        async with self._pool.acquire() as conn, conn.transaction():
            taken = await take(conn, FEED_BATCH, tenant_ids=tenants)
            for tenant, message_ids in taken.items():
                taken_rows += len(message_ids)
                processors = self._processors_of(tenant)
                fields = await load_filter_fields(conn, tenant, message_ids)
                for processor in processors:
                    chosen = [f.message_id for f in fields if matches_fields(processor, f)]
                    if not chosen:
                        continue
                    result = await enqueue(
                        conn, tenant, processor.id, str(processor.schema_version), chosen
                    )
                    if result.queued:
                        queued.add(tenant)
                        queued_jobs += len(result.queued)
                    if result.conflicts:
                        log.warning(
                            "extraction_payload_conflict",
                            tenant=tenant,
                            processor=processor.id,
                            messages=result.conflicts,
                        )
        await self._statistics.note_stored(queued_jobs)
        for tenant in sorted(queued):
            self._on_queued(tenant)
        return taken_rows
