"""Gmail users.watch renewal under `inboxd run` (issue 22 item 7).

A mailbox that gets no mail gets no push and no sync; its watch must still be
renewed before it lapses, or Gmail stops publishing its changes and the next mail
waits for the daily safety sync. The fake's watches last seconds here (Gmail's
last 7 days), and the fake publishes a change only while the watch lives
(tests/fakes/gmail/state.py); the test plays Pub/Sub and delivers what was
published.
"""

from __future__ import annotations

import time

import pytest
from gmail_rig import SUPPORT, gmail_daemon
from harness import generated_messages

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.slow,
    pytest.mark.own_database,  # daemon subprocesses (tests/conftest.py)
]

# How long the fake's watches last. The daemon renews at half the remaining life
# (adapters/gmail/watch.py), so a renewal may be ~3 s late on a busy machine.
WATCH_TTL_S = 6
# Lifetimes the mailbox spends without mail, pushes or syncs after its first watch lapses.
QUIET_LIFETIMES = 2


async def test_the_watch_is_renewed_on_its_own_schedule_so_pushes_keep_arriving(
    tmp_path, db_dsn
) -> None:
    ttl_ms = WATCH_TTL_S * 1000
    async with gmail_daemon(tmp_path, db_dsn, {SUPPORT: 1}, watch_ttl_ms=ttl_ms) as run:
        box = run.fake.mailbox(SUPPORT)
        first = await run.eventually(lambda: box.watch, "the first users.watch")
        first_expiry_ms = first.expiration_ms
        cursor = await run.cursor("support")
        syncs = run.fake.counters.calls_of("users.history.list", SUPPORT)

        # no mail, no push, no sync: the first watch lapses, then more lifetimes pass
        await run.eventually(
            lambda: time.time() * 1000 > first_expiry_ms + QUIET_LIFETIMES * ttl_ms,
            f"{QUIET_LIFETIMES} watch lifetimes after the first one",
        )
        new = box.add_message(generated_messages(1, tag="quiet")[0])
        assert box.published, "the watch lapsed: Gmail published the new mail to no one"
        assert run.fake.counters.calls_of("users.watch", SUPPORT) > 1 + QUIET_LIFETIMES
        # renewed without any sync, and renewing never moved the cursor
        assert run.fake.counters.calls_of("users.history.list", SUPPORT) == syncs
        assert await run.cursor("support") == cursor
        recorded_ms = await run.fetchval(
            "SELECT (extract(epoch FROM watch_expires_at) * 1000)::bigint FROM mailboxes"
            " WHERE mailbox_id = 'support'"
        )
        assert recorded_ms > first_expiry_ms + QUIET_LIFETIMES * ttl_ms

        assert await run.deliver_published(SUPPORT) == [204]
        await run.eventually(lambda: run.has_copy("support", new.id), "the pushed message")
        await run.eventually(
            lambda: run.cursor_is("support", str(box.history_id)), "the cursor past it"
        )
        assert await run.rows("support") == 2
        assert run.fake.counters.max_downloads() == 1
