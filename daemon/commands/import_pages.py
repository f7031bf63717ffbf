"""Settling one page of `inboxd import`: ingest through the queue, retry what is retriable.

    attempt 1..BATCH_ATTEMPTS:  the page's still-pending items → IngestQueue
        settled items (new, merged, duplicate, conflict, dead) are counted in the
        summary once; retriable ones stay pending for the next attempt
    still pending after the last attempt, or a stop signal during the backoff
        → Unsettled (the run ends "incomplete"; re-running the import is safe)

Backoff runs between attempts, never inside a transaction, and a stop signal
cuts it short.
"""

from __future__ import annotations

import anyio
import structlog
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
    wait_random,
)
from tenacity.stop import stop_base

from inboxd.adapters.base import Page
from inboxd.adapters.files import ImportSource, PageRefs
from inboxd.daemon.commands.import_report import ImportSummary
from inboxd.daemon.sync.pages import batch_of
from inboxd.daemon.sync.queue import IngestQueue
from inboxd.pipeline.outcomes import ItemResult, Outcome

log = structlog.get_logger(__name__)

# Attempts per page while items come back retriable_failure (connection lost,
# server restarting, object-store hiccup); waits grow 0.5 s → 1 → 2 → 4 s (+ up to
# 0.5 s jitter each), so a database restart of ~8 s is ridden out before giving up.
BATCH_ATTEMPTS = 5
RETRY_INITIAL_WAIT_S = 0.5
RETRY_MAX_WAIT_S = 8.0
RETRY_JITTER_S = 0.5
# One ingest call (transaction + object-store writes). A healthy page takes ~1 s;
# past this the server or the disk is stuck, and the page is retried.
BATCH_DEADLINE_S = 300.0


class Unsettled(Exception):
    """Some items of a page are still retriable_failure after its attempts."""

    def __init__(self, count: int, detail: str) -> None:
        super().__init__(detail)
        self.count = count
        self.detail = detail


class _StopRequested(stop_base):
    """tenacity stop condition: a signal asked the import to stop."""

    def __init__(self, event: anyio.Event) -> None:
        self.event = event

    def __call__(self, retry_state: RetryCallState) -> bool:  # noqa: ARG002 - tenacity's
        return self.event.is_set()


class PageSettler:
    """Settles pages of one import, counting their outcomes into `summary`."""

    def __init__(self, summary: ImportSummary, stop: anyio.Event) -> None:
        self.summary = summary
        self.stop = stop

    async def ingest(self, queue: IngestQueue, source: ImportSource, page: Page) -> None:
        """Ingest `page` until every item is settled; raises `Unsettled` when some
        are still retriable after BATCH_ATTEMPTS (counted in the summary)."""
        refs = page.context
        assert isinstance(refs, PageRefs)
        # already stored: never parsed (adapters/files/source.py), reported as duplicates
        self.summary.outcomes[Outcome.DUPLICATE.value] += refs.known
        if not page.items:
            return
        pending = list(range(len(page.items)))
        first_failure = True

        def log_retry(state: RetryCallState) -> None:
            nonlocal first_failure
            if first_failure:  # "unavailable" once, not every attempt (CONTRIBUTING.md)
                first_failure = False
                exc = state.outcome.exception() if state.outcome else None
                log.warning(
                    "import_batch_retrying",
                    tenant=self.summary.tenant,
                    mailbox=self.summary.mailbox,
                    items=len(pending),
                    error=str(exc),
                )

        retrying = AsyncRetrying(
            stop=stop_after_attempt(BATCH_ATTEMPTS) | _StopRequested(self.stop),
            wait=wait_exponential(multiplier=RETRY_INITIAL_WAIT_S, max=RETRY_MAX_WAIT_S)
            + wait_random(0, RETRY_JITTER_S),
            retry=retry_if_exception_type(Unsettled),
            sleep=self._sleep,
            before_sleep=log_retry,
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    # `pending` shrinks before a retry: a settled item is never sent
                    # (nor counted) twice
                    pending, detail = await self._attempt(queue, source, page, pending)
                    if pending:
                        raise Unsettled(len(pending), detail)
        except Unsettled as exc:
            self.summary.outcomes[Outcome.RETRIABLE_FAILURE.value] += exc.count
            self.summary.not_imported += exc.count
            self.summary.error = exc.detail
            raise
        if not first_failure:
            log.warning(
                "import_batch_recovered", tenant=self.summary.tenant, mailbox=self.summary.mailbox
            )

    async def _attempt(
        self, queue: IngestQueue, source: ImportSource, page: Page, pending: list[int]
    ) -> tuple[list[int], str]:
        """Ingest the pending items once, counting the settled ones; returns those
        still retriable and why the first of them failed."""
        part = Page(items=[page.items[i] for i in pending], backfill=page.backfill)
        try:
            with anyio.fail_after(BATCH_DEADLINE_S):
                results = await queue.ingest(batch_of(source, part))
        except TimeoutError:
            detail = f"a batch did not finish within {BATCH_DEADLINE_S:g} s"
            results = [
                ItemResult(i, Outcome.RETRIABLE_FAILURE, detail=detail)
                for i in range(len(part.items))
            ]
        refs = page.context
        assert isinstance(refs, PageRefs)
        still: list[int] = []
        detail = ""
        for result in results:
            index = pending[result.index]
            if result.outcome is Outcome.RETRIABLE_FAILURE:
                still.append(index)
                detail = detail or (result.detail or "retriable failure")
                continue
            self.summary.outcomes[result.outcome.value] += 1
            if result.outcome is Outcome.PERMANENT_FAILURE:
                self.summary.dead.append((refs.refs[index], result.detail or "dead item"))
        return still, detail

    async def _sleep(self, seconds: float) -> None:
        """Backoff that a stop request cuts short (no transaction is open here)."""
        with anyio.move_on_after(seconds):
            await self.stop.wait()
