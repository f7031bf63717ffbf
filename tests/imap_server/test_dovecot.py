"""tests/helpers/dovecot.py: the private Dovecot the IMAP door is tested against.

What the IMAP tests rely on, checked with the standard library's imaplib (a
client independent of the adapter): logins over plain IMAP, STARTTLS and
implicit TLS verified against the test CA, a host name the certificate does not
carry refused, mail delivered byte-exact and left unread, the capabilities the
door uses (IDLE, CONDSTORE, QRESYNC), a recreated folder's new UIDVALIDITY,
expunge, a stop that drops clients and a start on the same ports, two servers
side by side (xdist workers), and a start that fails loudly.
"""

from __future__ import annotations

import contextlib
import imaplib
import os
import re
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.dovecot import DovecotError, DovecotServer, ImapAccount

pytestmark = pytest.mark.slow

# How long a blocking imaplib read may wait for the server before the test fails
# (an IDLE push, a reply): Dovecot answers in milliseconds here.
READ_TIMEOUT_S = 10.0


def _corpus_messages(corpus: Path, *, crlf: bool, count: int) -> list[bytes]:
    """The first `count` corpus messages (by path) whose lines all end in CRLF
    (`crlf`) or all in bare LF, without NUL bytes (IMAP literals cannot carry
    NUL: Dovecot serves it as 0x80)."""
    found: list[bytes] = []
    for path in sorted((corpus / "mime").rglob("*.eml")):
        raw = path.read_bytes()
        if b"\0" in raw or b"\n" not in raw:
            continue
        with_cr = raw.count(b"\r\n")
        if (crlf and with_cr == raw.count(b"\n") and with_cr == raw.count(b"\r")) or (
            not crlf and b"\r" not in raw
        ):
            found.append(raw)
            if len(found) == count:
                return found
    pytest.fail(f"the corpus has fewer than {count} such messages")


def _ca_context(server: DovecotServer) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(server.ca_file))


def _login(client: imaplib.IMAP4, account: ImapAccount) -> imaplib.IMAP4:
    client.login(account.username, account.password)
    return client


def _bodies(client: imaplib.IMAP4, uids: str) -> list[bytes]:
    """BODY.PEEK[] of the messages `uids` (a UID set), in the server's order."""
    typ, data = client.uid("FETCH", uids, "(BODY.PEEK[])")
    assert typ == "OK"
    return [item[1] for item in data if isinstance(item, tuple)]


def _close(client: imaplib.IMAP4) -> None:
    """Close a session the server may already have dropped."""
    with contextlib.suppress(OSError):
        client.shutdown()


@pytest.fixture
def account(dovecot: DovecotServer) -> ImapAccount:
    return dovecot.new_user()


@pytest.fixture
def client(dovecot: DovecotServer, account: ImapAccount) -> Iterator[imaplib.IMAP4]:
    """A plain-IMAP session logged in as `account`."""
    conn = imaplib.IMAP4(dovecot.host, dovecot.plain_port, timeout=READ_TIMEOUT_S)
    try:
        yield _login(conn, account)
    finally:
        try:
            conn.logout()
        except (imaplib.IMAP4.error, OSError):
            _close(conn)  # the test stopped the server or was disconnected


def test_plain_login_and_the_capabilities_the_door_uses(
    dovecot: DovecotServer, account: ImapAccount
) -> None:
    conn = imaplib.IMAP4(dovecot.host, dovecot.plain_port, timeout=READ_TIMEOUT_S)
    try:
        assert "STARTTLS" in conn.capabilities
        assert {"AUTH=PLAIN", "AUTH=LOGIN"} <= set(conn.capabilities)
        _login(conn, account)
        typ, data = conn.capability()
        assert typ == "OK"
        capabilities = set(data[0].decode().upper().split())
        assert {"IDLE", "CONDSTORE", "QRESYNC", "UIDPLUS", "MOVE", "SPECIAL-USE"} <= capabilities
    finally:
        conn.logout()


def test_starttls_and_tls_verify_against_the_test_ca(
    dovecot: DovecotServer, account: ImapAccount
) -> None:
    starttls = imaplib.IMAP4(dovecot.host, dovecot.plain_port, timeout=READ_TIMEOUT_S)
    try:
        starttls.starttls(ssl_context=_ca_context(dovecot))
        assert isinstance(starttls.sock, ssl.SSLSocket)
        _login(starttls, account)
    finally:
        starttls.logout()
    for host in (dovecot.host, dovecot.cert_hostname):  # 127.0.0.1 and localhost
        tls = imaplib.IMAP4_SSL(
            host, dovecot.tls_port, ssl_context=_ca_context(dovecot), timeout=READ_TIMEOUT_S
        )
        try:
            assert isinstance(tls.sock, ssl.SSLSocket)
            peer = tls.sock.getpeercert()
            assert peer is not None
            assert peer["subject"] == ((("commonName", "localhost"),),)
            _login(tls, account)
        finally:
            tls.logout()


def test_a_host_name_the_certificate_does_not_carry_is_refused(dovecot: DovecotServer) -> None:
    with pytest.raises(ssl.SSLCertVerificationError, match="IP address mismatch"):
        imaplib.IMAP4_SSL(
            dovecot.mismatch_host,
            dovecot.tls_port,
            ssl_context=_ca_context(dovecot),
            timeout=READ_TIMEOUT_S,
        )
    starttls = imaplib.IMAP4(dovecot.mismatch_host, dovecot.plain_port, timeout=READ_TIMEOUT_S)
    try:
        with pytest.raises(ssl.SSLCertVerificationError, match="IP address mismatch"):
            starttls.starttls(ssl_context=_ca_context(dovecot))
    finally:
        _close(starttls)
    # A name that resolves to the server but is not in the certificate, by SNI.
    context = _ca_context(dovecot)
    with socket.create_connection((dovecot.host, dovecot.tls_port), timeout=READ_TIMEOUT_S) as raw:
        with pytest.raises(ssl.SSLCertVerificationError, match="Hostname mismatch"):
            context.wrap_socket(raw, server_hostname="imap.example.org")


def test_without_the_test_ca_the_certificate_is_untrusted(dovecot: DovecotServer) -> None:
    with pytest.raises(ssl.SSLCertVerificationError, match="unable to get local issuer"):
        imaplib.IMAP4_SSL(
            dovecot.host,
            dovecot.tls_port,
            ssl_context=ssl.create_default_context(),
            timeout=READ_TIMEOUT_S,
        )


def test_a_wrong_password_fails_and_a_changed_password_applies_at_once(
    dovecot: DovecotServer, account: ImapAccount
) -> None:
    conn = imaplib.IMAP4(dovecot.host, dovecot.plain_port, timeout=READ_TIMEOUT_S)
    try:
        with pytest.raises(imaplib.IMAP4.error, match="AUTHENTICATIONFAILED"):
            conn.login(account.username, account.password + "-wrong")
    finally:
        conn.logout()
    dovecot.add_user(account.username, "changed")
    conn = imaplib.IMAP4(dovecot.host, dovecot.plain_port, timeout=READ_TIMEOUT_S)
    try:
        with pytest.raises(imaplib.IMAP4.error, match="AUTHENTICATIONFAILED"):
            conn.login(account.username, account.password)
        conn.login(account.username, "changed")
    finally:
        conn.logout()


def test_delivered_mail_comes_back_byte_exact_and_stays_unread(
    dovecot: DovecotServer, account: ImapAccount, client: imaplib.IMAP4, corpus: Path
) -> None:
    crlf = _corpus_messages(corpus, crlf=True, count=3)
    lf = _corpus_messages(corpus, crlf=False, count=2)
    uids = [dovecot.deliver(account.username, "INBOX", raw) for raw in crlf + lf]
    assert uids == [1, 2, 3, 4, 5]
    client.select("INBOX")
    for uid, raw in zip(uids, crlf + lf, strict=True):
        [served] = _bodies(client, str(uid))
        # IMAP sends every line ending as CRLF (RFC 3501 §4.3): CRLF mail is
        # served byte for byte, bare-LF mail with CRLF line endings.
        assert served == (raw if uid <= 3 else raw.replace(b"\n", b"\r\n"))
    flags = dovecot.flags(account.username, "INBOX")
    assert sorted(flags) == uids
    assert all("\\Seen" not in f for f in flags.values())
    # …and the check can see \Seen: a FETCH without PEEK sets it (RFC 3501 §6.4.5).
    client.uid("FETCH", "2", "(BODY[])")
    assert "\\Seen" in dovecot.flags(account.username, "INBOX")[2]


def test_deliver_many_writes_maildir_files_numbered_in_order(
    dovecot: DovecotServer, account: ImapAccount, client: imaplib.IMAP4, corpus: Path
) -> None:
    messages = _corpus_messages(corpus, crlf=True, count=5)
    dovecot.create_folder(account.username, "Archive/2024")
    assert dovecot.deliver_many(account.username, "Archive/2024", messages) == 5
    assert dovecot.uids(account.username, "Archive/2024") == [1, 2, 3, 4, 5]
    typ, data = client.select("Archive/2024", readonly=True)
    assert (typ, data) == ("OK", [b"5"])
    assert _bodies(client, "1:*") == messages


def test_idle_hears_a_delivery(
    dovecot: DovecotServer, account: ImapAccount, client: imaplib.IMAP4
) -> None:
    client.select("INBOX")
    client.send(b"I1 IDLE\r\n")
    assert client.readline().startswith(b"+")
    dovecot.deliver(account.username, "INBOX", b"Subject: idle\r\n\r\nhello\r\n")
    line = client.readline()  # the socket's timeout (READ_TIMEOUT_S) is the deadline
    while line.startswith(b"* OK"):  # "Still here" keepalives
        line = client.readline()
    assert line == b"* 1 EXISTS\r\n"
    client.send(b"DONE\r\n")
    while not line.startswith(b"I1 "):
        line = client.readline()
    assert line.startswith(b"I1 OK")


def test_condstore_highestmodseq_matches_doveadm(
    dovecot: DovecotServer, account: ImapAccount, client: imaplib.IMAP4
) -> None:
    dovecot.deliver(account.username, "INBOX", b"Subject: modseq\r\n\r\nx\r\n")
    typ, _ = client._simple_command("SELECT", "INBOX", "(CONDSTORE)")
    assert typ == "OK"
    _, codes = client.response("HIGHESTMODSEQ")
    assert int(codes[-1]) == dovecot.status(account.username, "INBOX").highestmodseq


@pytest.mark.parametrize("folder", ["INBOX", "Sent"])
def test_a_recreated_folder_has_a_new_uidvalidity_and_the_same_mail(
    dovecot: DovecotServer, account: ImapAccount, folder: str
) -> None:
    user = account.username
    if folder != "INBOX":
        dovecot.create_folder(user, folder)
    messages = [f"Subject: {n}\r\n\r\nbody {n}\r\n".encode() for n in range(3)]
    for raw in messages:
        dovecot.deliver(user, folder, raw)
    watcher = imaplib.IMAP4(dovecot.host, dovecot.plain_port, timeout=READ_TIMEOUT_S)
    try:
        _login(watcher, account).select(folder)

        old, new = dovecot.recreate_folder(user, folder)

        assert new != old
        # A session that had the folder selected is dropped, or (depending on
        # when Dovecot notices) keeps its old view until it selects again.
        try:
            watcher.uid("FETCH", "1:*", "(FLAGS)")
        except (imaplib.IMAP4.abort, OSError):
            pass
        else:
            watcher.select(folder)
            assert watcher.response("UIDVALIDITY")[1][-1] == str(new).encode()
    finally:
        _close(watcher)
    conn = _login(imaplib.IMAP4(dovecot.host, dovecot.plain_port, timeout=READ_TIMEOUT_S), account)
    try:
        assert conn.select(folder) == ("OK", [b"3"])
        assert conn.response("UIDVALIDITY")[1][-1] == str(new).encode()
        assert _bodies(conn, "1:*") == messages
    finally:
        conn.logout()
    uids = dovecot.uids(user, folder)
    # Renumbered from 1, except INBOX (it cannot be deleted; see recreate_folder).
    assert uids == ([4, 5, 6] if folder == "INBOX" else [1, 2, 3])
    assert sorted(dovecot.doveadm("mailbox", "list", "-u", user).split()) == sorted(
        {"INBOX", folder}
    )


def test_expunge_and_delete_folder(
    dovecot: DovecotServer, account: ImapAccount, client: imaplib.IMAP4
) -> None:
    user = account.username
    for n in range(3):
        dovecot.deliver(user, "INBOX", f"Subject: {n}\r\n\r\nx\r\n".encode())
    dovecot.expunge(user, "INBOX", 2)
    assert dovecot.uids(user, "INBOX") == [1, 3]
    client.select("INBOX")
    assert client.uid("SEARCH", "ALL") == ("OK", [b"1 3"])

    dovecot.create_folder(user, "Old")
    dovecot.deliver(user, "Old", b"Subject: old\r\n\r\nx\r\n")
    dovecot.delete_folder(user, "Old")
    typ, data = client.list()
    assert typ == "OK"
    assert not any(isinstance(line, bytes) and line.endswith(b' "/" Old') for line in data)
    with pytest.raises(DovecotError, match="Mailbox doesn't exist"):
        dovecot.status(user, "Old")


def test_stop_drops_clients_and_start_comes_back_on_the_same_ports(
    dovecot: DovecotServer, account: ImapAccount, client: imaplib.IMAP4
) -> None:
    dovecot.deliver(account.username, "INBOX", b"Subject: before\r\n\r\nx\r\n")
    client.select("INBOX")
    ports, pid = (dovecot.plain_port, dovecot.tls_port), dovecot.pgid
    assert pid is not None

    with dovecot.stopped():
        assert not dovecot.running
        with pytest.raises((imaplib.IMAP4.abort, OSError)):
            client.noop()
        with pytest.raises(OSError):
            socket.create_connection((dovecot.host, dovecot.plain_port), timeout=1).close()
        # Nothing of the stopped server is left: not the master, not a child.
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)

    assert dovecot.running
    assert (dovecot.plain_port, dovecot.tls_port) == ports
    conn = _login(imaplib.IMAP4(dovecot.host, dovecot.plain_port, timeout=READ_TIMEOUT_S), account)
    try:
        assert conn.select("INBOX") == ("OK", [b"1"])
    finally:
        conn.logout()


def test_two_servers_run_side_by_side(dovecot: DovecotServer) -> None:
    """What two xdist workers do: each has its own ports, files and users."""
    mine = dovecot.new_user()
    with DovecotServer() as other:
        assert {other.plain_port, other.tls_port}.isdisjoint({dovecot.plain_port, dovecot.tls_port})
        assert other.root != dovecot.root
        theirs = other.new_user()
        other.deliver(theirs.username, "INBOX", b"Subject: other\r\n\r\nx\r\n")
        for server, account in ((dovecot, mine), (other, theirs)):
            conn = imaplib.IMAP4(server.host, server.plain_port, timeout=READ_TIMEOUT_S)
            try:
                _login(conn, account)
            finally:
                conn.logout()
        conn = imaplib.IMAP4(other.host, other.plain_port, timeout=READ_TIMEOUT_S)
        try:
            with pytest.raises(imaplib.IMAP4.error, match="AUTHENTICATIONFAILED"):
                _login(conn, mine)
        finally:
            conn.logout()
        root = other.root
    assert not root.exists()


def test_a_server_that_cannot_start_fails_with_its_log(dovecot: DovecotServer) -> None:
    """No silent skip: a port already taken fails the start, naming the cause."""
    clash = DovecotServer()
    try:
        clash.plain_port, clash.tls_port = dovecot.plain_port, dovecot.tls_port
        with pytest.raises(DovecotError) as failure:
            clash.start()
        assert re.search(r"Address already in use", str(failure.value))
        assert str(clash.config_path) in str(failure.value)
        assert not clash.running
    finally:
        clash.close()
    assert dovecot.running
