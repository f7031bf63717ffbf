"""OutlookSource through the real runner, queue and ingest stage, against FakeGraph.

Each scenario drives a MailboxRunner in-process (lease, pages, settle, fenced
cursor), so what is asserted is what a user sees: rows, cursors, events, and how
often Graph was asked for each body. The fake refuses any mail request without
Prefer: IdType="ImmutableId" (fake.strict_immutable), and every test checks that
none was sent.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import asyncpg
from fakes.graph import FakeGraph
from helpers import eventually

from inboxd.adapters.outlook.config import OutlookMailbox, OutlookSettings
from inboxd.adapters.outlook.source import OutlookSource
from inboxd.daemon.metrics import Metrics
from inboxd.daemon.sync.queue import IngestQueue
from inboxd.daemon.sync.runner import MailboxRunner, RunnerDeps
from inboxd.daemon.tenant_config import MailboxConfig
from inboxd.pipeline import copies
from inboxd.pipeline.ingest import IngestStage
from inboxd.pipeline.objectstore import ObjectStore

USER = "ops@contoso.example"
T, M = "acme", "outlook"
DEADLINE_S = 30.0
# A retry ladder short enough for a test to see it end.
FAST_RETRIES = {"attempts": 2, "backoff_initial_s": 0.05}
CORPUS = Path(__file__).parents[2] / "corpus" / "mime" / "jhillyerd-enmime"


class Ref:
    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value


@dataclass
class Rig:
    fake: FakeGraph
    pool: asyncpg.Pool
    runner: MailboxRunner
    source: OutlookSource

    async def rows(self) -> int:
        return int(await self.pool.fetchval("SELECT count(*) FROM message_copies"))

    async def cursor(self) -> str | None:
        return await self.pool.fetchval("SELECT cursor FROM mailboxes WHERE mailbox_id = $1", M)

    async def sync(self, until_rows: int | None = None) -> None:
        """Ring; wait for `until_rows` copies (if given) and the end of the run."""
        before = await self.pool.fetchval(
            "SELECT cursor_updated_at FROM mailboxes WHERE mailbox_id = $1", M
        )
        self.runner.ring()
        if until_rows is not None:
            await eventually(
                self.rows, DEADLINE_S, what=f"{until_rows} copies", until=lambda n: n == until_rows
            )
        else:
            await eventually(
                lambda: self.pool.fetchval(
                    "SELECT cursor_updated_at FROM mailboxes WHERE mailbox_id = $1", M
                ),
                DEADLINE_S,
                what="a committed cursor",
                until=lambda at: at is not None and at != before,
            )
        await eventually(lambda: not self.runner._running, DEADLINE_S, what="the run ended")

    def check_contract(self) -> None:
        assert self.fake.counters.missing_immutable_total() == 0
        assert self.fake.counters.max_downloads() <= 1  # no body downloaded twice
        assert self.fake.counters.throttled.get(USER, 0) == 0  # no self-inflicted 429


def corpus_files(n: int) -> list[Path]:
    return sorted(p for p in CORPUS.iterdir() if p.suffix == ".raw" or p.name.endswith(".eml"))[:n]


@asynccontextmanager
async def rig(
    pool: asyncpg.Pool, store: ObjectStore, make_mailbox, *, folders=("inbox", "sentitems")
) -> AsyncIterator[Rig]:
    await make_mailbox(T, M, provider="outlook", address=USER)
    async with FakeGraph([USER]) as fake:
        settings = OutlookSettings(
            directory_id=fake.directory_id,
            client_id=fake.client_id,
            client_secret=Ref(fake.client_secret),
            graph_url=fake.graph_url,
            authority_url=fake.authority_url,
        )
        mailbox = OutlookMailbox(address=USER, folders=tuple(folders), backfill="all")

        async def known(ids: list[str]) -> set[str]:
            return await copies.known_copies(pool, T, M, ids)

        source = OutlookSource(T, M, settings, mailbox, known, pool, transport_options=FAST_RETRIES)
        metrics = Metrics()
        queue = IngestQueue(IngestStage(pool, store), metrics, capacity_pages=2)
        deps = RunnerDeps(pool, queue, metrics, "test-owner", lease_ttl_s=30)
        runner = MailboxRunner(source, deps, MailboxConfig(T, M, "outlook", address=USER))
        async with anyio.create_task_group() as tg:
            await tg.start(queue.run_worker)
            await tg.start(runner.run)
            yield Rig(fake, pool, runner, source)
            runner.stop()
            queue.close()


async def test_backfill_then_delta_stores_each_message_once(pool, store, make_mailbox) -> None:
    files = corpus_files(14)
    async with rig(pool, store, make_mailbox) as r:
        box = r.fake.mailbox(USER)
        box.add_files(files[:8])
        sent = box.add_files(files[8:10], folder="sentitems")
        await r.sync(10)
        first = await r.cursor()
        assert first is not None and "inbox" in first and "sentitems" in first

        box.add_files(files[10:])
        await r.sync(14)
        assert await r.cursor() != first
        direction = await pool.fetchval(
            "SELECT m.direction FROM messages m JOIN message_copies c USING (tenant_id, message_id)"
            " WHERE c.external_id = $1",
            sent[0].immutable_id,
        )
        assert direction == "outbound"
        r.check_contract()
