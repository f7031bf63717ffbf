"""The doorbell listener: one LISTEN connection that rings this process's runners.

    connecting ──ok──▶ listening ──connection lost / any database error──▶ waiting
        ▲                                                                    │
        └──────────────────────── DOORBELL_RECONNECT_S ──────────────────────┘

A pooled connection cannot hold a LISTEN, so this one is its own. A ring that
arrives while the connection is down is lost; the poll scanner catches up with
it (a doorbell is a hint, pipeline/doorbell.py). No database error ends the
loop: it logs "lost" once and "listening" again when it is back.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
import asyncpg
import structlog
from anyio.abc import TaskStatus

from inboxd.daemon.sync.reconnect import keep_connected
from inboxd.pipeline.doorbell import DOORBELL_CHANNEL, parse_doorbell
from inboxd.pipeline.errors import DATABASE_ERRORS

log = structlog.get_logger(__name__)

# Pause before reconnecting the LISTEN connection after it dropped or failed.
DOORBELL_RECONNECT_S = 2.0
# A LISTEN connection that does not open within this long is treated as failed.
DOORBELL_CONNECT_TIMEOUT_S = 10.0
# Closing a connection that may be half dead must not hold up shutdown.
DOORBELL_CLOSE_TIMEOUT_S = 2.0

Ring = Callable[[tuple[str, str]], None]


async def listen_doorbell(
    dsn: str, ring: Ring, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
) -> None:
    """Ring `ring((tenant, mailbox))` for every doorbell until cancelled.

    Reports started after the first attempt, listening or not, so a database
    that is down at start does not hold the daemon's start-up.
    """

    async def serve(ready: Callable[[], None]) -> None:
        await _listen_once(dsn, ring, ready)

    await keep_connected("doorbell", serve, DOORBELL_RECONNECT_S, task_status=task_status)


async def _listen_once(dsn: str, ring: Ring, listening: Callable[[], None]) -> None:
    """LISTEN on one connection until it is lost; raises what the database raised."""
    with anyio.fail_after(DOORBELL_CONNECT_TIMEOUT_S):
        conn = await asyncpg.connect(dsn)
    lost = anyio.Event()

    def on_ring(_conn: object, _pid: int, _channel: str, payload: str) -> None:
        key = parse_doorbell(payload)
        if key is not None:
            ring(key)

    try:
        conn.add_termination_listener(lambda _conn: lost.set())
        await conn.add_listener(DOORBELL_CHANNEL, on_ring)
        log.info("doorbell_listening")
        listening()
        await lost.wait()
        log.warning("doorbell_connection_lost")
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(DOORBELL_CLOSE_TIMEOUT_S):
            try:
                await conn.close()
            except DATABASE_ERRORS:
                conn.terminate()
