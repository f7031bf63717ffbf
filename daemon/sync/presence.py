"""This process's presence: a session-level advisory lock that lives as long as we do.

    connecting ──lock taken──▶ present ──connection lost / ping failed──▶ absent
        ▲                         │ ping every PRESENCE_PING_S                │
        └──────────────────── PRESENCE_RECONNECT_S ◀──────────────────────────┘

While present, the process's row in `inboxd_daemons` (host, pid, version, start)
has its heartbeat moved with every ping, for `inboxd status`; a clean stop
(cancellation) removes it. Leases taken while present carry the lock's key
(pipeline/mailbox/leases.py). When the process dies — SIGKILL, OOM, power loss —
PostgreSQL drops the lock with the connection, and a restarted daemon (or
another replica) takes those leases at
once instead of waiting out their TTL. While absent, new leases carry no key
and fall back to plain expiry. Fencing is untouched: every acquisition still
moves the token, so a holder that only lost this connection finds its next
cursor write refused.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable
from datetime import UTC, datetime

import anyio
import asyncpg
import structlog
from anyio.abc import TaskStatus

from inboxd.daemon.sync.reconnect import keep_connected
from inboxd.pipeline.errors import DATABASE_ERRORS
from inboxd.pipeline.mailbox.presence import (
    DaemonIdentity,
    PresenceTaken,
    forget_daemon,
    hold_presence,
    presence_key,
    record_daemon,
)

log = structlog.get_logger(__name__)

# A dead connection (no FIN: a partition, a failover) is noticed within this long.
PRESENCE_PING_S = 10.0
PRESENCE_PING_TIMEOUT_S = 5.0
PRESENCE_CONNECT_TIMEOUT_S = 10.0
# Pause before taking the lock again after the connection was lost.
PRESENCE_RECONNECT_S = 2.0
PRESENCE_CLOSE_TIMEOUT_S = 2.0


class Presence:
    """Holds the presence lock of `owner` on a connection of its own."""

    def __init__(self, dsn: str, owner: str) -> None:
        self.dsn = dsn
        self.key = presence_key(owner)
        self.held = False
        self.me = DaemonIdentity(
            owner=owner,
            host=socket.gethostname(),
            pid=os.getpid(),
            version=_version(),
            started_at=datetime.now(UTC),
        )

    @property
    def session_key(self) -> int | None:
        """The key to put on a lease now: only while the lock is held."""
        return self.key if self.held else None

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Hold the lock until cancelled; reports started after the first attempt,
        held or not, so a database that is down does not hold up the start."""

        async def serve(ready: Callable[[], None]) -> None:
            try:
                await self._hold_once(ready)
            except PresenceTaken as exc:  # another session has our key: retried, logged
                log.error("presence_taken", error=str(exc))

        await keep_connected("presence", serve, PRESENCE_RECONNECT_S, task_status=task_status)

    async def _hold_once(self, held: Callable[[], None]) -> None:
        with anyio.fail_after(PRESENCE_CONNECT_TIMEOUT_S):
            conn = await asyncpg.connect(self.dsn)
        try:
            await hold_presence(conn, self.key)
            with anyio.fail_after(PRESENCE_PING_TIMEOUT_S):
                await record_daemon(conn, self.me, prune=True)
            self.held = True
            log.info("presence_held")
            held()
            while True:
                await anyio.sleep(PRESENCE_PING_S)
                with anyio.fail_after(PRESENCE_PING_TIMEOUT_S):
                    await record_daemon(conn, self.me)
        except anyio.get_cancelled_exc_class():
            # A clean stop: `inboxd status` no longer lists this process.
            with anyio.CancelScope(shield=True), anyio.move_on_after(PRESENCE_CLOSE_TIMEOUT_S):
                with contextlib.suppress(*DATABASE_ERRORS):
                    await forget_daemon(conn, self.me.owner)
            raise
        finally:
            self.held = False
            with anyio.CancelScope(shield=True), anyio.move_on_after(PRESENCE_CLOSE_TIMEOUT_S):
                try:
                    await conn.close()
                except DATABASE_ERRORS:
                    conn.terminate()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("inboxd")
    except PackageNotFoundError:
        return "unknown"
