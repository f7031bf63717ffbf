"""Mailbox ownership and cursors in the `mailboxes` row: leases, fencing tokens, cancel flag.

Several `inboxd run` replicas share one database (docs/architecture.md §4, §5). Which of
them syncs a mailbox and where its sync stands live in the mailbox's row, so
the database is the only coordinator — no home-made cluster protocol. Every
time below comes from the database clock (`now()`), never from a replica's
clock, and every statement is scoped by tenant. When a mailbox syncs next and
how it is doing (throttle, sync state, poll claims, status) is
`pipeline/mailbox/scheduling.py`, on the same row.

Lease protocol (one lease per mailbox; `lease_token` is the fencing token)::

                acquire_lease(owner, ttl_s)          [free, expired, or owner's own]
     FREE ───────────────────────────────────────────▶ HELD(owner, token=N+1, expires)
      ▲  ▲                                             │  │ renew_lease(owner, N+1, ttl_s)
      │  └──── release_lease(owner, N+1) ──────────────┘  │   every ≲ ttl_s/3: expires moves on;
      │                                                   │   False = lost → stop syncing now
      └──── expires ≤ now() (EXPIRED) ◀───────────────────┘
              anyone's acquire_lease → N+2: the holder of N+1 is fenced off

`renew_leases` is renew_lease for every lease one owner holds, in one statement:
the daemon renews all of its leases that way, on a connection of its own
(daemon/sync/lease_keeper.py), so a renewal never queues behind the syncs it keeps.

* Every successful acquire increments `lease_token`, also when the same owner
  re-acquires (after expiry or not): each acquisition has its own token, and a
  token never comes back. Two holders must therefore never share an owner id:
  make it unique per process (`new_owner_id`: host, pid, random part), not a
  bare host name, and run at most one sync per mailbox inside a process.
* The token is what makes a stalled holder harmless: `commit_cursor` and
  `reset_cursor` write only `WHERE lease_token = token` and the lease has not
  expired, so once another replica acquired (token moved on), or the lease ran
  out, the stale holder's write changes no row and it learns so (False). Under
  READ COMMITTED an UPDATE re-checks its WHERE against the newest row version,
  so this holds however the two transactions interleave.
* Presence: a lease may carry the holder's *session key*, the key of a
  session-level advisory lock the holder keeps on a connection of its own
  (pipeline/mailbox/presence.py `hold_presence`; the daemon's task, daemon/sync/presence.py).
  When that lock is gone from `pg_locks`, the holder's session is gone — the
  process was killed, crashed, lost power or lost its connection — and
  `acquire_lease` takes the lease at once instead of waiting out its expiry,
  so a restarted daemon resyncs its mailboxes within seconds. This moves no
  fencing: the token still increments, and a holder whose connection merely
  dropped finds its next cursor write refused. A lease without a session key
  (an older daemon, a holder without presence) is taken only after expiry.
* The lease's expiry check uses `now()`, i.e. the start of the caller's
  transaction. Call these functions in short transactions (or autocommit);
  `commit_cursor` inside a long ingest transaction judges expiry at that
  transaction's start, and the token still rejects any holder that was
  replaced.

Cursor rules (adapters/base.py has the whole source contract): the source
writes its cursor with `commit_cursor` only past clean pages, after (or in) the
ingest transaction. Cursors are opaque provider strings, so *forward* cannot be
checked here: moving it only forward is the source's duty. An expired cursor
(Gmail 404, Graph 410/syncStateNotFound, IMAP UIDVALIDITY change) goes through
`reset_cursor`, which clears it and writes a `mailbox.cursor_reset` outbox
event in one transaction; the next run resyncs from the beginning, idempotent
through the dedup cascade.

A sync run, as the supervisor drives it (`scheduling` writes its health)::

    token = acquire_lease(...)            None → another replica syncs it: skip
    scheduling.set_sync_state(..., "syncing", token=token)
    for each page:   take_cancel? → stop (cursor stays at the last clean page)
                     ingest → commit_cursor(token, page.cursor_after)  False → stop
                     renew_lease when due                               False → stop
    scheduling.record_success | scheduling.record_failure(error, retry_after_s=…, attention=…)
    release_lease(owner, token)

Cancel flag: `cancel_running_sync` (`inboxd sync cancel`) sets it from any
process while a sync holds the lease, and sets nothing when none does; the
running sync checks it between pages and clears it when it stops
(`take_cancel` does both in one statement), and releasing the lease clears it
too, so a cancel never outlives the run it was meant for. (`request_cancel`
sets it unconditionally: it then stops the next run at its first check.)
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from inboxd.pipeline.mailbox.rows import (
    CLEAN_RUN,
    HELD,
    Executor,
    MailboxNotFound,
    connection,
    one_line,
    positive_seconds,
    require_owner,
)
from inboxd.pipeline.outbox import EventBuffer

# Executor, MailboxNotFound and one_line are imported from here by other modules
# (their home is pipeline/mailbox/rows.py).
__all__ = [
    "CURSOR_RESET_EVENT",
    "Executor",
    "MailboxNotFound",
    "one_line",
]

# The outbox event written by reset_cursor.
CURSOR_RESET_EVENT = "mailbox.cursor_reset"


def new_owner_id(name: str = "inboxd") -> str:
    """A lease owner id unique to this call: host, pid and a random part.

    Use one per process (or per sync task), never per host: two processes
    sharing an owner id would each take a mailbox's lease from the other.
    """
    return f"{name}@{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


# --- leases ------------------------------------------------------------------------------

# $6: leave a throttled mailbox alone (begin_run). `target` is the row as it was
# before the statement: its throttle, and whether it exists at all.
_ACQUIRE = """
WITH target AS (
    SELECT throttle_until FROM mailboxes WHERE tenant_id = $1 AND mailbox_id = $2
), taken AS (
    UPDATE mailboxes
       SET lease_owner = $3,
           lease_expires_at = now() + make_interval(secs => $4),
           lease_token = lease_token + 1,
           lease_session_key = $5,
           -- a run answering a poll claim counts from the claim ($7, begin_run)
           sync_started_at = CASE WHEN $7 THEN least(coalesce(last_polled_at, now()), now())
                                  ELSE now() END,
           -- a cancel meant for an earlier holder's run (one that died before
           -- seeing it) must not stop this one
           cancel_requested = false
     WHERE tenant_id = $1 AND mailbox_id = $2
       AND NOT ($6 AND coalesce(throttle_until, '-infinity') > now())
       AND (lease_owner IS NULL OR lease_owner = $3
            OR lease_expires_at IS NULL OR lease_expires_at <= now()
            OR (lease_session_key IS NOT NULL AND NOT EXISTS (
                   -- the holder's presence lock (a session advisory lock on a bigint key shows as
                   -- classid = high 32 bits, objid = low 32 bits, objsubid = 1)
                   SELECT 1 FROM pg_locks l
                    WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
                      AND l.database = (SELECT oid FROM pg_database
                                         WHERE datname = current_database())
                      AND l.classid = ((lease_session_key >> 32) & 4294967295)::oid
                      AND l.objid = (lease_session_key & 4294967295)::oid)))
    RETURNING lease_token, cursor
)
SELECT (SELECT lease_token FROM taken), EXISTS (SELECT 1 FROM target), (SELECT cursor FROM taken),
       (SELECT extract(epoch FROM throttle_until - now())::float8 FROM target
         WHERE $6 AND throttle_until > now())
"""

# A page's end (commit_page): its cursor (when it has one) and the cancel flag, taken
# and cleared, in one fenced statement. `before` reads the flag as it was: joined in
# FROM, it is read (and the row locked) before the update, so a cancel set
# concurrently is either seen now or left for the next page. (As a CTE read only in
# RETURNING it saw the row this statement had just written.)
_COMMIT_PAGE = f"""
UPDATE mailboxes
   SET cursor = coalesce($4, cursor),
       cursor_updated_at = CASE WHEN $4 IS NOT NULL AND cursor IS DISTINCT FROM $4 THEN now()
                                ELSE cursor_updated_at END,
       cancel_requested = false
  FROM (SELECT cancel_requested AS was FROM mailboxes
         WHERE tenant_id = $1 AND mailbox_id = $2 FOR UPDATE) AS before
 WHERE tenant_id = $1 AND mailbox_id = $2 AND {HELD}
RETURNING before.was
"""

# A clean run's end (finish_run): the run recorded clean and the lease released, in one
# statement, while this holder still has it.
_FINISH_RUN = f"""
UPDATE mailboxes
   SET {CLEAN_RUN},
       lease_owner = NULL, lease_expires_at = NULL, cancel_requested = false
 WHERE tenant_id = $1 AND mailbox_id = $2 AND lease_owner = $3 AND lease_token = $4
RETURNING true
"""

_RENEW = """
UPDATE mailboxes SET lease_expires_at = now() + make_interval(secs => $5)
 WHERE tenant_id = $1 AND mailbox_id = $2 AND lease_owner = $3 AND lease_token = $4
   AND lease_expires_at > now()
RETURNING true
"""

# Every lease of one owner in one statement (renew_leases): a daemon holding
# hundreds renews them all with one round trip instead of one each.
_RENEW_MANY = """
UPDATE mailboxes m SET lease_expires_at = now() + make_interval(secs => $5)
  FROM unnest($2::text[], $3::text[], $4::bigint[]) AS h (tenant_id, mailbox_id, token)
 WHERE m.tenant_id = h.tenant_id AND m.mailbox_id = h.mailbox_id
   AND m.lease_owner = $1 AND m.lease_token = h.token AND m.lease_expires_at > now()
RETURNING m.tenant_id, m.mailbox_id
"""

# A cancel meant for this run must not stop the next one: releasing clears it.
_RELEASE = """
UPDATE mailboxes SET lease_owner = NULL, lease_expires_at = NULL, cancel_requested = false
 WHERE tenant_id = $1 AND mailbox_id = $2 AND lease_owner = $3 AND lease_token = $4
"""


_COMMIT_CURSOR = f"""
UPDATE mailboxes
   SET cursor = $4,
       cursor_updated_at = CASE WHEN cursor IS DISTINCT FROM $4 THEN now()
                                ELSE cursor_updated_at END
 WHERE tenant_id = $1 AND mailbox_id = $2 AND {HELD}
RETURNING true
"""

_RESET_CURSOR = f"""
UPDATE mailboxes SET cursor = $4, cursor_updated_at = now()
 WHERE tenant_id = $1 AND mailbox_id = $2 AND {HELD}
RETURNING true
"""


async def acquire_lease(
    conn: Executor,
    tenant_id: str,
    mailbox_id: str,
    owner: str,
    ttl_s: float,
    *,
    session_key: int | None = None,
) -> int | None:
    """Take the mailbox's lease for `ttl_s` seconds; the new fencing token, or None.

    One statement. Succeeds when the lease is free, expired, already held by
    `owner`, or held by an owner whose presence lock is gone (module
    docstring), and then always increments `lease_token` and returns it (a
    re-acquire by the same owner gets a new token; the old one is stale).
    None: another live owner holds an unexpired lease — do not sync.
    `session_key`: this owner's presence key, only while `hold_presence`
    holds it. Raises MailboxNotFound when the mailbox does not exist,
    ValueError for a bad owner or ttl_s.
    """
    start = await _acquire(conn, tenant_id, mailbox_id, owner, ttl_s, session_key, False, False)
    return start.token


@dataclass(frozen=True, slots=True)
class RunStart:
    """What `begin_run` found: the lease taken (`token`, and the `cursor` to start
    from), or why not — throttled for `throttled_for_s`, or held elsewhere (both None)."""

    token: int | None
    cursor: str | None = None
    throttled_for_s: float | None = None


async def begin_run(
    conn: Executor,
    tenant_id: str,
    mailbox_id: str,
    owner: str,
    ttl_s: float,
    *,
    session_key: int | None = None,
    from_claim: bool = False,
) -> RunStart:
    """A sync run's start in one statement (a poll at 10,000 mailboxes is a handful of
    statements, each counts): unless the mailbox is throttled, `acquire_lease`, with
    the cursor the new holder starts from. `from_claim`: the run answers a poll claim
    (scheduling.claim_due); its start is recorded as the claim's time, so the time it
    waited for a turn does not stretch the poll period (the mailbox was in sync as of
    the claim all the same once the run is clean). Raises MailboxNotFound."""
    return await _acquire(conn, tenant_id, mailbox_id, owner, ttl_s, session_key, True, from_claim)


async def _acquire(
    conn: Executor,
    tenant_id: str,
    mailbox_id: str,
    owner: str,
    ttl_s: float,
    session_key: int | None,
    unless_throttled: bool,
    from_claim: bool,
) -> RunStart:
    require_owner(owner)
    row = await conn.fetchrow(
        _ACQUIRE,
        tenant_id,
        mailbox_id,
        owner,
        positive_seconds("ttl_s", ttl_s),
        session_key,
        unless_throttled,
        from_claim,
    )
    if not row[1]:
        raise MailboxNotFound(tenant_id, mailbox_id)
    throttled = row[3]
    return RunStart(row[0], row[2], None if throttled is None else float(throttled))


async def renew_lease(
    conn: Executor,
    tenant_id: str,
    mailbox_id: str,
    owner: str,
    token: int,
    ttl_s: float,
) -> bool:
    """Extend a held lease to now() + ttl_s; False when it was lost.

    Lost means expired, released, or taken by another acquisition (token moved
    on): the caller must stop syncing at once, without writing its cursor, and
    may try `acquire_lease` again later (it then gets a new token and resumes
    from the cursor in the database). Renew well before expiry (every ttl_s/3).
    """
    require_owner(owner)
    renewed = await conn.fetchval(
        _RENEW, tenant_id, mailbox_id, owner, token, positive_seconds("ttl_s", ttl_s)
    )
    return bool(renewed)


async def renew_leases(
    conn: Executor,
    owner: str,
    held: Sequence[tuple[str, str, int]],
    ttl_s: float,
) -> set[tuple[str, str]]:
    """`renew_lease` for many (tenant_id, mailbox_id, token) leases of `owner` in one
    statement; the (tenant_id, mailbox_id) pairs renewed. A pair missing from the
    answer was lost, exactly as renew_lease's False: its run must stop at once."""
    require_owner(owner)
    ttl = positive_seconds("ttl_s", ttl_s)
    if not held:
        return set()
    rows = await conn.fetch(
        _RENEW_MANY,
        owner,
        [t for t, _, _ in held],
        [m for _, m, _ in held],
        [token for _, _, token in held],
        ttl,
    )
    return {(r[0], r[1]) for r in rows}


async def release_lease(
    conn: Executor,
    tenant_id: str,
    mailbox_id: str,
    owner: str,
    token: int,
) -> None:
    """Give the lease up so another replica may sync at once (no wait for expiry).

    A no-op when `owner`/`token` no longer hold it. The token is kept, so the
    next acquisition still gets a larger one.
    """
    await conn.execute(_RELEASE, tenant_id, mailbox_id, owner, token)


# --- cursor ------------------------------------------------------------------------------


async def commit_cursor(
    conn: Executor,
    tenant_id: str,
    mailbox_id: str,
    token: int,
    cursor: str,
) -> bool:
    """Write the sync cursor, fenced by the lease token; False: stale holder, stop.

    Writes `cursor` (and `cursor_updated_at` when it changed) only while the
    lease with `token` is held and unexpired. Pass the ingest transaction's
    connection to write it in that transaction, or call it after that commit —
    never before (adapters/base.py). The value is opaque: that it only moves
    forward is the caller's duty. Raises ValueError for an empty cursor (use
    `reset_cursor` to forget one).
    """
    if not cursor:
        raise ValueError("cursor must be a non-empty string; use reset_cursor to clear it")
    return bool(await conn.fetchval(_COMMIT_CURSOR, tenant_id, mailbox_id, token, cursor))


async def commit_page(
    conn: Executor,
    tenant_id: str,
    mailbox_id: str,
    token: int,
    cursor: str | None,
) -> bool | None:
    """A committed page's end in one statement: `commit_cursor` (when `cursor` is not
    None) and `take_cancel`, fenced by `token`. None: the lease is no longer held
    (stale holder: stop, nothing was written); otherwise whether a cancel was
    requested (it is cleared: stop now)."""
    if cursor == "":
        raise ValueError("cursor must be a non-empty string; use reset_cursor to clear it")
    row = await conn.fetchrow(_COMMIT_PAGE, tenant_id, mailbox_id, token, cursor)
    return None if row is None else bool(row[0])


async def finish_run(
    conn: Executor,
    tenant_id: str,
    mailbox_id: str,
    owner: str,
    token: int,
) -> bool:
    """A clean run's end in one statement: scheduling.record_success and
    release_lease. False: `owner`/`token` no longer hold the lease, and nothing was
    written (the holder that took it over records its own runs)."""
    require_owner(owner)
    return bool(await conn.fetchval(_FINISH_RUN, tenant_id, mailbox_id, owner, token))


async def read_cursor(conn: Executor, tenant_id: str, mailbox_id: str) -> str | None:
    """The mailbox's committed cursor; None before its first committed page."""
    cursor = await conn.fetchval(
        "SELECT cursor FROM mailboxes WHERE tenant_id = $1 AND mailbox_id = $2",
        tenant_id,
        mailbox_id,
    )
    return None if cursor is None else str(cursor)


async def reset_cursor(
    conn: Executor,
    tenant_id: str,
    mailbox_id: str,
    token: int,
    reason: str,
    *,
    restart_from: str | None = None,
) -> bool:
    """Forget an expired cursor (full resync next) and record why; False: stale holder.

    In one transaction (a savepoint inside the caller's): clears `cursor` (or sets
    it to `restart_from`, when only part of it expired), fenced by `token` like
    commit_cursor, and writes a `mailbox.cursor_reset`
    outbox event with payload {"reason": reason} (one line, truncated), whose
    NOTIFY goes out at commit. Nothing is written when the lease is not held.
    """
    async with connection(conn) as c, c.transaction():
        if not await c.fetchval(_RESET_CURSOR, tenant_id, mailbox_id, token, restart_from):
            return False
        events = EventBuffer()
        events.add(CURSOR_RESET_EVENT, payload={"reason": one_line(reason)})
        await events.flush(c, tenant_id, mailbox_id)
    return True


# --- cancel flag -------------------------------------------------------------------------


async def request_cancel(conn: Executor, tenant_id: str, mailbox_id: str) -> bool:
    """Ask the mailbox's running (or next) sync to stop between pages; False: no mailbox."""
    return bool(
        await conn.fetchval(
            "UPDATE mailboxes SET cancel_requested = true "
            "WHERE tenant_id = $1 AND mailbox_id = $2 RETURNING true",
            tenant_id,
            mailbox_id,
        )
    )


async def cancel_running_sync(conn: Executor, tenant_id: str, mailbox_id: str) -> bool | None:
    """`inboxd sync cancel`: set the cancel flag only while a sync holds the lease.

    True: a sync is running and will stop between pages. False: nothing runs,
    and nothing is set (a flag left for later would stop an unrelated future
    run). None: no such mailbox. One statement, judged by the database clock.
    """
    running: bool | None = await conn.fetchval(
        "UPDATE mailboxes SET cancel_requested = "
        "(lease_owner IS NOT NULL AND lease_expires_at > now()) "
        "WHERE tenant_id = $1 AND mailbox_id = $2 RETURNING cancel_requested",
        tenant_id,
        mailbox_id,
    )
    return running


async def cancel_requested(conn: Executor, tenant_id: str, mailbox_id: str) -> bool:
    """True when a cancel is pending (False also for a mailbox that does not exist)."""
    return bool(
        await conn.fetchval(
            "SELECT cancel_requested FROM mailboxes WHERE tenant_id = $1 AND mailbox_id = $2",
            tenant_id,
            mailbox_id,
        )
    )


async def clear_cancel(conn: Executor, tenant_id: str, mailbox_id: str) -> None:
    """Withdraw a pending cancel (after the sync stopped for it)."""
    await conn.execute(
        "UPDATE mailboxes SET cancel_requested = false "
        "WHERE tenant_id = $1 AND mailbox_id = $2 AND cancel_requested",
        tenant_id,
        mailbox_id,
    )


async def take_cancel(conn: Executor, tenant_id: str, mailbox_id: str) -> bool:
    """Check and clear the cancel flag in one statement: True means stop now.

    What a sync calls between pages: a cancel requested concurrently is either
    seen now or stays set for the next check, never lost.
    """
    return bool(
        await conn.fetchval(
            "UPDATE mailboxes SET cancel_requested = false "
            "WHERE tenant_id = $1 AND mailbox_id = $2 AND cancel_requested RETURNING true",
            tenant_id,
            mailbox_id,
        )
    )
