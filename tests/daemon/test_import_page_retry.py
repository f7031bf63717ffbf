"""`inboxd import`'s page retries (daemon/commands/import_pages.py): only the items
still unsettled go again, and every file is counted once in the summary.

A real IngestStage over PostgreSQL and a local object store that fails to store
one message's raw bytes once (a disk that was full for a moment): the retry must
ingest that message alone, not the page again.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Sequence
from pathlib import Path

import anyio
import asyncpg
import pytest

from inboxd.adapters.files import ImportSource, plan_import
from inboxd.daemon.commands import import_pages
from inboxd.daemon.commands.import_pages import PageSettler
from inboxd.daemon.commands.import_report import ImportSummary
from inboxd.daemon.metrics.registry import Metrics
from inboxd.daemon.sync.queue import IngestQueue
from inboxd.pipeline.ingest.stage import IngestStage
from inboxd.pipeline.objectstore.local import LocalDirectoryStore
from inboxd.pipeline.objectstore.store import ObjectStoreError

NAMES = (
    "axllent-mailpit/plain-text.eml",
    "axllent-mailpit/tags.eml",
    "axllent-mailpit/mime-attachment.eml",
    "axllent-mailpit/mixed-attachment.eml",
)


class FailsOnce(LocalDirectoryStore):
    """A local store that refuses the first write of the object named `raw/…/<sha>`."""

    def __init__(self, root: Path, sha: str) -> None:
        super().__init__(root)
        self.sha = sha
        self.failed = False

    async def put_many(
        self, items: Sequence[tuple[str, bytes, str]], *, conn: asyncpg.Connection | None = None
    ) -> list[BaseException | None]:
        results = await super().put_many(items, conn=conn)
        for i, (key, _data, _type) in enumerate(items):
            if not self.failed and key.endswith(self.sha):
                self.failed = True
                results[i] = ObjectStoreError(f"writing object {key!r} failed: disk full")
        return results


async def test_a_retry_ingests_only_what_is_unsettled_and_counts_each_file_once(
    corpus: Path,
    tmp_path: Path,
    pool: asyncpg.Pool,
    make_mailbox,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the backoff is the code's, not this test's synchronisation: no need to wait it out
    monkeypatch.setattr(import_pages, "RETRY_INITIAL_WAIT_S", 0.0)
    monkeypatch.setattr(import_pages, "RETRY_JITTER_S", 0.0)
    folder = tmp_path / "in"
    folder.mkdir()
    for i, name in enumerate(NAMES):
        shutil.copyfile(corpus / "mime" / name, folder / f"m{i}.eml")
    (folder / "z-blob.eml").write_bytes(bytes(range(256)) * 16)  # not mail: a dead item
    flaky = hashlib.sha256((folder / "m2.eml").read_bytes()).hexdigest()
    store = FailsOnce(tmp_path / "objects", flaky)
    tenant, mailbox = await make_mailbox()
    plan = plan_import([folder])
    summary = ImportSummary(tenant, mailbox, len(plan.files), [])
    source = ImportSource(tenant, mailbox, plan, parse_in_thread=True)
    queue = IngestQueue(IngestStage(pool, store), Metrics(), capacity_pages=1)
    batches: list[int] = []
    real_ingest = queue.ingest

    async def watched(batch):  # type: ignore[no-untyped-def]
        batches.append(len(batch.items))
        return await real_ingest(batch)

    monkeypatch.setattr(queue, "ingest", watched)

    async with anyio.create_task_group() as tg:
        await tg.start(queue.run_worker)
        async for page in source.pages(None):
            await PageSettler(summary, anyio.Event()).ingest(queue, source, page)
        queue.close()

    assert store.failed
    assert batches == [5, 1], "the retry carries the one unsettled item, not the page"
    assert summary.messages == len(plan.files) == 5
    assert +summary.outcomes == {"new": 4, "permanent_failure": 1}
    assert [ref for ref, _reason in summary.dead] == [str(folder / "z-blob.eml")]
    assert await pool.fetchval("SELECT count(*) FROM messages") == 4
