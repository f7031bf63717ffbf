"""Presence locks: a session-level advisory lock per lease owner, alive as long as
its process (pipeline/mailbox/leases.py module docstring, "Presence"). A lease carries the
lock's key; `acquire_lease` takes a lease whose holder's lock is gone at once.

Beside the lock, the process's row in `inboxd_daemons` (host, pid, version, start,
heartbeat) tells `inboxd status` which daemons run: written when the lock is taken,
its heartbeat moved with each presence ping, removed at a clean stop. A row whose
heartbeat is older than `DAEMON_GONE_AFTER_S` is a daemon that died or lost the
database; rows older than `DAEMON_ROW_KEPT_S` are removed by the next daemon that starts.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime

import asyncpg

#: A daemon pings every 10 s (daemon/sync/presence.py PRESENCE_PING_S); three missed
#: pings and it is reported gone.
DAEMON_GONE_AFTER_S = 30.0
#: How long the row of a daemon that died without a clean stop is kept, to say "last
#: seen": a week covers a weekend's outage.
DAEMON_ROW_KEPT_S = 7 * 86_400


class PresenceTaken(RuntimeError):
    """Another session holds this owner's presence lock (two processes, one owner id)."""


def presence_key(owner: str) -> int:
    """The advisory-lock key of `owner`'s presence: 64 bits of its sha256, signed."""
    return int.from_bytes(hashlib.sha256(owner.encode()).digest()[:8], "big", signed=True)


async def hold_presence(conn: asyncpg.Connection, key: int) -> None:
    """Take the session-level presence lock `key` on `conn` (a connection kept for
    it alone); it lasts until the connection ends. Raises RuntimeError when
    another session holds it (two processes sharing an owner id)."""
    if not await conn.fetchval("SELECT pg_try_advisory_lock($1)", key):
        raise PresenceTaken("presence lock held by another session: owner ids must be unique")


@dataclass(frozen=True, slots=True)
class DaemonIdentity:
    """What a daemon says of itself in `inboxd_daemons`."""

    owner: str
    host: str
    pid: int
    version: str
    started_at: datetime


async def record_daemon(
    conn: asyncpg.Connection, me: DaemonIdentity, *, prune: bool = False
) -> None:
    """The process's `inboxd_daemons` row with its heartbeat now (written again when
    someone removed it); with `prune`, long-dead rows go too."""
    await conn.execute(
        "INSERT INTO inboxd_daemons (owner, host, pid, version, started_at, heartbeat_at)"
        " VALUES ($1, $2, $3, $4, $5, now())"
        " ON CONFLICT (owner) DO UPDATE SET heartbeat_at = now()",
        me.owner,
        me.host,
        me.pid,
        me.version,
        me.started_at,
    )
    if prune:
        await conn.execute(
            "DELETE FROM inboxd_daemons WHERE heartbeat_at < now() - make_interval(secs => $1)",
            DAEMON_ROW_KEPT_S,
        )


async def forget_daemon(conn: asyncpg.Connection, owner: str) -> None:
    """A clean stop: the process's row goes."""
    await conn.execute("DELETE FROM inboxd_daemons WHERE owner = $1", owner)


@dataclass(frozen=True, slots=True)
class DaemonRow:
    """One `inboxd_daemons` row, with `running` = heartbeat within DAEMON_GONE_AFTER_S."""

    owner: str
    host: str
    pid: int
    version: str
    started_at: datetime
    heartbeat_at: datetime
    heartbeat_age_s: float
    running: bool


async def daemons(conn: asyncpg.Connection | asyncpg.Pool) -> list[DaemonRow]:
    """Every recorded daemon, running ones first, newest heartbeat first."""
    rows = await conn.fetch(
        "SELECT owner, host, pid, version, started_at, heartbeat_at,"
        " extract(epoch FROM now() - heartbeat_at)::float8 AS heartbeat_age_s,"
        " heartbeat_at > now() - make_interval(secs => $1) AS running"
        " FROM inboxd_daemons ORDER BY running DESC, heartbeat_at DESC, owner",
        DAEMON_GONE_AFTER_S,
    )
    return [DaemonRow(**dict(r)) for r in rows]
