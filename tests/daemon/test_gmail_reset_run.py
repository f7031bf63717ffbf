"""Gmail cursor resets under `inboxd run`, for every `backfill` setting (issue 22).

The daemon syncs, goes down, and mail arrives while it is down; Gmail then forgets
the history after the last committed historyId, so the restarted daemon's
history.list answers 404 and the cursor is reset. Whatever the mailbox's
`backfill` ("none", a number of days, "all"), every message that arrived while
the cursor was stale is stored after the reset, including one delivered late (a
new historyId, an internalDate older than the backfill window: delayed delivery,
an import, a restore), and no body is downloaded twice. `backfill` governs only
the first sync of a new mailbox.
"""

from __future__ import annotations

import time

import pytest
from gmail_rig import SUPPORT, GatedGmail, daemon_life, tenant_file
from harness import generated_messages, write_config
from helpers.google_jwt import GoogleSigner

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.slow,
    pytest.mark.own_database,  # daemon subprocesses (tests/conftest.py)
]

DAY_MS = 86_400_000
# A numeric backfill window and a late delivery well outside it.
WINDOW_DAYS = 30
LATE_AGE_DAYS = 90


@pytest.mark.parametrize("backfill", ['"none"', str(WINDOW_DAYS), '"all"'])
async def test_mail_that_arrived_while_the_cursor_was_stale_is_stored_after_the_reset(
    tmp_path, db_dsn, backfill
) -> None:
    async with GatedGmail() as fake:
        box = fake.add_user(SUPPORT)
        signer = GoogleSigner()
        fake.set_certs(signer.certs())
        now_ms = int(time.time() * 1000)
        # in the mailbox before the daemon ever ran (inside any backfill window)
        before = [
            box.add_message(raw, internal_date_ms=now_ms - DAY_MS)
            for raw in generated_messages(2, tag="before")
        ]
        token = tmp_path / "support.refresh-token"
        token.write_text(fake.issue_refresh_token(SUPPORT) + "\n")
        write_config(tmp_path)
        (tmp_path / "tenants" / "acme.toml").write_text(
            tenant_file(fake, {SUPPORT: token}, backfill=backfill)
        )

        async with daemon_life(tmp_path, db_dsn, fake, signer, "first") as run:
            await run.eventually(lambda: run.cursor("support"), "the first sync's cursor")
            pushed = box.add_message(generated_messages(1, tag="pushed")[0])
            assert await run.push(SUPPORT) == 204
            await run.eventually(
                lambda: run.cursor_is("support", str(box.history_id)), "the pushed message"
            )
            assert await run.has_copy("support", pushed.id)

        # the daemon is down: mail arrives, one of it delivered late, and Gmail
        # forgets the history after the cursor (history.list answers 404)
        recent = box.add_message(
            generated_messages(1, tag="recent")[0], internal_date_ms=now_ms - DAY_MS
        )
        late = box.add_message(
            generated_messages(1, tag="late")[0],
            internal_date_ms=now_ms - LATE_AGE_DAYS * DAY_MS,
        )
        box.expire_history()

        async with daemon_life(tmp_path, db_dsn, fake, signer, "second") as run:
            await run.eventually(
                lambda: run.cursor_is("support", str(box.history_id)), "the rebuilt cursor"
            )
            for message in (recent, late, pushed):
                assert await run.has_copy("support", message.id), message
            # a reset lists every configured label in full: what was there before
            # the first sync is stored too, whatever the backfill
            for message in before:
                assert await run.has_copy("support", message.id), message
            assert await run.rows("support") == 5
            assert await run.fetchval("SELECT count(*) FROM messages") == 5
            assert fake.counters.max_downloads() == 1  # nothing downloaded twice
            resets = await run.fetchval(
                "SELECT count(*) FROM events WHERE kind = 'mailbox.cursor_reset'"
                " AND mailbox_id = 'support'"
            )
            assert resets == 1
            # the application is told of each message the reset found, one event each
            for message in (recent, late):
                told = await run.fetchval(
                    "SELECT count(*) FROM events e JOIN message_copies c"
                    " ON c.tenant_id = e.tenant_id AND c.message_id = e.message_id"
                    " WHERE e.kind = 'message.created' AND c.external_id = $1",
                    message.id,
                )
                assert told == 1, message
