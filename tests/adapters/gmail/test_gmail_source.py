"""GmailSource through the real runner, queue and ingest stage, against the Gmail fake.

Each scenario drives a MailboxRunner in-process (lease, pages, settle, fenced
cursor) so what is asserted is what a user sees: rows, cursors, events, and how
often Gmail was asked for each body.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import asyncpg
import pytest
from fakes.gmail import FakeGmail
from helpers import eventually
from helpers.corpus import corpus_files

from inboxd.adapters.gmail.config import Backfill, GmailMailbox, GmailSettings
from inboxd.adapters.gmail.source import RELIST_CURSOR, GmailSource
from inboxd.daemon.config.tenant import MailboxConfig
from inboxd.daemon.metrics.registry import Metrics
from inboxd.daemon.sync.lease_keeper import LeaseKeeper
from inboxd.daemon.sync.queue import IngestQueue
from inboxd.daemon.sync.runner import MailboxRunner, RunnerDeps
from inboxd.pipeline import copies
from inboxd.pipeline.ingest.stage import IngestStage
from inboxd.pipeline.objectstore.store import ObjectStore

USER = "ops@acme.example"
T, M = "acme", "gmail"
DEADLINE_S = 30.0
# A retry ladder short enough for a test to see it end (the defaults take ~30 s).
FAST_RETRIES = {"batch_attempts": 2, "backoff_initial_s": 0.05, "backoff_max_s": 0.1}
CORPUS = Path(__file__).parents[2] / "corpus" / "mime" / "jhillyerd-enmime"


class Ref:
    """A secret reference, as the daemon's Secret: revealed only when used."""

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value


@dataclass
class Rig:
    fake: FakeGmail
    pool: asyncpg.Pool
    runner: MailboxRunner
    source: GmailSource

    async def rows(self) -> int:
        return int(await self.pool.fetchval("SELECT count(*) FROM message_copies"))

    async def cursor(self) -> str | None:
        return await self.pool.fetchval("SELECT cursor FROM mailboxes WHERE mailbox_id = $1", M)

    async def sync(self, until_rows: int) -> None:
        """Ring and wait for `until_rows` copies and the end of the run."""
        self.runner.ring()
        await eventually(
            self.rows, DEADLINE_S, what=f"{until_rows} copies", until=lambda n: n == until_rows
        )
        await eventually(lambda: not self.runner._running, DEADLINE_S, what="the run ended")


@asynccontextmanager
async def rig(
    pool: asyncpg.Pool,
    db_dsn: str,
    store: ObjectStore,
    make_mailbox,
    *,
    labels=("INBOX",),
    topic: str | None = None,
    units_per_s: float = 250.0,
    sync_mode: str = "auto",
    watch_renew_period_s: float | None = None,
    backfill: Backfill = "all",
    gmail_setup: Callable[[FakeGmail], None] | None = None,
) -> AsyncIterator[Rig]:
    await make_mailbox(T, M, provider="gmail", address=USER)
    async with FakeGmail([USER], quota_units_per_s=units_per_s) as fake:
        if gmail_setup is not None:
            gmail_setup(fake)
        settings = GmailSettings(
            client_id=fake.client_id,
            client_secret=Ref(fake.client_secret),
            topic=topic,
            api_url=fake.base_url,
            token_url=fake.token_url,
        )
        mailbox = GmailMailbox(
            address=USER,
            refresh_token=Ref(fake.issue_refresh_token(USER)),
            labels=tuple(labels),
            backfill=backfill,
        )

        async def known(ids: list[str]) -> set[str]:
            return await copies.known_copies(pool, T, M, ids)

        watch_period = (
            {} if watch_renew_period_s is None else {"watch_renew_period_s": watch_renew_period_s}
        )
        source = GmailSource(
            T,
            M,
            settings,
            mailbox,
            known,
            client_options=FAST_RETRIES,
            units_per_s=units_per_s,
            **watch_period,
        )
        metrics = Metrics()
        queue = IngestQueue(IngestStage(pool, store), metrics, capacity_pages=2)
        keeper = LeaseKeeper(db_dsn, "test-owner", ttl_s=30)
        deps = RunnerDeps(pool, queue, metrics, keeper)
        config = MailboxConfig(T, M, "gmail", address=USER, sync_mode=sync_mode)
        runner = MailboxRunner(source, deps, config)
        async with anyio.create_task_group() as tg:
            await tg.start(queue.run_worker)
            keeper_scope = tg.cancel_scope  # the keeper serves until cancelled
            await tg.start(keeper.run)
            await tg.start(runner.run)
            yield Rig(fake, pool, runner, source)
            runner.stop()
            queue.close()
            keeper_scope.cancel()


async def test_backfill_then_incremental_stores_each_message_once(
    pool, db_dsn, store, make_mailbox
) -> None:
    files = corpus_files(CORPUS, 12)
    async with rig(pool, db_dsn, store, make_mailbox) as r:
        box = r.fake.mailbox(USER)
        box.add_files(files[:8])
        await r.sync(8)
        first_cursor = await r.cursor()
        assert first_cursor is not None

        box.add_files(files[8:])
        await r.sync(12)
        assert int(await r.cursor()) > int(first_cursor)
        assert r.fake.counters.max_downloads() == 1  # no body downloaded twice
        threads = await pool.fetchval(
            "SELECT count(*) FROM threads WHERE external_thread_id IS NOT NULL"
        )
        assert threads >= 1
        assert r.fake.counters.rejected(429, USER) == 0  # our pacing drew no 429


async def test_an_expired_cursor_resyncs_without_losing_doubling_or_redownloading(
    pool, db_dsn, store, make_mailbox
) -> None:
    files = corpus_files(CORPUS, 10)
    async with rig(pool, db_dsn, store, make_mailbox) as r:
        box = r.fake.mailbox(USER)
        box.add_files(files[:6])
        await r.sync(6)
        box.add_files(files[6:8])
        box.expire_history()  # the cursor is now older than the history Gmail keeps
        box.add_files(files[8:])
        await r.sync(10)
        resets = await pool.fetchval(
            "SELECT count(*) FROM events WHERE kind = 'mailbox.cursor_reset'"
        )
        assert resets == 1
        assert r.fake.counters.max_downloads() == 1  # the stored six were not fetched again
        assert await pool.fetchval("SELECT count(*) FROM messages") <= 10


async def test_a_reset_cut_short_goes_on_as_a_reset_not_as_a_first_sync(
    pool, db_dsn, store, make_mailbox
) -> None:
    files = corpus_files(CORPUS, 3)
    async with rig(pool, db_dsn, store, make_mailbox, backfill="none") as r:
        box = r.fake.mailbox(USER)
        r.runner.ring()  # the first sync of backfill "none": no list, a cursor
        await eventually(r.cursor, DEADLINE_S, what="the first cursor")
        await eventually(lambda: not r.runner._running, DEADLINE_S, what="the run ended")
        box.add_files(files)
        box.expire_history()
        r.fake.faults.fail_next_batches(1000, status=500)  # the reset's downloads fail
        r.runner.ring()
        await eventually(
            lambda: pool.fetchval("SELECT last_error FROM mailboxes WHERE mailbox_id = $1", M),
            DEADLINE_S,
            what="the reset run failed",
        )
        # stored, so the next run (or a restarted daemon) resumes the reset
        assert await r.cursor() == RELIST_CURSOR
        assert await r.rows() == 0

        r.fake.faults.clear()
        await pool.execute("UPDATE mailboxes SET throttle_until = NULL WHERE mailbox_id = $1", M)
        await r.sync(3)
        await eventually(r.cursor, DEADLINE_S, what="a history cursor", until=str.isdigit)
        assert r.fake.counters.max_downloads() == 1


async def test_a_message_deleted_before_fetch_is_settled_and_does_not_pin_the_cursor(
    pool, db_dsn, store, make_mailbox
) -> None:
    files = corpus_files(CORPUS, 4)
    async with rig(pool, db_dsn, store, make_mailbox) as r:
        box = r.fake.mailbox(USER)
        box.add_files(files[:2])
        await r.sync(2)
        doomed, _kept = box.add_files(files[2:4])
        r.fake.faults.fail_message(doomed.id, status=404, times=None)
        await r.sync(3)
        dead = await pool.fetchval(
            "SELECT reason FROM dead_items WHERE external_id = $1", doomed.id
        )
        assert dead == "deleted_before_fetch"
        assert await r.cursor() == str(box.history_id)  # moved past it


async def test_a_per_part_429_holds_the_cursor_and_the_next_run_completes(
    pool, db_dsn, store, make_mailbox
) -> None:
    files = corpus_files(CORPUS, 4)
    async with rig(pool, db_dsn, store, make_mailbox) as r:
        box = r.fake.mailbox(USER)
        box.add_files(files[:2])
        await r.sync(2)
        cursor = await r.cursor()
        flaky = box.add_files(files[2:3])[0]
        r.fake.faults.fail_message(flaky.id, status=429, times=None, retry_after_s=0)
        r.runner.ring()
        await eventually(
            lambda: pool.fetchval("SELECT last_error FROM mailboxes WHERE mailbox_id = $1", M),
            DEADLINE_S,
            what="the failed run recorded",
        )
        assert await r.cursor() == cursor  # held before the page that failed
        r.fake.faults.clear()
        await pool.execute("UPDATE mailboxes SET throttle_until = NULL")
        await r.sync(3)
        assert int(await r.cursor()) > int(cursor)


async def test_deletions_and_label_changes_reach_the_stored_copies(
    pool, db_dsn, store, make_mailbox
) -> None:
    files = corpus_files(CORPUS, 3)
    async with rig(pool, db_dsn, store, make_mailbox) as r:
        box = r.fake.mailbox(USER)
        a, b, c = box.add_files(files)
        await r.sync(3)
        box.delete_message(a.id)
        box.modify_labels(b.id, add=["STARRED"], remove=[])
        box.modify_labels(c.id, add=[], remove=["INBOX"])  # archived: leaves the synced label
        r.runner.ring()

        async def removed() -> dict[str, str]:
            rows = await pool.fetch(
                "SELECT external_id, removal_reason FROM message_copies "
                "WHERE removed_at IS NOT NULL"
            )
            return {row[0]: row[1] for row in rows}

        got = await eventually(
            removed, DEADLINE_S, what="two removals", until=lambda d: len(d) == 2
        )
        assert got == {a.id: "deleted", c.id: "unlabelled"}
        labels = await pool.fetchval(
            "SELECT labels FROM message_copies WHERE external_id = $1", b.id
        )
        assert "STARRED" in labels
        assert await pool.fetchval("SELECT count(*) FROM messages") == 3  # the data stays


@pytest.mark.parametrize("label", ["SENT"])
async def test_sent_copies_are_outbound(pool, db_dsn, store, make_mailbox, label: str) -> None:
    files = corpus_files(CORPUS, 1)
    async with rig(pool, db_dsn, store, make_mailbox, labels=("INBOX", label)) as r:
        r.fake.mailbox(USER).add_files(files, label_ids=[label])
        await r.sync(1)
        assert await pool.fetchval("SELECT direction FROM messages") == "outbound"


async def test_a_removed_mailbox_stops_its_watch(pool, db_dsn, store, make_mailbox) -> None:
    await make_mailbox(T, M, provider="gmail", address=USER)
    async with FakeGmail([USER]) as fake:
        settings = GmailSettings(
            client_id=fake.client_id,
            client_secret=Ref(fake.client_secret),
            topic="projects/acme-project/topics/gmail",
            api_url=fake.base_url,
            token_url=fake.token_url,
        )
        mailbox = GmailMailbox(address=USER, refresh_token=Ref(fake.issue_refresh_token(USER)))

        async def known(ids: list[str]) -> set[str]:
            return set()

        source = GmailSource(T, M, settings, mailbox, known)
        try:
            await source.forget()
        finally:
            await source.aclose()
        assert fake.counters.calls_of("users.stop", USER) == 1


# A quota far above Gmail's on both sides, so 3,000 bodies take seconds, not a minute;
# the pacing itself is tested at the real quota (test_client.py).
FAST_QUOTA_UNITS_PER_S = 20_000.0


async def test_3000_new_messages_in_one_history_window_are_all_stored(
    pool, db_dsn, store, make_mailbox
) -> None:
    async with rig(pool, db_dsn, store, make_mailbox, units_per_s=FAST_QUOTA_UNITS_PER_S) as r:
        box = r.fake.mailbox(USER)
        box.add_files(corpus_files(CORPUS, 1))
        await r.sync(1)
        box.add_generated(3000)  # history paging: several pages of one window
        r.runner.ring()
        await eventually(r.rows, 120, what="3,001 copies", until=lambda n: n == 3001)
        await eventually(lambda: not r.runner._running, DEADLINE_S, what="the run ended")
        assert await r.cursor() == str(box.history_id)
        assert r.fake.counters.max_downloads() == 1


async def test_the_watch_is_renewed_on_its_schedule_without_syncs_or_cursor_moves(
    pool, db_dsn, store, make_mailbox
) -> None:
    topic = "projects/acme-project/topics/gmail"
    # a renewal every second (WATCH_RENEW_MIN_WAIT_S) instead of every day
    async with rig(pool, db_dsn, store, make_mailbox, topic=topic, watch_renew_period_s=1.0) as r:
        r.fake.mailbox(USER).add_files(corpus_files(CORPUS, 2))
        await r.sync(2)
        cursor = await r.cursor()
        syncs = r.fake.counters.calls_of("users.history.list", USER)
        watches = r.fake.counters.calls_of("users.watch", USER)
        r.fake.mailbox(USER).add_files(corpus_files(CORPUS, 1))  # waits behind the cursor
        await eventually(
            lambda: r.fake.counters.calls_of("users.watch", USER),
            DEADLINE_S,
            what="two more users.watch",
            until=lambda n: n >= watches + 2,
        )
        assert r.fake.counters.calls_of("users.history.list", USER) == syncs
        assert r.fake.counters.calls_of("users.getProfile", USER) == 1
        assert await r.cursor() == cursor


async def test_in_poll_mode_a_sync_renews_a_watch_that_is_due(
    pool, db_dsn, store, make_mailbox
) -> None:
    topic = "projects/acme-project/topics/gmail"
    async with rig(pool, db_dsn, store, make_mailbox, topic=topic, sync_mode="poll") as r:
        r.fake.mailbox(USER).add_files(corpus_files(CORPUS, 2))
        await r.sync(2)
        assert r.fake.counters.calls_of("users.watch", USER) == 1
        cursor = await r.cursor()
        assert r.source._watch is not None
        r.source._watch.expires_at = 0.0  # the watch is about to lapse
        r.runner.ring()
        await eventually(
            lambda: r.fake.counters.calls_of("users.watch", USER),
            DEADLINE_S,
            what="a second users.watch",
            until=lambda n: n == 2,
        )
        await eventually(lambda: not r.runner._running, DEADLINE_S, what="the run ended")
        assert await r.cursor() == cursor


async def test_a_watch_gmail_refuses_does_not_stop_the_sync(
    pool, db_dsn, store, make_mailbox
) -> None:
    topic = "projects/acme-project/topics/gmail"
    async with rig(pool, db_dsn, store, make_mailbox, topic=topic) as r:
        r.fake.faults.fail_next_calls(1, status=403, methods={"users.watch"})
        r.fake.mailbox(USER).add_files(corpus_files(CORPUS, 2))
        await r.sync(2)  # synced all the same; the watch is tried again next run
        assert await r.cursor() is not None


async def test_a_topic_gmail_may_not_publish_to_needs_attention_and_mail_still_syncs(
    pool, db_dsn, store, make_mailbox
) -> None:
    """users.watch refused (the topic lacks Gmail's publish right): no push will
    ever come, so the status says so (needs_attention with Gmail's text) instead of
    a log line nobody reads; polling still stores mail, and once the right is
    granted the next renewal clears it."""
    topic = "projects/acme-project/topics/gmail"
    files = corpus_files(CORPUS, 2)
    async with rig(
        pool,
        db_dsn,
        store,
        make_mailbox,
        topic=topic,
        watch_renew_period_s=0.2,
        gmail_setup=no_topics,
    ) as r:

        async def state() -> tuple[str, str | None]:
            """The state, and the last error while no later sync succeeded (status)."""
            row = await pool.fetchrow(
                "SELECT sync_state, last_error, last_error_at < last_success_at AS old"
                " FROM mailboxes WHERE mailbox_id = $1",
                M,
            )
            return row["sync_state"], None if row["old"] else row["last_error"]

        await eventually(
            state, DEADLINE_S, what="needs_attention", until=lambda s: s[0] == "needs_attention"
        )
        _, error = await state()
        assert error is not None and "users.watch" in error and "not authorized" in error
        # polling goes on: mail is stored all the same
        r.fake.mailbox(USER).add_files(files[:1])
        await r.sync(1)
        assert (await state())[0] == "needs_attention"

        r.fake.publishable_topics = {topic}  # the operator grants the right
        await eventually(state, DEADLINE_S, what="idle again", until=lambda s: s == ("idle", None))
        assert r.fake.mailbox(USER).watch is not None


def no_topics(fake: FakeGmail) -> None:
    fake.publishable_topics = set()
