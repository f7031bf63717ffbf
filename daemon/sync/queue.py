"""The bounded queue between sources and the ingest workers (docs/architecture.md §2).

Sources put pages; `ingest_workers` tasks take them and run the ingest stage;
each page's producer awaits its own results before it settles the page and
moves its cursor. The queue holds at most `capacity_pages` pages, so a producer
whose page does not fit waits (backpressure): memory stays flat however large
a backfill is.

Cancellation: a producer cancelled while its page waits in the queue simply
stops waiting; the worker still ingests the page later (or not, at shutdown),
and because the producer never settled it, the next run produces it again and
the cascade answers `duplicate`. Nothing is lost and nothing is doubled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio
import structlog
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from inboxd.daemon.metrics.registry import Metrics
from inboxd.pipeline.ingest.stage import IngestBatch, IngestStage
from inboxd.pipeline.outcomes import ItemResult, Outcome

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class _Job:
    batch: IngestBatch
    done: anyio.Event = field(default_factory=anyio.Event)
    results: list[ItemResult] | None = None
    taken: bool = False  # a worker owns it (and its share of the depth gauge)


class IngestQueue:
    """Bounded page queue + the worker tasks that drain it."""

    def __init__(self, stage: IngestStage, metrics: Metrics, *, capacity_pages: int) -> None:
        self._stage = stage
        self._metrics = metrics
        send, receive = anyio.create_memory_object_stream[_Job](max_buffer_size=capacity_pages)
        self._send: MemoryObjectSendStream[_Job] = send
        self._receive: MemoryObjectReceiveStream[_Job] = receive
        self._queued_items = 0
        self._capacity_pages = capacity_pages
        self._taken = anyio.Event()  # set (and replaced) whenever a worker takes a page

    async def ingest(self, batch: IngestBatch) -> list[ItemResult]:
        """Queue a batch (waiting while the queue is full) and wait for its results."""
        job = _Job(batch)
        self._queued_items += len(batch.items)
        self._metrics.set_queue(self._queued_items)
        try:
            await self._send.send(job)
            await job.done.wait()
        except BaseException:
            if not job.taken:
                job.taken = True  # a worker that receives it later skips it
                self._queued_items -= len(batch.items)
                self._metrics.set_queue(self._queued_items)
            raise
        assert job.results is not None
        return job.results

    async def wait_for_room(self) -> None:
        """Return once a page would be queued without waiting: a queue door (the SES
        poller) receives nothing it could not hand over at once."""
        while self._send.statistics().current_buffer_used >= self._capacity_pages:
            await self._taken.wait()

    def close(self) -> None:
        """No more pages: workers finish what is queued, then return."""
        self._send.close()
        self._receive.close()  # the workers read through clones of their own

    async def run_worker(
        self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """One ingest worker; returns when the queue is closed and drained."""
        task_status.started()
        async with self._receive.clone() as jobs:
            async for job in jobs:
                self._taken.set()  # a page left the buffer: room for another
                self._taken = anyio.Event()
                if job.taken:  # its producer gave up before we got to it
                    continue
                job.taken = True
                try:
                    job.results = await self._stage.ingest(job.batch)
                except Exception:  # a bug must not take every mailbox down with it
                    log.exception(
                        "ingest_worker_batch_crashed",
                        tenant=job.batch.tenant_id,
                        mailbox=job.batch.mailbox_id,
                        size=len(job.batch.items),
                    )
                finally:
                    if job.results is None:  # cancelled mid-batch: the transaction rolled back
                        job.results = [
                            ItemResult(i, Outcome.RETRIABLE_FAILURE, detail="shutdown")
                            for i in range(len(job.batch.items))
                        ]
                    self._queued_items -= len(job.batch.items)
                    self._metrics.set_queue(self._queued_items)
                    self._metrics.observe_outcomes(job.results)
                    job.done.set()
