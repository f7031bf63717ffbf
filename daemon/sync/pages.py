"""Pages from a Source into the ingest queue: the one path every door takes.

    read_ahead(source, cursor)   source.pages(cursor) in a task of its own, one page
                                 ahead: reading and parsing page n+1 overlaps the
                                 ingest of page n; the generator is closed when the
                                 caller stops early; a source's error comes after
                                 the pages it produced before it
    batch_of(source, page)       the IngestBatch of a page (the source's attachment
                                 fetcher only where it fetches lazily)
    unwrap_single(work)          a lone error out of the task groups, as itself

The mailbox runner (sync/runner.py) and `inboxd import` (commands/importer.py)
both read pages this way and hand them to the bounded queue (sync/queue.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing, asynccontextmanager
from typing import TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from inboxd.adapters.base import Page, Source
from inboxd.pipeline.ingest.stage import IngestBatch

T = TypeVar("T")

# Pages read ahead of the one being ingested: one overlaps reading and parsing
# with the database work; more would only hold more parsed mail in memory.
PAGE_PREFETCH = 1


@asynccontextmanager
async def read_ahead(
    source: Source, cursor: str | None
) -> AsyncIterator[MemoryObjectReceiveStream[Page]]:
    """The source's pages from `cursor`, one read ahead; exhausted at the last page.

    An error of the source ends the stream after the pages read before it, and is
    raised when the block ends: every page the source produced is handed over
    (and can be committed) before its error stops the run. Leaving the block early
    stops the reader.
    """
    send, receive = anyio.create_memory_object_stream[Page](max_buffer_size=PAGE_PREFETCH)
    failed: list[Exception] = []
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_read, source, cursor, send, failed)
            yield receive
            tg.cancel_scope.cancel()  # stopped early: the reader may be parsing ahead
    finally:
        receive.close()  # only once the reader is gone: it never meets a closed stream
    if failed:
        raise failed[0]


async def _read(
    source: Source,
    cursor: str | None,
    send: MemoryObjectSendStream[Page],
    failed: list[Exception],
) -> None:
    async with send, aclosing(source.pages(cursor)) as pages:
        try:
            async for page in pages:
                await send.send(page)
        except Exception as exc:  # handed over after the pages before it
            failed.append(exc)


def batch_of(source: Source, page: Page) -> IngestBatch:
    """The ingest batch of one page of `source`."""
    lazy = getattr(source, "lazy_attachments", False)
    return IngestBatch(
        source.tenant_id,
        source.mailbox_id,
        page.items,
        backfill=page.backfill,
        fetch_attachment=source.fetch_attachment if lazy else None,
    )


async def unwrap_single(work: Awaitable[T]) -> T:
    """Await `work`; a lone error from inside task groups (read_ahead's, the
    runner's) is raised as itself, so callers can catch it by type."""
    try:
        return await work
    except BaseExceptionGroup as group:
        inner: BaseException = group
        while isinstance(inner, BaseExceptionGroup) and len(inner.exceptions) == 1:
            inner = inner.exceptions[0]
        if inner is group:
            raise
        raise inner from None
