"""The Outlook door under `inboxd run`: a real daemon process against FakeGraph.

FakeGraph runs in the test's event loop on 127.0.0.1; the tenant's `[outlook]` table
points graph_url/authority_url at it and notification_url at the daemon's listener,
whose port is chosen before the start, so when the daemon creates its subscriptions
the fake performs Graph's validation handshake against the daemon itself, and
`fake.notify` / `fake.send_lifecycle` POST to it as Graph would. Blocking waits
(DaemonProcess.wait_ready, CLI runs) go to a thread: the fake must keep answering
the daemon meanwhile.

Graph itself serves REST ids to a request without Prefer: IdType="ImmutableId";
the fake refuses and counts every mail request without it, and each daemon's
teardown asserts there was none.

"Nothing happens" is asserted with `Running.never`: a wait, with a deadline, for the
condition that would make the test fail, which ends the test at once if it holds.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import asyncpg
import orjson
import pytest
from fakes.graph import FakeGraph
from harness import DaemonProcess, generated_messages, write_config
from helpers import WaitTimeout, cli_env, eventually, run_cli

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.slow,
    pytest.mark.own_database,  # daemon subprocesses (tests/conftest.py)
]

OPS, SALES = "ops@contoso.example", "sales@contoso.example"
API_TOKEN = "acme-api-token-for-tests"
FOLDERS = ("inbox", "sentitems")
WAIT_S = 60
#: How long "nothing more happens" is watched for: a ring reaches the runner and its
#: sync asks Graph within tens of milliseconds on this machine.
QUIET_S = 2.0


@dataclass
class Box:
    """One configured Outlook mailbox: id, address, folders, and how it signs in."""

    mailbox_id: str
    address: str
    folders: tuple[str, ...] = FOLDERS
    delegated: bool = False
    backfill: int | str = "all"


@dataclass
class Running:
    tmp: Path
    dsn: str
    fake: FakeGraph
    daemon: DaemonProcess
    base: str
    session: aiohttp.ClientSession
    refresh_tokens: dict[str, str]
    config: Path | None = None
    env: dict[str, str] | None = None

    async def restart(self, while_down: Callable[[], Awaitable[None]] | None = None) -> None:
        """Stop the daemon as an operator would (SIGTERM: its leases released), run
        `while_down`, start it again on the same config, port and database."""
        assert self.config is not None
        self.daemon.signal()
        code = await anyio.to_thread.run_sync(self.daemon.wait_exit)
        assert code == 0, self.daemon.log_tail()
        if while_down is not None:
            await while_down()
        log = self.tmp / f"daemon.{len(list(self.tmp.glob('daemon*.log')))}.log"
        self.daemon = DaemonProcess(self.config, self.dsn, log, env=self.env)
        await anyio.to_thread.run_sync(self.daemon.wait_ready)

    async def fetchval(self, sql: str, *args: Any) -> Any:
        conn = await asyncpg.connect(self.dsn)
        try:
            return await conn.fetchval(sql, *args)
        finally:
            await conn.close()

    async def fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        conn = await asyncpg.connect(self.dsn)
        try:
            return await conn.fetch(sql, *args)
        finally:
            await conn.close()

    async def eventually(self, check: Callable[[], Awaitable[Any]], what: str) -> Any:
        return await self.daemon.eventually(check, WAIT_S, what=what)

    async def rows(self, mailbox: str) -> int:
        return await self.fetchval(
            "SELECT count(*) FROM message_copies WHERE mailbox_id = $1", mailbox
        )

    async def has_copy(self, mailbox: str, external_id: str) -> bool:
        return bool(
            await self.fetchval(
                "SELECT count(*) FROM message_copies WHERE mailbox_id = $1 AND external_id = $2",
                mailbox,
                external_id,
            )
        )

    async def copy(self, mailbox: str, external_id: str) -> asyncpg.Record | None:
        found = await self.fetch(
            "SELECT message_id, labels, removed_at, removal_reason FROM message_copies"
            " WHERE mailbox_id = $1 AND external_id = $2",
            mailbox,
            external_id,
        )
        return found[0] if found else None

    async def cursor(self, mailbox: str) -> str | None:
        return await self.fetchval("SELECT cursor FROM mailboxes WHERE mailbox_id = $1", mailbox)

    async def events(self, kind: str, mailbox: str) -> list[asyncpg.Record]:
        return await self.fetch(
            "SELECT message_id, payload FROM events WHERE kind = $1 AND mailbox_id = $2"
            " ORDER BY event_id",
            kind,
            mailbox,
        )

    async def events_count(self, kind: str, mailbox: str) -> int:
        return len(await self.events(kind, mailbox))

    async def subscription_rows(self, mailbox: str) -> dict[str, asyncpg.Record]:
        found = await self.fetch(
            "SELECT folder, subscription_id, client_state, lifecycle_event"
            " FROM graph_subscriptions WHERE mailbox_id = $1",
            mailbox,
        )
        return {r["folder"]: r for r in found}

    async def status_text(self) -> str:
        env = cli_env(self.tmp / "data")
        result = await anyio.to_thread.run_sync(
            lambda: run_cli("status", "--json", "--dsn", self.dsn, env=env)
        )
        assert result.code == 0, result.stderr
        return result.stdout

    async def status(self) -> dict[str, dict[str, Any]]:
        return {s["mailbox_id"]: s for s in orjson.loads(await self.status_text())}

    async def sync_now(self, mailbox: str) -> None:
        env = cli_env(self.tmp / "data")
        result = await anyio.to_thread.run_sync(
            lambda: run_cli(
                "sync", "now", "--mailbox", mailbox, "--tenant", "acme", "--dsn", self.dsn, env=env
            )
        )
        assert result.code == 0, result.stderr

    async def runs(self) -> tuple[int, int]:
        """Outlook sync runs (started, finished) so far, from the daemon's /metrics."""
        async with self.session.get(f"{self.base}/metrics") as response:
            assert response.status == 200
            text = await response.text()
        started = finished = 0.0
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            if name == 'inboxd_sync_runs_total{provider="outlook"}':
                started = float(value)
            elif name == 'inboxd_sync_duration_seconds_count{provider="outlook"}':
                finished = float(value)
        return int(started), int(finished)

    async def idle(self) -> bool:
        """Every run started so far has ended (runs of one runner follow each other
        without a pause, so a follow-up is counted as started when its forerunner ends)."""
        started, finished = await self.runs()
        return started == finished

    def deltas(self, address: str) -> int:
        return self.fake.counters.calls_of("message.delta", address)

    def push_url(self, lifecycle: bool = False) -> str:
        return f"{self.base}/push/outlook/acme" + ("/lifecycle" if lifecycle else "")

    async def never(self, check: Callable[[], Awaitable[bool] | bool], what: str) -> None:
        """Fail if `check()` holds within QUIET_S (the negative of `eventually`)."""
        try:
            await eventually(check, QUIET_S, what=what)
        except WaitTimeout:
            return
        raise AssertionError(f"{what} happened\n{self.daemon.log_tail()}")


def free_port() -> int:
    """A port the daemon's listener can take (notification_url must name it before
    the daemon starts, so port 0 will not do)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def tenant_file(fake: FakeGraph, boxes: list[Box], port: int, token_files: dict[str, Path]) -> str:
    blocks = []
    for box in boxes:
        folders = ", ".join(f'"{f}"' for f in box.folders)
        token = f'refresh_token = "file:{token_files[box.address]}"\n' if box.delegated else ""
        backfill = f'"{box.backfill}"' if isinstance(box.backfill, str) else str(box.backfill)
        blocks.append(
            f"""
[[mailboxes]]
id = "{box.mailbox_id}"
provider = "outlook"
address = "{box.address}"
sync_mode = "push"
folders = [{folders}]
backfill = {backfill}
{token}"""
        )
    return f"""
id = "acme"
api_token = "env:ACME_API_TOKEN"
[outlook]
directory_id = "{fake.directory_id}"
client_id = "{fake.client_id}"
client_secret = "env:ACME_GRAPH_SECRET"
graph_url = "{fake.graph_url}"
authority_url = "{fake.authority_url}"
notification_url = "http://127.0.0.1:{port}"
{"".join(blocks)}"""


@asynccontextmanager
async def outlook_daemon(
    tmp: Path, dsn: str, seed: dict[str, int], boxes: list[Box] | None = None
) -> AsyncIterator[Running]:
    """A daemon whose tenant "acme" has push-mode Outlook mailboxes (`boxes`, by
    default one app-only mailbox "ops"), each seeded in its inbox with `seed[address]`
    messages and fully backfilled. At the end (when the test passed): no request
    left without the ImmutableId preference."""
    boxes = boxes or [Box("ops", OPS)]
    async with FakeGraph([b.address for b in boxes]) as fake:
        tokens: dict[str, str] = {}
        files: dict[str, Path] = {}
        for box in boxes:
            for raw in generated_messages(seed.get(box.address, 0), tag=box.mailbox_id):
                fake.mailbox(box.address).add_message(raw)
            if box.delegated:
                tokens[box.address] = fake.issue_refresh_token(box.address)
                files[box.address] = tmp / f"{box.mailbox_id}.refresh-token"
                files[box.address].write_text(tokens[box.address] + "\n")
        port = free_port()
        config = write_config(tmp, port=port)
        (tmp / "tenants" / "acme.toml").write_text(tenant_file(fake, boxes, port, files))
        env = {"ACME_GRAPH_SECRET": fake.client_secret, "ACME_API_TOKEN": API_TOKEN}
        daemon = DaemonProcess(config, dsn, tmp / "daemon.log", env=env)
        running: Running | None = None
        try:
            ready_port = await anyio.to_thread.run_sync(daemon.wait_ready)
            assert ready_port == port
            async with aiohttp.ClientSession() as session:
                running = Running(
                    tmp, dsn, fake, daemon, f"http://127.0.0.1:{port}", session, tokens, config, env
                )
                for box in boxes:
                    count = seed.get(box.address, 0)
                    await running.eventually(
                        lambda box=box, count=count: _ready(running, box, count),
                        f"{box.mailbox_id}: {count} rows, a cursor and its subscriptions",
                    )
                yield running
                # CONTRIBUTING rule 13 / the issue: every mail request asked for
                # immutable ids (the fake refuses and counts those that did not)
                assert fake.counters.missing_immutable_total() == 0, fake.counters.missing_immutable
        finally:
            daemon.kill()
            if running is not None:
                running.daemon.kill()


async def _ready(running: Running, box: Box, count: int) -> bool:
    # The start rings each mailbox, and the poll scanner may claim it for its first
    # safety sync (last_polled_at) and ring again, unless a sync succeeded first (then
    # it is not due for a day): counting starts once a run ended after any claim.
    settled = await running.fetchval(
        "SELECT last_success_at IS NOT NULL"
        " AND (last_polled_at IS NULL OR last_success_at > last_polled_at)"
        " FROM mailboxes WHERE mailbox_id = $1",
        box.mailbox_id,
    )
    subscribed = await running.subscription_rows(box.mailbox_id)
    return (
        bool(settled)
        and await running.cursor(box.mailbox_id) is not None
        and await running.rows(box.mailbox_id) == count
        and set(subscribed) == set(box.folders)
        and await running.idle()
    )


async def _equals(value: Awaitable[Any], expected: Any) -> bool:
    return await value == expected


def _live_subscriptions(fake: FakeGraph, address: str) -> list[Any]:
    return [s for s in fake.subscriptions.by_id.values() if s.user.lower() == address.lower()]


# --- 1, 2: the handshake, then a notification brings the message ----------------------


async def test_subscriptions_are_validated_on_both_urls_and_a_notification_brings_mail(
    tmp_path, db_dsn
) -> None:
    async with outlook_daemon(tmp_path, db_dsn, {OPS: 3}) as run:
        notify_url, lifecycle_url = run.push_url(), run.push_url(lifecycle=True)
        subs = _live_subscriptions(run.fake, OPS)
        assert sorted(s.folder_id for s in subs) == sorted(
            run.fake.mailbox(OPS).folder(f).id for f in FOLDERS
        )
        for sub in subs:
            assert sub.notification_url == notify_url
            assert sub.lifecycle_url == lifecycle_url
            assert sub.change_types == ["created"]
        # Graph validated both URLs (the subscriptions exist only because the
        # daemon echoed each token)
        assert run.fake.counters.validations[notify_url] >= len(FOLDERS)
        assert run.fake.counters.validations[lifecycle_url] >= len(FOLDERS)
        rows = await run.subscription_rows("ops")
        assert {r["subscription_id"] for r in rows.values()} == {s.id for s in subs}

        new = run.fake.mailbox(OPS).add_message(generated_messages(1, tag="new")[0])
        assert await run.fake.notify(OPS, "inbox") == [202]
        await run.eventually(lambda: run.has_copy("ops", new.immutable_id), "the new message")
        assert await run.rows("ops") == 4
        assert run.fake.counters.max_downloads() == 1  # nothing downloaded twice

        # `inboxd status` shows the subscriptions' expiry, never their clientState
        text = await run.status_text()
        status = {s["mailbox_id"]: s for s in orjson.loads(text)}
        assert status["ops"]["provider"] == "outlook"
        assert status["ops"]["sync_state"] == "idle"
        assert status["ops"]["watch_expires_at"] is not None
        log = run.daemon.log_path.read_text(errors="replace")
        for row in rows.values():
            secret = row["client_state"]
            assert len(secret) >= 32
            assert secret not in text
            assert secret not in log


# --- 3, 4: a storm of notifications, and a forged clientState -----------------------


async def test_fifty_notifications_in_a_post_cost_one_sync_and_a_wrong_client_state_none(
    tmp_path, db_dsn
) -> None:
    async with outlook_daemon(tmp_path, db_dsn, {OPS: 2}) as run:
        fake, box = run.fake, run.fake.mailbox(OPS)
        inbox_sub = next(
            s for s in _live_subscriptions(fake, OPS) if s.folder_id == box.folder("inbox").id
        )
        new = box.add_message(generated_messages(1, tag="storm")[0])
        note = fake.subscriptions.change_notification(inbox_sub, box, new, "created")

        # a wrong clientState: refused, and nothing asks Graph for anything
        before = run.deltas(OPS)
        forged = [note | {"clientState": "forged-" + "x" * 40}]
        async with run.session.post(run.push_url(), json={"value": forged}) as response:
            assert response.status == 401
        await run.never(lambda: run.deltas(OPS) > before, "a sync after a forged notification")
        assert not await run.has_copy("ops", new.immutable_id)
        assert "forged-" not in run.daemon.log_path.read_text(errors="replace")
        # the same notification with its real clientState rings
        async with run.session.post(run.push_url(), json={"value": [note]}) as response:
            assert response.status == 202
        await run.eventually(lambda: run.has_copy("ops", new.immutable_id), "the message")
        await run.eventually(run.idle, "the sync of the notification ended")
        assert run.deltas(OPS) - before == len(FOLDERS)  # exactly one sync

        # 50 notifications in one POST while a sync is held in flight, then 50 more
        before = run.deltas(OPS)
        runs_before, _ = await run.runs()
        more = box.add_message(generated_messages(1, tag="storm2")[0])
        notes = [
            fake.subscriptions.change_notification(inbox_sub, box, more, "created")
            for _ in range(50)
        ]
        fake.faults.hold()
        try:
            assert await fake.send_notifications(notes) == 202
            await fake.wait_in_flight(OPS, 1, timeout_s=WAIT_S)  # the sync is at Graph
            assert await fake.send_notifications(notes) == 202
        finally:
            fake.faults.release()
        await run.eventually(lambda: run.has_copy("ops", more.immutable_id), "the storm's message")
        limit = 2 * len(FOLDERS)  # the held sync and at most one follow-up
        await run.never(lambda: run.deltas(OPS) - before > limit, f"more than {limit} delta calls")
        syncs = (run.deltas(OPS) - before) / len(FOLDERS)
        assert 1 <= syncs <= 2, syncs
        started, _ = await run.runs()
        assert 1 <= started - runs_before <= 2
        assert await run.rows("ops") == 4


# --- 9: immutable ids everywhere, the subscriptions included ----------------------------


async def test_subscriptions_are_created_asking_for_immutable_ids(tmp_path, db_dsn) -> None:
    async with outlook_daemon(tmp_path, db_dsn, {}) as run:
        subs = _live_subscriptions(run.fake, OPS)
        assert len(subs) == len(FOLDERS)
        if not all(s.immutable for s in subs):  # Prefer: IdType="ImmutableId" at creation
            raise AssertionError("a subscription was created without the ImmutableId preference")


# --- 5: 410 in the middle of a round ----------------------------------------------------


async def test_an_expired_link_mid_round_restarts_the_folder_losing_and_doubling_nothing(
    tmp_path, db_dsn
) -> None:
    async with outlook_daemon(tmp_path, db_dsn, {OPS: 5}) as run:
        box = run.fake.mailbox(OPS)
        # more than one delta page (the door asks for 100 a page): the round's
        # nextLink answers 410 Gone, after its first page was stored
        added = box.add_generated(150)
        run.fake.delta.expire_next_skiptoken = True
        assert await run.fake.notify(OPS, "inbox") == [202]

        await run.eventually(
            lambda: _equals(run.events_count("mailbox.cursor_reset", "ops"), 1), "a cursor reset"
        )
        await run.eventually(lambda: _equals(run.rows("ops"), 155), "155 rows")
        await run.eventually(run.idle, "the runs ended")
        assert not run.fake.delta.expire_next_skiptoken  # the 410 did happen
        assert await run.fetchval("SELECT count(*) FROM messages") == 155
        assert await run.fetchval("SELECT count(*) FROM dead_items") == 0
        for message in (added[0], added[99], added[100], added[-1]):
            assert await run.has_copy("ops", message.immutable_id)
        assert run.fake.counters.max_downloads() == 1  # nothing downloaded twice
        assert await run.cursor("ops") is not None
        assert await _state_is(run, "ops", "idle")


# --- 6, 8: @removed, and a move between synced folders ----------------------------------

THREE_FOLDERS = ("inbox", "archive", "sentitems")


def _seeded(run: Running, address: str, folder: str = "inbox") -> list[Any]:
    box = run.fake.mailbox(address)
    inside = box.in_folder(box.folder(folder).id)
    return sorted(inside, key=lambda m: m.entered_seq)


async def test_a_deleted_message_is_recorded_removed_and_a_moved_one_keeps_its_row(
    tmp_path, db_dsn
) -> None:
    boxes = [Box("ops", OPS, folders=THREE_FOLDERS)]
    async with outlook_daemon(tmp_path, db_dsn, {OPS: 3}, boxes) as run:
        gone, moved, _kept = _seeded(run, OPS)
        # a hard delete: delta's @removed marks the copy, the message row stays
        run.fake.delete_message(gone.immutable_id)
        assert await run.fake.notify(OPS, "inbox") == [202]
        await run.eventually(
            lambda: _removed(run, "ops", gone.immutable_id), "the deleted copy marked removed"
        )
        removed = await run.events("message.removed", "ops")
        assert [orjson.loads(e["payload"])["external_id"] for e in removed] == [gone.immutable_id]
        assert await run.fetchval("SELECT count(*) FROM messages") == 3

        # moved inbox -> archive: same immutable id, one row, now labelled archive
        await run.eventually(run.idle, "the runs ended")
        run.fake.move_message(moved.immutable_id, "archive")
        assert await run.fake.notify(OPS, "archive") == [202]
        await run.eventually(
            lambda: _labels_are(run, "ops", moved.immutable_id, ["archive"]), "labels [archive]"
        )
        await run.eventually(run.idle, "the runs ended")
        copy = await run.copy("ops", moved.immutable_id)
        assert copy is not None and copy["removed_at"] is None
        assert await run.rows("ops") == 3
        assert await run.fetchval("SELECT count(*) FROM messages") == 3
        assert run.fake.counters.max_downloads() == 1


async def test_a_message_moved_to_an_earlier_synced_folder_is_not_marked_removed(
    tmp_path, db_dsn
) -> None:
    # folders are synced in config order: archive's @removed comes after inbox's item
    boxes = [Box("ops", OPS, folders=THREE_FOLDERS)]
    async with outlook_daemon(tmp_path, db_dsn, {OPS: 2}, boxes) as run:
        moved, _kept = _seeded(run, OPS)
        run.fake.move_message(moved.immutable_id, "archive")
        assert await run.fake.notify(OPS, "archive") == [202]
        await run.eventually(
            lambda: _labels_are(run, "ops", moved.immutable_id, ["archive"]), "labels [archive]"
        )
        await run.eventually(run.idle, "the runs ended")

        run.fake.move_message(moved.immutable_id, "inbox")
        assert await run.fake.notify(OPS, "inbox") == [202]
        await run.eventually(
            lambda: _labels_are(run, "ops", moved.immutable_id, ["inbox"]), "labels [inbox]"
        )
        await run.eventually(run.idle, "the runs ended")
        assert await run.rows("ops") == 2
        assert await run.fetchval("SELECT count(*) FROM messages") == 2
        assert run.fake.counters.max_downloads() == 1
        copy = await run.copy("ops", moved.immutable_id)
        assert copy is not None
        if copy["removed_at"] is not None:
            raise AssertionError(f"the copy in inbox is marked {copy['removal_reason']}")


async def _removed(run: Running, mailbox: str, external_id: str) -> bool:
    copy = await run.copy(mailbox, external_id)
    return copy is not None and copy["removed_at"] is not None


async def _labels_are(run: Running, mailbox: str, external_id: str, labels: list[str]) -> bool:
    copy = await run.copy(mailbox, external_id)
    return copy is not None and list(copy["labels"]) == labels


# --- 7: an inner 429 past every retry ---------------------------------------------------


async def test_a_body_rate_limited_past_every_retry_holds_the_cursor_until_a_later_run(
    tmp_path, db_dsn
) -> None:
    async with outlook_daemon(tmp_path, db_dsn, {OPS: 1}) as run:
        box = run.fake.mailbox(OPS)
        before = await run.cursor("ops")
        limited, other = [box.add_message(r) for r in generated_messages(2, tag="429")]
        # 429 inside a 200 $batch for one part, on every attempt of this run
        run.fake.faults.fail_message(limited.immutable_id, 429, times=None, retry_after_s=1)
        assert await run.fake.notify(OPS, "inbox") == [202]

        await run.eventually(
            lambda: _last_error_mentions(run, "ops", "throttled"), "the run gives up"
        )
        assert await run.cursor("ops") == before  # held: the page is not stored
        assert not await run.has_copy("ops", limited.immutable_id)
        assert await _state_is(run, "ops", "idle")  # retriable: no operator needed

        run.fake.faults.clear()
        # the mailbox's backoff (at least 30 s after a failure) runs out: time travel
        await run.fetchval(
            "UPDATE mailboxes SET throttle_until = now() WHERE mailbox_id = $1", "ops"
        )
        await run.eventually(lambda: _unthrottled(run, "ops"), "the backoff passed")
        await run.sync_now("ops")
        await run.eventually(
            lambda: run.has_copy("ops", limited.immutable_id), "the next run completes"
        )
        await run.eventually(run.idle, "the runs ended")
        assert await run.has_copy("ops", other.immutable_id)
        assert await run.rows("ops") == 3
        assert await run.cursor("ops") != before
        assert await _state_is(run, "ops", "idle")


async def _unthrottled(run: Running, mailbox: str) -> bool:
    return bool(
        await run.fetchval(
            "SELECT throttle_until IS NULL OR throttle_until <= now() FROM mailboxes"
            " WHERE mailbox_id = $1",
            mailbox,
        )
    )


async def _last_error_mentions(run: Running, mailbox: str, word: str) -> bool:
    error = await run.fetchval("SELECT last_error FROM mailboxes WHERE mailbox_id = $1", mailbox)
    return error is not None and word in error.lower()


# --- 10: lifecycle notifications --------------------------------------------------------


async def test_lifecycle_missed_resyncs_and_subscription_removed_recreates_then_resyncs(
    tmp_path, db_dsn
) -> None:
    async with outlook_daemon(tmp_path, db_dsn, {OPS: 1}) as run:
        box = run.fake.mailbox(OPS)
        inbox_id = box.folder("inbox").id

        def inbox_sub() -> Any:
            return next(s for s in _live_subscriptions(run.fake, OPS) if s.folder_id == inbox_id)

        # missed: Graph dropped notifications; the mail that came meanwhile is synced
        first = inbox_sub()
        before = run.deltas(OPS)
        missed = box.add_message(generated_messages(1, tag="missed")[0])
        assert await run.fake.send_lifecycle(first.id, "missed") == 202
        await run.eventually(lambda: run.has_copy("ops", missed.immutable_id), "the missed mail")
        assert run.deltas(OPS) > before
        await run.eventually(
            lambda: _lifecycle_cleared(run, "ops", "inbox"), "the event acted on and cleared"
        )
        assert inbox_sub().id == first.id  # a resync, not a new subscription

        # subscriptionRemoved: Graph dropped the subscription itself
        await run.eventually(run.idle, "the runs ended")
        before = run.deltas(OPS)
        later = box.add_message(generated_messages(1, tag="removed")[0])
        assert await run.fake.send_lifecycle(first.id, "subscriptionRemoved") == 202
        await run.eventually(lambda: run.has_copy("ops", later.immutable_id), "the resync")
        assert run.deltas(OPS) > before
        await run.eventually(
            lambda: _lifecycle_cleared(run, "ops", "inbox"), "the event acted on and cleared"
        )
        second = inbox_sub()
        assert second.id != first.id
        assert second.notification_url == run.push_url()
        assert second.lifecycle_url == run.push_url(lifecycle=True)
        row = (await run.subscription_rows("ops"))["inbox"]
        assert row["subscription_id"] == second.id
        assert row["client_state"] == second.client_state
        # and the new subscription's notifications are accepted
        newest = box.add_message(generated_messages(1, tag="after")[0])
        assert await run.fake.notify(OPS, "inbox") == [202]
        await run.eventually(lambda: run.has_copy("ops", newest.immutable_id), "new mail")
        assert await run.rows("ops") == 4


async def _lifecycle_cleared(run: Running, mailbox: str, folder: str) -> bool:
    row = (await run.subscription_rows(mailbox)).get(folder)
    return row is not None and row["lifecycle_event"] is None


# --- 11: a revoked grant ------------------------------------------------------------------


async def test_a_revoked_grant_needs_attention_while_the_other_mailbox_syncs(
    tmp_path, db_dsn
) -> None:
    boxes = [Box("ops", OPS, delegated=True), Box("sales", SALES)]
    async with outlook_daemon(tmp_path, db_dsn, {OPS: 2, SALES: 2}, boxes) as run:
        run.fake.revoke_refresh_token(run.refresh_tokens[OPS])
        run.fake.mailbox(OPS).add_message(generated_messages(1, tag="lost")[0])
        run.fake.mailbox(SALES).add_message(generated_messages(1, tag="kept")[0])
        assert await run.fake.notify(OPS, "inbox") == [202]
        assert await run.fake.notify(SALES, "inbox") == [202]

        await run.eventually(
            lambda: _state_is(run, "ops", "needs_attention"), "ops needs attention"
        )
        await run.eventually(lambda: _equals(run.rows("sales"), 3), "sales keeps syncing")
        status = await run.status()
        assert status["ops"]["sync_state"] == "needs_attention"
        assert "invalid_grant" in (status["ops"]["last_error"] or "")
        assert status["sales"]["sync_state"] == "idle"
        assert await run.rows("ops") == 2
        # and later notifications for sales still bring mail
        later = run.fake.mailbox(SALES).add_message(generated_messages(1, tag="later")[0])
        assert await run.fake.notify(SALES, "inbox") == [202]
        await run.eventually(lambda: run.has_copy("sales", later.immutable_id), "sales syncing")
        assert await run.rows("sales") == 4


async def _state_is(run: Running, mailbox: str, state: str) -> bool:
    got = await run.fetchval("SELECT sync_state FROM mailboxes WHERE mailbox_id = $1", mailbox)
    return got == state


# --- 12: the sent copy of a recorded outbound message -------------------------------------


async def test_sent_copy_of_a_recorded_outbound_message_promotes_the_placeholder(
    tmp_path, db_dsn
) -> None:
    async with outlook_daemon(tmp_path, db_dsn, {OPS: 1}) as run:
        recorded = {
            "mailbox_id": "ops",
            "message_id_header": "<out-1@contoso.example>",
            "placeholder_message_id": "pending_abc",
            "thread_id": "pending_t1",
            "from_address": OPS,
            "subject": "Your order",
            "sent_at": "2026-11-02T09:30:00Z",
            "text": "Thanks for your order.",
            "send_status": "pending",
        }
        headers = {"Authorization": f"Bearer {API_TOKEN}"}
        async with run.session.post(
            f"{run.base}/v1/outbound", json=recorded, headers=headers
        ) as response:
            assert response.status == 201, await response.text()
            message_id = (await response.json())["message_id"]
        raw = (
            f"From: Ops <{OPS}>\r\nTo: customer@example.org\r\n"
            "Subject: Your order\r\nDate: Mon, 02 Nov 2026 09:30:00 +0000\r\n"
            "Message-ID: <out-1@contoso.example>\r\nMIME-Version: 1.0\r\n"
            "Content-Type: text/plain; charset=utf-8\r\n\r\nThanks for your order.\r\n"
        ).encode()
        sent = run.fake.mailbox(OPS).add_message(raw, folder="sentitems")
        assert await run.fake.notify(OPS, "sentitems") == [202]

        await run.eventually(lambda: run.has_copy("ops", sent.immutable_id), "the sent copy")
        ours = "SELECT count(*) FROM messages WHERE message_id_norm = 'out-1@contoso.example'"
        assert await run.fetchval(ours) == 1
        row = "SELECT {} FROM messages WHERE message_id = $1"
        assert await run.fetchval(row.format("external_id"), message_id) == sent.immutable_id
        assert await run.fetchval(row.format("direction"), message_id) == "outbound"
        assert await run.fetchval("SELECT count(*) FROM messages") == 2
        copy = await run.copy("ops", sent.immutable_id)
        assert copy is not None and list(copy["labels"]) == ["sentitems"]
