"""Maildir door: ingest what lands in new/, then move it to cur/.

Maildir is what Postfix, Dovecot LDA, fetchmail and procmail write for local
delivery (https://cr.yp.to/proto/maildir.html): a writer creates the file in
tmp/ and renames it into new/, so a file in new/ is always complete.

One sync run:

    repeat (one pass):
      list new/: the `list_size` smallest names not yet listed in this run
      (sorted by name: Maildir names start with the delivery time); none → done
        └─ pages of `batch_size` files: read + parse (worker process) → Page
             └─ supervisor ingests the page → settle(page, results):
                  settled items (new, merged, duplicate, conflict, dead) are
                  renamed new/NAME → cur/NAME:2, ; retriable ones stay in new/
                  and are read again by the next run.

A pass holds at most `list_size` names, so the memory of a run does not depend
on the backlog; a backlog present when the run starts comes out in the order of
one full sort, and files delivered during the run are picked up by a later pass
(or the next run). Each pass scans all of new/ again: the names listed in this
run that are still there (unreadable files, pages not settled yet, retriable
ones) are kept in a set and left out, so a pass that finds only those ends the
run instead of looping; the set forgets names that left new/, so it stays as
small as what is stuck there.

There is no cursor: the directory is the state. The external id of a message is
the sha256 of its bytes, so a crash between the ingest commit and the rename
re-ingests the file as a duplicate and then moves it: nothing is lost, nothing
is stored twice. Files that vanish between listing and reading (another
consumer) are skipped.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import AsyncGenerator, Iterable, Iterator
from dataclasses import dataclass

import anyio
import anyio.to_thread
import structlog

from inboxd.adapters.base import Page
from inboxd.adapters.maildir.config import MaildirConfig
from inboxd.adapters.maildir.errors import MaildirMissing, MaildirUnavailable
from inboxd.pipeline.message import AttachmentData, MessageData
from inboxd.pipeline.mime.workers import parse_in_workers
from inboxd.pipeline.outcomes import ItemResult, Outcome

log = structlog.get_logger(__name__)

# Files per page. A page is one ingest transaction; 500 corpus-like messages
# commit in well under a second (bench/README.md), so a SIGTERM waits at most that.
MAILDIR_PAGE_SIZE = 500
# Pages of names listed per pass over new/. A listed name costs ~100 bytes
# (tracemalloc: 10.4 MiB per 100,000 names, bench/README.md), so a pass of 10
# pages of 500 peaks at 0.7 MiB whatever the backlog, where listing all of new/
# held 10 MiB per 100k. But each pass scans all of new/ again (os.scandir, no
# stat: 0.07 s per 100,000 entries on the bench machine), so a backlog of N costs
# N / (10 pages) scans: 20 for 100k at 500 per page, ~0.7 s in all against ~80 s
# of ingest. Fewer pages per pass would rescan more for little memory saved.
MAILDIR_LIST_PAGES = 10
# Maildir "info" suffix for a message moved to cur/ with no flags set.
_INFO = ":2,"


@dataclass(slots=True)
class _PageFiles:
    names: list[str]


class MaildirSource:
    """The Source (adapters/base.py) for one Maildir."""

    provider = "maildir"

    def __init__(
        self,
        tenant_id: str,
        mailbox_id: str,
        config: MaildirConfig,
        *,
        page_size: int = MAILDIR_PAGE_SIZE,
        list_pages: int = MAILDIR_LIST_PAGES,
    ) -> None:
        self.tenant_id = tenant_id
        self.mailbox_id = mailbox_id
        self.root = config.path
        self.page_size = page_size
        self.list_size = page_size * list_pages  # names per pass over new/

    def ensure_layout(self) -> None:
        """Create cur/ new/ tmp/ when missing; raises MaildirMissing when impossible."""
        try:
            for sub in ("cur", "new", "tmp"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise MaildirMissing(f"cannot create Maildir at {self.root}: {exc.strerror}") from exc

    # The Source contract's cursor goes unused: a Maildir lists new/ whatever it says.
    async def pages(self, cursor: str | None) -> AsyncGenerator[Page, None]:  # noqa: ARG002
        listed: set[str] = set()  # listed in this run and, at the last pass, still in new/
        while True:
            names, listed = await anyio.to_thread.run_sync(self._list_new, listed)
            if not names:
                return  # nothing in new/ this run has not tried already
            listed.update(names)
            for start in range(0, len(names), self.page_size):
                chunk = names[start : start + self.page_size]
                raws, kept = await anyio.to_thread.run_sync(self._read, chunk)
                if raws:
                    items = await parse_in_workers(raws, self.tenant_id, self.mailbox_id, "maildir")
                    yield Page(items=items, context=_PageFiles(kept))

    async def settle(self, page: Page, results: list[ItemResult]) -> None:
        files = page.context
        assert isinstance(files, _PageFiles)
        done = [
            name
            for name, r in zip(files.names, results, strict=True)
            if r.outcome is not Outcome.RETRIABLE_FAILURE
        ]
        await anyio.to_thread.run_sync(self._move_to_cur, done)

    async def fetch_attachment(self, item: MessageData, attachment: AttachmentData) -> bytes:
        raise NotImplementedError("raw-MIME door: attachments arrive with the message")

    def _list_new(self, listed: set[str]) -> tuple[list[str], set[str]]:
        """One pass: the `list_size` smallest names in new/ not in `listed`, sorted,
        and the names of `listed` still in new/ (the others were settled or taken)."""
        still: set[str] = set()

        def fresh(entries: Iterable[os.DirEntry[str]]) -> Iterator[str]:
            for e in entries:
                if e.name.startswith(".") or not e.is_file(follow_symlinks=False):
                    continue
                if e.name in listed:
                    still.add(e.name)
                else:
                    yield e.name

        try:
            with os.scandir(self.root / "new") as entries:
                # a heap of list_size names, not a list of all: same order as sorted()
                return heapq.nsmallest(self.list_size, fresh(entries)), still
        except FileNotFoundError as exc:
            raise MaildirMissing(f"{self.root} has no new/ directory") from exc
        except OSError as exc:
            raise MaildirUnavailable(f"listing {self.root / 'new'}: {exc.strerror}") from exc

    def _read(self, names: list[str]) -> tuple[list[bytes], list[str]]:
        raws: list[bytes] = []
        kept: list[str] = []
        for name in names:
            try:
                raw = (self.root / "new" / name).read_bytes()
            except FileNotFoundError:
                continue  # taken by another consumer between listing and reading
            except OSError as exc:
                # one unreadable file must not block the files sorted after it; it
                # stays in new/ and is tried again on the next run (not by a later
                # pass of this one: pages() remembers it)
                log.warning("maildir_file_unreadable", file=name, error=exc.strerror)
                continue
            raws.append(raw)
            kept.append(name)
        return raws, kept

    def _move_to_cur(self, names: list[str]) -> None:
        for name in names:
            target = name if _INFO in name else name + _INFO
            try:
                os.rename(self.root / "new" / name, self.root / "cur" / target)
            except FileNotFoundError:
                continue  # already moved (a previous run crashed after its rename)
            except OSError as exc:
                log.warning("maildir_move_failed", file=name, error=exc.strerror)
