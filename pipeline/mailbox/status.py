"""What `inboxd status` shows of each mailbox: its row, plus what it left behind.

One read-only query per call over the `mailboxes` rows that pipeline/mailbox/leases.py
and pipeline/mailbox/scheduling.py write: cursor, last success and lag, throttle, sync
state and last error, lease, cancel flag, poll settings, push and watch times —
and, per mailbox, the unresolved dead items and the attachments whose store
failed and that the sweep (pipeline/reprocess/attachments.py) has not re-derived yet.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from inboxd.pipeline.mailbox.leases import Executor


@dataclass(frozen=True, slots=True)
class MailboxStatus:
    """One mailbox's sync position and health, for `inboxd status` and /metrics.

    lag_s: seconds since the last clean sync (None: never). throttled /
    leased: whether throttle_until / the lease are still in the future.
    """

    tenant_id: str
    mailbox_id: str
    provider: str
    sync_mode: str
    cursor: str | None
    cursor_updated_at: datetime | None
    last_success_at: datetime | None
    lag_s: float | None
    throttle_until: datetime | None
    throttled: bool
    throttle_backoff_s: int
    sync_state: str
    last_error: str | None
    last_error_at: datetime | None
    lease_owner: str | None
    lease_expires_at: datetime | None
    leased: bool
    cancel_requested: bool
    poll_interval_s: float
    last_polled_at: datetime | None
    last_push_at: datetime | None = None  # the provider's last push (push and auto modes)
    watch_expires_at: datetime | None = None  # when the push channel lapses unless renewed
    # Outlook: why the last subscription create/renewal failed, while it keeps failing
    push_error: str | None = None
    dead_items: int = 0  # unresolved dead items of the mailbox
    attachments_pending: int = 0  # attachments whose store failed, not yet re-derived


_STATUS = """
SELECT tenant_id, mailbox_id, provider, sync_mode, cursor, cursor_updated_at,
       last_success_at,
       extract(epoch FROM now() - last_success_at)::float8 AS lag_s,
       throttle_until,
       coalesce(throttle_until > now(), false) AS throttled,
       throttle_backoff_s, sync_state, last_error, last_error_at,
       lease_owner, lease_expires_at,
       coalesce(lease_owner IS NOT NULL AND lease_expires_at > now(), false) AS leased,
       cancel_requested, poll_interval_s, last_polled_at, last_push_at, watch_expires_at,
       (SELECT g.folder || ': ' || g.last_error FROM graph_subscriptions g
         WHERE g.tenant_id = mb.tenant_id AND g.mailbox_id = mb.mailbox_id
           AND g.renew_failures > 0
         ORDER BY g.renew_failures DESC, g.folder LIMIT 1) AS push_error,
       (SELECT count(*) FROM dead_items d
         WHERE d.tenant_id = mb.tenant_id AND d.mailbox_id = mb.mailbox_id
           AND d.resolved_at IS NULL)::int AS dead_items,
       (SELECT count(*) FROM attachments a
          JOIN messages m ON m.tenant_id = a.tenant_id AND m.message_id = a.message_id
         WHERE a.tenant_id = mb.tenant_id AND m.mailbox_id = mb.mailbox_id
           AND NOT a.stored AND a.store_error IS NOT NULL)::int AS attachments_pending
  FROM mailboxes mb
 WHERE ($1::text IS NULL OR tenant_id = $1) AND ($2::text IS NULL OR mailbox_id = $2)
 ORDER BY tenant_id, mailbox_id
"""


async def mailbox_status(
    conn: Executor,
    tenant_id: str | None = None,
    *,
    mailbox_id: str | None = None,
) -> list[MailboxStatus]:
    """Every mailbox's status (of one tenant / one mailbox id when given), by tenant, id."""
    rows = await conn.fetch(_STATUS, tenant_id, mailbox_id)
    return [MailboxStatus(**dict(r)) for r in rows]


async def tenants_of_mailbox(conn: Executor, mailbox_id: str) -> list[str]:
    """Tenants that have a mailbox with this id, sorted (operator tools resolving an id).

    The one lookup not scoped by tenant: it is how a command finds the tenant
    when the operator gave only a mailbox id.
    """
    rows = await conn.fetch(
        "SELECT tenant_id FROM mailboxes WHERE mailbox_id = $1 ORDER BY tenant_id", mailbox_id
    )
    return [r[0] for r in rows]


async def mailboxes_in_states(conn: Executor, states: Iterable[str]) -> list[asyncpg.Record]:
    """`tenant_id`, `mailbox_id`, `sync_state` of every mailbox in one of `states`
    (the operator's gauges: needs_attention, needs_connect)."""
    rows: list[asyncpg.Record] = await conn.fetch(
        "SELECT tenant_id, mailbox_id, sync_state FROM mailboxes"
        " WHERE sync_state = ANY($1::text[])",
        list(states),
    )
    return rows
