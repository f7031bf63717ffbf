"""Outlook daemons against the fake Graph, and what their tests read back.

Shared by test_outlook_run, test_outlook_faults_run and test_outlook_reset_run (a
test module never imports another test module).
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import asyncpg
from fakes.graph import FakeGraph
from harness import DAEMON_WAIT_S, DaemonProcess, DaemonReads, generated_messages, write_config
from helpers import WaitTimeout, cli_env, eventually, run_cli

OPS, SALES = "ops@contoso.example", "sales@contoso.example"
API_TOKEN = "acme-api-token-for-tests"
FOLDERS = ("inbox", "sentitems")
WAIT_S = DAEMON_WAIT_S
#: How long "nothing more happens" is watched for: a ring reaches the runner and its
#: sync asks Graph within tens of milliseconds on this machine.
QUIET_S = 2.0


@dataclass
class Box:
    """One configured Outlook mailbox: id, address, folders, and how it signs in."""

    mailbox_id: str
    address: str
    folders: tuple[str, ...] = FOLDERS
    delegated: bool = False
    backfill: int | str = "all"


@dataclass
class Running(DaemonReads):
    tmp: Path
    dsn: str
    fake: FakeGraph
    daemon: DaemonProcess
    base: str
    session: aiohttp.ClientSession
    refresh_tokens: dict[str, str]
    config: Path | None = None
    env: dict[str, str] | None = None

    async def restart(self, while_down: Callable[[], Awaitable[None]] | None = None) -> None:
        """Stop the daemon as an operator would (SIGTERM: its leases released), run
        `while_down`, start it again on the same config, port and database."""
        assert self.config is not None
        self.daemon.signal()
        code = await anyio.to_thread.run_sync(self.daemon.wait_exit)
        assert code == 0, self.daemon.log_tail()
        if while_down is not None:
            await while_down()
        log = self.tmp / f"daemon.{len(list(self.tmp.glob('daemon*.log')))}.log"
        self.daemon = DaemonProcess(self.config, self.dsn, log, env=self.env)
        await anyio.to_thread.run_sync(self.daemon.wait_ready)

    async def copy(self, mailbox: str, external_id: str) -> asyncpg.Record | None:
        found = await self.fetch(
            "SELECT message_id, labels, removed_at, removal_reason FROM message_copies"
            " WHERE mailbox_id = $1 AND external_id = $2",
            mailbox,
            external_id,
        )
        return found[0] if found else None

    async def events(self, kind: str, mailbox: str) -> list[asyncpg.Record]:
        return await self.fetch(
            "SELECT message_id, payload FROM events WHERE kind = $1 AND mailbox_id = $2"
            " ORDER BY event_id",
            kind,
            mailbox,
        )

    async def events_count(self, kind: str, mailbox: str) -> int:
        return len(await self.events(kind, mailbox))

    async def subscription_rows(self, mailbox: str) -> dict[str, asyncpg.Record]:
        found = await self.fetch(
            "SELECT folder, subscription_id, client_state, lifecycle_event"
            " FROM graph_subscriptions WHERE mailbox_id = $1",
            mailbox,
        )
        return {r["folder"]: r for r in found}

    async def sync_now(self, mailbox: str) -> None:
        env = cli_env(self.tmp / "data")
        result = await anyio.to_thread.run_sync(
            lambda: run_cli(
                "sync", "now", "--mailbox", mailbox, "--tenant", "acme", "--dsn", self.dsn, env=env
            )
        )
        assert result.code == 0, result.stderr

    async def runs(self) -> tuple[int, int]:
        """Outlook sync runs (started, finished) so far, from the daemon's /metrics."""
        async with self.session.get(f"{self.base}/metrics") as response:
            assert response.status == 200
            text = await response.text()
        started = finished = 0.0
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            if name == 'inboxd_sync_runs_total{provider="outlook"}':
                started = float(value)
            elif name == 'inboxd_sync_duration_seconds_count{provider="outlook"}':
                finished = float(value)
        return int(started), int(finished)

    async def idle(self) -> bool:
        """Every run started so far has ended (runs of one runner follow each other
        without a pause, so a follow-up is counted as started when its forerunner ends)."""
        started, finished = await self.runs()
        return started == finished

    def deltas(self, address: str) -> int:
        return self.fake.counters.calls_of("message.delta", address)

    def push_url(self, lifecycle: bool = False) -> str:
        return f"{self.base}/push/outlook/acme" + ("/lifecycle" if lifecycle else "")

    async def never(self, check: Callable[[], Awaitable[bool] | bool], what: str) -> None:
        """Fail if `check()` holds within QUIET_S (the negative of `eventually`)."""
        try:
            await eventually(check, QUIET_S, what=what)
        except WaitTimeout:
            return
        raise AssertionError(f"{what} happened\n{self.daemon.log_tail()}")


def free_port() -> int:
    """A port the daemon's listener can take (notification_url must name it before
    the daemon starts, so port 0 will not do)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def tenant_file(fake: FakeGraph, boxes: list[Box], port: int, token_files: dict[str, Path]) -> str:
    blocks = []
    for box in boxes:
        folders = ", ".join(f'"{f}"' for f in box.folders)
        token = f'refresh_token = "file:{token_files[box.address]}"\n' if box.delegated else ""
        backfill = f'"{box.backfill}"' if isinstance(box.backfill, str) else str(box.backfill)
        blocks.append(
            f"""
[[mailboxes]]
id = "{box.mailbox_id}"
provider = "outlook"
address = "{box.address}"
sync_mode = "push"
folders = [{folders}]
backfill = {backfill}
{token}"""
        )
    return f"""
id = "acme"
api_token = "env:ACME_API_TOKEN"
[outlook]
directory_id = "{fake.directory_id}"
client_id = "{fake.client_id}"
client_secret = "env:ACME_GRAPH_SECRET"
graph_url = "{fake.graph_url}"
authority_url = "{fake.authority_url}"
notification_url = "http://127.0.0.1:{port}"
{"".join(blocks)}"""


@asynccontextmanager
async def outlook_daemon(
    tmp: Path, dsn: str, seed: dict[str, int], boxes: list[Box] | None = None
) -> AsyncIterator[Running]:
    """A daemon whose tenant "acme" has push-mode Outlook mailboxes (`boxes`, by
    default one app-only mailbox "ops"), each seeded in its inbox with `seed[address]`
    messages and fully backfilled. At the end (when the test passed): no request
    left without the ImmutableId preference."""
    boxes = boxes or [Box("ops", OPS)]
    async with FakeGraph([b.address for b in boxes]) as fake:
        tokens: dict[str, str] = {}
        files: dict[str, Path] = {}
        for box in boxes:
            for raw in generated_messages(seed.get(box.address, 0), tag=box.mailbox_id):
                fake.mailbox(box.address).add_message(raw)
            if box.delegated:
                tokens[box.address] = fake.issue_refresh_token(box.address)
                files[box.address] = tmp / f"{box.mailbox_id}.refresh-token"
                files[box.address].write_text(tokens[box.address] + "\n")
        port = free_port()
        config = write_config(tmp, port=port)
        (tmp / "tenants" / "acme.toml").write_text(tenant_file(fake, boxes, port, files))
        env = {"ACME_GRAPH_SECRET": fake.client_secret, "ACME_API_TOKEN": API_TOKEN}
        daemon = DaemonProcess(config, dsn, tmp / "daemon.log", env=env)
        running: Running | None = None
        try:
            ready_port = await anyio.to_thread.run_sync(daemon.wait_ready)
            assert ready_port == port
            async with aiohttp.ClientSession() as session:
                running = Running(
                    tmp, dsn, fake, daemon, f"http://127.0.0.1:{port}", session, tokens, config, env
                )
                for box in boxes:
                    count = seed.get(box.address, 0)
                    await running.eventually(
                        lambda box=box, count=count: _ready(running, box, count),
                        f"{box.mailbox_id}: {count} rows, a cursor and its subscriptions",
                    )
                yield running
                # CONTRIBUTING rule 13 / the issue: every mail request asked for
                # immutable ids (the fake refuses and counts those that did not)
                assert fake.counters.missing_immutable_total() == 0, fake.counters.missing_immutable
        finally:
            daemon.kill()
            if running is not None:
                running.daemon.kill()


async def _ready(running: Running, box: Box, count: int) -> bool:
    # The start rings each mailbox, and the poll scanner may claim it for its first
    # safety sync (last_polled_at) and ring again, unless a sync succeeded first (then
    # it is not due for a day): counting starts once a run ended after any claim.
    settled = await running.fetchval(
        "SELECT last_success_at IS NOT NULL"
        " AND (last_polled_at IS NULL OR last_success_at > last_polled_at)"
        " FROM mailboxes WHERE mailbox_id = $1",
        box.mailbox_id,
    )
    subscribed = await running.subscription_rows(box.mailbox_id)
    return (
        bool(settled)
        and await running.cursor(box.mailbox_id) is not None
        and await running.rows(box.mailbox_id) == count
        and set(subscribed) == set(box.folders)
        and await running.idle()
    )


async def equals(value: Awaitable[Any], expected: Any) -> bool:
    return await value == expected


def live_subscriptions(fake: FakeGraph, address: str) -> list[Any]:
    return [s for s in fake.subscriptions.by_id.values() if s.user.lower() == address.lower()]


# --- 1, 2: the handshake, then a notification brings the message ----------------------


async def state_is(run: Running, mailbox: str, state: str) -> bool:
    got = await run.fetchval("SELECT sync_state FROM mailboxes WHERE mailbox_id = $1", mailbox)
    return got == state
