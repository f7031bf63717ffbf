"""The import door as a Source: an `ImportPlan`'s messages in parsed pages.

    pages()   read up to IMPORT_PAGE_SIZE raw messages (or IMPORT_PAGE_MAX_BYTES)
              and hash each as it is read, in a worker thread → ask `known` once
              which of those sha256s the mailbox stores → parse the others off the
              loop (pipeline.mime.workers.parse_in_workers, its limiter) → Page; the
              next page is read and hashed while one is looked up and parsed
    settle()  nothing: an import moves no file and keeps no cursor

Messages are content-addressed (external id = raw sha256), so an import that is
run again, complete or not, only adds what is missing, and what is already stored
is never parsed again: it is counted in `PageRefs.known` (reported as duplicate)
and left out of the page's items. Parsing costs ≈ 0.5 ms a message, hashing and
the one query per page a few µs (issue 15: a re-import at ≥ 20,000 files/s). A file
deleted since planning is skipped and listed in `vanished`. A file that cannot be
read otherwise ends the pages early: the messages read before it, those of its own
page included, still make a last page (ingested and reported), and the error is
kept in `read_error`, never raised into the ingest path.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import anyio.to_thread
import structlog

from inboxd.adapters.base import Page
from inboxd.adapters.files.errors import SourceError
from inboxd.adapters.files.reader import ImportPlan, RawMessage, iter_messages
from inboxd.pipeline.errors import DATABASE_ERRORS
from inboxd.pipeline.message import AttachmentData, MessageData
from inboxd.pipeline.mime.workers import parse_in_workers
from inboxd.pipeline.outcomes import ItemResult

log = structlog.get_logger(__name__)

_LOOKUP_FAILURES: tuple[type[BaseException], ...] = (TimeoutError, *DATABASE_ERRORS)

# Messages per page, i.e. per ingest transaction. The cascade costs ≤ 2 queries
# per batch and every write is one set-based statement, so bigger batches
# amortise round trips; 500 messages of the corpus' mix (~18 MB) commit in 1-2 s on
# a 2-core VM, which is also about the longest a Ctrl-C waits and what a failed
# batch retries. (100, 250, 500 and 1000 measured within noise on 3,940 messages.)
IMPORT_PAGE_SIZE = 500
# A page also closes at this many raw bytes, so an mbox of large attachments keeps
# memory bounded (four pages in flight: one read ahead here, one being looked up and
# parsed, one in the queue, one being ingested, plus parsed attachment copies).
IMPORT_PAGE_MAX_BYTES = 64 * 1024 * 1024
IMPORT_PROVIDER = "import"
# Deadline of the one "which of these are stored" query per page (CONTRIBUTING.md
# rule 7): a page of 500 ids answers in milliseconds; past this the database is in
# trouble and the page is parsed whole instead (ImportSource._stored).
KNOWN_TIMEOUT_S = 30.0


@dataclass(slots=True)
class PageRefs:
    """What the import report needs of a page: where each item came from, and how
    many of the page's messages were already stored (not parsed, not in the items)."""

    refs: list[str]
    span_bytes: int
    known: int = 0


KnownCopies = Callable[[Sequence[str]], Awaitable[set[str]]]


class _Chunk(NamedTuple):
    """One page's raw messages as read, their sha256s when the source looks them up,
    and the error that cut it short."""

    raws: list[RawMessage]
    shas: list[str] | None
    error: SourceError | None = None


class ImportSource:
    """One mailbox's import from local files (the `Source` contract, adapters/base.py)."""

    provider = IMPORT_PROVIDER

    def __init__(
        self,
        tenant_id: str,
        mailbox_id: str,
        plan: ImportPlan,
        *,
        parse_in_thread: bool,
        backfill: bool = False,
        known: KnownCopies | None = None,
    ) -> None:
        self.tenant_id = tenant_id
        self.known = known
        self.mailbox_id = mailbox_id
        self.plan = plan
        self.parse_in_thread = parse_in_thread
        self.backfill = backfill  # one sync_completed event per page, not one per message
        self.read_error: SourceError | None = None
        self.vanished: list[str] = []  # planned files deleted before they were read

    async def pages(
        self,
        cursor: str | None,  # noqa: ARG002 - the Source contract's; imports keep no cursor
    ) -> AsyncGenerator[Page, None]:
        """Every message of the plan, in order; `cursor` is ignored (imports keep none).

        The next page is read and hashed (one worker thread, one pass over the page,
        one hand-off) while this one is looked up and parsed on the loop. Hashing in a second thread
        instead cost more in hand-offs and GIL turns than it overlapped (pages of
        bench/reimport.py's 20,000 files: 0.44 s that way, 0.36 s this way, medians
        of 5 runs); so did reading a page's files in two threads. The task group
        closes before the yield, so nothing runs while the consumer holds the page
        or closes the generator.
        """
        messages = iter_messages(self.plan, self.vanished)
        upcoming = await self._read(messages)
        while upcoming.raws:
            following = _Chunk([], None)

            async def read_following() -> None:
                nonlocal following
                following = await self._read(messages)

            async with anyio.create_task_group() as tg:
                tg.start_soon(read_following)
                page = await self._page_of(upcoming)
            yield page
            upcoming = following

    async def _read(self, messages: Iterator[RawMessage]) -> _Chunk:
        """The next page's raw messages (hashed when `known` is set); none at the end.
        A file that cannot be read cuts this page short and ends the pages (kept in
        `read_error`); what was read before it is still ingested."""
        if self.read_error is not None:
            return _Chunk([], None)
        known_gone = len(self.vanished)
        chunk = await anyio.to_thread.run_sync(_take, messages, self.known is not None)
        for path in self.vanished[known_gone:]:
            log.warning("import_file_vanished", path=path)
        self.read_error = chunk.error
        return chunk

    async def _stored(self, shas: list[str]) -> set[str]:
        """`known(shas)`, or nothing when the database does not answer in time: the
        page is then parsed whole and the ingest path meets the outage with its own
        retries and report (the lookup only saves work, it never decides an outcome)."""
        assert self.known is not None
        try:
            with anyio.fail_after(KNOWN_TIMEOUT_S):
                return await self.known(shas)
        except _LOOKUP_FAILURES as exc:
            log.warning("import_known_lookup_failed", error=type(exc).__name__)
            return set()

    async def _page_of(self, chunk: _Chunk) -> Page:
        raws, shas = chunk.raws, chunk.shas
        span_bytes = sum(m.span_bytes for m in raws)
        if shas is not None:
            stored = await self._stored(shas)
            todo = [m for m, sha in zip(raws, shas, strict=True) if sha not in stored]
        else:
            todo = raws
        items = await parse_in_workers(
            [m.raw for m in todo],
            self.tenant_id,
            self.mailbox_id,
            IMPORT_PROVIDER,
            in_thread=self.parse_in_thread,
        )
        refs = PageRefs([m.source_ref for m in todo], span_bytes, len(raws) - len(todo))
        return Page(items=items, backfill=self.backfill, context=refs)

    async def settle(self, page: Page, results: list[ItemResult]) -> None:
        """Nothing to do: the files stay where they are."""

    async def fetch_attachment(self, item: MessageData, attachment: AttachmentData) -> bytes:
        raise NotImplementedError("raw-MIME doors carry their attachments' bytes")


def _take(messages: Iterator[RawMessage], hashed: bool) -> _Chunk:
    """The next page of raw messages and, when `hashed`, each one's sha256: the
    import door's external id as parse_raw computes it (blocking file I/O and
    hashing, which releases the GIL for inputs over 2 KB: run in a worker thread).
    A read error ends the page early and comes back with what was read before it."""
    batch: list[RawMessage] = []
    shas: list[str] = []
    size = 0
    error: SourceError | None = None
    try:
        for message in messages:
            batch.append(message)
            if hashed:
                shas.append(hashlib.sha256(message.raw).hexdigest())
            size += len(message.raw)
            if len(batch) >= IMPORT_PAGE_SIZE or size >= IMPORT_PAGE_MAX_BYTES:
                break
    except SourceError as exc:
        error = exc
    return _Chunk(batch, shas if hashed else None, error)
