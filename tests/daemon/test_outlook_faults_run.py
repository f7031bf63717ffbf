"""The Outlook door under `inboxd run`: answers about the mailbox and its credentials.

Issue 22, items 4-6: a mailbox-level 404 inside `$batch` is not "the message was
deleted" (nothing dead-lettered, the mailbox needs attention with Graph's words,
the mail stored once the mailbox is back); an access token Graph refuses before its
expiry is replaced and the request sent again with the new one; a refresh token
Entra rotated is what the daemon presents after a restart.
"""

from __future__ import annotations

import signal

import pytest
from harness import generated_messages
from outlook_rig import OPS, Box, equals, outlook_daemon, state_is

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.slow,
    pytest.mark.own_database,  # daemon subprocesses (tests/conftest.py)
]


async def _last_error(run, mailbox: str) -> str:
    return await run.fetchval("SELECT last_error FROM mailboxes WHERE mailbox_id = $1", mailbox)


# --- item 4: a mailbox-level 404 inside $batch ----------------------------------------------


@pytest.mark.parametrize(
    ("code", "text"),
    [
        ("ErrorInvalidUser", "The requested user 'ops@contoso.example' is invalid."),
        ("MailboxNotEnabledForRESTAPI", "REST API is not yet supported for this mailbox."),
    ],
)
async def test_a_mailbox_level_404_in_a_batch_needs_attention_and_dead_letters_nothing(
    tmp_path, db_dsn, code, text
) -> None:
    async with outlook_daemon(tmp_path, db_dsn, {OPS: 1}) as run:
        box = run.fake.mailbox(OPS)
        before = await run.cursor("ops")
        arrived = [box.add_message(raw) for raw in generated_messages(2, tag="away")]
        # the delta page lists them; every body request inside $batch answers the
        # mailbox-level 404 (the mailbox went away between the two)
        run.fake.faults.fail_next_requests(
            None, 404, kinds={"message.value"}, code=code, message=text
        )
        assert await run.fake.notify(OPS, "inbox") == [202]

        await run.eventually(lambda: state_is(run, "ops", "needs_attention"), "needs attention")
        error = await _last_error(run, "ops")
        assert code in error and text in error, error
        assert await run.fetchval("SELECT count(*) FROM dead_items") == 0
        assert await run.cursor("ops") == before
        assert await run.rows("ops") == 1

        # the mailbox is back; a reload gives it another run (once the failure's
        # backoff ran out: time travel) and the mail is stored
        run.fake.faults.clear()
        await run.fetchval(
            "UPDATE mailboxes SET throttle_until = now() WHERE mailbox_id = $1", "ops"
        )
        run.daemon.signal(signal.SIGHUP)
        for message in arrived:
            await run.eventually(lambda m=message: run.has_copy("ops", m.immutable_id), "mail")
        await run.eventually(lambda: state_is(run, "ops", "idle"), "idle again")
        await run.eventually(run.idle, "the runs ended")
        assert await run.rows("ops") == 3
        assert await run.fetchval("SELECT count(*) FROM dead_items") == 0
        assert run.fake.counters.max_downloads() == 1


async def test_a_mailbox_level_404_looking_up_a_removal_marks_no_copy_deleted(
    tmp_path, db_dsn
) -> None:
    async with outlook_daemon(tmp_path, db_dsn, {OPS: 2}) as run:
        gone, _kept = sorted(
            run.fake.mailbox(OPS).in_folder(run.fake.mailbox(OPS).folder("inbox").id),
            key=lambda m: m.entered_seq,
        )
        run.fake.delete_message(gone.immutable_id)
        # delta says @removed; where the copy went is asked by $batch, and Graph
        # answers about the mailbox, not the message
        run.fake.faults.fail_next_requests(
            None, 404, kinds={"message.get"}, code="ErrorInvalidUser"
        )
        assert await run.fake.notify(OPS, "inbox", message_id=_kept.immutable_id) == [202]
        await run.eventually(lambda: state_is(run, "ops", "needs_attention"), "needs attention")
        copy = await run.copy("ops", gone.immutable_id)
        assert copy is not None and copy["removed_at"] is None
        assert await run.events_count("message.removed", "ops") == 0

        run.fake.faults.clear()
        await run.fetchval(
            "UPDATE mailboxes SET throttle_until = now() WHERE mailbox_id = $1", "ops"
        )
        run.daemon.signal(signal.SIGHUP)
        await run.eventually(
            lambda: equals(run.events_count("message.removed", "ops"), 1), "the removal"
        )
        copy = await run.copy("ops", gone.immutable_id)
        assert copy is not None and copy["removal_reason"] == "deleted"


async def test_an_item_level_404_in_a_batch_is_a_message_deleted_before_fetch(
    tmp_path, db_dsn
) -> None:
    async with outlook_daemon(tmp_path, db_dsn, {OPS: 1}) as run:
        box = run.fake.mailbox(OPS)
        gone, kept = (box.add_message(raw) for raw in generated_messages(2, tag="item"))
        run.fake.faults.fail_message(gone.immutable_id, 404, times=None)  # ErrorItemNotFound
        assert await run.fake.notify(OPS, "inbox") == [202]
        await run.eventually(lambda: run.has_copy("ops", kept.immutable_id), "the other one")
        await run.eventually(
            lambda: equals(run.fetchval("SELECT count(*) FROM dead_items"), 1), "one dead item"
        )
        assert await state_is(run, "ops", "idle")
        reason = await run.fetchval("SELECT reason FROM dead_items")
        assert reason == "deleted_before_fetch"


# --- item 5: an access token Graph refuses before its expiry -----------------------------


async def test_a_revoked_access_token_is_replaced_and_the_retry_carries_the_new_one(
    tmp_path, db_dsn
) -> None:
    async with outlook_daemon(tmp_path, db_dsn, {OPS: 1}) as run:
        box, fake = run.fake.mailbox(OPS), run.fake
        issued = fake.counters.token_requests["client_credentials"]
        assert fake.revoke_access_tokens() >= 1  # continuous access evaluation, say
        first = box.add_message(generated_messages(1, tag="cae")[0])
        assert await fake.notify(OPS, "inbox") == [202]
        await run.eventually(lambda: run.has_copy("ops", first.immutable_id), "the message")
        await run.eventually(run.idle, "the runs ended")
        assert await state_is(run, "ops", "idle")
        assert fake.counters.token_requests["client_credentials"] == issued + 1

        # the same inside $batch: a 401 in the batch's answer is no reason to
        # dead-letter the message; it is asked again with a new token, and the other
        # message of the batch is not downloaded twice
        second, third = (box.add_message(r) for r in generated_messages(2, tag="cae-batch"))
        fake.faults.fail_message(
            second.immutable_id, 401, times=1, code="InvalidAuthenticationToken"
        )
        assert await fake.notify(OPS, "inbox") == [202]
        for message in (second, third):
            await run.eventually(lambda m=message: run.has_copy("ops", m.immutable_id), "mail")
        await run.eventually(run.idle, "the runs ended")
        assert await state_is(run, "ops", "idle")
        assert await run.fetchval("SELECT count(*) FROM dead_items") == 0
        assert await run.rows("ops") == 4
        assert fake.counters.max_downloads() == 1


# --- item 6: a refresh token Entra rotated outlives the process ---------------------------


async def test_a_rotated_refresh_token_is_the_one_presented_after_a_restart(
    tmp_path, db_dsn
) -> None:
    boxes = [Box("ops", OPS, delegated=True)]
    async with outlook_daemon(tmp_path, db_dsn, {OPS: 1}, boxes) as run:
        fake, box = run.fake, run.fake.mailbox(OPS)
        identity = fake.identity
        token_file = tmp_path / "ops.refresh-token"
        configured = token_file.read_text()
        # from now on Entra refuses a refresh token once redeemed (AADSTS70000); the
        # configured one was redeemed by the first sync already
        identity.single_use_refresh_tokens = True
        assert identity.refresh_tokens[run.refresh_tokens[OPS]].redeemed
        # a refresh while running: its access token is refused, the daemon refreshes
        fake.revoke_access_tokens(OPS)
        live = box.add_message(generated_messages(1, tag="live")[0])
        assert await fake.notify(OPS, "inbox") == [202]
        await run.eventually(lambda: run.has_copy("ops", live.immutable_id), "the live mail")
        await run.eventually(run.idle, "the runs ended")

        stale: list = []

        async def while_down() -> None:
            stale.append(box.add_message(generated_messages(1, tag="down")[0]))

        await run.restart(while_down)
        await run.eventually(lambda: run.has_copy("ops", stale[0].immutable_id), "mail after")
        await run.eventually(run.idle, "the runs ended")
        status = await run.status()
        assert status["ops"]["sync_state"] == "idle", status["ops"]["last_error"]
        assert token_file.read_text() == configured  # the operator's file is left alone
        # the door presented only the newest token each time: none was refused
        assert identity.refused_redeemed == 0

        # the operator connects again (a new sign-in written to the same file): the
        # configured token wins over the stored one
        fresh = fake.issue_refresh_token(OPS)

        async def reconnect() -> None:
            token_file.write_text(fresh + "\n")
            stale.append(box.add_message(generated_messages(1, tag="again")[0]))

        await run.restart(reconnect)
        await run.eventually(lambda: run.has_copy("ops", stale[1].immutable_id), "mail again")
        assert identity.refresh_tokens[fresh].redeemed
        assert await state_is(run, "ops", "idle")
        assert await run.rows("ops") == 4

        # no refresh token, stored or issued, in any log or in status
        logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("daemon*.log"))
        shown = await run.status_text()
        for token in identity.refresh_tokens:
            assert token not in logs
            assert token not in shown
