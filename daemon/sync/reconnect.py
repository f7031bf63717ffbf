"""The loop every dedicated database connection of the daemon runs in.

    attempt ──connected──▶ serving ──lost / any database error──▶ pause ──▶ attempt

A dedicated connection (a LISTEN, a session lock) cannot come from the pool, so
each holder reconnects by itself. `keep_connected` reports started after the
first attempt whether it connected or not — a database that is down at start
must not hold up the daemon — and retries for as long as it runs: the
connection must come back whenever the database does.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import structlog
from anyio.abc import TaskStatus

from inboxd.pipeline.errors import DATABASE_ERRORS, describe

log = structlog.get_logger(__name__)

# `serve(ready)` connects, calls `ready()` once it serves, and returns or raises
# when the connection is lost.
Serve = Callable[[Callable[[], None]], Awaitable[None]]


async def keep_connected(
    name: str,
    serve: Serve,
    reconnect_s: float,
    *,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run `serve` again after every loss, `reconnect_s` apart, until cancelled.

    A database error is logged as `<name>_unavailable`; anything else is a defect
    and propagates.
    """
    started = False

    def ready() -> None:
        nonlocal started
        if not started:
            started = True
            task_status.started()

    while True:
        try:
            await serve(ready)
        except DATABASE_ERRORS as exc:
            log.warning(f"{name}_unavailable", error=describe(exc))
        ready()
        await anyio.sleep(reconnect_s)
