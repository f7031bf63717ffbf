"""A server that stops answering without closing the connection (a crashed host, a
NAT or firewall that dropped the flow: no FIN, no RST): every command the IMAP door
sends is bounded, so a run fails and is retried instead of holding its mailbox, and
every connection probes its peer (TCP keepalive), so an IDLE does not wait for its
renewal to notice.

Dovecot is reached through a relay that can go silent: it keeps both sockets open
and stops passing bytes on, which a loopback connection cannot do by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
from collections.abc import AsyncIterator

import anyio
import pytest
from helpers.dovecot import DovecotServer
from helpers.secrets import PlainSecret

from inboxd.adapters.imap import client
from inboxd.adapters.imap.client import ImapConnection
from inboxd.adapters.imap.config import ImapMailbox
from inboxd.adapters.imap.errors import ImapUnavailable
from inboxd.adapters.imap.source import ImapSource

pytestmark = pytest.mark.slow

# The command timeout in these tests (60 s in production): the door's bound on a
# silent server, which the test then waits a generous multiple of.
SILENCE_S = 1.0
# A run against a silent server must fail within this (the hang was an hour).
FAIL_WITHIN_S = 30.0


class SilentRelay:
    """A TCP relay to a local port. Once the client sends `mute_at` (a command's
    name), what it sends is dropped from that command on: the server never hears it,
    so never answers, and nothing is ever closed by the relay."""

    def __init__(self, target_port: int, *, mute_at: bytes) -> None:
        self.target_port = target_port
        self.mute_at = mute_at
        self.client_muted = False
        self.port = 0
        self._writers: list[asyncio.StreamWriter] = []

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, from_client: bool
    ) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                if from_client and self.mute_at in data:
                    self.client_muted = True
                if from_client and self.client_muted:
                    continue  # swallowed: no answer will come, no FIN either
                writer.write(data)
                await writer.drain()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers += [writer, up_writer]
        async with anyio.create_task_group() as pumps:
            pumps.start_soon(functools.partial(self._pump, reader, up_writer, from_client=True))
            pumps.start_soon(functools.partial(self._pump, up_reader, writer, from_client=False))

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[SilentRelay]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        try:
            yield self
        finally:
            for writer in self._writers:
                writer.close()
            server.close()


async def test_a_server_silent_after_its_greeting_fails_the_run_in_bounded_time(
    dovecot: DovecotServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """STARTTLS and the CAPABILITY after it were sent without a timeout: a server
    that greeted and then went silent held the sync run (and its mailbox's lease)
    for COMMAND_DEADLINE_S, an hour."""
    monkeypatch.setattr(client, "COMMAND_TIMEOUT_S", SILENCE_S)
    user = dovecot.new_user()
    # the greeting and CAPABILITY come through; STARTTLS goes nowhere
    async with SilentRelay(dovecot.plain_port, mute_at=b"STARTTLS").running() as relay:
        mailbox = ImapMailbox.from_settings(
            {
                "host": dovecot.cert_hostname,
                "port": relay.port,
                "security": "starttls",
                "ca_file": str(dovecot.ca_file),
                "username": user.username,
                "password": PlainSecret(user.password),
            }
        )
        source = ImapSource("acme", "imap", mailbox)
        try:
            with anyio.fail_after(FAIL_WITHIN_S), pytest.raises(ImapUnavailable, match="STARTTLS"):
                async for _ in source.pages(None):
                    pass
        finally:
            await source.aclose()


@pytest.mark.parametrize("security", ["none", "starttls", "tls"])
async def test_every_connection_probes_a_silent_peer(dovecot: DovecotServer, security: str) -> None:
    """A peer gone without a FIN cannot be made on loopback (a relay's kernel answers
    the probes), so this checks the probes themselves: without them an IDLE
    connection to a vanished server, or behind a NAT that dropped its flow, went
    unnoticed until its renewal 25 min later and the mail it announced waited."""
    user = dovecot.new_user()
    settings: dict[str, object] = {
        "host": dovecot.cert_hostname,
        "port": dovecot.tls_port if security == "tls" else dovecot.plain_port,
        "security": security,
        "ca_file": str(dovecot.ca_file),
        "username": user.username,
        "password": PlainSecret(user.password),
    }
    if security == "none":
        settings.update(host=dovecot.host)
        del settings["ca_file"]
    connection = await ImapConnection.open(ImapMailbox.from_settings(settings))
    try:
        sock = connection._client.protocol.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        idle_s = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)
        interval_s = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL)
        probes = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT)
        # a dead peer is noticed within a few minutes, not at the 25 min renewal
        assert idle_s + interval_s * probes <= 5 * 60
    finally:
        await connection.close()
