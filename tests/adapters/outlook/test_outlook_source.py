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
from datetime import UTC, datetime, timedelta
from pathlib import Path

import anyio
import asyncpg
import orjson
import pytest
from aiohttp import web
from fakes.graph import FakeGraph
from helpers import eventually
from helpers.corpus import corpus_files

from inboxd.adapters.outlook import tables as graph_subscriptions
from inboxd.adapters.outlook.config import OutlookMailbox, OutlookSettings
from inboxd.adapters.outlook.cursor import DeltaCursor
from inboxd.adapters.outlook.source import OutlookSource
from inboxd.adapters.settings import Backfill
from inboxd.daemon.config.tenant import MailboxConfig
from inboxd.daemon.metrics.registry import Metrics
from inboxd.daemon.sync.lease_keeper import LeaseKeeper
from inboxd.daemon.sync.queue import IngestQueue
from inboxd.daemon.sync.runner import MailboxRunner, RunnerDeps
from inboxd.pipeline import copies
from inboxd.pipeline.errors import CursorExpired
from inboxd.pipeline.ingest.stage import IngestStage
from inboxd.pipeline.objectstore.store import ObjectStore

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
    refresh_token: str | None
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
        # every delta request, follow-up links included, carried odata.maxpagesize
        assert self.fake.counters.without_maxpagesize() == 0
        assert self.fake.counters.max_downloads() <= 1  # no body downloaded twice
        assert self.fake.counters.throttled.get(USER, 0) == 0  # no self-inflicted 429


@asynccontextmanager
async def rig(
    pool: asyncpg.Pool,
    db_dsn: str,
    store: ObjectStore,
    make_mailbox,
    *,
    folders=("inbox", "sentitems"),
    delegated: bool = False,
    backfill: Backfill = "all",
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
        refresh = Ref(fake.issue_refresh_token(USER)) if delegated else None
        mailbox = OutlookMailbox(
            address=USER, refresh_token=refresh, folders=tuple(folders), backfill=backfill
        )

        async def known(ids: list[str]) -> set[str]:
            return await copies.known_copies(pool, T, M, ids)

        source = OutlookSource(T, M, settings, mailbox, known, pool, transport_options=FAST_RETRIES)
        metrics = Metrics()
        queue = IngestQueue(IngestStage(pool, store), metrics, capacity_pages=2)
        keeper = LeaseKeeper(db_dsn, "test-owner", ttl_s=30)
        deps = RunnerDeps(pool, queue, metrics, keeper)
        runner = MailboxRunner(source, deps, MailboxConfig(T, M, "outlook", address=USER))
        async with anyio.create_task_group() as tg:
            await tg.start(queue.run_worker)
            keeper_scope = tg.cancel_scope  # the keeper serves until cancelled
            await tg.start(keeper.run)
            await tg.start(runner.run)
            yield Rig(fake, None if refresh is None else refresh.reveal(), pool, runner, source)
            runner.stop()
            queue.close()
            keeper_scope.cancel()


async def test_backfill_then_delta_stores_each_message_once(
    pool, db_dsn, store, make_mailbox
) -> None:
    files = corpus_files(CORPUS, 14)
    async with rig(pool, db_dsn, store, make_mailbox) as r:
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


async def copy_row(pool: asyncpg.Pool, external_id: str) -> asyncpg.Record | None:
    return await pool.fetchrow(
        "SELECT labels, removed_at FROM message_copies WHERE mailbox_id = $1 AND external_id = $2",
        M,
        external_id,
    )


async def test_a_move_between_synced_folders_keeps_one_row_and_a_delete_is_recorded(
    pool, db_dsn, store, make_mailbox
) -> None:
    files = corpus_files(CORPUS, 4)
    async with rig(pool, db_dsn, store, make_mailbox) as r:
        box = r.fake.mailbox(USER)
        moved, deleted, _, _ = box.add_files(files)
        await r.sync(4)

        r.fake.move_message(moved.immutable_id, "sentitems")
        r.fake.delete_message(deleted.immutable_id)
        await r.sync()
        assert await r.rows() == 4
        assert await pool.fetchval("SELECT count(*) FROM messages") == 4
        row = await copy_row(pool, moved.immutable_id)
        assert row is not None and list(row["labels"]) == ["sentitems"]
        assert row["removed_at"] is None  # left inbox, arrived in sentitems: still here
        gone = await copy_row(pool, deleted.immutable_id)
        assert gone is not None and gone["removed_at"] is not None
        removals = await pool.fetch(
            "SELECT payload->>'external_id' AS id, payload->>'reason' AS reason"
            " FROM events WHERE kind = 'message.removed'"
        )
        # the move never looked like a removal, not even for a moment
        assert [(x["id"], x["reason"]) for x in removals] == [(deleted.immutable_id, "deleted")]
        r.check_contract()


async def test_an_expired_delta_restarts_only_that_folder_and_downloads_nothing_twice(
    pool, db_dsn, store, make_mailbox
) -> None:
    files = corpus_files(CORPUS, 8)
    async with rig(pool, db_dsn, store, make_mailbox) as r:
        box = r.fake.mailbox(USER)
        box.add_files(files[:4])
        box.add_files(files[4:6], folder="sentitems")
        await r.sync(6)
        box.add_files(files[6:])
        box.expire_delta_tokens("inbox")  # inbox's deltaLink answers 410 now
        await r.sync(8)
        resets = await pool.fetch("SELECT payload FROM events WHERE kind = 'mailbox.cursor_reset'")
        assert len(resets) == 1
        assert await pool.fetchval("SELECT count(*) FROM messages") == 8
        r.check_contract()


async def test_a_body_throttled_past_every_retry_holds_the_cursor_then_completes(
    pool, db_dsn, store, make_mailbox
) -> None:
    files = corpus_files(CORPUS, 5)
    async with rig(pool, db_dsn, store, make_mailbox, folders=("inbox",)) as r:
        box = r.fake.mailbox(USER)
        box.add_files(files[:2])
        await r.sync(2)
        before = await r.cursor()
        stuck, *_ = box.add_files(files[2:])
        r.fake.faults.fail_message(stuck.immutable_id, 429, times=None, retry_after_s=0)
        r.runner.ring()
        await eventually(
            lambda: pool.fetchval("SELECT last_error FROM mailboxes WHERE mailbox_id = $1", M),
            DEADLINE_S,
            what="the run gives up",
            until=lambda error: error is not None and "429" in error,
        )
        assert await r.cursor() == before  # the page is not settled: the cursor holds
        await pool.execute("UPDATE mailboxes SET throttle_until = NULL WHERE mailbox_id = $1", M)
        r.fake.faults.fail_message(stuck.immutable_id, 429, times=0)
        r.fake.faults.by_message.clear()
        await r.sync(5)
        assert await r.cursor() != before
        assert r.fake.counters.missing_immutable_total() == 0


async def test_a_revoked_grant_needs_attention_with_the_reason(
    pool, db_dsn, store, make_mailbox
) -> None:
    async with rig(pool, db_dsn, store, make_mailbox, delegated=True) as r:
        r.fake.mailbox(USER).add_files(corpus_files(CORPUS, 1))
        await r.sync(1)
        assert r.refresh_token is not None
        r.fake.revoke_refresh_token(r.refresh_token)
        r.fake.expire_access_tokens()
        r.runner.ring()
        state = await eventually(
            lambda: pool.fetchrow(
                "SELECT sync_state, last_error FROM mailboxes WHERE mailbox_id = $1", M
            ),
            DEADLINE_S,
            what="needs_attention",
            until=lambda row: row["sync_state"] == "needs_attention",
        )
        assert "invalid_grant" in state["last_error"]
        assert r.refresh_token not in state["last_error"]


async def test_a_link_expiring_mid_round_of_the_first_sync_restarts_the_round(
    pool, db_dsn, store, make_mailbox
) -> None:
    async with rig(pool, db_dsn, store, make_mailbox, folders=("inbox",)) as r:
        r.fake.mailbox(USER).add_generated(250)  # three delta pages of 100
        r.fake.delta.expire_next_skiptoken = True  # the first nextLink followed: 410
        await r.sync(250)
        resets = await pool.fetchval(
            "SELECT count(*) FROM events WHERE kind = 'mailbox.cursor_reset'"
        )
        assert resets == 1
        assert await pool.fetchval("SELECT count(*) FROM messages") == 250
        r.check_contract()


async def test_a_removed_mailbox_deletes_its_subscriptions_at_graph_and_in_the_table(
    pool, make_mailbox
) -> None:
    async def echo(request: web.Request) -> web.Response:  # the listener's validation answer
        return web.Response(text=request.query.get("validationToken", ""))

    app = web.Application()
    app.router.add_post("/{tail:.*}", echo)
    listener = web.AppRunner(app)
    await listener.setup()
    site = web.TCPSite(listener, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{listener.addresses[0][1]}"
    await make_mailbox(T, M, provider="outlook", address=USER)
    try:
        async with FakeGraph([USER]) as fake:
            settings = OutlookSettings(
                directory_id=fake.directory_id,
                client_id=fake.client_id,
                client_secret=Ref(fake.client_secret),
                notification_url=base,
                graph_url=fake.graph_url,
                authority_url=fake.authority_url,
            )
            mailbox = OutlookMailbox(address=USER, backfill="all")

            async def known(ids: list[str]) -> set[str]:
                return set()

            source = OutlookSource(T, M, settings, mailbox, known, pool)
            try:
                async for _ in source.pages(None):
                    pass
                rows = await graph_subscriptions.subscriptions_of(pool, T, M)
                assert sorted(r.folder for r in rows) == ["inbox", "sentitems"]
                assert set(fake.subscriptions.by_id) == {r.subscription_id for r in rows}

                await source.forget()
                assert await graph_subscriptions.subscriptions_of(pool, T, M) == []
                assert not fake.subscriptions.by_id
            finally:
                await source.aclose()
    finally:
        await listener.cleanup()


# Exchange's clock behind ours by this much (a VM without NTP is off by minutes)
EXCHANGE_BEHIND_S = 120


async def test_backfill_none_stores_mail_exchange_stamps_before_our_clock_said_now(
    pool, db_dsn, store, make_mailbox
) -> None:
    """receivedDateTime is Exchange's clock; the first round's bound (and every
    round after it, a reset's included) is ours. With ours two minutes ahead, mail
    arriving right after the mailbox was added is stamped below the bound: no
    round would ever report it."""
    files = corpus_files(CORPUS, 2)
    async with rig(pool, db_dsn, store, make_mailbox, folders=("inbox",), backfill="none") as r:
        box = r.fake.mailbox(USER)
        await r.sync()  # the first round: nothing to store
        assert await r.rows() == 0

        def deliver(path: Path) -> None:
            stamped = datetime.now(UTC) - timedelta(seconds=EXCHANGE_BEHIND_S)
            box.add_message(path.read_bytes(), received=stamped)

        deliver(files[0])
        await r.sync(1)
        # and after the folder's delta state expired, the reset's round too
        box.expire_delta_tokens()
        deliver(files[1])
        await r.sync(2)
        r.check_contract()


async def test_a_reset_keeps_the_bound_of_a_folder_whose_first_round_ran_in_that_run(
    pool, make_mailbox
) -> None:
    """A newly configured folder (inbox) starts its first round, bound by the
    backfill window as of that moment; in the same run another folder's state
    expires (410). The reset's cursor keeps inbox's bound: a first round started
    again later would have a later one, and mail stamped in between that no round
    had reported yet would never be."""
    await make_mailbox(T, M, provider="outlook", address=USER)
    async with FakeGraph([USER]) as fake:
        settings = OutlookSettings(
            directory_id=fake.directory_id,
            client_id=fake.client_id,
            client_secret=Ref(fake.client_secret),
            graph_url=fake.graph_url,
            authority_url=fake.authority_url,
        )
        mailbox = OutlookMailbox(address=USER, folders=("inbox", "sentitems"), backfill=30)

        async def known(ids: list[str]) -> set[str]:
            return set()

        source = OutlookSource(T, M, settings, mailbox, known, pool)
        try:
            cursor: str | None = None
            async for page in source.pages(None):
                cursor = page.cursor_after or cursor
            assert cursor is not None
            # inbox newly configured: the stored cursor knows only sentitems
            data = orjson.loads(cursor)
            del data["folders"]["inbox"]
            fake.mailbox(USER).expire_delta_tokens("sentitems")
            inbox_bound: str | None = None
            with pytest.raises(CursorExpired) as caught:
                async for page in source.pages(orjson.dumps(data).decode()):
                    assert page.cursor_after is not None
                    position = DeltaCursor.decode(page.cursor_after, ["inbox"]).folders["inbox"]
                    inbox_bound = position.since
            assert inbox_bound is not None and inbox_bound != "all"
            restart = DeltaCursor.decode(caught.value.restart_from, ["inbox", "sentitems"])
            assert restart.folders["inbox"].since == inbox_bound
            assert restart.folders["inbox"].first  # still its first round: a backfill
            assert restart.folders["sentitems"].link is None  # the expired one restarts
        finally:
            await source.aclose()
