"""The Gmail door under `inboxd run`: a real daemon process against FakeGmail.

The daemon, the fake and the signed pushes are tests/daemon/gmail_rig.py's.
"""

from __future__ import annotations

from collections.abc import Awaitable

import anyio
import pytest
from gmail_rig import API_TOKEN, SALES, SUPPORT, Running, gmail_daemon
from harness import generated_messages
from helpers import cli_env, run_cli

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.slow,
    pytest.mark.own_database,  # daemon subprocesses (tests/conftest.py)
]


async def test_backfill_then_a_push_brings_the_new_message(tmp_path, db_dsn) -> None:
    async with gmail_daemon(tmp_path, db_dsn, {SUPPORT: 5}) as run:
        status = (await run.status())["support"]
        assert status["provider"] == "gmail" and status["sync_state"] == "idle"
        # users.watch was called when the mailbox started and its expiry recorded (~7 days)
        await run.eventually(
            lambda: run.fetchval(
                "SELECT watch_expires_at FROM mailboxes WHERE mailbox_id = 'support'"
            ),
            "the watch's expiry recorded",
        )
        assert run.fake.mailbox(SUPPORT).watch is not None

        (new,) = [run.fake.mailbox(SUPPORT).add_message(r) for r in generated_messages(1, tag="p")]
        assert await run.push(SUPPORT) == 204

        await run.eventually(
            lambda: run.has_copy("support", new.id), "a copy with the new Gmail id"
        )
        assert await run.rows("support") == 6
        assert run.fake.counters.max_downloads() == 1  # nothing downloaded twice


async def test_a_storm_of_pushes_costs_at_most_two_syncs(tmp_path, db_dsn) -> None:
    async with gmail_daemon(tmp_path, db_dsn, {SUPPORT: 2}, gated=True) as run:
        before = run.fake.counters.calls_of("users.history.list", SUPPORT)
        run.fake.mailbox(SUPPORT).add_message(generated_messages(1, tag="storm")[0])

        # one sync is held inside history.list while all 100 pushes are answered
        statuses = []
        async with anyio.create_task_group() as tg:
            for _ in range(100):
                tg.start_soon(lambda: _append(statuses, run.push(SUPPORT)))
        assert statuses == [204] * 100
        assert run.fake.gate is not None
        run.fake.gate.set()

        await run.eventually(lambda: _equals(run.rows("support"), 3), "3 rows")
        await anyio.sleep(3)  # room for any further sync to show up
        syncs = run.fake.counters.calls_of("users.history.list", SUPPORT) - before
        assert 1 <= syncs <= 2, syncs


async def _append(out: list[int], status: Awaitable[int]) -> None:
    out.append(await status)


async def _equals(value: Awaitable[int], expected: int) -> bool:
    return await value == expected


async def test_revoked_grant_needs_attention_while_the_other_mailbox_syncs(
    tmp_path, db_dsn
) -> None:
    async with gmail_daemon(tmp_path, db_dsn, {SUPPORT: 2, SALES: 2}) as run:
        run.fake.revoke_refresh_token(run.refresh_tokens[SUPPORT])
        run.fake.mailbox(SUPPORT).add_message(generated_messages(1, tag="lost")[0])
        run.fake.mailbox(SALES).add_message(generated_messages(1, tag="kept")[0])
        assert await run.push(SUPPORT) == 204
        assert await run.push(SALES) == 204

        await run.eventually(
            lambda: _state_is(run, "support", "needs_attention"), "support needs attention"
        )
        await run.eventually(lambda: _equals(run.rows("sales"), 3), "sales keeps syncing")
        status = await run.status()
        assert status["support"]["sync_state"] == "needs_attention"
        assert "invalid_grant" in (status["support"]["last_error"] or "")
        assert status["sales"]["sync_state"] == "idle"
        assert await run.rows("support") == 2
        # and later pushes for sales still bring mail
        run.fake.mailbox(SALES).add_message(generated_messages(1, tag="later")[0])
        assert await run.push(SALES) == 204
        await run.eventually(lambda: _equals(run.rows("sales"), 4), "sales still syncing")


async def _state_is(run: Running, mailbox: str, state: str) -> bool:
    got = await run.fetchval("SELECT sync_state FROM mailboxes WHERE mailbox_id = $1", mailbox)
    return got == state


async def test_sent_copy_of_a_recorded_outbound_message_promotes_the_placeholder(
    tmp_path, db_dsn
) -> None:
    async with gmail_daemon(tmp_path, db_dsn, {SUPPORT: 1}) as run:
        recorded = {
            "mailbox_id": "support",
            "message_id_header": "<out-1@acme.example>",
            "placeholder_message_id": "pending_abc",
            "thread_id": "pending_t1",
            "from_address": SUPPORT,
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
            f"From: Support <{SUPPORT}>\r\nTo: customer@example.org\r\n"
            "Subject: Your order\r\nDate: Mon, 02 Nov 2026 09:30:00 +0000\r\n"
            "Message-ID: <out-1@acme.example>\r\nMIME-Version: 1.0\r\n"
            "Content-Type: text/plain; charset=utf-8\r\n\r\nThanks for your order.\r\n"
        ).encode()
        sent = run.fake.mailbox(SUPPORT).add_message(raw, label_ids=["SENT"])
        assert await run.push(SUPPORT) == 204

        await run.eventually(lambda: run.has_copy("support", sent.id), "the SENT copy")
        ours = "SELECT count(*) FROM messages WHERE message_id_norm = 'out-1@acme.example'"
        assert await run.fetchval(ours) == 1
        row = "SELECT {} FROM messages WHERE message_id = $1"
        assert await run.fetchval(row.format("external_id"), message_id) == sent.id
        assert await run.fetchval(row.format("direction"), message_id) == "outbound"
        assert await run.fetchval("SELECT count(*) FROM messages") == 2


async def test_an_expired_cursor_resyncs_everything_without_downloading_twice(
    tmp_path, db_dsn
) -> None:
    async with gmail_daemon(tmp_path, db_dsn, {SUPPORT: 5}) as run:
        box = run.fake.mailbox(SUPPORT)
        new = [box.add_message(r) for r in generated_messages(2, tag="after")]
        box.expire_history()  # the cursor is now older than the history Gmail keeps
        assert await run.push(SUPPORT) == 204

        await run.eventually(
            lambda: run.cursor_is("support", str(box.history_id)), "the rebuilt cursor"
        )
        assert await run.rows("support") == 7
        assert await run.fetchval("SELECT count(*) FROM messages") == 7
        for message in new:
            assert await run.has_copy("support", message.id)
        assert run.fake.counters.calls_of("users.history.list", SUPPORT) >= 1
        assert run.fake.counters.max_downloads() == 1  # the 5 stored ones not fetched again
        resets = await run.fetchval(
            "SELECT count(*) FROM events WHERE kind = 'mailbox.cursor_reset'"
            " AND mailbox_id = 'support'"
        )
        assert resets == 1


async def test_a_message_deleted_before_its_fetch_does_not_pin_the_cursor(tmp_path, db_dsn) -> None:
    async with gmail_daemon(tmp_path, db_dsn, {SUPPORT: 1}) as run:
        box = run.fake.mailbox(SUPPORT)
        gone, kept = [box.add_message(r) for r in generated_messages(2, tag="race")]
        # listed in the history, then gone when fetched (Gmail answers 404 for it)
        run.fake.faults.fail_message(gone.id, 404, times=None)
        assert await run.push(SUPPORT) == 204

        await run.eventually(
            lambda: run.cursor_is("support", str(box.history_id)), "the cursor past both"
        )
        assert await run.has_copy("support", kept.id)
        assert not await run.has_copy("support", gone.id)
        reason = await run.fetchval(
            "SELECT reason FROM dead_items WHERE mailbox_id = 'support' AND external_id = $1",
            gone.id,
        )
        assert reason == "deleted_before_fetch"


async def test_a_part_rate_limited_past_every_retry_holds_the_cursor_until_a_later_run(
    tmp_path, db_dsn
) -> None:
    async with gmail_daemon(tmp_path, db_dsn, {SUPPORT: 1}) as run:
        box = run.fake.mailbox(SUPPORT)
        before = await run.cursor("support")
        limited, other = [box.add_message(r) for r in generated_messages(2, tag="429")]
        # 429 inside a 200 batch for one part, on every attempt of this run
        run.fake.faults.fail_message(
            limited.id, 429, times=None, retry_after_s=1, reason="rateLimitExceeded"
        )
        assert await run.push(SUPPORT) == 204

        await run.eventually(
            lambda: _last_error_mentions(run, "support", "rate"), "the run gives up"
        )
        assert await run.cursor("support") == before  # held: the page is not settled
        assert not await run.has_copy("support", limited.id)

        run.fake.faults.clear()
        # the mailbox's backoff (at least 30 s after a failure) runs out: time travel
        await run.fetchval(
            "UPDATE mailboxes SET throttle_until = now() WHERE mailbox_id = $1", "support"
        )
        await run.eventually(lambda: _unthrottled(run, "support"), "the backoff passed")
        await anyio.to_thread.run_sync(
            lambda: run_cli(
                "sync",
                "now",
                "--mailbox",
                "support",
                "--tenant",
                "acme",
                "--dsn",
                run.dsn,
                env=cli_env(run.tmp / "data"),
            )
        )
        await run.eventually(
            lambda: run.cursor_is("support", str(box.history_id)), "the next run completes"
        )
        assert await run.has_copy("support", limited.id)
        assert await run.has_copy("support", other.id)
        assert await run.rows("support") == 3


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


async def test_three_thousand_messages_in_one_history_window_are_all_stored(
    tmp_path, db_dsn
) -> None:
    async with gmail_daemon(tmp_path, db_dsn, {SUPPORT: 1}, unmetered=True) as run:
        box = run.fake.mailbox(SUPPORT)
        added = box.add_generated(3000)
        assert await run.push(SUPPORT) == 204

        await run.eventually(
            lambda: run.cursor_is("support", str(box.history_id)), "the cursor past 3,000"
        )
        assert await run.rows("support") == 3001
        assert await run.has_copy("support", added[0].id)
        assert await run.has_copy("support", added[-1].id)
        assert run.fake.counters.max_downloads() == 1


async def test_a_watch_renewal_leaves_the_cursor_where_the_sync_put_it(tmp_path, db_dsn) -> None:
    # the fake's watches last 2 s: the daemon renews them on its own schedule
    # (adapters/gmail/watch.py) while a message waits, unsynced, behind the cursor
    async with gmail_daemon(tmp_path, db_dsn, {SUPPORT: 1}, watch_ttl_ms=2000) as run:
        box = run.fake.mailbox(SUPPORT)
        cursor = await run.cursor("support")
        new = box.add_message(generated_messages(1, tag="w")[0])
        watches = run.fake.counters.calls_of("users.watch", SUPPORT)
        assert cursor is not None and int(cursor) < box.history_id

        await run.eventually(
            lambda: run.fake.counters.calls_of("users.watch", SUPPORT) >= watches + 2,
            "two renewals",
        )
        # users.watch answers the newest historyId: the cursor did not jump past
        # the message that is not synced yet
        assert await run.cursor("support") == cursor
        assert await run.push(SUPPORT) == 204
        await run.eventually(lambda: run.has_copy("support", new.id), "the new message")
        # The cursor is written once the page's rows committed, a moment after the copy.
        await run.eventually(
            lambda: run.cursor_is("support", str(box.history_id)), "the cursor at the end"
        )
        assert await run.rows("support") == 2
        status = (await run.status())["support"]
        assert status["watch_expires_at"] is not None
