"""The IMAP door under `inboxd run` (issue 13): a real daemon process against Dovecot.

The session's private Dovecot (tests/helpers/dovecot.py) serves a user of its own
to each test; the tenant file points a `provider = "imap"` mailbox at its
plain-text loopback listener (`security = "none"`), the password a reference to a
variable in the daemon's environment. Mail is put in with `doveadm save`, as an
MTA's delivery would, and the test watches what a user of inboxd sees: rows in
message_copies, the mailbox's sync_state, `inboxd status --json`, events,
the metrics. Issue 13's scenarios: backfill then new mail (exactly the delivered
set, nothing marked read), IDLE within 2 s, a wrong password, a UIDVALIDITY
change, the server stopped mid-sync.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import orjson
import pytest
from harness import deliver, generated_messages, maildir, write_config
from helpers.db import fetch, fetchval
from helpers.dovecot import DovecotServer
from imap_rig import (
    ATTENTION_METRIC_S,
    IDLE_DELIVERY_S,
    LONG_POLL_S,
    WAIT_S,
    Imap,
    a_later_sync,
    copies,
    corpus_messages,
    external_ids,
    imap_tenant,
    metrics_text,
    passwords,
    start,
    status_json,
    stop,
    sync_state,
)

from inboxd.adapters.imap.client import COMMAND_TIMEOUT_S

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.slow,
    pytest.mark.own_database,  # daemon subprocesses (tests/conftest.py)
]


async def test_backfill_then_new_mail_stored_once_and_left_unread(
    tmp_path: Path, db_dsn: str, dovecot: DovecotServer, corpus: Path
) -> None:
    user = dovecot.new_user()
    first = [dovecot.deliver(user.username, "INBOX", raw) for raw in corpus_messages(corpus, 3)]
    box = Imap("support", user)
    config = write_config(tmp_path, tenants={"acme": []})
    imap_tenant(tmp_path, "acme", dovecot, [box])
    daemon = start(tmp_path, config, db_dsn, passwords(box))
    try:
        want = external_ids(dovecot, user.username, "INBOX", first)
        await daemon.eventually(
            lambda: copies(db_dsn, "acme", "support"),
            WAIT_S,
            what="the 3 delivered messages backfilled",
            until=lambda got: got == want,
        )

        more = corpus_messages(corpus, 2, skip=3)
        second = [dovecot.deliver(user.username, "INBOX", raw) for raw in more]
        want = external_ids(dovecot, user.username, "INBOX", first + second)
        assert len(want) == 5
        await daemon.eventually(
            lambda: copies(db_dsn, "acme", "support"),
            WAIT_S,
            what="the 2 new messages synced",
            until=lambda got: got == want,
        )
        # a later sync run (poll_interval_s 1) brings nothing twice
        await a_later_sync(db_dsn, daemon, "acme", "support")
        assert await copies(db_dsn, "acme", "support") == want
        assert await fetchval(db_dsn, "SELECT count(*) FROM messages") == 5
    finally:
        stop(daemon)
    flags = dovecot.flags(user.username, "INBOX")
    assert sorted(flags) == sorted(first + second)
    assert all("\\Seen" not in f for f in flags.values()), flags


@pytest.mark.parametrize("sync_mode", ["auto", "push"])
async def test_idle_stores_a_delivered_message_within_two_seconds(
    tmp_path: Path, db_dsn: str, dovecot: DovecotServer, corpus: Path, sync_mode: str
) -> None:
    user = dovecot.new_user()
    box = Imap("support", user, sync_mode=sync_mode, poll_interval_s=LONG_POLL_S)
    config = write_config(tmp_path, tenants={"acme": []})
    imap_tenant(tmp_path, "acme", dovecot, [box])
    daemon = start(tmp_path, config, db_dsn, passwords(box))
    try:
        await daemon.eventually(
            lambda: fetchval(
                db_dsn,
                "SELECT cursor IS NOT NULL FROM mailboxes WHERE tenant_id = 'acme'"
                " AND mailbox_id = 'support'",
            ),
            WAIT_S,
            what="the first sync of the empty folder",
        )
        # The first message proves the watch is listening (no poll is due for 300 s);
        # the second is timed.
        warm, timed = corpus_messages(corpus, 2)
        uid = dovecot.deliver(user.username, "INBOX", warm)
        want = external_ids(dovecot, user.username, "INBOX", [uid])
        await daemon.eventually(
            lambda: copies(db_dsn, "acme", "support"),
            WAIT_S,
            what="a message brought by IDLE",
            until=lambda got: got == want,
        )

        delivered_at = time.monotonic()
        uid = dovecot.deliver(user.username, "INBOX", timed)
        want |= external_ids(dovecot, user.username, "INBOX", [uid])
        left_s = IDLE_DELIVERY_S - (time.monotonic() - delivered_at)
        await daemon.eventually(
            lambda: copies(db_dsn, "acme", "support"),
            max(left_s, 0.0),
            what=f"the delivered message stored within {IDLE_DELIVERY_S} s",
            until=lambda got: got == want,
        )
    finally:
        stop(daemon)


async def test_a_wrong_password_needs_attention_while_another_tenant_syncs(
    tmp_path: Path, db_dsn: str, dovecot: DovecotServer, corpus: Path
) -> None:
    wrong_user, good_user = dovecot.new_user(), dovecot.new_user()
    for user in (wrong_user, good_user):
        dovecot.deliver(user.username, "INBOX", corpus_messages(corpus, 1)[0])
    wrong = Imap("support", wrong_user, password="not-" + wrong_user.password)
    good = Imap("sales", good_user)
    config = write_config(tmp_path, tenants={"acme": [], "globex": [], "initech": ["inbox"]})
    imap_tenant(tmp_path, "acme", dovecot, [wrong])
    imap_tenant(tmp_path, "globex", dovecot, [good])
    local = maildir(tmp_path, "initech", "inbox")
    daemon = start(tmp_path, config, db_dsn, passwords(wrong, good))
    try:
        await daemon.eventually(
            lambda: sync_state(db_dsn, "acme", "support"),
            WAIT_S,
            what="acme/support needs attention",
            until=lambda state: state == "needs_attention",
        )
        await daemon.eventually(
            lambda: copies(db_dsn, "globex", "sales"),
            WAIT_S,
            what="globex/sales backfilled",
            until=lambda got: len(got) == 1,
        )

        # after the failure, the others keep syncing
        uid = dovecot.deliver(good_user.username, "INBOX", corpus_messages(corpus, 1, skip=1)[0])
        deliver(local, generated_messages(2, tag="initech"))
        want = external_ids(dovecot, good_user.username, "INBOX", [1, uid])
        await daemon.eventually(
            lambda: copies(db_dsn, "globex", "sales"),
            WAIT_S,
            what="globex/sales: the new message",
            until=lambda got: got == want,
        )
        await daemon.eventually(
            lambda: copies(db_dsn, "initech", "inbox"),
            WAIT_S,
            what="initech/inbox (maildir) synced",
            until=lambda got: len(got) == 2,
        )

        status = await status_json(tmp_path, db_dsn)
        assert status[("acme", "support")]["sync_state"] == "needs_attention"
        assert status[("globex", "sales")]["sync_state"] != "needs_attention"
        assert await copies(db_dsn, "acme", "support") == set()
        # the server's own words, for the operator; never the password
        error = status[("acme", "support")]["last_error"]
        assert "authentication failed" in (error or "").lower(), error
        assert wrong.password not in error
        # one outbox event for the application, and no retry loop against the server
        events = await fetch(
            db_dsn,
            "SELECT tenant_id, payload FROM events WHERE kind = 'mailbox.needs_attention'",
        )
        assert [e["tenant_id"] for e in events] == ["acme"], events
        attempts = [
            e
            for e in daemon.events()
            if e.get("event") == "sync_needs_attention" and e.get("mailbox") == "support"
        ]
        assert len(attempts) == 1, attempts
        await daemon.eventually(
            lambda: metrics_text(daemon),
            ATTENTION_METRIC_S,
            what="the needs-attention gauge at 1 for acme/support",
            until=lambda text: (
                'inboxd_mailbox_needs_attention{mailbox="support",tenant="acme"} 1.0' in text
            ),
        )
    finally:
        stop(daemon)
    assert wrong.password not in daemon.log_path.read_text(errors="replace")


async def recreate_archive(
    tmp: Path, dsn: str, dovecot: DovecotServer, inbox: list[bytes], archived: list[bytes]
) -> None:
    """Sync INBOX and Archive, give Archive a new UIDVALIDITY with the same mail
    (dovecot.recreate_folder), then check the daemon read it again from scratch
    (one mailbox.cursor_reset, the cursor at Archive's new UIDVALIDITY) and
    stored nothing twice: the same messages, and the new copies are of them."""
    user = dovecot.new_user()
    dovecot.create_folder(user.username, "Archive")
    inbox_uids = [dovecot.deliver(user.username, "INBOX", raw) for raw in inbox]
    archive_uids = [dovecot.deliver(user.username, "Archive", raw) for raw in archived]
    box = Imap("support", user, folders=("INBOX", "Archive"))
    config = write_config(tmp, tenants={"acme": []})
    imap_tenant(tmp, "acme", dovecot, [box])
    daemon = start(tmp, config, dsn, passwords(box))
    try:
        before = external_ids(dovecot, user.username, "INBOX", inbox_uids)
        before |= external_ids(dovecot, user.username, "Archive", archive_uids)
        await daemon.eventually(
            lambda: copies(dsn, "acme", "support"),
            WAIT_S,
            what="both folders backfilled",
            until=lambda got: got == before,
        )
        messages = await message_ids(dsn)
        assert len(messages) == len(inbox) + len(archived)

        old, new = dovecot.recreate_folder(user.username, "Archive")
        renumbered = external_ids(
            dovecot, user.username, "Archive", dovecot.uids(user.username, "Archive")
        )
        assert len(renumbered) == len(archived)
        await daemon.eventually(
            lambda: archive_position(dsn),
            WAIT_S,
            what=f"the cursor at Archive {new}:{len(archived)} (was UIDVALIDITY {old})",
            until=lambda position: position == (new, len(archived)),
        )
        await daemon.eventually(
            lambda: copies(dsn, "acme", "support"),
            WAIT_S,
            what="copies of the re-read Archive",
            until=lambda got: renumbered <= got,
        )
        await a_later_sync(dsn, daemon, "acme", "support")

        resets = await fetch(
            dsn,
            "SELECT payload FROM events WHERE tenant_id = 'acme' AND mailbox_id = 'support'"
            " AND kind = 'mailbox.cursor_reset'",
        )
        assert len(resets) == 1, resets
        # nothing stored twice: the same messages rows as before the change
        assert await message_ids(dsn) == messages
        rows = await fetch(
            dsn,
            "SELECT message_id FROM message_copies WHERE tenant_id = 'acme'"
            " AND mailbox_id = 'support' AND external_id = ANY($1::text[])",
            sorted(renumbered),
        )
        assert {row["message_id"] for row in rows} <= set(messages)
    finally:
        stop(daemon)


async def message_ids(dsn: str) -> list[int]:
    rows = await fetch(dsn, "SELECT message_id FROM messages WHERE tenant_id = 'acme' ORDER BY 1")
    return [row["message_id"] for row in rows]


async def archive_position(dsn: str) -> tuple[int, int] | None:
    """(uidvalidity, last_uid) of Archive in acme/support's cursor."""
    cursor = await fetchval(
        dsn, "SELECT cursor FROM mailboxes WHERE tenant_id = 'acme' AND mailbox_id = 'support'"
    )
    folder = orjson.loads(cursor)["folders"].get("Archive") if cursor else None
    return None if folder is None else (folder["uidvalidity"], folder["last_uid"])


async def test_a_recreated_folder_resets_the_cursor_and_stores_nothing_twice(
    tmp_path: Path, db_dsn: str, dovecot: DovecotServer, corpus: Path
) -> None:
    mail = corpus_messages(corpus, 5, identified=True)
    await recreate_archive(tmp_path, db_dsn, dovecot, mail[:2], mail[2:])


async def test_a_recreated_folder_does_not_store_headerless_mail_twice(
    tmp_path: Path, db_dsn: str, dovecot: DovecotServer, corpus: Path
) -> None:
    # the first corpus files: no Message-ID, most without From or Date either
    mail = corpus_messages(corpus, 5)
    await recreate_archive(tmp_path, db_dsn, dovecot, mail[:2], mail[2:])


# Enough 100-UID windows that the first pages are stored well before the last is
# fetched, so the server can be stopped in the middle of the backfill.
INTERRUPTED_BACKFILL = 2000
# A server that goes away closes its connections: the door can know at once.
# 10 s leaves room for a slow runner.
DROPPED_CONNECTION_NOTICED_S = 10
# Today a command in flight on a dropped connection ends by its own deadline
# (adapters/imap/client.py COMMAND_TIMEOUT_S); this much more for the run to end.
RUN_ENDS_AFTER_TIMEOUT_S = 30


async def interrupt_backfill(
    tmp: Path, dsn: str, dovecot: DovecotServer, *, failure_within_s: float
) -> None:
    """Stop Dovecot in the middle of a backfill, wait (up to `failure_within_s`)
    for the run to be recorded as failed, start Dovecot again: the backfill
    completes with every message stored exactly once."""
    user = dovecot.new_user()
    dovecot.deliver_many(
        user.username, "INBOX", generated_messages(INTERRUPTED_BACKFILL, tag="restart")
    )
    box = Imap("support", user)
    config = write_config(tmp, tenants={"acme": []})
    imap_tenant(tmp, "acme", dovecot, [box])
    daemon = start(tmp, config, dsn, passwords(box))
    try:
        await daemon.eventually(
            lambda: copies(dsn, "acme", "support"),
            WAIT_S,
            what="the first pages of the backfill",
            until=bool,
        )
        # The daemon is frozen while the server stops (which takes a second or
        # two: its processes say BYE and exit): a fast machine finished the
        # backfill within the stop, and the test then checked nothing.
        daemon.signal(signal.SIGSTOP)
        try:
            stored = len(await copies(dsn, "acme", "support"))
            assert stored < INTERRUPTED_BACKFILL, "the backfill finished before the stop"
            dovecot.stop()
        finally:
            daemon.signal(signal.SIGCONT)
        with dovecot.stopped():
            await daemon.eventually(
                lambda: fetchval(
                    dsn,
                    "SELECT last_error FROM mailboxes WHERE tenant_id = 'acme'"
                    " AND mailbox_id = 'support'",
                ),
                failure_within_s,
                what="the interrupted run recorded as failed",
            )
        # the failure's backoff (30 s at first) runs out now: time travel
        await fetchval(
            dsn,
            "UPDATE mailboxes SET throttle_until = now() WHERE tenant_id = 'acme'"
            " AND mailbox_id = 'support'",
        )
        uids = list(range(1, INTERRUPTED_BACKFILL + 1))
        want = external_ids(dovecot, user.username, "INBOX", uids)
        await daemon.eventually(
            lambda: copies(dsn, "acme", "support"),
            WAIT_S,
            what=f"all {INTERRUPTED_BACKFILL} messages after the restart",
            until=lambda got: got == want,
        )
        assert await fetchval(dsn, "SELECT count(*) FROM messages") == INTERRUPTED_BACKFILL
    finally:
        stop(daemon)


async def test_a_server_stopped_mid_sync_then_back_completes_exactly_once(
    tmp_path: Path, db_dsn: str, dovecot: DovecotServer
) -> None:
    await interrupt_backfill(
        tmp_path, db_dsn, dovecot, failure_within_s=COMMAND_TIMEOUT_S + RUN_ENDS_AFTER_TIMEOUT_S
    )


async def test_a_server_going_away_fails_the_run_at_once(
    tmp_path: Path, db_dsn: str, dovecot: DovecotServer
) -> None:
    await interrupt_backfill(
        tmp_path, db_dsn, dovecot, failure_within_s=DROPPED_CONNECTION_NOTICED_S
    )
