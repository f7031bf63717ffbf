"""Maildir door: ingest what lands in new/, then move it to cur/.

Maildir is what Postfix, Dovecot LDA, fetchmail and procmail write for local
delivery (https://cr.yp.to/proto/maildir.html): a writer creates the file in
tmp/ and renames it into new/, so a file in new/ is always complete.

One sync run:

    list new/ once (sorted by name: Maildir names start with the delivery time)
      └─ pages of `batch_size` files: read + parse (worker thread) → Page
           └─ supervisor ingests the page → settle(page, results):
                settled items (new, merged, duplicate, conflict, dead) are
                renamed new/NAME → cur/NAME:2, ; retriable ones stay in new/
                and are read again by the next run.

There is no cursor: the directory is the state. The external id of a message is
the sha256 of its bytes, so a crash between the ingest commit and the rename
re-ingests the file as a duplicate and then moves it: nothing is lost, nothing
is stored twice. Files that vanish between listing and reading (another
consumer) are skipped.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
import anyio.to_thread
import structlog

from inboxd.adapters.base import Page
from inboxd.adapters.maildir.config import MaildirConfig
from inboxd.adapters.maildir.errors import MaildirMissing, MaildirUnavailable
from inboxd.pipeline.message import AttachmentData, MessageData
from inboxd.pipeline.outcomes import ItemResult, Outcome
from inboxd.pipeline.parsing import parse_in_workers

log = structlog.get_logger(__name__)

# Files per page. A page is one ingest transaction; 500 corpus-like messages
# commit in well under a second (bench/README.md), so a SIGTERM waits at most that.
MAILDIR_PAGE_SIZE = 500
# Maildir "info" suffix for a message moved to cur/ with no flags set.
_INFO = ":2,"


@dataclass(slots=True)
class _PageFiles:
    names: list[str]


class MaildirSource:
    """The Source (adapters/base.py) for one Maildir."""

    provider = "maildir"

    def __init__(
        self, tenant_id: str, mailbox_id: str, config: MaildirConfig, *,
        page_size: int = MAILDIR_PAGE_SIZE,
    ) -> None:
        self.tenant_id = tenant_id
        self.mailbox_id = mailbox_id
        self.root = config.path
        self.page_size = page_size

    def ensure_layout(self) -> None:
        """Create cur/ new/ tmp/ when missing; raises MaildirMissing when impossible."""
        try:
            for sub in ("cur", "new", "tmp"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise MaildirMissing(f"cannot create Maildir at {self.root}: {exc.strerror}") from exc

    async def pages(self, cursor: str | None) -> AsyncIterator[Page]:
        names = await anyio.to_thread.run_sync(self._list_new)
        for start in range(0, len(names), self.page_size):
            chunk = names[start:start + self.page_size]
            raws, kept = await anyio.to_thread.run_sync(self._read, chunk)
            if raws:
                items = await parse_in_workers(raws, self.tenant_id, self.mailbox_id, "maildir")
                yield Page(items=items, context=_PageFiles(kept))

    async def settle(self, page: Page, results: list[ItemResult]) -> None:
        files = page.context
        assert isinstance(files, _PageFiles)
        done = [name for name, r in zip(files.names, results, strict=True)
                if r.outcome is not Outcome.RETRIABLE_FAILURE]
        await anyio.to_thread.run_sync(self._move_to_cur, done)

    async def fetch_attachment(self, item: MessageData, attachment: AttachmentData) -> bytes:
        raise NotImplementedError("raw-MIME door: attachments arrive with the message")

    def _list_new(self) -> list[str]:
        try:
            with os.scandir(self.root / "new") as entries:
                return sorted(e.name for e in entries
                              if not e.name.startswith(".") and e.is_file(follow_symlinks=False))
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
                # stays in new/ and is tried again on the next run
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
