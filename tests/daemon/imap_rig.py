"""IMAP daemons against Dovecot, and what their tests read back.

Shared by test_imap_run and test_imap_faults (a test module never imports another
test module).
"""

from __future__ import annotations

import signal
import subprocess
from dataclasses import dataclass
from email.parser import BytesHeaderParser
from email.policy import compat32
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import orjson
from harness import DaemonProcess
from helpers import cli_env, run_cli
from helpers.db import fetch, fetchval
from helpers.dovecot import DovecotServer, ImapAccount

WAIT_S = 60
# Issue 13: with IDLE, a delivered message is stored within 2 s.
IDLE_DELIVERY_S = 2.0
# Long enough that only IDLE (never a scheduled poll) can bring mail within a test.
LONG_POLL_S = 300
# daemon/metrics/attention.py re-reads the mailboxes table every 15 s.
ATTENTION_METRIC_S = 40
HTTP_TIMEOUT_S = 10


@dataclass(frozen=True)
class Imap:
    """One imap mailbox of a tenant file: its id, the account and its options."""

    mailbox: str
    account: ImapAccount
    sync_mode: str = "poll"
    poll_interval_s: float = 1
    folders: tuple[str, ...] = ("INBOX",)
    password: str | None = None  # a wrong one; default: the account's
    backfill: str | int = "all"
    extra: str = ""  # more TOML lines of the mailbox table (TLS settings)

    @property
    def env_var(self) -> str:
        return f"INBOXD_TEST_IMAP_{self.mailbox.upper()}_PASSWORD"


def imap_tenant(tmp: Path, tenant: str, server: DovecotServer, boxes: list[Imap]) -> Path:
    """tenants/<tenant>.toml with the imap mailboxes `boxes` (replacing any file)."""
    blocks = "".join(
        f"""
[[mailboxes]]
id = "{box.mailbox}"
provider = "imap"
address = "{box.mailbox}@{tenant}.example"
sync_mode = "{box.sync_mode}"
poll_interval_s = {box.poll_interval_s}
{box.extra or _plain(server)}
username = "{box.account.username}"
password = "env:{box.env_var}"
folders = {orjson.dumps(list(box.folders)).decode()}
backfill = {orjson.dumps(box.backfill).decode()}
"""
        for box in boxes
    )
    (tmp / "tenants").mkdir(exist_ok=True)
    path = tmp / "tenants" / f"{tenant}.toml"
    path.write_text(f'id = "{tenant}"\nname = "{tenant.title()}"\n{blocks}')
    return path


def _plain(server: DovecotServer) -> str:
    return f'host = "{server.host}"\nport = {server.plain_port}\nsecurity = "none"'


def passwords(*boxes: Imap) -> dict[str, str]:
    return {box.env_var: box.password or box.account.password for box in boxes}


def corpus_messages(
    corpus: Path, n: int, skip: int = 0, *, identified: bool = False
) -> list[bytes]:
    """n corpus files (after `skip`), in name order. `identified`: only files with a
    Message-ID, a From and a Date, as most mail has (the first files of the corpus
    have none of them)."""
    raws = [path.read_bytes() for path in sorted((corpus / "mime").rglob("*.eml"))]
    if identified:
        raws = [raw for raw in raws if _identified(raw)]
    chosen = raws[skip : skip + n]
    assert len(chosen) == n, f"the corpus has fewer than {skip + n} such messages"
    return chosen


def _identified(raw: bytes) -> bool:
    headers = BytesHeaderParser(policy=compat32).parsebytes(raw)
    return all(headers.get(name) for name in ("Message-ID", "From", "Date"))


def start(tmp: Path, config: Path, dsn: str, env: dict[str, str]) -> DaemonProcess:
    daemon = DaemonProcess(config, dsn, tmp / "daemon.log", env=env)
    try:
        daemon.wait_ready()
    except BaseException:
        daemon.kill()
        raise
    return daemon


def stop(daemon: DaemonProcess) -> None:
    """SIGTERM; the daemon must exit 0 (killed if it hangs)."""
    if daemon.exited() is None:
        daemon.signal(signal.SIGTERM)
    try:
        code = daemon.wait_exit(60)
    except subprocess.TimeoutExpired:
        daemon.kill()
        code = None
    assert code == 0, daemon.log_tail()


async def copies(dsn: str, tenant: str, mailbox: str) -> set[str]:
    """The external ids of the mailbox's rows in message_copies."""
    rows = await fetch(
        dsn,
        "SELECT external_id FROM message_copies WHERE tenant_id = $1 AND mailbox_id = $2",
        tenant,
        mailbox,
    )
    return {row["external_id"] for row in rows}


async def sync_state(dsn: str, tenant: str, mailbox: str) -> str | None:
    return await fetchval(
        dsn,
        "SELECT sync_state FROM mailboxes WHERE tenant_id = $1 AND mailbox_id = $2",
        tenant,
        mailbox,
    )


async def a_later_sync(dsn: str, daemon: DaemonProcess, tenant: str, mailbox: str) -> None:
    """Wait until a sync run of the mailbox finishes cleanly after now."""
    now = await fetchval(dsn, "SELECT now()")
    await daemon.eventually(
        lambda: fetchval(
            dsn,
            "SELECT last_success_at FROM mailboxes WHERE tenant_id = $1 AND mailbox_id = $2",
            tenant,
            mailbox,
        ),
        WAIT_S,
        what=f"a clean sync run of {tenant}/{mailbox} after {now}",
        until=lambda at: at is not None and at > now,
    )


async def metrics_text(daemon: DaemonProcess) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.get(
            f"http://127.0.0.1:{daemon.port}/metrics",
            timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S),
        ) as response:
            assert response.status == 200
            return await response.text()


def external_ids(server: DovecotServer, user: str, folder: str, uids: list[int]) -> set[str]:
    """The external ids the door gives those UIDs: folder:uidvalidity:uid."""
    uidvalidity = server.status(user, folder).uidvalidity
    return {f"{folder}:{uidvalidity}:{uid}" for uid in uids}


async def status_json(tmp: Path, dsn: str) -> dict[tuple[str, str], dict[str, Any]]:
    result = await anyio.to_thread.run_sync(
        lambda: run_cli("status", "--json", "--dsn", dsn, env=cli_env(tmp / "data"))
    )
    assert result.code == 0, result.stderr
    return {(s["tenant_id"], s["mailbox_id"]): s for s in orjson.loads(result.stdout)}
