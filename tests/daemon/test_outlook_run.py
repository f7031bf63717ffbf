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

from typing import Any

import orjson
import pytest
from harness import generated_messages
from outlook_rig import (
    API_TOKEN,
    FOLDERS,
    OPS,
    SALES,
    WAIT_S,
    Box,
    Running,
    equals,
    live_subscriptions,
    outlook_daemon,
    state_is,
)

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.slow,
    pytest.mark.own_database,  # daemon subprocesses (tests/conftest.py)
]


async def test_subscriptions_are_validated_on_both_urls_and_a_notification_brings_mail(
    tmp_path, db_dsn
) -> None:
    async with outlook_daemon(tmp_path, db_dsn, {OPS: 3}) as run:
        notify_url, lifecycle_url = run.push_url(), run.push_url(lifecycle=True)
        subs = live_subscriptions(run.fake, OPS)
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
            s for s in live_subscriptions(fake, OPS) if s.folder_id == box.folder("inbox").id
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
        subs = live_subscriptions(run.fake, OPS)
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
            lambda: equals(run.events_count("mailbox.cursor_reset", "ops"), 1), "a cursor reset"
        )
        await run.eventually(lambda: equals(run.rows("ops"), 155), "155 rows")
        await run.eventually(run.idle, "the runs ended")
        assert not run.fake.delta.expire_next_skiptoken  # the 410 did happen
        assert await run.fetchval("SELECT count(*) FROM messages") == 155
        assert await run.fetchval("SELECT count(*) FROM dead_items") == 0
        for message in (added[0], added[99], added[100], added[-1]):
            assert await run.has_copy("ops", message.immutable_id)
        assert run.fake.counters.max_downloads() == 1  # nothing downloaded twice
        assert await run.cursor("ops") is not None
        assert await state_is(run, "ops", "idle")


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
        assert await state_is(run, "ops", "idle")  # retriable: no operator needed

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
        assert await state_is(run, "ops", "idle")


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
            return next(s for s in live_subscriptions(run.fake, OPS) if s.folder_id == inbox_id)

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

        await run.eventually(lambda: state_is(run, "ops", "needs_attention"), "ops needs attention")
        await run.eventually(lambda: equals(run.rows("sales"), 3), "sales keeps syncing")
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
