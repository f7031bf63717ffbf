"""When a mailbox syncs next and how it is doing, in its `mailboxes` row: throttle, polls, status.

The companion of `pipeline/mailbox/leases.py`, which owns the lease, the fencing
token, the cursor and the cancel flag; this module writes none of those. The
same rules hold: every time comes from the database clock (`now()`), every
statement is scoped by tenant (bar `tenants_of_mailbox`), and the row is the
only coordinator between replicas (docs/architecture.md §4, §5).

Sync state (`sync_state`), as a sync run moves it::

    idle ──set_sync_state("syncing" | "backfilling", token=…)──▶ syncing | backfilling
    any ──record_success──▶ idle
    any ──record_failure(attention=False)──▶ idle   (needs_attention stays needs_attention)
    any ──record_failure(attention=True)──▶ needs_attention
          (left only through record_success or set_sync_state)

Throttle: `record_failure` moves `throttle_backoff_s` along 30 s, 60 s, 120 s,
… capped at 1 h (docs/architecture.md §4) and sets `throttle_until` to now() plus the
larger of that step and the provider's Retry-After (and never earlier than an
existing throttle_until); one `record_success` resets both. No provider call
for the mailbox before `throttle_until` — `claim_due` does not hand it out.

Poll scheduling: see `claim_due`. Configuration: `upsert_configured_mailboxes`
writes only the configured columns (provider, address, sync_mode,
poll_interval_s). Reading it all back for operators: pipeline/mailbox/status.py.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

import asyncpg

from inboxd.pipeline.doorbell import ring

# Private helpers of leases on purpose: the fence and argument checks of the one
# row both modules write, kept in one place (leases does not import this module).
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
from inboxd.pipeline.tenancy import validate_id

SyncState = Literal["idle", "syncing", "backfilling", "needs_attention"]
SyncMode = Literal["push", "poll", "auto"]

SYNC_STATES: frozenset[str] = frozenset({"idle", "syncing", "backfilling", "needs_attention"})
SYNC_MODES: frozenset[str] = frozenset({"push", "poll", "auto"})

# docs/architecture.md §4: exponential backoff 30 s → 1 h, persisted on the mailbox.
BACKOFF_INITIAL_S = 30
BACKOFF_MAX_S = 3600


# --- throttle and health -----------------------------------------------------------------

_RECORD_SUCCESS = f"""
UPDATE mailboxes SET {CLEAN_RUN}
 WHERE tenant_id = $1 AND mailbox_id = $2
RETURNING true
"""

# The next backoff step from the current one: 0 → 30, then doubling, capped.
# Computed in the UPDATE from the row's newest version, so two failures
# recorded at once still make two steps.
_NEXT_BACKOFF = "least(greatest(throttle_backoff_s * 2, $6::integer), $7::integer)"

_RECORD_FAILURE = f"""
UPDATE mailboxes
   SET throttle_backoff_s = {_NEXT_BACKOFF},
       throttle_until = greatest(
           throttle_until,
           now() + make_interval(secs => greatest({_NEXT_BACKOFF}::float8, coalesce($4, 0)))),
       last_error = $3,
       last_error_at = now(),
       sync_state = CASE WHEN $5 THEN 'needs_attention'
                         WHEN sync_state = 'needs_attention' THEN sync_state
                         ELSE 'idle' END
 WHERE tenant_id = $1 AND mailbox_id = $2
RETURNING throttle_until
"""


async def record_success(conn: Executor, tenant_id: str, mailbox_id: str) -> None:
    """A sync run finished cleanly: last_success_at = now(), throttle reset, state idle.

    `last_error`/`last_error_at` are kept for the operator (they say what last
    went wrong and when; last_success_at says it has recovered since).
    Raises MailboxNotFound.
    """
    if not await conn.fetchval(_RECORD_SUCCESS, tenant_id, mailbox_id):
        raise MailboxNotFound(tenant_id, mailbox_id)


async def record_partial_success(
    conn: Executor,
    tenant_id: str,
    mailbox_id: str,
    problem: str,
    *,
    attention: bool,
) -> None:
    """A run that completed without one part of the mailbox (an IMAP folder gone):
    like record_success (throttle reset, last_success_at) — the rest is synced and
    nothing is retried sooner — but `problem` becomes last_error, and with
    `attention` the state is needs_attention (a `mailbox.needs_attention` event when
    newly so) while the runner keeps syncing what it can. Raises MailboxNotFound."""
    async with connection(conn) as c, c.transaction():
        before = await c.fetchval(
            "SELECT sync_state FROM mailboxes WHERE tenant_id = $1 AND mailbox_id = $2 FOR UPDATE",
            tenant_id,
            mailbox_id,
        )
        if before is None:
            raise MailboxNotFound(tenant_id, mailbox_id)
        await c.execute(
            "UPDATE mailboxes SET last_success_at = now(), throttle_backoff_s = 0,"
            " throttle_until = NULL, last_error = $3, last_error_at = now(),"
            " sync_state = CASE WHEN $4 THEN 'needs_attention'"
            # the same problem still there: a restarted process, whose door counts
            # again from its first run, does not clear it (nor announce it again)
            "  WHEN sync_state = 'needs_attention' AND last_error = $3 THEN sync_state"
            "  ELSE 'idle' END"
            " WHERE tenant_id = $1 AND mailbox_id = $2",
            tenant_id,
            mailbox_id,
            one_line(problem),
            attention,
        )
        if attention and before != "needs_attention":
            events = EventBuffer()
            events.add(NEEDS_ATTENTION_EVENT, payload={"error": one_line(problem)})
            await events.flush(c, tenant_id, mailbox_id)


async def record_needs_connect(conn: Executor, tenant_id: str, mailbox_id: str, how: str) -> None:
    """A configured mailbox without a credential yet: state needs_connect, `how` (the
    command that connects it) as its last error, no throttle (nothing is retried: the
    reload that adds the credential starts it). Raises MailboxNotFound."""
    if not await conn.fetchval(
        "UPDATE mailboxes SET sync_state = 'needs_connect', last_error = $3,"
        " last_error_at = now() WHERE tenant_id = $1 AND mailbox_id = $2 RETURNING true",
        tenant_id,
        mailbox_id,
        one_line(how),
    ):
        raise MailboxNotFound(tenant_id, mailbox_id)


async def record_failure(
    conn: Executor,
    tenant_id: str,
    mailbox_id: str,
    error: str,
    *,
    retry_after_s: float | None = None,
    attention: bool = False,
) -> datetime:
    """A sync run failed: next backoff step, throttle, last error; returns throttle_until.

    Backoff steps 30 s, 60 s, 120 s, … capped at 3600 s (persisted in
    throttle_backoff_s). throttle_until = now() + max(step, retry_after_s), and
    never earlier than a throttle_until already set. `attention=True` (auth or
    config error) sets sync_state 'needs_attention', which only
    record_success or set_sync_state clears; otherwise the state goes back to
    'idle'. `error` is stored as one line of at most 300 characters — it must
    not contain secrets. A mailbox that newly needs attention also gets a
    `mailbox.needs_attention` outbox event with that line, in the same
    transaction, so the application can tell its users to reconnect. Raises
    MailboxNotFound, ValueError for a negative or non-finite retry_after_s.
    """
    if retry_after_s is not None:
        retry_after_s = _non_negative("retry_after_s", retry_after_s)
    async with connection(conn) as c, c.transaction():
        before = await c.fetchval(
            "SELECT sync_state FROM mailboxes WHERE tenant_id = $1 AND mailbox_id = $2 FOR UPDATE",
            tenant_id,
            mailbox_id,
        )
        until: datetime | None = await c.fetchval(
            _RECORD_FAILURE,
            tenant_id,
            mailbox_id,
            one_line(error),
            retry_after_s,
            attention,
            BACKOFF_INITIAL_S,
            BACKOFF_MAX_S,
        )
        if until is None:
            raise MailboxNotFound(tenant_id, mailbox_id)
        if attention and before != "needs_attention":
            events = EventBuffer()
            events.add(NEEDS_ATTENTION_EVENT, payload={"error": one_line(error)})
            await events.flush(c, tenant_id, mailbox_id)
    return until


async def set_sync_state(
    conn: Executor,
    tenant_id: str,
    mailbox_id: str,
    state: SyncState,
    *,
    token: int | None = None,
) -> bool:
    """Set sync_state; with `token`, only while that lease is held. False: no row changed.

    States: idle, syncing, backfilling, needs_attention. Raises ValueError for
    any other.
    """
    if state not in SYNC_STATES:
        raise ValueError(f"unknown sync state {state!r}: one of {sorted(SYNC_STATES)}")
    if token is None:
        done = await conn.fetchval(
            "UPDATE mailboxes SET sync_state = $3 WHERE tenant_id = $1 AND mailbox_id = $2 "
            "RETURNING true",
            tenant_id,
            mailbox_id,
            state,
        )
    else:
        done = await conn.fetchval(
            f"UPDATE mailboxes SET sync_state = $4 WHERE tenant_id = $1 AND mailbox_id = $2 "
            f"AND {HELD} RETURNING true",
            tenant_id,
            mailbox_id,
            token,
            state,
        )
    return bool(done)


# --- poll scheduling ---------------------------------------------------------------------

# The outbox event of a mailbox that newly needs an operator (record_failure).
NEEDS_ATTENTION_EVENT = "mailbox.needs_attention"
# A push-mode mailbox is still synced once a day: a lost notification is caught up,
# and its watch is renewed (Gmail's lapses after 7 days without a users.watch call).
PUSH_SAFETY_SYNC_S = 24 * 3600.0


def poll_every_s(sync_mode: str, poll_interval_s: float) -> float:
    """Seconds between a mailbox's polls: its interval, or for a push mailbox the
    daily safety sync when that is longer (the claim's rule, `_DUE_AT`)."""
    if sync_mode == "push":
        return max(poll_interval_s, PUSH_SAFETY_SYNC_S)
    return poll_interval_s


# When the mailbox was last known in sync: the start of its last clean run (a run
# that took the lease at sync_started_at — or, answering a claim, was recorded as
# starting at the claim, leases.begin_run — and then succeeded), else — a run under
# way or failed since, or a row from before sync_started_at — its last success.
_IN_SYNC_AS_OF = (
    "CASE WHEN m.last_success_at >= m.sync_started_at THEN m.sync_started_at "
    "ELSE m.last_success_at END"
)

# When a mailbox is next due: its interval after the later of its last poll claim
# and when it was last known in sync (by any trigger). Counting from the run's start,
# not its end, keeps the period at the interval however long a poll takes (issue 25:
# from the end, every period grew by the run). NULL: neither ever happened.
_DUE_AT = (
    f"greatest(m.last_polled_at, {_IN_SYNC_AS_OF}) + make_interval(secs => "
    f"CASE WHEN m.sync_mode = 'push' THEN greatest(m.poll_interval_s, {PUSH_SAFETY_SYNC_S}) "
    "ELSE m.poll_interval_s END)"
)

_IS_DUE = f"""
       coalesce({_DUE_AT}, '-infinity') <= now() + make_interval(secs => $7)
       AND coalesce(m.next_poll_at, '-infinity') <= now()
       AND coalesce(m.throttle_until, '-infinity') <= now()
       AND NOT (m.sync_mode = 'auto'
                AND coalesce(m.last_push_at, '-infinity') > now() - make_interval(secs => $6))
       AND (m.lease_owner IS NULL OR m.lease_owner = $1
            OR coalesce(m.lease_expires_at, '-infinity') <= now())"""

# Tenant-fair: each tenant's due mailboxes are ranked by how overdue they are, and
# the claim takes rank 1 of every tenant before rank 2 of any, so a tenant with
# thousands of due mailboxes cannot push another's one mailbox past the limit. The
# ranking cannot lock (PostgreSQL allows no FOR UPDATE beside window functions), so
# the locking pass re-checks every condition on the rows it takes.
_CLAIM_DUE = f"""
WITH ranked AS (
    SELECT m.tenant_id, m.mailbox_id,
           row_number() OVER (PARTITION BY m.tenant_id
                              ORDER BY {_DUE_AT} NULLS FIRST, m.mailbox_id) AS tenant_rank
      FROM mailboxes m
      JOIN unnest($2::text[], $3::text[]) AS w (tenant_id, mailbox_id)
        ON m.tenant_id = w.tenant_id AND m.mailbox_id = w.mailbox_id
     WHERE {_IS_DUE}
),
due AS (
    SELECT m.tenant_id, m.mailbox_id
      FROM mailboxes m
      JOIN ranked r ON m.tenant_id = r.tenant_id AND m.mailbox_id = r.mailbox_id
     WHERE {_IS_DUE}
     ORDER BY r.tenant_rank, {_DUE_AT} NULLS FIRST, m.tenant_id, m.mailbox_id
     LIMIT $5
       FOR UPDATE OF m SKIP LOCKED
)
UPDATE mailboxes m
   SET last_polled_at = now(), next_poll_at = now() + make_interval(secs => $4)
  FROM due
 WHERE m.tenant_id = due.tenant_id AND m.mailbox_id = due.mailbox_id
RETURNING m.tenant_id, m.mailbox_id
"""


async def claim_due(
    conn: Executor,
    owner: str,
    *,
    mailboxes: Sequence[tuple[str, str]],
    cooldown_s: float,
    limit: int,
    push_quiet_after_s: float = 0.0,
    ahead_s: float = 0.0,
) -> list[tuple[str, str]]:
    """Claim up to `limit` of `mailboxes` that are due for a poll; (tenant, mailbox) pairs.

    `mailboxes` are the (tenant_id, mailbox_id) pairs this scanner polls
    (mailboxes in poll mode, and in auto mode with poll_interval_s as the
    "push has been quiet" threshold); others are never returned. A mailbox is
    due when all hold:

    * its interval has passed, or passes within `ahead_s`: now() + ahead_s ≥
      poll_interval_s after the later of last_polled_at (the last claim) and the
      start of its last clean sync run (sync_started_at, whatever triggered the
      run — so a push-fed mailbox is only polled once push has been quiet for its
      interval), or it has neither. A scanner passes half its period as
      `ahead_s`: a mailbox falling due before the next pass is claimed in the
      pass nearest to its due time, early or late, instead of always late;
    * its claim cooldown has passed: next_poll_at ≤ now();
    * it is not throttled: throttle_until ≤ now();
    * in push mode, at least PUSH_SAFETY_SYNC_S since the last poll or success
      (a daily safety sync, whatever poll_interval_s says);
    * in auto mode, push has been quiet: no `record_push` in the last
      `push_quiet_after_s` seconds (a mailbox whose pushes arrive is not polled);
    * its lease is free, expired or held by `owner`.

    Fair across tenants, then most overdue first: every tenant's most overdue
    mailbox comes before any tenant's second (when `limit` cuts the list, no
    tenant is starved by another's backlog). In the same statement the claimed rows get
    last_polled_at = now() and next_poll_at = now() + cooldown_s. The rows are
    picked `FOR UPDATE SKIP LOCKED`, and a row another scanner claimed in the
    meantime fails the re-check, so concurrent scanners (threads, processes,
    replicas) never claim one mailbox twice within a cooldown. A claim is not
    a lease: the caller rings its doorbell for each mailbox, and its sync run
    still acquires the lease.
    """
    require_owner(owner)
    cooldown_s = _non_negative("cooldown_s", cooldown_s)
    push_quiet_after_s = _non_negative("push_quiet_after_s", push_quiet_after_s)
    ahead_s = _non_negative("ahead_s", ahead_s)
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    pairs = list(dict.fromkeys((t, m) for t, m in mailboxes))
    if not pairs:
        return []
    rows = await conn.fetch(
        _CLAIM_DUE,
        owner,
        [t for t, _ in pairs],
        [m for _, m in pairs],
        cooldown_s,
        limit,
        push_quiet_after_s,
        ahead_s,
    )
    return sorted((r[0], r[1]) for r in rows)


# --- configuration -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MailboxRow:
    """A configured mailbox, as the daemon's config loader hands it to the database."""

    tenant_id: str
    mailbox_id: str
    provider: str
    address: str = ""
    sync_mode: SyncMode = "auto"
    poll_interval_s: float = 300.0

    def __post_init__(self) -> None:
        validate_id("tenant", self.tenant_id)
        validate_id("mailbox", self.mailbox_id)
        if not self.provider:
            raise ValueError(f"mailbox {self.mailbox_id!r}: provider must not be empty")
        if self.sync_mode not in SYNC_MODES:
            raise ValueError(
                f"mailbox {self.mailbox_id!r}: sync_mode {self.sync_mode!r} "
                f"is not one of {sorted(SYNC_MODES)}"
            )
        positive_seconds("poll_interval_s", self.poll_interval_s)


_UPSERT_TENANTS = """
INSERT INTO tenants (tenant_id) SELECT DISTINCT t FROM unnest($1::text[]) AS t
ON CONFLICT (tenant_id) DO NOTHING
"""

_UPSERT_MAILBOXES = """
INSERT INTO mailboxes (tenant_id, mailbox_id, provider, address, sync_mode, poll_interval_s)
SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::float8[])
ON CONFLICT (tenant_id, mailbox_id) DO UPDATE
   SET provider = EXCLUDED.provider, address = EXCLUDED.address,
       sync_mode = EXCLUDED.sync_mode, poll_interval_s = EXCLUDED.poll_interval_s
 WHERE (mailboxes.provider, mailboxes.address, mailboxes.sync_mode, mailboxes.poll_interval_s)
       IS DISTINCT FROM
       (EXCLUDED.provider, EXCLUDED.address, EXCLUDED.sync_mode, EXCLUDED.poll_interval_s)
"""


async def upsert_configured_mailboxes(conn: Executor, rows: Sequence[MailboxRow]) -> int:
    """Create missing tenant/mailbox rows and update the configured columns; rows changed.

    Sets provider, address, sync_mode and poll_interval_s; never touches
    cursor, lease, throttle, cancel or health columns, and never deletes a
    mailbox that left the config (its rows stay the application's). Rows are
    written in key order, so replicas upserting one config at once cannot
    deadlock. Raises ValueError for a (tenant, mailbox) given twice.
    """
    ordered = sorted(rows, key=lambda r: (r.tenant_id, r.mailbox_id))
    for prev, row in itertools.pairwise(ordered):
        if (prev.tenant_id, prev.mailbox_id) == (row.tenant_id, row.mailbox_id):
            raise ValueError(
                f"mailbox {row.mailbox_id!r} of tenant {row.tenant_id!r} is configured twice"
            )
    if not ordered:
        return 0
    columns = (
        [r.tenant_id for r in ordered],
        [r.mailbox_id for r in ordered],
        [r.provider for r in ordered],
        [r.address for r in ordered],
        [r.sync_mode for r in ordered],
        [float(r.poll_interval_s) for r in ordered],
    )
    async with connection(conn) as c, c.transaction():
        await c.execute(_UPSERT_TENANTS, columns[0])
        status = await c.execute(_UPSERT_MAILBOXES, *columns)
    return int(status.rsplit(" ", 1)[-1])


# --- push --------------------------------------------------------------------------------


async def record_push(
    conn: asyncpg.Connection, tenant_id: str, mailbox_id: str, hint: str | None = None
) -> bool:
    """A provider pushed a change for the mailbox: stamp it and ring its doorbell.

    In one transaction (a savepoint inside the caller's): `last_push_at = now()`
    (auto mode polls only once push has been quiet, `claim_due`), `push_hint`
    = what the push said (Gmail's historyId), and the doorbell's NOTIFY, sent at
    commit. A push handler records and answers; it never syncs inline. False:
    no such mailbox (nothing written, no ring).
    """
    async with conn.transaction():
        found = await conn.fetchval(
            "UPDATE mailboxes SET last_push_at = now(), push_hint = $3 "
            "WHERE tenant_id = $1 AND mailbox_id = $2 RETURNING true",
            tenant_id,
            mailbox_id,
            hint,
        )
        if not found:
            return False
        await ring(conn, tenant_id, mailbox_id)
    return True


async def record_watch_expiry(
    conn: Executor, tenant_id: str, mailbox_id: str, expires_at: datetime | None
) -> None:
    """When the mailbox's push channel (Gmail watch, Graph subscriptions) lapses
    unless renewed; None: it has none. `inboxd status` shows it."""
    await conn.execute(
        "UPDATE mailboxes SET watch_expires_at = $3 WHERE tenant_id = $1 AND mailbox_id = $2",
        tenant_id,
        mailbox_id,
        expires_at,
    )


# --- helpers -----------------------------------------------------------------------------


def _non_negative(name: str, value: float) -> float:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a non-negative number of seconds, got {value!r}")
    return float(value)
