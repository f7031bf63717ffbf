"""`inboxd run` outlives its database connections (issue: hardening, part 0).

PostgreSQL drops a daemon's connections on a restart, a failover or
`pg_terminate_backend`. Every long-lived loop must ride that out with backoff,
and nothing may be lost or stored twice.
"""

from __future__ import annotations

import signal
from pathlib import Path

import aiohttp
import anyio
import asyncpg
import pytest
from harness import DaemonProcess, deliver, generated_messages, maildir, write_config
from helpers.db import count

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.slow,
    pytest.mark.own_database,  # daemon subprocesses (tests/conftest.py)
]

# The fault: every 200 ms for 15 s, every backend of the daemon goes.
TERMINATE_EVERY_S = 0.2
TERMINATE_FOR_S = 15.0
BACKFILL_MESSAGES = 3000


async def _terminate_backends(dsn: str, daemon: DaemonProcess) -> int:
    """Terminate every backend of the test database but the caller's, for TERMINATE_FOR_S."""
    conn = await asyncpg.connect(dsn)
    terminated = 0
    try:
        deadline = anyio.current_time() + TERMINATE_FOR_S
        while anyio.current_time() < deadline and daemon.exited() is None:
            terminated += int(
                await conn.fetchval(
                    "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) "
                    "FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            )
            await anyio.sleep(TERMINATE_EVERY_S)  # the fault's own rhythm, not a wait
    finally:
        await conn.close()
    return terminated


async def _ready_status(port: int) -> int:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/readyz") as response:
            return response.status


def _moved_all(box: Path, n: int) -> bool:
    return len(list((box / "cur").iterdir())) == n and not list((box / "new").iterdir())


async def test_terminating_every_backend_for_15_s_mid_backfill_loses_and_doubles_nothing(
    tmp_path: Path, db_dsn: str
) -> None:
    config = write_config(tmp_path)
    box = maildir(tmp_path, "acme", "inbox")
    deliver(box, generated_messages(BACKFILL_MESSAGES, tag="kill"))
    daemon = DaemonProcess(config, db_dsn, tmp_path / "daemon.log")
    try:
        port = daemon.wait_ready()
        await daemon.eventually(
            lambda: count(db_dsn, "SELECT count(*) FROM messages"),
            60,
            what="the backfill started",
        )
        terminated = await _terminate_backends(db_dsn, daemon)
        assert daemon.exited() is None, daemon.log_tail()
        assert terminated > 0

        await daemon.eventually(
            lambda: count(db_dsn, "SELECT count(*) FROM messages"),
            180,
            what=f"{BACKFILL_MESSAGES} messages after the database came back",
            until=lambda got: got == BACKFILL_MESSAGES,
        )
        await daemon.eventually(
            lambda: _moved_all(box, BACKFILL_MESSAGES), 60, what="every file moved to cur/"
        )
        assert await count(db_dsn, "SELECT count(*) FROM message_copies") == BACKFILL_MESSAGES
        assert (
            await count(db_dsn, "SELECT count(DISTINCT message_id_norm) FROM messages")
            == BACKFILL_MESSAGES
        )
        await daemon.eventually(
            lambda: _ready_status(port),
            30,
            what="/readyz 200 again",
            until=lambda status: status == 200,
        )
    finally:
        daemon.signal(signal.SIGTERM)
        assert daemon.wait_exit(60) == 0, daemon.log_tail()


async def test_readyz_is_503_while_the_database_refuses_and_200_when_it_is_back(
    tmp_path: Path, db_dsn: str, server_dsn: str
) -> None:
    config = write_config(tmp_path)
    maildir(tmp_path, "acme", "inbox")
    daemon = DaemonProcess(config, db_dsn, tmp_path / "daemon.log")
    probe = await asyncpg.connect(db_dsn)
    database = await probe.fetchval("SELECT current_database()")
    await probe.close()
    admin = await asyncpg.connect(server_dsn)  # another database: it may lock this one
    try:
        port = daemon.wait_ready()
        assert await _ready_status(port) == 200
        # New connections refused and the existing ones gone: the database is away.
        await admin.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS false')
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1", database
        )
        await daemon.eventually(
            lambda: _ready_status(port), 30, what="/readyz 503", until=lambda status: status == 503
        )
        await admin.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')
        await daemon.eventually(
            lambda: _ready_status(port), 30, what="/readyz 200", until=lambda status: status == 200
        )
        assert daemon.exited() is None
    finally:
        await admin.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')
        await admin.close()
        daemon.signal(signal.SIGTERM)
        assert daemon.wait_exit(60) == 0, daemon.log_tail()


# Far longer than the test may take: a takeover that waited for expiry would fail.
KILLED_LEASE_TTL_S = 300.0


async def test_a_restart_after_sigkill_takes_its_mailboxes_back_within_seconds(
    tmp_path: Path, db_dsn: str
) -> None:
    config = write_config(tmp_path, lease_ttl_s=KILLED_LEASE_TTL_S)
    box = maildir(tmp_path, "acme", "inbox")
    deliver(box, generated_messages(BACKFILL_MESSAGES, tag="crash"))
    first = DaemonProcess(config, db_dsn, tmp_path / "first.log")
    try:
        first.wait_ready()
        await first.eventually(
            lambda: count(db_dsn, "SELECT count(*) FROM messages"),
            60,
            what="the backfill started",
        )
    finally:
        first.proc.kill()  # SIGKILL: no lease release, no goodbye
        first.wait_exit(10)
    held = "SELECT count(*) FROM mailboxes WHERE lease_expires_at > now() + interval '200 s'"
    assert await count(db_dsn, held) == 1  # the dead process's lease is still unexpired

    second = DaemonProcess(config, db_dsn, tmp_path / "second.log")
    try:
        second.wait_ready()
        await second.eventually(
            lambda: count(db_dsn, "SELECT count(*) FROM messages"),
            120,
            what=f"{BACKFILL_MESSAGES} messages, long before the old lease expires",
            until=lambda got: got == BACKFILL_MESSAGES,
        )
        await second.eventually(
            lambda: _moved_all(box, BACKFILL_MESSAGES), 60, what="every file moved to cur/"
        )
        assert await count(db_dsn, "SELECT count(*) FROM message_copies") == BACKFILL_MESSAGES
    finally:
        second.signal(signal.SIGTERM)
        assert second.wait_exit(60) == 0, second.log_tail()
