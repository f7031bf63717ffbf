"""adapters.maildir: MaildirSource lists new/ in bounded passes, in name order, and ends.

The source is driven the way the daemon's MailboxRunner drives it (pages in
order, settle after each page's results, optionally a few pages behind, as the
runner's read-ahead does), with parsing in-process instead of in a worker
process. No database: every item is answered `new` unless a test says otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import aclosing
from email.message import EmailMessage
from pathlib import Path

import anyio
import pytest

from inboxd.adapters.maildir import MaildirSource
from inboxd.adapters.maildir import source as maildir_source
from inboxd.adapters.maildir.config import MaildirConfig
from inboxd.pipeline.mime.workers import parse_many
from inboxd.pipeline.outcomes import ItemResult, Outcome

# Files per page and pages per pass in these tests: a pass lists at most 4 names.
PAGE_SIZE = 2
LIST_PAGES = 2


@pytest.fixture(autouse=True)
def _parse_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    async def parse(raws, tenant_id, mailbox_id, source):
        return parse_many(raws, tenant_id, mailbox_id, source, keep_raw=True)

    monkeypatch.setattr(maildir_source, "parse_in_workers", parse)


def _maildir(root: Path) -> Path:
    for sub in ("cur", "new", "tmp"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    return root


def _deliver(root: Path, name: str) -> str:
    """Deliver like an MTA (tmp/, then rename into new/) one distinct message."""
    msg = EmailMessage()
    msg["From"] = "Sender <sender@example.org>"
    msg["To"] = "inbox@acme.example"
    msg["Subject"] = f"Message {name}"
    msg["Message-ID"] = f"<{name}@example.org>"
    msg.set_content(f"Body of {name}.\n")
    (root / "tmp" / name).write_bytes(msg.as_bytes())
    os.rename(root / "tmp" / name, root / "new" / name)
    return name


def _name(i: int) -> str:
    return f"{1700000000 + i}.M{i}P1.host"


class _Passes:
    """Wraps MaildirSource._list_new: the names each pass listed."""

    def __init__(self, source: MaildirSource) -> None:
        self.listed: list[list[str]] = []
        inner = source._list_new

        def list_new(listed: set[str]) -> tuple[list[str], set[str]]:
            names, still = inner(listed)
            self.listed.append(names)
            return names, still

        source._list_new = list_new  # type: ignore[method-assign]


def _source(root: Path) -> tuple[MaildirSource, _Passes]:
    source = MaildirSource(
        "acme", "inbox", MaildirConfig(root), page_size=PAGE_SIZE, list_pages=LIST_PAGES
    )
    return source, _Passes(source)


async def _run(
    source: MaildirSource,
    *,
    behind: int = 0,
    outcome: Callable[[str], Outcome] = lambda name: Outcome.NEW,
    after_page: Callable[[int], None] = lambda n: None,
) -> list[str]:
    """One sync run; each page is settled `behind` pages late. The names yielded, in order."""
    yielded: list[str] = []
    unsettled = []
    count = 0

    async def settle(page) -> None:
        names = page.context.names
        await source.settle(page, [ItemResult(i, outcome(n)) for i, n in enumerate(names)])

    with anyio.fail_after(30):  # a run that loops forever fails here
        async with aclosing(source.pages(None)) as pages:
            async for page in pages:
                assert len(page.items) == len(page.context.names) <= PAGE_SIZE
                yielded += page.context.names
                unsettled.append(page)
                count += 1
                after_page(count)
                while len(unsettled) > behind:
                    await settle(unsettled.pop(0))
        for page in unsettled:
            await settle(page)
    return yielded


def _in(root: Path, sub: str) -> list[str]:
    return sorted(p.name for p in (root / sub).iterdir())


@pytest.mark.parametrize("behind", [0, 3])
async def test_backlog_larger_than_a_pass_is_ingested_whole_in_order(
    tmp_path: Path, behind: int
) -> None:
    root = _maildir(tmp_path / "Maildir")
    names = [_deliver(root, _name(i)) for i in (7, 3, 10, 0, 5, 1, 9, 2, 8, 4, 6)]
    source, passes = _source(root)

    yielded = await _run(source, behind=behind)

    assert yielded == sorted(names)  # the order of one full sort, each name once
    assert [len(p) for p in passes.listed] == [4, 4, 3, 0]  # never more than a pass
    assert _in(root, "new") == []
    assert _in(root, "cur") == sorted(n + ":2," for n in names)


async def test_files_that_stay_in_new_do_not_make_the_run_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _maildir(tmp_path / "Maildir")
    # more unreadable files than a pass holds, sorted before everything else
    unreadable = [_deliver(root, _name(i)) for i in range(5)]
    readable = [_deliver(root, _name(i)) for i in range(5, 12)]
    retriable = readable[3]
    (root / "new" / _name(99)).mkdir()  # a directory is never listed
    for name in unreadable:
        (root / "new" / name).chmod(0)
    if os.geteuid() == 0:  # root reads files whatever their mode
        read_bytes = Path.read_bytes

        def refuse(path: Path) -> bytes:
            if path.name in unreadable:
                raise PermissionError(13, "Permission denied", str(path))
            return read_bytes(path)

        monkeypatch.setattr(Path, "read_bytes", refuse)
    source, passes = _source(root)

    yielded = await _run(
        source,
        behind=1,
        outcome=lambda n: Outcome.RETRIABLE_FAILURE if n == retriable else Outcome.NEW,
    )

    assert yielded == readable  # the unreadable ones were skipped, each file tried once
    assert passes.listed[-1] == []  # the run ended on a pass with nothing new
    assert sum(map(len, passes.listed)) == len(unreadable) + len(readable)
    assert _in(root, "new") == sorted([*unreadable, retriable, _name(99)])

    # the next run tries what stayed in new/ again
    monkeypatch.undo()
    for name in unreadable:
        (root / "new" / name).chmod(0o600)
    assert await _run(source) == sorted([*unreadable, retriable])
    assert _in(root, "new") == [_name(99)]


async def test_mail_delivered_during_a_run_is_picked_up_by_a_later_pass(tmp_path: Path) -> None:
    root = _maildir(tmp_path / "Maildir")
    backlog = [_deliver(root, _name(i)) for i in range(10, 16)]
    source, passes = _source(root)
    late: list[str] = []

    def deliver_during_first_pass(pages_so_far: int) -> None:
        if pages_so_far == 1:
            # one that sorts after the backlog, one before it (a slow clock, another host)
            late.append(_deliver(root, _name(99)))
            late.append(_deliver(root, _name(1)))

    yielded = await _run(source, after_page=deliver_during_first_pass)

    # first pass: what was there when it listed; the late ones in the second pass
    assert yielded == backlog[:4] + sorted([*backlog[4:], *late])
    assert len(passes.listed) == 3
    assert _in(root, "new") == []

    # delivered after the run ended: the next run has it
    after = _deliver(root, _name(100))
    assert await _run(source) == [after]
    assert _in(root, "new") == []
    assert len(_in(root, "cur")) == len(backlog) + len(late) + 1
