"""One IMAP connection (aioimaplib): connect with TLS, STARTTLS or (loopback only) in
clear, log in, EXAMINE a folder, UID SEARCH, UID FETCH BODY.PEEK[], IDLE.

Folders are opened with EXAMINE (read-only) and bodies fetched with BODY.PEEK[],
so nothing we do marks mail read (RFC 3501 §6.3.2, §6.4.5). aioimaplib has no
STARTTLS (its command table names it, but nothing upgrades the transport): we send
the command and upgrade aioimaplib's asyncio transport with loop.start_tls, then
ask for CAPABILITY again (RFC 3501 §6.2.1: capabilities before TLS are void).

Every call runs under a deadline; a connection that misses one is closed, and
its errors are translated (adapters/imap/errors.py): a login refused with
[AUTHENTICATIONFAILED]/[AUTHORIZATIONFAILED]/[EXPIRED] → ImapAuthError (the
server's text kept, credentials never), with a temporary code (RFC 5530
[UNAVAILABLE], [SERVERBUG], [LIMIT], [INUSE]) → ImapUnavailable, without a code →
ImapLoginRefused; a certificate that fails verification → ImapCertificateError,
a TLS handshake answered in clear (the STARTTLS port) → ImapNotTls;
a dropped connection, BYE or a timeout → ImapUnavailable; EXAMINE of a folder
the server does not have → ImapFolderMissing, of one it will not open →
ImapFolderRefused; another answer we cannot use →
ImapProtocolError. A connection the server closed counts as closed at once
(aioimaplib's connection-lost callback): nothing reuses it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import os
import re
import socket
import ssl
from dataclasses import dataclass
from typing import Any

import aioimaplib

from inboxd.adapters.imap.config import ImapMailbox
from inboxd.adapters.imap.errors import (
    ImapAuthError,
    ImapCertificateError,
    ImapFolderMissing,
    ImapFolderRefused,
    ImapLoginRefused,
    ImapNotTls,
    ImapProtocolError,
    ImapUnavailable,
)

__all__ = ["FolderState", "ImapConnection", "encode_folder"]

# Connect + greeting + TLS handshake. A server that has not greeted in 20 s is down.
CONNECT_TIMEOUT_S = 20.0
# Silence within one command's answer: aioimaplib's per-command timer, restarted
# by every chunk received, so a large window on a slow link is not cut off while
# it makes progress. A server silent for 60 s in the middle of an answer is stuck.
COMMAND_TIMEOUT_S = 60.0
# Whole-command bound on top of that: a UID FETCH of a window of 100 messages at
# the 40 MB SES/Exchange size limit each is 4 GB; at 2 MB/s that is ~35 min.
COMMAND_DEADLINE_S = 3600.0
# TCP keepalive on every connection (Linux's socket options, tcp(7)): a probe after
# KEEPALIVE_IDLE_S of silence, every KEEPALIVE_INTERVAL_S, the peer declared dead
# after KEEPALIVE_PROBES unanswered (about 2 min). An IDLE connection is silent for
# up to IDLE_RENEW_S (25 min): without probes a server that vanished without a FIN
# (a crashed host, a NAT or load balancer that dropped the flow — Azure's default
# idle timeout is 4 min, AWS NAT's 350 s) went unnoticed that long, and the new
# mail it announced meanwhile waited for the renewal. The probes also keep such
# flows alive. TCP_USER_TIMEOUT bounds a write (DONE) that is never acknowledged.
KEEPALIVE_IDLE_S = 60
KEEPALIVE_INTERVAL_S = 15
KEEPALIVE_PROBES = 4
USER_TIMEOUT_S = KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_PROBES
# LOGOUT at close is a courtesy; never allowed to hold a shutdown.
LOGOUT_TIMEOUT_S = 3.0
# TLS contexts kept for reuse: one per distinct (CA files as on disk, verify) of the
# configured mailboxes; past it the least recently used is rebuilt when next needed.
TLS_CONTEXTS_KEPT = 64

_FETCH_RE = re.compile(rb"^(\d+) FETCH \(")
_UID_RE = re.compile(rb"UID (\d+)")
_CODE_RE = re.compile(rb"\[(UIDVALIDITY|UIDNEXT|HIGHESTMODSEQ) (\d+)\]")
_EXISTS_RE = re.compile(rb"^(\d+) EXISTS")
_VANISHED_RE = re.compile(rb"^VANISHED \(EARLIER\) ([0-9:,]+)")
# What IDLE reports as a change of the folder: new mail (EXISTS), an expunge
# (EXPUNGE, or VANISHED once QRESYNC is enabled: RFC 7162 §3.2.10).
_IDLE_CHANGES = (b"EXISTS", b"EXPUNGE", b"VANISHED")
# The response code a tagged NO starts with (RFC 3501 §7.1, RFC 5530).
_RESPONSE_CODE_RE = re.compile(r"^\s*\[([A-Za-z0-9-]+)")
# RFC 5530 §3: a login refused for the credential itself (wrong, not allowed for
# that user, expired): a person must act.
CREDENTIAL_REFUSED_CODES = frozenset({"AUTHENTICATIONFAILED", "AUTHORIZATIONFAILED", "EXPIRED"})
# RFC 5530 §3: the server cannot log anyone in now (its user database is down, a
# bug, too many connections, the mailbox in use): the same login works later.
LOGIN_TEMPORARY_CODES = frozenset({"UNAVAILABLE", "SERVERBUG", "LIMIT", "INUSE"})
# OpenSSL's reasons for a handshake answered by something that is not TLS (an IMAP
# greeting on the plain port): the setting is wrong, not the server down.
_NOT_TLS_REASONS = frozenset({"WRONG_VERSION_NUMBER", "UNKNOWN_PROTOCOL", "HTTP_REQUEST"})
# RFC 5530 §3: a folder the server cannot open now but will (its storage down, too
# many sessions, the folder locked by another): never a reason for attention.
FOLDER_TEMPORARY_CODES = frozenset({"UNAVAILABLE", "LIMIT", "INUSE"})
# RFC 5530 §3: EXAMINE of a folder that does not exist.
NONEXISTENT_CODE = "NONEXISTENT"
# A VANISHED range wider than this is a server listing UIDs it never had (RFC 7162
# lets it); the ones that matter are ≤ our last UID, which bounds it anyway.
_MAX_VANISHED_RANGE = 1_000_000


@dataclass(frozen=True, slots=True)
class FolderState:
    """What EXAMINE said: the folder's identity, next UID, modseq (CONDSTORE) and size,
    and with QRESYNC the UIDs expunged since the modseq we gave (RFC 7162 §3.2.5)."""

    uidvalidity: int
    uidnext: int | None
    highestmodseq: int | None
    exists: int
    vanished: tuple[int, ...] = ()


class ImapConnection:
    """A logged-in connection to one account; `await ImapConnection.open(mailbox)`."""

    def __init__(self, mailbox: ImapMailbox, client: Any) -> None:
        self.mailbox = mailbox
        self._client = client
        self.selected: str | None = None
        # aioimaplib fails no pending command when the connection drops: we notice
        # through its connection-lost callback and stop waiting at once
        self._lost = asyncio.Event()
        client.protocol.conn_lost_cb = lambda _exc: self._lost.set()
        self.qresync = False  # ENABLE QRESYNC accepted: EXAMINE reports VANISHED

    @property
    def closed(self) -> bool:
        """True once a failure or close() dropped the connection, or the server closed
        it (a restart, an idle timeout): a pooled connection is checked before reuse."""
        return self._client is None or self._lost.is_set()

    @property
    def capabilities(self) -> set[str]:
        return set(self._client.protocol.capabilities)

    @classmethod
    async def open(cls, mailbox: ImapMailbox) -> ImapConnection:
        where = f"{mailbox.host}:{mailbox.port}"
        try:
            context = _tls_context(mailbox) if mailbox.security != "none" else None
        except (OSError, ssl.SSLError) as exc:
            # a ca_file missing or not PEM: the operator's, like a certificate that
            # fails verification; escaping the IDLE watch it ended the whole fleet
            raise ImapCertificateError(
                f"imap connect {where}: ca_file {str(mailbox.ca_file)!r} cannot be loaded: "
                f"{_describe(exc)}"
            ) from exc
        try:
            if mailbox.security == "tls":
                client = aioimaplib.IMAP4_SSL(
                    mailbox.host, mailbox.port, timeout=COMMAND_TIMEOUT_S, ssl_context=context
                )
            else:
                client = aioimaplib.IMAP4(mailbox.host, mailbox.port, timeout=COMMAND_TIMEOUT_S)
            await asyncio.wait_for(client.wait_hello_from_server(), CONNECT_TIMEOUT_S)
            connection = cls(mailbox, client)
            _keep_alive(client.protocol.transport)
            if mailbox.security == "starttls":
                assert context is not None
                await connection._starttls(context)
        except ssl.SSLCertVerificationError as exc:
            # a wrong CA or host name does not fix itself: retrying it for ever hid it
            raise ImapCertificateError(
                f"imap connect {where}: the server's certificate failed verification: "
                f"{exc.verify_message or _describe(exc)}"
            ) from exc
        except ssl.SSLError as exc:
            if mailbox.security == "tls" and exc.reason in _NOT_TLS_REASONS:
                # a plaintext greeting where a TLS record was due: retried for ever,
                # the failure only showed in last_error while the mailbox never synced
                raise ImapNotTls(
                    f"imap connect {where}: the server does not speak TLS on this port "
                    f'({exc.reason}): is it the STARTTLS port? (security = "starttls", '
                    "or the implicit-TLS port, usually 993)"
                ) from exc
            raise ImapUnavailable(f"imap connect {where}: {_describe(exc)}") from exc
        except (OSError, TimeoutError, aioimaplib.AioImapException) as exc:
            raise ImapUnavailable(f"imap connect {where}: {_describe(exc)}") from exc
        await connection._login()
        await connection._enable_qresync()
        return connection

    async def _enable_qresync(self) -> None:
        """ENABLE QRESYNC (RFC 7162 §3.2.3) where offered: expunges are then reported
        by EXAMINE as VANISHED (EARLIER), at no extra round trip."""
        if "QRESYNC" not in self.capabilities:
            return
        answer = await self._call(self._client.enable("QRESYNC"), "ENABLE QRESYNC")
        self.qresync = answer.result == "OK"

    async def _starttls(self, context: ssl.SSLContext) -> None:
        caps = self.capabilities
        if "STARTTLS" not in caps:
            raise ImapUnavailable(f"imap {self.mailbox.host}: the server does not offer STARTTLS")
        protocol = self._client.protocol
        command = aioimaplib.Command("STARTTLS", protocol.new_tag(), loop=protocol.loop)
        # the protocol-level calls carry no timeout of their own (only aioimaplib's
        # IMAP4 methods do): without one, a server silent after its greeting held
        # the run for COMMAND_DEADLINE_S, an hour
        answer = await self._call(
            asyncio.wait_for(protocol.execute(command), COMMAND_TIMEOUT_S), "STARTTLS"
        )
        if answer.result != "OK":
            raise ImapUnavailable(f"imap {self.mailbox.host}: STARTTLS refused")
        loop = asyncio.get_running_loop()
        protocol.transport = await asyncio.wait_for(
            loop.start_tls(
                protocol.transport, protocol, context, server_hostname=self.mailbox.host
            ),
            CONNECT_TIMEOUT_S,
        )
        await self._call(asyncio.wait_for(protocol.capability(), COMMAND_TIMEOUT_S), "CAPABILITY")

    async def _login(self) -> None:
        m = self.mailbox
        try:
            if m.oauth2_token is not None:
                answer = await asyncio.wait_for(
                    self._client.xoauth2(m.username, m.oauth2_token.reveal()), COMMAND_TIMEOUT_S
                )
            else:
                assert m.password is not None
                answer = await asyncio.wait_for(
                    self._client.login(m.username, m.password.reveal()), COMMAND_TIMEOUT_S
                )
        except (OSError, TimeoutError, aioimaplib.AioImapException) as exc:
            await self.close()
            raise ImapUnavailable(f"imap login {m.host}: {_describe(exc)}") from exc
        if answer.result != "OK":
            text = _text(answer.lines[-1:]) or answer.result
            await self.close()
            refused = f"imap {m.host} refused the login of {m.username}: {text}"
            code = _response_code(text)
            if code in CREDENTIAL_REFUSED_CODES:
                raise ImapAuthError(refused)
            if code in LOGIN_TEMPORARY_CODES:
                raise ImapUnavailable(refused)
            raise ImapLoginRefused(refused)

    async def examine(self, folder: str, since: tuple[int, int] | None = None) -> FolderState:
        """Open `folder` read-only; its UIDVALIDITY, UIDNEXT, HIGHESTMODSEQ, EXISTS.

        `since` = (uidvalidity, modseq) known from the last sync: with QRESYNC
        enabled, the answer lists the UIDs expunged since then (`vanished`)."""
        name = encode_folder(folder)
        if since is not None and self.qresync:
            name += f" (QRESYNC ({since[0]} {since[1]}))"
        answer = await self._call(self._client.examine(name), f"EXAMINE {folder}")
        if answer.result != "OK":
            self.selected = None  # a failed EXAMINE leaves no folder selected (RFC 3501 §6.3.1)
            text = _text(answer.lines[-1:])
            refused = f"imap {self.mailbox.host}: EXAMINE {folder!r}: {text}"
            code = _response_code(text)
            if code == NONEXISTENT_CODE or not await self._exists(folder):
                raise ImapFolderMissing(refused, folder)
            # one folder the server will not open (no rights; Dovecot answers a
            # folder it cannot read with [SERVERBUG]) must not hold back the others
            raise ImapFolderRefused(
                refused, folder, temporary=code in FOLDER_TEMPORARY_CODES, code=code
            )
        codes: dict[bytes, int] = {}
        exists = 0
        vanished: list[int] = []
        for line in answer.lines:
            if not isinstance(line, bytes):
                continue
            for code, value in _CODE_RE.findall(line):
                codes[code] = int(value)
            if match := _EXISTS_RE.match(line):
                exists = int(match.group(1))
            if match := _VANISHED_RE.match(line):
                vanished.extend(_expand(match.group(1)))
        if b"UIDVALIDITY" not in codes:
            raise ImapProtocolError(f"imap {self.mailbox.host}: {folder!r} has no UIDVALIDITY")
        # aioimaplib moves to SELECTED only for its select(); EXAMINE selects too
        # (RFC 3501 §6.3.2), and its UID commands check that state
        self._client.protocol.state = aioimaplib.SELECTED
        self.selected = folder
        return FolderState(
            uidvalidity=codes[b"UIDVALIDITY"],
            uidnext=codes.get(b"UIDNEXT"),
            highestmodseq=codes.get(b"HIGHESTMODSEQ"),
            exists=exists,
            vanished=tuple(sorted(set(vanished))),
        )

    async def _exists(self, folder: str) -> bool:
        """LIST names the folder (for a NO to EXAMINE without [NONEXISTENT]: Dovecot 2.3
        answers a missing folder with a bare NO)."""
        answer = await self._call(self._client.list('""', encode_folder(folder)), "LIST")
        if answer.result != "OK":
            return True  # cannot tell: not missing as far as we know
        return any(isinstance(line, bytes) and line.startswith(b"(") for line in answer.lines)

    async def search_uids(self, *criteria: str) -> list[int]:
        """UID SEARCH in the selected folder, answered sorted."""
        answer = await self._call(self._client.uid_search(*criteria, charset=None), "UID SEARCH")
        if answer.result != "OK":
            raise ImapProtocolError(
                f"imap {self.mailbox.host}: UID SEARCH: {_text(answer.lines[-1:])}"
            )
        uids: set[int] = set()
        # aioimaplib hands the untagged `* SEARCH 1 2 3` as b"1 2 3" (its name
        # stripped), then the tagged completion's text as the last line
        for line in answer.lines[:-1]:
            if isinstance(line, bytes):
                uids.update(int(t) for t in line.removeprefix(b"SEARCH").split() if t.isdigit())
        return sorted(uids)

    async def fetch_raw(self, uids: list[int]) -> tuple[dict[int, bytes], bool]:
        """UID FETCH BODY.PEEK[] of `uids`: the bytes by UID, and whether the server
        answered OK (a NO still carries the messages it could deliver)."""
        if not uids:
            return {}, True
        answer = await self._call(
            self._client.uid("fetch", _uid_set(uids), "(UID BODY.PEEK[])"), "UID FETCH"
        )
        return _fetched(answer.lines), answer.result == "OK"

    async def idle(self, renew_after_s: float) -> bool:
        """IDLE in the selected folder until the server reports a change (True when it
        announced new or expunged mail) or `renew_after_s` passed (False); then DONE."""
        client = self._client
        if client is None:
            raise ImapUnavailable(f"imap {self.mailbox.host}: connection closed")
        try:
            idle = await asyncio.wait_for(
                client.idle_start(timeout=renew_after_s), COMMAND_TIMEOUT_S
            )
            changed = False
            while not changed:
                pushed = await self._call(
                    client.wait_server_push(timeout=renew_after_s + COMMAND_TIMEOUT_S), "IDLE"
                )
                if pushed == aioimaplib.STOP_WAIT_SERVER_PUSH:
                    break  # the renewal timer: end this IDLE, start the next
                lines = pushed if isinstance(pushed, list) else [pushed]
                changed = any(
                    isinstance(line, bytes) and any(word in line for word in _IDLE_CHANGES)
                    for line in lines
                )
            client.idle_done()
            await asyncio.wait_for(idle, COMMAND_TIMEOUT_S)
            return changed
        except (OSError, TimeoutError, aioimaplib.AioImapException) as exc:
            await self.close()
            raise ImapUnavailable(f"imap {self.mailbox.host}: IDLE: {_describe(exc)}") from exc

    def _abandon(self) -> None:
        """Drop the connection without a word (a command of it was abandoned)."""
        client, self._client = self._client, None
        self.selected = None
        transport = getattr(getattr(client, "protocol", None), "transport", None)
        if transport is not None:
            transport.close()

    async def close(self) -> None:
        """LOGOUT, bounded; the connection is gone afterwards whatever the server says."""
        client, self._client = self._client, None
        self.selected = None
        if client is None:
            return
        with contextlib.suppress(Exception):  # a courtesy: the transport is closed below
            await asyncio.wait_for(client.logout(), LOGOUT_TIMEOUT_S)
        transport = getattr(client.protocol, "transport", None)
        if transport is not None:
            transport.close()

    async def _call(self, awaitable: Any, what: str) -> Any:
        """One command's answer; a dropped connection, BYE or a stall is ImapUnavailable."""
        if self._client is None:
            raise ImapUnavailable(f"imap {self.mailbox.host}: connection closed")
        # A race of two awaitables inside this call, not tasks that outlive it: both end
        # in the finally below (aioimaplib's commands are asyncio futures already).
        command = asyncio.ensure_future(awaitable)  # noqa: TID251
        lost = asyncio.ensure_future(self._lost.wait())  # noqa: TID251
        try:
            done, _ = await asyncio.wait(
                {command, lost}, timeout=COMMAND_DEADLINE_S, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            lost.cancel()
            if not command.done():  # abandoned (lost, deadline, or we are cancelled):
                command.cancel()  # the connection is in an unknown state; drop it
                self._abandon()
        try:
            if command not in done:
                raise ConnectionError("connection lost" if lost in done else "deadline passed")
            return command.result()
        except (OSError, TimeoutError, aioimaplib.AioImapException) as exc:
            await self.close()
            raise ImapUnavailable(f"imap {self.mailbox.host}: {what}: {_describe(exc)}") from exc


def _keep_alive(transport: Any) -> None:
    """Turn on TCP keepalive for the connection's socket (see KEEPALIVE_IDLE_S);
    the Linux-only options are set where the platform has them."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
        ("TCP_USER_TIMEOUT", USER_TIMEOUT_S * 1000),  # milliseconds
    ):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


def _tls_context(mailbox: ImapMailbox) -> ssl.SSLContext:
    """One context per trust setting, shared by every connection that uses it: with
    a context of its own, loading the system's CA store, an IDLE connection over
    TLS held 1,174 KB of RSS; sharing one, 352 KB (100 IDLE connections to Dovecot,
    docs/providers/imap.md). CAs that change on disk get a new context, as when
    every connection built its own: the key holds the trusted files' identity
    (`_trust_files`), the system store's too when no `ca_file` is set."""
    ca_file = None if mailbox.ca_file is None else str(mailbox.ca_file)
    return _shared_tls_context(ca_file, _trust_files(ca_file), mailbox.verify_certificate)


def _trust_files(ca_file: str | None) -> tuple[tuple[str | None, int, int, int], ...]:
    """(path, mtime, size, inode) of the files a context for `ca_file` loads: the file
    itself, or the system store OpenSSL finds (SSL_CERT_FILE / SSL_CERT_DIR, else its
    defaults; update-ca-certificates rewrites them). The size and inode catch a copy
    that kept the old modification time (`cp -p`, `rsync -t`, tar)."""
    if ca_file is not None:
        # a missing ca_file raises FileNotFoundError here (ImapConnection.open says so)
        return (_identity(ca_file, os.stat(ca_file)),)
    defaults = ssl.get_default_verify_paths()  # None where the file or folder is missing
    files = []
    for path in (defaults.cafile, defaults.capath):
        try:
            files.append(_identity(path, os.stat(path) if path is not None else None))
        except FileNotFoundError:  # removed since: nothing of it to load
            files.append(_identity(path, None))
    return tuple(files)


def _identity(path: str | None, st: os.stat_result | None) -> tuple[str | None, int, int, int]:
    if st is None:
        return (path, 0, 0, 0)
    return (path, st.st_mtime_ns, st.st_size, st.st_ino)


@functools.lru_cache(maxsize=TLS_CONTEXTS_KEPT)
def _shared_tls_context(
    ca_file: str | None, _files: tuple[tuple[str | None, int, int, int], ...], verify: bool
) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca_file)
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def _fetched(lines: list[Any]) -> dict[int, bytes]:
    """The literals of an UID FETCH answer by UID (aioimaplib hands the FETCH line,
    then the literal as a bytearray, then the rest of the line)."""
    out: dict[int, bytes] = {}
    uid: int | None = None
    literal: bytes | None = None
    for line in lines:
        if isinstance(line, bytes) and _FETCH_RE.match(line):
            if uid is not None and literal is not None:
                out[uid] = literal
            uid, literal = None, None
            if m := _UID_RE.search(line):
                uid = int(m.group(1))
        elif isinstance(line, bytearray):
            literal = bytes(line)
        elif isinstance(line, bytes) and uid is None and (m := _UID_RE.search(line)):
            uid = int(m.group(1))  # "UID n" after the literal: `BODY[] {n}` came first
    if uid is not None and literal is not None:
        out[uid] = literal
    return out


def _expand(uid_set: bytes) -> list[int]:
    """3,5:7 → [3, 5, 6, 7] (a range too wide to be real is cut, see above)."""
    out: list[int] = []
    for part in uid_set.split(b","):
        low, _, high = part.partition(b":")
        first, last = int(low), int(high or low)
        first, last = min(first, last), max(first, last)
        out.extend(range(first, min(last, first + _MAX_VANISHED_RANGE) + 1))
    return out


def _uid_set(uids: list[int]) -> str:
    """A compact sequence set: 3,5:9,12."""
    ordered = sorted(set(uids))
    ranges: list[str] = []
    start = prev = ordered[0]
    for uid in ordered[1:]:
        if uid == prev + 1:
            prev = uid
            continue
        ranges.append(f"{start}:{prev}" if start != prev else str(start))
        start = prev = uid
    ranges.append(f"{start}:{prev}" if start != prev else str(start))
    return ",".join(ranges)


def encode_folder(name: str) -> str:
    """A folder name as an IMAP astring: modified UTF-7 (RFC 3501 §5.1.3), quoted."""
    out: list[str] = []
    pending: list[str] = []

    def flush() -> None:
        if pending:
            utf16 = "".join(pending).encode("utf-16-be")
            out.append("&" + base64.b64encode(utf16).decode().rstrip("=").replace("/", ",") + "-")
            pending.clear()

    for char in name:
        if 0x20 <= ord(char) <= 0x7E:
            flush()
            out.append("&-" if char == "&" else char)
        else:
            pending.append(char)
    flush()
    text = "".join(out)
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _response_code(text: str) -> str | None:
    """The response code a tagged completion's text starts with: "[UNAVAILABLE] …" →
    "UNAVAILABLE"."""
    match = _RESPONSE_CODE_RE.match(text)
    return match.group(1).upper() if match else None


def _text(lines: list[Any]) -> str:
    return " ".join(
        bytes(line).decode("utf-8", "replace") for line in lines if isinstance(line, bytes)
    ).strip()


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
