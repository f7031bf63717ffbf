"""The IMAP door's TLS contexts (adapters/imap/client.py `_tls_context`): one per
trust setting, a new one once the CAs it trusts change on disk, as when every
connection built its own, and a CA file that cannot be read is the operator's."""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest
from helpers.keys import make_certificate, rsa_key

from inboxd.adapters.imap.client import ImapConnection, _tls_context
from inboxd.adapters.imap.config import ImapMailbox
from inboxd.adapters.imap.errors import ImapCertificateError
from inboxd.adapters.imap.source import ImapSource


def _mailbox(ca_file: Path | None) -> ImapMailbox:
    return ImapMailbox(host="imap.example.test", username="u", ca_file=ca_file)


def _certificates(n: int) -> bytes:
    return b"".join(make_certificate(rsa_key(), f"ca-{i}.example.test") for i in range(n))


def _trusted(context: object) -> int:
    return int(context.cert_store_stats()["x509"])  # type: ignore[attr-defined]


def test_one_context_per_trust_setting(tmp_path: Path) -> None:
    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes(_certificates(1))
    assert _tls_context(_mailbox(ca_file)) is _tls_context(_mailbox(ca_file))


def test_ca_file_replaced_with_its_old_mtime_is_read_again(tmp_path: Path) -> None:
    # `cp -p`, `install -p`, `rsync -t` and tar keep the source's modification time
    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes(_certificates(1))
    assert _trusted(_tls_context(_mailbox(ca_file))) == 1
    old = ca_file.stat()
    replacement = tmp_path / "new.pem"
    replacement.write_bytes(_certificates(2))
    os.utime(replacement, ns=(old.st_atime_ns, old.st_mtime_ns))
    replacement.replace(ca_file)
    assert _trusted(_tls_context(_mailbox(ca_file))) == 2


def test_system_store_change_is_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # no ca_file: the system's CAs (OpenSSL reads SSL_CERT_FILE / SSL_CERT_DIR);
    # update-ca-certificates then a new connection must not need a restart
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(_certificates(1))
    (tmp_path / "certs").mkdir()
    monkeypatch.setenv("SSL_CERT_FILE", str(bundle))
    monkeypatch.setenv("SSL_CERT_DIR", str(tmp_path / "certs"))
    assert _trusted(_tls_context(_mailbox(None))) == 1
    updated = tmp_path / "updated.pem"
    updated.write_bytes(_certificates(2))
    updated.replace(bundle)
    assert _trusted(_tls_context(_mailbox(None))) == 2


async def test_unreadable_ca_file_needs_attention_and_spares_the_watch(tmp_path: Path) -> None:
    # a ca_file typo (or a CA file mid-rotation) is the operator's: it must not escape
    # the IDLE watch, which would end the runner's task group and the fleet with it
    mailbox = ImapMailbox(
        host="127.0.0.1",
        username="u",
        port=1,
        password=None,
        ca_file=tmp_path / "missing.pem",
    )
    with pytest.raises(ImapCertificateError, match="ca_file"):
        await ImapConnection.open(mailbox)
    rang: list[None] = []
    with anyio.move_on_after(1.0):
        await ImapSource("t", "m", mailbox).watch(lambda: rang.append(None))
    assert rang  # a run is asked for, which records the mailbox as needing attention
