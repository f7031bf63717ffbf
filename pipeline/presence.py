"""Presence locks: a session-level advisory lock per lease owner, alive as long as
its process (pipeline/leases.py module docstring, "Presence"). A lease carries the
lock's key; `acquire_lease` takes a lease whose holder's lock is gone at once.
"""

from __future__ import annotations

import hashlib

import asyncpg


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
