"""The IMAP source against a real Dovecot (tests/helpers/dovecot.py), in process."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from helpers.dovecot import DovecotServer
from helpers.secrets import PlainSecret
from helpers.waiting import eventually

from inboxd.adapters.imap.client import ImapConnection
from inboxd.adapters.imap.config import ImapMailbox
from inboxd.adapters.imap.cursor import load_cursor
from inboxd.adapters.imap.errors import ImapAuthError, ImapCertificateError, ImapLoginRefused
from inboxd.adapters.imap.source import LOGIN_REFUSED_ATTEMPTS, ImapSource
from inboxd.pipeline.errors import CursorExpired
from inboxd.pipeline.message import MessageData

pytestmark = pytest.mark.slow


def _corpus(corpus: Path, n: int, skip: int = 0) -> list[bytes]:
    files = sorted((corpus / "mime").rglob("*.eml"))[skip : skip + n]
    return [p.read_bytes() for p in files]


def _mailbox(server: DovecotServer, user, **over: object) -> ImapMailbox:
    settings: dict[str, object] = {
        "host": server.host,
        "port": server.plain_port,
        "security": "none",
        "username": user.username,
        "password": PlainSecret(user.password),
        "backfill": "all",
        **over,
    }
    return ImapMailbox.from_settings(settings)


async def _run(source: ImapSource, cursor: str | None) -> tuple[list, str | None]:
    items: list = []
    async for page in source.pages(cursor):
        items.extend(page.items)
        cursor = page.cursor_after or cursor
    return items, cursor


async def test_backfill_then_only_new_mail_and_nothing_marked_read(
    dovecot: DovecotServer, corpus: Path
) -> None:
    user = dovecot.new_user()
    for raw in _corpus(corpus, 3):
        dovecot.deliver(user.username, "INBOX", raw)
    source = ImapSource("acme", "imap", _mailbox(dovecot, user), window=2)
    try:
        first, cursor = await _run(source, None)
        status = dovecot.status(user.username, "INBOX")
        assert [i.external_id for i in first] == [
            f"INBOX:{status.uidvalidity}:{uid}" for uid in (1, 2, 3)
        ]
        assert load_cursor(cursor)["INBOX"].last_uid == 3
        for raw in _corpus(corpus, 2, skip=3):
            dovecot.deliver(user.username, "INBOX", raw)
        second, cursor = await _run(source, cursor)
        assert [i.external_id.rsplit(":", 1)[1] for i in second] == ["4", "5"]
        nothing, _ = await _run(source, cursor)
        assert nothing == []
    finally:
        await source.aclose()
    assert all("\\Seen" not in flags for flags in dovecot.flags(user.username, "INBOX").values())
    assert all(isinstance(i, MessageData) and i.raw for i in first + second)


async def test_a_recreated_folder_is_read_again_and_its_old_copies_retired(
    dovecot: DovecotServer, corpus
) -> None:
    user = dovecot.new_user()
    dovecot.create_folder(user.username, "Archive")
    for raw in _corpus(corpus, 2):
        dovecot.deliver(user.username, "Archive", raw)
    stored: list[str] = []

    async def stored_under(prefix: str) -> list[str]:
        return [i for i in stored if i.startswith(prefix)]

    mailbox = _mailbox(dovecot, user, folders=["Archive"])
    source = ImapSource("acme", "imap", mailbox, stored_under=stored_under)
    try:
        items, cursor = await _run(source, None)
        stored.extend(i.external_id for i in items)
        dovecot.recreate_folder(user.username, "Archive")
        with pytest.raises(CursorExpired) as expired:
            await _run(source, cursor)
        removed: dict[str, str] = {}
        again: list = []
        async for page in source.pages(expired.value.restart_from):
            again.extend(page.items)
            removed.update(page.removed)
            cursor = page.cursor_after or cursor
        assert len(again) == 2 and {i.external_id for i in again}.isdisjoint(stored)
        assert removed == dict.fromkeys(stored, "uidvalidity_changed")
        assert [p.removed async for p in source.pages(cursor)] == []  # retired once
    finally:
        await source.aclose()


async def test_tls_and_starttls_verify_the_certificate(dovecot: DovecotServer, corpus) -> None:
    user = dovecot.new_user()
    dovecot.deliver(user.username, "INBOX", _corpus(corpus, 1)[0])
    for security, port in (("tls", dovecot.tls_port), ("starttls", dovecot.plain_port)):
        mailbox = _mailbox(
            dovecot,
            user,
            host=dovecot.cert_hostname,
            port=port,
            security=security,
            ca_file=str(dovecot.ca_file),
        )
        source = ImapSource("acme", "imap", mailbox)
        try:
            items, _ = await _run(source, None)
        finally:
            await source.aclose()
        assert len(items) == 1, security
        wrong = _mailbox(
            dovecot,
            user,
            host=dovecot.mismatch_host,
            port=port,
            security=security,
            ca_file=str(dovecot.ca_file),
        )
        # a certificate that fails verification needs an operator (issue 22 #10)
        with pytest.raises(ImapCertificateError, match="certificate"):
            await _run(ImapSource("acme", "imap", wrong), None)


async def test_a_wrong_password_is_an_auth_error(dovecot: DovecotServer) -> None:
    user = dovecot.new_user()
    mailbox = _mailbox(dovecot, user, password=PlainSecret("not-the-password"))
    with pytest.raises(ImapAuthError):
        await _run(ImapSource("acme", "imap", mailbox), None)


async def test_idle_rings_when_mail_arrives(dovecot: DovecotServer, corpus) -> None:
    user = dovecot.new_user()
    source = ImapSource("acme", "imap", _mailbox(dovecot, user))
    rings: list[float] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(source.watch, lambda: rings.append(anyio.current_time()))
        # the first ring says the watch is listening (and covers mail from before)
        await eventually(lambda: len(rings), 10, what="the IDLE watch listening")
        listening = len(rings)
        dovecot.deliver(user.username, "INBOX", _corpus(corpus, 1)[0])
        # the issue: such mail is stored within 2 s, so it must ring well within that
        await eventually(lambda: len(rings) > listening, 2, what="a ring for the new mail")
        tg.cancel_scope.cancel()


async def test_expunged_mail_is_reported_once_through_qresync(
    dovecot: DovecotServer, corpus: Path
) -> None:
    user = dovecot.new_user()
    for raw in _corpus(corpus, 3):
        dovecot.deliver(user.username, "INBOX", raw)
    source = ImapSource("acme", "imap", _mailbox(dovecot, user))
    try:
        removed: dict[str, str] = {}
        _, cursor = await _run(source, None)
        dovecot.expunge(user.username, "INBOX", 2)
        async for page in source.pages(cursor):
            removed.update(page.removed)
            cursor = page.cursor_after or cursor
        uidvalidity = dovecot.status(user.username, "INBOX").uidvalidity
        assert removed == {f"INBOX:{uidvalidity}:2": "expunged"}
        again = [p.removed async for p in source.pages(cursor)]
        assert all(not r for r in again)
    finally:
        await source.aclose()


async def test_without_qresync_expunges_are_found_by_a_bounded_scan(
    dovecot: DovecotServer, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def no_qresync(self: ImapConnection) -> None:
        return None  # a server that does not offer QRESYNC (Gmail's IMAP, for one)

    monkeypatch.setattr(ImapConnection, "_enable_qresync", no_qresync)
    user = dovecot.new_user()
    for raw in _corpus(corpus, 3):
        dovecot.deliver(user.username, "INBOX", raw)
    stored: list[str] = []
    scans: list[str] = []

    async def stored_under(prefix: str) -> list[str]:
        scans.append(prefix)
        return [i for i in stored if i.startswith(prefix)]

    source = ImapSource("acme", "imap", _mailbox(dovecot, user), stored_under=stored_under)
    try:
        items, cursor = await _run(source, None)
        stored.extend(i.external_id for i in items)
        dovecot.expunge(user.username, "INBOX", 2)
        removed: dict[str, str] = {}
        async for page in source.pages(cursor):
            removed.update(page.removed)
            cursor = page.cursor_after or cursor
        assert removed == {stored[1]: "expunged"}
        assert len(scans) == 1
        again = [p.removed async for p in source.pages(cursor)]
        assert all(not r for r in again) and len(scans) == 1  # not before the interval
    finally:
        await source.aclose()


async def test_a_message_the_server_cannot_read_is_dead_and_does_not_pin_the_cursor(
    dovecot: DovecotServer, corpus: Path
) -> None:
    user = dovecot.new_user()
    raws = _corpus(corpus, 3)
    for raw in raws:
        dovecot.deliver(user.username, "INBOX", raw)
    maildir = dovecot.home(user.username) / "Maildir"
    files = [*(maildir / "cur").iterdir(), *(maildir / "new").iterdir()]

    def same(path: Path, raw: bytes) -> bool:
        return path.read_bytes().replace(b"\r\n", b"\n") == raw.replace(b"\r\n", b"\n")

    [second] = [f for f in files if same(f, raws[1])]
    second.chmod(0)  # Dovecot answers BYE "Internal error" reading UID 2
    source = ImapSource("acme", "imap", _mailbox(dovecot, user))
    try:
        items, cursor = await _run(source, None)
    finally:
        await source.aclose()
    uidvalidity = dovecot.status(user.username, "INBOX").uidvalidity
    outcome = {i.external_id: type(i).__name__ for i in items}
    assert outcome == {
        f"INBOX:{uidvalidity}:1": "MessageData",
        f"INBOX:{uidvalidity}:2": "DeadItem",
        f"INBOX:{uidvalidity}:3": "MessageData",
    }
    assert load_cursor(cursor)["INBOX"].last_uid == 3


async def test_a_login_refused_without_a_code_is_an_auth_error_only_when_it_lasts(
    dovecot: DovecotServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RFC 5530 codes are optional: a bare NO may be a server's passing trouble. It
    is retried; LOGIN_REFUSED_ATTEMPTS in a row make it a refused credential, and a
    login that works in between starts the count again. (Dovecot always sends a
    code, so the bare NO is played by ImapConnection.open here.)"""
    user = dovecot.new_user()
    source = ImapSource("acme", "imap", _mailbox(dovecot, user))
    real_open = ImapConnection.open
    refuse = True

    async def open_or_refuse(mailbox: ImapMailbox) -> ImapConnection:
        if refuse:
            raise ImapLoginRefused(f"imap {mailbox.host} refused the login: Login failed.")
        return await real_open(mailbox)

    monkeypatch.setattr(ImapConnection, "open", open_or_refuse)
    try:
        for _ in range(LOGIN_REFUSED_ATTEMPTS - 1):
            with pytest.raises(ImapLoginRefused):
                await _run(source, None)
        refuse = False
        await _run(source, None)  # the server's trouble passed
        await source.aclose()
        refuse = True
        for _ in range(LOGIN_REFUSED_ATTEMPTS - 1):
            with pytest.raises(ImapLoginRefused):
                await _run(source, None)
        with pytest.raises(ImapAuthError, match=f"{LOGIN_REFUSED_ATTEMPTS} times in a row"):
            await _run(source, None)
    finally:
        await source.aclose()
