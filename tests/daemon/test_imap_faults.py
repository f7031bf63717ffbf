"""The IMAP door under `inboxd run` when the server misbehaves (issue 22, items 8-11).

Against the session's Dovecot (tests/helpers/dovecot.py): the server restarted
under a live daemon, its user database failing for a while, a certificate the
mailbox cannot trust, a configured folder removed, an expunge while the daemon
idles. Each test watches what a user sees: rows, removed copies, the mailbox's
sync_state, last_error and throttle, events.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import orjson
import pytest
from harness import write_config
from helpers import run_cli_async
from helpers.db import fetch, fetchval
from helpers.dovecot import DovecotServer
from imap_rig import (
    LONG_POLL_S,
    WAIT_S,
    Imap,
    a_later_sync,
    copies,
    corpus_messages,
    external_ids,
    imap_tenant,
    passwords,
    start,
    status_json,
    stop,
    sync_state,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

# Mail delivered once the server is back is stored by IDLE in about a second; the
# bound is generous for a busy machine yet well under the throttle a failed run
# costs (30 s, pipeline/mailbox/scheduling.py) and the poll interval (LONG_POLL_S).
PROMPT_S = 20


async def mailbox_row(dsn: str, column: str) -> object:
    return await fetchval(
        dsn,
        f"SELECT {column} FROM mailboxes WHERE tenant_id = 'acme' AND mailbox_id = 'support'",
    )


async def first_sync(dsn: str, daemon) -> None:
    await daemon.eventually(
        lambda: mailbox_row(dsn, "cursor IS NOT NULL"),
        WAIT_S,
        what="the first sync",
    )


async def removed(dsn: str) -> set[str]:
    rows = await fetch(
        dsn,
        "SELECT external_id FROM message_copies WHERE tenant_id = 'acme'"
        " AND mailbox_id = 'support' AND removed_at IS NOT NULL",
    )
    return {row["external_id"] for row in rows}


async def test_a_server_restarted_under_a_live_daemon_is_used_again_at_once(
    tmp_path: Path, db_dsn: str, dovecot: DovecotServer, corpus: Path
) -> None:
    """Item 8: the pooled sync connection the restart closed is not reused (which
    failed the next run and throttled the mailbox, dropping IDLE's rings)."""
    user = dovecot.new_user()
    box = Imap("support", user, sync_mode="push", poll_interval_s=LONG_POLL_S)
    config = write_config(tmp_path, tenants={"acme": []})
    imap_tenant(tmp_path, "acme", dovecot, [box])
    daemon = start(tmp_path, config, db_dsn, passwords(box))
    try:
        await first_sync(db_dsn, daemon)
        warm, first, second = corpus_messages(corpus, 3)
        want = external_ids(
            dovecot, user.username, "INBOX", [dovecot.deliver(user.username, "INBOX", warm)]
        )
        await daemon.eventually(
            lambda: copies(db_dsn, "acme", "support"),
            WAIT_S,
            what="a message brought by IDLE (the sync connection is pooled now)",
            until=lambda got: got == want,
        )
        for raw in (first, second):
            dovecot.restart()
            uid = dovecot.deliver(user.username, "INBOX", raw)
            want |= external_ids(dovecot, user.username, "INBOX", [uid])
            await daemon.eventually(
                lambda: copies(db_dsn, "acme", "support"),
                PROMPT_S,
                what="the message delivered after the restart, stored via IDLE",
                until=lambda got, want=want: got == want,
            )
        assert await mailbox_row(db_dsn, "throttle_until") is None
        assert await mailbox_row(db_dsn, "last_error") is None
        # every line the IDLE watch logged about its reconnects names the mailbox
        reconnects = [e for e in daemon.events() if e.get("event") == "imap_idle_reconnect"]
        assert reconnects, daemon.log_tail()
        assert {(e.get("tenant"), e.get("mailbox")) for e in reconnects} == {("acme", "support")}
    finally:
        stop(daemon)


# The first backoff step of a failed run (pipeline/mailbox/scheduling.py BACKOFF_INITIAL_S).
FIRST_THROTTLE_S = 30


async def test_a_push_during_a_throttle_is_synced_when_it_ends(
    tmp_path: Path, db_dsn: str, dovecot: DovecotServer, corpus: Path
) -> None:
    """Item 8: a run that failed while the server was down throttles the mailbox;
    IDLE's rings during the throttle (the watch back, new mail) are run when it
    ends, not left to the next poll."""
    user = dovecot.new_user()
    box = Imap("support", user, sync_mode="push", poll_interval_s=LONG_POLL_S)
    config = write_config(tmp_path, tenants={"acme": []})
    imap_tenant(tmp_path, "acme", dovecot, [box])
    daemon = start(tmp_path, config, db_dsn, passwords(box))
    try:
        await first_sync(db_dsn, daemon)
        with dovecot.stopped():
            now = await run_cli_async(
                "sync", "now", "--mailbox", "support", "--tenant", "acme", "--dsn", db_dsn
            )
            assert now.code == 0, now.stderr
            await daemon.eventually(
                lambda: mailbox_row(db_dsn, "throttle_until"),
                WAIT_S,
                what="the run while the server is down failed and throttled",
            )
        uid = dovecot.deliver(user.username, "INBOX", corpus_messages(corpus, 1)[0])
        want = external_ids(dovecot, user.username, "INBOX", [uid])
        await daemon.eventually(
            lambda: copies(db_dsn, "acme", "support"),
            FIRST_THROTTLE_S + PROMPT_S,
            what="the mail IDLE announced during the throttle, synced when it ended",
            until=lambda got: got == want,
        )
    finally:
        stop(daemon)


async def test_a_temporary_login_failure_is_retried_and_never_needs_attention(
    tmp_path: Path, db_dsn: str, dovecot: DovecotServer, corpus: Path
) -> None:
    """Item 10: NO [UNAVAILABLE] at login (the user database is down) is retried;
    once the server recovers the mail is synced and IDLE works again."""
    user = dovecot.new_user()
    early, late = corpus_messages(corpus, 2)
    uids = [dovecot.deliver(user.username, "INBOX", early)]
    box = Imap("support", user, sync_mode="auto", poll_interval_s=1)
    config = write_config(tmp_path, tenants={"acme": []})
    imap_tenant(tmp_path, "acme", dovecot, [box])
    with dovecot.passdb_failing(user.username):
        daemon = start(tmp_path, config, db_dsn, passwords(box))
        try:
            await daemon.eventually(
                lambda: mailbox_row(db_dsn, "last_error"),
                WAIT_S,
                what="a run failed on the temporary login failure",
                until=lambda error: error is not None and "UNAVAILABLE" in error,
            )
            assert await sync_state(db_dsn, "acme", "support") != "needs_attention"
        except BaseException:
            stop(daemon)
            raise
    try:
        # the failure's throttle (30 s at first) runs out now: time travel
        await fetchval(
            db_dsn,
            "UPDATE mailboxes SET throttle_until = now() WHERE tenant_id = 'acme'"
            " AND mailbox_id = 'support'",
        )
        want = external_ids(dovecot, user.username, "INBOX", uids)
        await daemon.eventually(
            lambda: copies(db_dsn, "acme", "support"),
            WAIT_S,
            what="the mail synced once the user database is back",
            until=lambda got: got == want,
        )
        uid = dovecot.deliver(user.username, "INBOX", late)
        want |= external_ids(dovecot, user.username, "INBOX", [uid])
        await daemon.eventually(
            lambda: copies(db_dsn, "acme", "support"),
            WAIT_S,
            what="new mail after the recovery",
            until=lambda got: got == want,
        )
        assert await sync_state(db_dsn, "acme", "support") != "needs_attention"
        events = await fetch(
            db_dsn, "SELECT kind FROM events WHERE kind = 'mailbox.needs_attention'"
        )
        assert events == []
    finally:
        stop(daemon)


async def test_a_password_rotated_then_fixed_syncs_again_after_sighup(
    tmp_path: Path, db_dsn: str, dovecot: DovecotServer, corpus: Path
) -> None:
    """The server's password changed under the daemon ([AUTHENTICATIONFAILED] at the
    next login: needs attention, the runner stopped); once the operator fixed it, a
    SIGHUP with the same configuration starts the mailbox again: it leaves
    needs_attention and the mail that waited is stored."""
    user = dovecot.new_user()
    mail = corpus_messages(corpus, 3)
    first = [dovecot.deliver(user.username, "INBOX", mail[0])]
    box = Imap("support", user, sync_mode="push", poll_interval_s=LONG_POLL_S)
    config = write_config(tmp_path, tenants={"acme": []})
    imap_tenant(tmp_path, "acme", dovecot, [box])
    daemon = start(tmp_path, config, db_dsn, passwords(box))
    try:
        want = external_ids(dovecot, user.username, "INBOX", first)
        await daemon.eventually(
            lambda: copies(db_dsn, "acme", "support"),
            WAIT_S,
            what="INBOX synced",
            until=lambda got: got == want,
        )
        dovecot.add_user(user.username, "rotated-elsewhere")
        dovecot.restart()  # every connection drops: the next logins are refused
        waited = dovecot.deliver(user.username, "INBOX", mail[1])
        await daemon.eventually(
            lambda: sync_state(db_dsn, "acme", "support"),
            WAIT_S,
            what="needs attention for the refused password",
            until=lambda state: state == "needs_attention",
        )
        dovecot.add_user(user.username, user.password)  # the operator puts it back
        daemon.signal(signal.SIGHUP)
        want |= external_ids(dovecot, user.username, "INBOX", [waited])
        await daemon.eventually(
            lambda: copies(db_dsn, "acme", "support"),
            WAIT_S,
            what="the mail that waited, after the reload",
            until=lambda got: got == want,
        )
        await daemon.eventually(
            lambda: sync_state(db_dsn, "acme", "support"),
            WAIT_S,
            what="the mailbox out of needs_attention",
            until=lambda state: state == "idle",
        )
        uid = dovecot.deliver(user.username, "INBOX", mail[2])  # IDLE is back too
        want |= external_ids(dovecot, user.username, "INBOX", [uid])
        await daemon.eventually(
            lambda: copies(db_dsn, "acme", "support"),
            PROMPT_S,
            what="new mail through IDLE after the reload",
            until=lambda got: got == want,
        )
    finally:
        stop(daemon)


async def test_an_untrusted_certificate_needs_attention_with_the_reason(
    tmp_path: Path, db_dsn: str, dovecot: DovecotServer
) -> None:
    """Item 10: a certificate that fails verification is an operator's problem, not
    a server that will come back: needs_attention, saying why (it was retried for ever)."""
    user = dovecot.new_user()
    # the test CA is trusted, but the host name is one the certificate does not carry
    tls = (
        f'host = "{dovecot.mismatch_host}"\nport = {dovecot.tls_port}\nsecurity = "tls"\n'
        f'ca_file = "{dovecot.ca_file}"'
    )
    box = Imap("support", user, extra=tls)
    config = write_config(tmp_path, tenants={"acme": []})
    imap_tenant(tmp_path, "acme", dovecot, [box])
    daemon = start(tmp_path, config, db_dsn, passwords(box))
    try:
        await daemon.eventually(
            lambda: sync_state(db_dsn, "acme", "support"),
            WAIT_S,
            what="the mailbox needs attention",
            until=lambda state: state == "needs_attention",
        )
        status = await status_json(tmp_path, db_dsn)
        error = status[("acme", "support")]["last_error"] or ""
        assert "certificate" in error.lower(), error
    finally:
        stop(daemon)


async def test_tls_to_the_plain_port_needs_attention_with_the_reason(
    tmp_path: Path, db_dsn: str, dovecot: DovecotServer
) -> None:
    """`security = "tls"` against the STARTTLS port (143 for 993): the handshake meets
    an IMAP greeting in clear. A setting to fix, never a server that will come back:
    it was retried for ever, the mailbox never syncing and never needing attention."""
    user = dovecot.new_user()
    tls = (
        f'host = "{dovecot.cert_hostname}"\nport = {dovecot.plain_port}\nsecurity = "tls"\n'
        f'ca_file = "{dovecot.ca_file}"'
    )
    box = Imap("support", user, extra=tls)
    config = write_config(tmp_path, tenants={"acme": []})
    imap_tenant(tmp_path, "acme", dovecot, [box])
    daemon = start(tmp_path, config, db_dsn, passwords(box))
    try:
        await daemon.eventually(
            lambda: sync_state(db_dsn, "acme", "support"),
            WAIT_S,
            what="the mailbox needs attention",
            until=lambda state: state == "needs_attention",
        )
        status = await status_json(tmp_path, db_dsn)
        error = status[("acme", "support")]["last_error"] or ""
        assert "does not speak TLS" in error and "starttls" in error, error
    finally:
        stop(daemon)


async def test_a_missing_folder_does_not_hold_back_the_others(
    tmp_path: Path, db_dsn: str, dovecot: DovecotServer, corpus: Path
) -> None:
    """Item 11: INBOX keeps syncing without a throttle while Archive is gone; the
    status names Archive, and the mailbox needs attention once it stays missing."""
    user = dovecot.new_user()
    dovecot.create_folder(user.username, "Archive")
    mail = corpus_messages(corpus, 5)
    inbox = [dovecot.deliver(user.username, "INBOX", mail[0])]
    archived = [dovecot.deliver(user.username, "Archive", mail[1])]
    box = Imap("support", user, folders=("INBOX", "Archive"))
    config = write_config(tmp_path, tenants={"acme": []})
    imap_tenant(tmp_path, "acme", dovecot, [box])
    daemon = start(tmp_path, config, db_dsn, passwords(box))
    try:
        want = external_ids(dovecot, user.username, "INBOX", inbox)
        want |= external_ids(dovecot, user.username, "Archive", archived)
        await daemon.eventually(
            lambda: copies(db_dsn, "acme", "support"),
            WAIT_S,
            what="both folders synced",
            until=lambda got: got == want,
        )
        dovecot.delete_folder(user.username, "Archive")
        for raw in mail[2:4]:
            uid = dovecot.deliver(user.username, "INBOX", raw)
            want |= external_ids(dovecot, user.username, "INBOX", [uid])
            await daemon.eventually(
                lambda: copies(db_dsn, "acme", "support"),
                PROMPT_S,
                what="INBOX mail while Archive is missing",
                until=lambda got, want=want: got == want,
            )
        await daemon.eventually(
            lambda: mailbox_row(db_dsn, "last_error"),
            WAIT_S,
            what="the missing folder named in the status",
            until=lambda error: error is not None and "Archive" in error,
        )
        await daemon.eventually(
            lambda: sync_state(db_dsn, "acme", "support"),
            WAIT_S,
            what="needs attention once Archive stays missing",
            until=lambda state: state == "needs_attention",
        )
        assert await mailbox_row(db_dsn, "throttle_until") is None
        # still syncing INBOX
        uid = dovecot.deliver(user.username, "INBOX", mail[4])
        want |= external_ids(dovecot, user.username, "INBOX", [uid])
        await daemon.eventually(
            lambda: copies(db_dsn, "acme", "support"),
            PROMPT_S,
            what="INBOX mail while the mailbox needs attention for Archive",
            until=lambda got: got == want,
        )
        # the folder back: the mailbox is well again
        dovecot.create_folder(user.username, "Archive")
        await daemon.eventually(
            lambda: sync_state(db_dsn, "acme", "support"),
            WAIT_S,
            what="the mailbox well again once Archive is back",
            until=lambda state: state == "idle",
        )
        events = await fetch(
            db_dsn, "SELECT payload FROM events WHERE kind = 'mailbox.needs_attention'"
        )
        assert len(events) == 1 and "Archive" in events[0]["payload"], events
    finally:
        stop(daemon)


async def test_a_folder_that_stays_missing_stays_needing_attention_across_a_restart(
    tmp_path: Path, db_dsn: str, dovecot: DovecotServer, corpus: Path
) -> None:
    """A folder missing from the first sync on puts the mailbox in needs_attention
    after FOLDER_MISSING_RUNS runs, a count each process starts again: a restarted
    daemon set it back to idle at its first run, then announced it again (a second
    mailbox.needs_attention event per restart, alerts flapping)."""
    user = dovecot.new_user()
    mail = corpus_messages(corpus, 3)
    box = Imap("support", user, folders=("INBOX", "Archive"))
    config = write_config(tmp_path, tenants={"acme": []})
    imap_tenant(tmp_path, "acme", dovecot, [box])
    daemon = start(tmp_path, config, db_dsn, passwords(box))
    try:
        await daemon.eventually(
            lambda: sync_state(db_dsn, "acme", "support"),
            WAIT_S,
            what="needs attention for Archive",
            until=lambda state: state == "needs_attention",
        )
    finally:
        stop(daemon)
    daemon = start(tmp_path, config, db_dsn, passwords(box))
    try:
        want: set[str] = set()
        for raw in mail:  # three runs at least of the new process
            uid = dovecot.deliver(user.username, "INBOX", raw)
            want |= external_ids(dovecot, user.username, "INBOX", [uid])
            await daemon.eventually(
                lambda: copies(db_dsn, "acme", "support"),
                WAIT_S,
                what="INBOX mail after the restart",
                until=lambda got, want=want: got == want,
            )
        assert await sync_state(db_dsn, "acme", "support") == "needs_attention"
        events = await fetch(
            db_dsn, "SELECT payload FROM events WHERE kind = 'mailbox.needs_attention'"
        )
        assert len(events) == 1, events
    finally:
        stop(daemon)


async def test_a_folder_the_server_refuses_does_not_hold_back_the_others(
    tmp_path: Path, db_dsn: str, dovecot: DovecotServer, corpus: Path
) -> None:
    """A folder that exists but that the server will not open (its files unreadable:
    Dovecot answers EXAMINE `NO [SERVERBUG]`; an ACL answers [NOPERM]) failed the
    whole run, so INBOX mail waited out a throttle growing to an hour, IDLE's rings
    with it. INBOX keeps syncing; the status names the folder; it syncs once readable."""
    user = dovecot.new_user()
    dovecot.create_folder(user.username, "Archive")
    mail = corpus_messages(corpus, 5)
    inbox = [dovecot.deliver(user.username, "INBOX", mail[0])]
    box = Imap("support", user, folders=("INBOX", "Archive"))
    config = write_config(tmp_path, tenants={"acme": []})
    imap_tenant(tmp_path, "acme", dovecot, [box])
    daemon = start(tmp_path, config, db_dsn, passwords(box))
    archive = dovecot.home(user.username) / "Maildir" / ".Archive"
    readable = archive.stat().st_mode & 0o7777
    try:
        want = external_ids(dovecot, user.username, "INBOX", inbox)
        await daemon.eventually(
            lambda: copies(db_dsn, "acme", "support"),
            WAIT_S,
            what="INBOX synced",
            until=lambda got: got == want,
        )
        archive.chmod(0)  # the mail processes run as another user: they cannot read it
        for raw in mail[1:3]:
            uid = dovecot.deliver(user.username, "INBOX", raw)
            want |= external_ids(dovecot, user.username, "INBOX", [uid])
            await daemon.eventually(
                lambda: copies(db_dsn, "acme", "support"),
                PROMPT_S,
                what="INBOX mail while Archive is refused",
                until=lambda got, want=want: got == want,
            )
        await daemon.eventually(
            lambda: mailbox_row(db_dsn, "last_error"),
            WAIT_S,
            what="the refused folder named in the status",
            until=lambda error: error is not None and "Archive" in error,
        )
        assert await mailbox_row(db_dsn, "throttle_until") is None
        archive.chmod(readable)
        archived = [dovecot.deliver(user.username, "Archive", mail[3])]
        want |= external_ids(dovecot, user.username, "Archive", archived)
        uid = dovecot.deliver(user.username, "INBOX", mail[4])  # a ring: a run
        want |= external_ids(dovecot, user.username, "INBOX", [uid])
        await daemon.eventually(
            lambda: copies(db_dsn, "acme", "support"),
            WAIT_S,
            what="Archive synced once readable",
            until=lambda got: got == want,
        )
    finally:
        archive.chmod(readable)
        stop(daemon)


async def test_the_idle_folder_gone_in_push_mode_is_reported_without_a_poll(
    tmp_path: Path, db_dsn: str, dovecot: DovecotServer, corpus: Path
) -> None:
    """Push mode, the first folder (the one IDLE watches) deleted: the watch could not
    IDLE and rang nothing, so no run happened until the poll (a day away), the status
    said nothing and the other folders' mail waited. The watch's failure rings: the
    run reports the folder and syncs the rest."""
    user = dovecot.new_user()
    dovecot.create_folder(user.username, "Support")
    mail = corpus_messages(corpus, 2)
    box = Imap(
        "support",
        user,
        folders=("Support", "INBOX"),
        sync_mode="push",
        poll_interval_s=LONG_POLL_S,
    )
    config = write_config(tmp_path, tenants={"acme": []})
    imap_tenant(tmp_path, "acme", dovecot, [box])
    daemon = start(tmp_path, config, db_dsn, passwords(box))
    try:
        await first_sync(db_dsn, daemon)
        dovecot.delete_folder(user.username, "Support")
        dovecot.restart()  # the IDLE connection drops; its folder is gone when it is back
        uid = dovecot.deliver(user.username, "INBOX", mail[0])
        want = external_ids(dovecot, user.username, "INBOX", [uid])
        await daemon.eventually(
            lambda: mailbox_row(db_dsn, "last_error"),
            WAIT_S,
            what="the missing IDLE folder named in the status",
            until=lambda error: error is not None and "Support" in error,
        )
        await daemon.eventually(
            lambda: copies(db_dsn, "acme", "support"),
            WAIT_S,
            what="INBOX mail without a poll",
            until=lambda got: got == want,
        )
    finally:
        stop(daemon)


async def test_an_expunge_while_idling_is_recorded_without_a_poll(
    tmp_path: Path, db_dsn: str, dovecot: DovecotServer, corpus: Path
) -> None:
    """Item 11: with QRESYNC enabled, IDLE reports an expunge as `* VANISHED`; it
    rings too, so the copy is recorded removed before any poll."""
    user = dovecot.new_user()
    uids = [dovecot.deliver(user.username, "INBOX", raw) for raw in corpus_messages(corpus, 2)]
    box = Imap("support", user, sync_mode="push", poll_interval_s=LONG_POLL_S)
    config = write_config(tmp_path, tenants={"acme": []})
    imap_tenant(tmp_path, "acme", dovecot, [box])
    daemon = start(tmp_path, config, db_dsn, passwords(box))
    try:
        want = external_ids(dovecot, user.username, "INBOX", uids)
        await daemon.eventually(
            lambda: copies(db_dsn, "acme", "support"),
            WAIT_S,
            what="the backfill",
            until=lambda got: got == want,
        )
        dovecot.expunge(user.username, "INBOX", uids[0])
        gone = external_ids(dovecot, user.username, "INBOX", uids[:1])
        await daemon.eventually(
            lambda: removed(db_dsn),
            PROMPT_S,
            what="the expunged copy recorded removed",
            until=lambda got: got == gone,
        )
    finally:
        stop(daemon)


# --- the property: a stale cursor's mail is stored after the reset -----------------------

BACKFILLS = ["all", "none", 30]


async def cursor_folders(dsn: str) -> dict[str, Any]:
    cursor = await mailbox_row(dsn, "cursor")
    return orjson.loads(cursor)["folders"] if cursor else {}


async def cursor_resets(dsn: str) -> int:
    return await fetchval(
        dsn,
        "SELECT count(*) FROM events WHERE tenant_id = 'acme' AND mailbox_id = 'support'"
        " AND kind = 'mailbox.cursor_reset'",
    )


async def synced_once(tmp: Path, dsn: str, dovecot: DovecotServer, box: Imap, folders: int) -> Path:
    """Start the daemon, wait for its first sync of `folders` folders, stop it;
    the config to start it again."""
    config = write_config(tmp, tenants={"acme": []})
    imap_tenant(tmp, "acme", dovecot, [box])
    daemon = start(tmp, config, dsn, passwords(box))
    try:
        await daemon.eventually(
            lambda: cursor_folders(dsn),
            WAIT_S,
            what=f"the first sync of {folders} folders",
            until=lambda got: len(got) == folders,
        )
        await a_later_sync(dsn, daemon, "acme", "support")
    finally:
        stop(daemon)
    return config


@pytest.mark.parametrize("backfill", BACKFILLS)
async def test_a_uidvalidity_change_while_down_stores_the_mail_that_arrived(
    tmp_path: Path, db_dsn: str, dovecot: DovecotServer, corpus: Path, backfill: str | int
) -> None:
    """Archive gets new mail and a new UIDVALIDITY while the daemon is down: after
    the reset every message is stored, once, whatever `backfill` says."""
    user = dovecot.new_user()
    dovecot.create_folder(user.username, "Archive")
    mail = corpus_messages(corpus, 7, identified=True)
    for raw in mail[:2]:
        dovecot.deliver(user.username, "INBOX", raw)
    for raw in mail[2:4]:
        dovecot.deliver(user.username, "Archive", raw)
    box = Imap("support", user, folders=("INBOX", "Archive"), backfill=backfill)
    config = await synced_once(tmp_path, db_dsn, dovecot, box, 2)
    before = await fetchval(db_dsn, "SELECT count(*) FROM messages")
    assert before == (0 if backfill == "none" else 4)

    dovecot.deliver(user.username, "Archive", mail[4])  # while the cursor is stale
    dovecot.recreate_folder(user.username, "Archive")
    dovecot.deliver(user.username, "Archive", mail[5])
    inbox_new = dovecot.deliver(user.username, "INBOX", mail[6])
    want = external_ids(dovecot, user.username, "Archive", dovecot.uids(user.username, "Archive"))
    want |= external_ids(dovecot, user.username, "INBOX", [inbox_new])
    daemon = start(tmp_path, config, db_dsn, passwords(box))
    try:
        await daemon.eventually(
            lambda: copies(db_dsn, "acme", "support"),
            WAIT_S,
            what="every Archive message under its new UIDVALIDITY, and the new INBOX one",
            until=lambda got: want <= got,
        )
        await a_later_sync(db_dsn, daemon, "acme", "support")
        # nothing stored twice: one messages row per delivered message
        assert await fetchval(db_dsn, "SELECT count(*) FROM messages") == (
            5 if backfill == "none" else 7
        )
        assert await cursor_resets(db_dsn) == 1
    finally:
        stop(daemon)


@pytest.mark.parametrize("backfill", BACKFILLS)
async def test_a_server_that_forgot_its_modseq_and_uids_loses_no_mail(
    tmp_path: Path, db_dsn: str, dovecot: DovecotServer, corpus: Path, backfill: str | int
) -> None:
    """The server comes back behind the cursor (restored from a backup, its index
    rebuilt): HIGHESTMODSEQ below the cursor's, new mail under UIDs the cursor has
    passed. That is a cursor reset: the new mail is stored, nothing twice."""
    user = dovecot.new_user()
    mail = corpus_messages(corpus, 4, identified=True)
    for raw in mail[:2]:
        dovecot.deliver(user.username, "INBOX", raw)
    box = Imap("support", user, backfill=backfill)
    config = await synced_once(tmp_path, db_dsn, dovecot, box, 1)

    new = [dovecot.deliver(user.username, "INBOX", raw) for raw in mail[2:]]
    # what the server knew when the cursor was written is more than it knows now
    folders = await cursor_folders(db_dsn)
    status = dovecot.status(user.username, "INBOX")
    folders["INBOX"] |= {"last_uid": status.uidnext + 5, "modseq": status.highestmodseq + 100}
    await fetchval(
        db_dsn,
        "UPDATE mailboxes SET cursor = $1 WHERE tenant_id = 'acme' AND mailbox_id = 'support'",
        orjson.dumps({"v": 1, "folders": folders}).decode(),
    )
    want = external_ids(dovecot, user.username, "INBOX", new)
    daemon = start(tmp_path, config, db_dsn, passwords(box))
    try:
        await daemon.eventually(
            lambda: copies(db_dsn, "acme", "support"),
            WAIT_S,
            what="the mail that arrived behind the cursor",
            until=lambda got: want <= got,
        )
        await a_later_sync(db_dsn, daemon, "acme", "support")
        assert await fetchval(db_dsn, "SELECT count(*) FROM messages") == 4
        assert await cursor_resets(db_dsn) == 1
        assert (await cursor_folders(db_dsn))["INBOX"]["last_uid"] == status.uidnext - 1
    finally:
        stop(daemon)
