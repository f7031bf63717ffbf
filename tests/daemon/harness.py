"""Run `inboxd run` as a real subprocess and wait on what it does, with deadlines."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from email.message import EmailMessage
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import orjson
from helpers import cli_argv, cli_env, db, eventually, run_cli, wait_for
from helpers.config_files import write_config_tree, write_tenant_file

READY_TIMEOUT_S = 60.0


def write_config(
    tmp: Path,
    *,
    tenants: dict[str, list[str]] | None = None,
    port: int = 0,
    shutdown_deadline_s: float = 20.0,
    lease_ttl_s: float = 10.0,
    extra_main: str = "",
) -> Path:
    """Main config + one tenant file per tenant, each with Maildir mailboxes.

    `tenants`: {tenant_id: [mailbox_id, ...]}; mailbox M of tenant T lives in
    tmp/maildirs/T/M. Returns the main config path.
    """
    tenants = tenants or {"acme": ["inbox"]}
    for tenant, mailboxes in tenants.items():
        write_tenant(tmp, tenant, mailboxes)
    return write_config_tree(
        tmp,
        f"""
[listener]
host = "127.0.0.1"
port = {port}

[object_store]
kind = "local"
path = "{tmp / "objects"}"

[queue]
capacity = 1000

[workers]
ingest = 2
batch_size = 250

[shutdown]
deadline_s = {shutdown_deadline_s}

[sync]
lease_ttl_s = {lease_ttl_s}
poll_scan_interval_s = 0.5

[tenants]
dir = "tenants"
{extra_main}
""",
    )


def write_tenant(tmp: Path, tenant: str, mailboxes: list[str], token: str | None = None) -> Path:
    blocks = "\n".join(
        f"""
[[mailboxes]]
id = "{mailbox}"
provider = "maildir"
address = "{mailbox}@{tenant}.example"
sync_mode = "poll"
poll_interval_s = 0.5
path = "{tmp / "maildirs" / tenant / mailbox}"
"""
        for mailbox in mailboxes
    )
    token_line = f'api_token = "env:{token}"' if token else ""
    text = f'id = "{tenant}"\nname = "{tenant.title()}"\n{token_line}\n{blocks}'
    return write_tenant_file(tmp, tenant, text)


def maildir(tmp: Path, tenant: str, mailbox: str) -> Path:
    root = tmp / "maildirs" / tenant / mailbox
    for sub in ("cur", "new", "tmp"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    return root


def deliver(root: Path, raws: list[bytes], prefix: str = "m") -> None:
    """Deliver like an MTA: write into tmp/, then rename into new/."""
    for i, raw in enumerate(raws):
        name = f"{int(time.time())}.{prefix}{i}.test"
        (root / "tmp" / name).write_bytes(raw)
        os.rename(root / "tmp" / name, root / "new" / name)


def generated_messages(n: int, *, tag: str = "x") -> list[bytes]:
    """n distinct small messages (unique Message-ID, subject and body)."""
    out = []
    for i in range(n):
        msg = EmailMessage()
        msg["From"] = f"Sender {i % 17} <sender{i % 17}@example.org>"
        msg["To"] = "support@acme.example"
        msg["Subject"] = f"Order {tag}-{i}"
        msg["Date"] = "Mon, 02 Nov 2026 09:30:00 +0000"
        msg["Message-ID"] = f"<{tag}-{i}@example.org>"
        msg.set_content(f"Hello, this is message {tag} number {i}.\n")
        out.append(msg.as_bytes())
    return out


class DaemonProcess:
    """`python -m inboxd.daemon.cli run` with stderr captured to a file."""

    def __init__(self, config: Path, dsn: str, log_path: Path, *, env: dict | None = None) -> None:
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            cli_argv("run", "--config", config, "--dsn", dsn, "--log-level", "info"),
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
        self.port: int | None = None

    def events(self) -> list[dict]:
        out = []
        for line in self.log_path.read_bytes().splitlines():
            try:
                out.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                continue
        return out

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> int:
        ready = wait_for(
            lambda: next((e for e in self.events() if e.get("event") == "daemon_ready"), None),
            timeout_s,
            what="daemon_ready",
            abort=self.exited,
            context=self.log_tail,
        )
        self.port = int(ready["port"])
        return self.port

    def exited(self) -> str | None:
        """Why waiting on this daemon is pointless: it exited (None while it runs)."""
        code = self.proc.poll()
        return None if code is None else f"daemon exited ({code})"

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    async def eventually(
        self,
        check: Callable[[], Awaitable[Any] | Any],
        timeout_s: float,
        *,
        what: str,
        until: Callable[[Any], object] = bool,
    ) -> Any:
        """helpers.eventually, given up when the daemon exits; failures show its log."""
        return await eventually(
            check, timeout_s, what=what, until=until, abort=self.exited, context=self.log_tail
        )

    def signal(self, signum: int = signal.SIGTERM) -> None:
        self.proc.send_signal(signum)

    def wait_exit(self, timeout_s: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()


def ses_table(queue_url: str, endpoint_url: str, **settings: int | str) -> str:
    """The main file's `[ses]` table (for write_config's `extra_main`): the queue on
    `endpoint_url` (moto's server in tests) and any other `[ses]` keys as given."""
    lines = [
        "[ses]",
        f'queue_url = "{queue_url}"',
        f'endpoint_url = "{endpoint_url}"',
        'region = "us-east-1"',
    ]
    for key, value in settings.items():
        lines.append(f"{key} = {orjson.dumps(value).decode()}")
    return "\n".join(lines) + "\n"


def write_ses_tenant(tmp: Path, tenant: str, mailboxes: dict[str, dict[str, Any]]) -> Path:
    """tenants/<tenant>.toml with one `provider = "ses"` mailbox per entry of
    `mailboxes` ({mailbox_id: {"addresses": [...], "allowed_senders": [...],
    "keep_objects": bool}}), replacing any file write_config wrote for it."""
    blocks = []
    for mailbox, keys in mailboxes.items():
        body = "".join(f"{key} = {orjson.dumps(value).decode()}\n" for key, value in keys.items())
        blocks.append(f'\n[[mailboxes]]\nid = "{mailbox}"\nprovider = "ses"\n{body}')
    text = f'id = "{tenant}"\nname = "{tenant.title()}"\n' + "".join(blocks)
    return write_tenant_file(tmp, tenant, text)


#: How long a rig's `eventually` waits on a running daemon: generous, every wait under
#: it ends as soon as its condition holds.
DAEMON_WAIT_S = 60.0


class DaemonReads:
    """What the tests of a running daemon read back: its database's rows and
    `inboxd status`. A rig's Running (gmail_rig, outlook_rig) mixes it in; it needs
    the test's folder `tmp`, the database `dsn` and the `daemon`."""

    tmp: Path
    dsn: str
    daemon: DaemonProcess

    async def fetchval(self, sql: str, *args: Any) -> Any:
        return await db.fetchval(self.dsn, sql, *args)

    async def fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        return await db.fetch(self.dsn, sql, *args)

    async def eventually(self, check: Callable[[], Awaitable[Any]], what: str) -> Any:
        return await self.daemon.eventually(check, DAEMON_WAIT_S, what=what)

    async def rows(self, mailbox: str) -> int:
        """How many copies the mailbox holds."""
        return await db.count(
            self.dsn, "SELECT count(*) FROM message_copies WHERE mailbox_id = $1", mailbox
        )

    async def has_copy(self, mailbox: str, external_id: str) -> bool:
        return bool(
            await db.count(
                self.dsn,
                "SELECT count(*) FROM message_copies WHERE mailbox_id = $1 AND external_id = $2",
                mailbox,
                external_id,
            )
        )

    async def cursor(self, mailbox: str) -> str | None:
        return await self.fetchval("SELECT cursor FROM mailboxes WHERE mailbox_id = $1", mailbox)

    async def status_text(self) -> str:
        """`inboxd status --json`'s output."""
        env = cli_env(self.tmp / "data")
        result = await anyio.to_thread.run_sync(
            lambda: run_cli("status", "--json", "--dsn", self.dsn, env=env)
        )
        assert result.code == 0, result.stderr
        return result.stdout

    async def status(self) -> dict[str, dict[str, Any]]:
        """`inboxd status`, mailbox id → its status."""
        return {s["mailbox_id"]: s for s in orjson.loads(await self.status_text())}
