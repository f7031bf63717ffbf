"""Every lease this process holds, renewed together on a connection of its own.

    runner: acquire_lease ──▶ keeper.holding(key, token, on_lost) ──▶ sync ──▶ release_lease
                                   │ registered while the run lasts
    keeper: every ttl/3 ── renew_leases(all registered) ──▶ missing from the answer: on_lost()

Why one keeper and not a renewal task per run (issue 25): with thousands of
mailboxes syncing at once — every mailbox is rung at start — a renewal waiting for
a connection of the shared pool queued behind the very syncs it was keeping, the
lease expired, the other replica took it, and both replicas' first syncs cancelled
each other for as long as they ran (bench/README.md, "Two replicas at 10,000"). The
keeper's connection is its own, its statement renews every lease at once, so its
cost does not grow with the leases' count in round trips, and it does not wait on
the pool.

A renewal that fails (the connection lost, the database down) is retried at the
next tick: a lease outlives two missed renewals, and if it expires meanwhile the
fencing token refuses the stale holder's next cursor write (LeaseLost). A lease the
answer does not name was lost (taken over, expired): its run is cancelled at once.
A run that ended between the statement and its answer is no longer registered and
is left alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import anyio
import asyncpg
import structlog
from anyio.abc import TaskStatus

from inboxd.daemon.sync.reconnect import keep_connected
from inboxd.pipeline.errors import DATABASE_ERRORS
from inboxd.pipeline.mailbox import leases

log = structlog.get_logger(__name__)

Key = tuple[str, str]

# Renew every third of the TTL: a lease survives two missed renewals.
RENEWALS_PER_TTL = 3
KEEPER_CONNECT_TIMEOUT_S = 10.0
# Pause before connecting again after the keeper's connection was lost.
KEEPER_RECONNECT_S = 2.0
KEEPER_CLOSE_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class _Held:
    token: int
    on_lost: Callable[[], None]


class LeaseKeeper:
    """Renews the leases registered with `holding` until cancelled (`run`)."""

    def __init__(self, dsn: str, owner: str, ttl_s: float) -> None:
        self.dsn = dsn
        self.owner = owner
        self.ttl_s = ttl_s
        self._held: dict[Key, _Held] = {}

    @property
    def interval_s(self) -> float:
        return self.ttl_s / RENEWALS_PER_TTL

    @contextlib.contextmanager
    def holding(self, key: Key, token: int, on_lost: Callable[[], None]) -> Iterator[None]:
        """Keep the lease (`key`, `token`) renewed inside the block; `on_lost` is called
        (once) if the database no longer has it. Leave the block before releasing."""
        self._held[key] = _Held(token, on_lost)
        try:
            yield
        finally:
            held = self._held.get(key)
            if held is not None and held.token == token:
                del self._held[key]

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Renew until cancelled; reports started after the first connection attempt,
        connected or not (a database that is down must not hold up the start)."""
        await keep_connected(
            "lease_keeper", self._serve, KEEPER_RECONNECT_S, task_status=task_status
        )

    async def renew_now(self, conn: asyncpg.Connection) -> None:
        """One renewal of everything registered (a tick of `run`)."""
        held = dict(self._held)
        if not held:
            return
        renewed = await leases.renew_leases(
            conn, self.owner, [(t, m, h.token) for (t, m), h in held.items()], self.ttl_s
        )
        for key, was in held.items():
            if key in renewed:
                continue
            now = self._held.get(key)
            if now is not None and now.token == was.token:  # still running: it must stop
                del self._held[key]
                log.warning("lease_lost", tenant=key[0], mailbox=key[1])
                was.on_lost()

    async def _serve(self, ready: Callable[[], None]) -> None:
        with anyio.fail_after(KEEPER_CONNECT_TIMEOUT_S):
            conn = await asyncpg.connect(self.dsn)
        try:
            ready()
            while True:
                # at once on a new connection: the renewals before it may have failed.
                # A statement that hangs (a lock, a dead peer) must not outlast a tick:
                # the next one tries again on a new connection (keep_connected logs
                # `lease_keeper_unavailable`)
                with anyio.fail_after(self.interval_s):
                    await self.renew_now(conn)
                await anyio.sleep(self.interval_s)
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(KEEPER_CLOSE_TIMEOUT_S):
                try:
                    await conn.close()
                except DATABASE_ERRORS:
                    conn.terminate()
