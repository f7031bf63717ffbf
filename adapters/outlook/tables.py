"""The Outlook door's tables: `graph_subscriptions` and `graph_refresh_tokens` (schema.sql).

Every statement of the door lives here, scoped by tenant; the door's other modules
(subscriptions.py, token_store.py) and its webhook route call in.

## Subscriptions

One row per synced folder of a mailbox: Graph's subscription id, the random
`client_state` secret Graph echoes in every notification, its expiry, renewal
health and a pending lifecycle event. Two writers share the rows:

    the Outlook source         save_subscription (created or recreated), record_renewal,
                               record_renew_failure, clear_lifecycle, delete_subscriptions;
                               reads them with subscriptions_of
    the notification routes    subscriptions_by_id (one query per POST, to compare each
    (notifications.py)         notification's clientState), record_lifecycle

Lifecycle events (Graph "Reduce missing subscriptions and change notifications"),
from weakest to strongest, with what the source does about each:

    reauthorizationRequired    renew the subscription (PATCH expirationDateTime)
    missed                     resync the folder with delta
    subscriptionRemoved        recreate the subscription, then resync with delta

The column holds one event, so the strongest pending one is kept: a stronger
event's action includes the weaker's (recreating renews; recreating resyncs).
`lifecycle_at` is the arrival of the latest event of any kind, so a source that
read the row at `lifecycle_at = t` and acted clears it with `seen_at=t`: an event
that arrived meanwhile is not cleared and is acted on again by the next run.

Every statement is scoped by tenant; `client_state` never leaves this module
but in `GraphSubscription.client_state`, which its repr hides. Nothing here needs
Graph itself: no SDK, no web framework, only asyncpg.

## Refresh tokens

The newest refresh token of a delegated Outlook mailbox. Entra answers a new
refresh token with every refresh and may refuse the one it replaced (issue 22
item 6): a token kept only in memory is lost with the process, and the configured
one is then refused. The door writes each new token here before it uses it, and
reads it back at start:

    load_refresh_token(configured_sha256)   the stored token, only if the row was
                                            written while the configuration named
                                            the same token (sha256); a changed
                                            configured token (`inboxd connect
                                            outlook` again) wins over the row
    save_refresh_token(...)                 insert or replace, committed with
                                            synchronous_commit on before it returns

One row per (tenant, mailbox); every statement is scoped by tenant. The token never
leaves this module but as the return value of `load_refresh_token`; nothing here logs.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

import asyncpg

from inboxd.pipeline.mailbox.leases import one_line
from inboxd.pipeline.tenancy import validate_id

__all__ = [
    "LIFECYCLE_EVENTS",
    "GraphSubscription",
    "clear_lifecycle",
    "delete_subscriptions",
    "load_refresh_token",
    "record_lifecycle",
    "record_renew_failure",
    "record_renewal",
    "save_refresh_token",
    "save_subscription",
    "stronger_event",
    "subscriptions_by_id",
    "subscriptions_of",
]

#: Graph's lifecycleEvent values, weakest first (module docstring).
LIFECYCLE_EVENTS: tuple[str, ...] = ("reauthorizationRequired", "missed", "subscriptionRemoved")

_COLUMNS = (
    "tenant_id, mailbox_id, folder, subscription_id, client_state, expires_at, created_at,"
    " renewed_at, renew_failures, last_error, lifecycle_event, lifecycle_at"
)


@dataclass(frozen=True, slots=True)
class GraphSubscription:
    """One `graph_subscriptions` row (columns: schema.sql)."""

    tenant_id: str
    mailbox_id: str
    folder: str
    subscription_id: str
    client_state: str = field(repr=False)
    expires_at: datetime
    created_at: datetime
    renewed_at: datetime | None
    renew_failures: int
    last_error: str | None
    lifecycle_event: str | None
    lifecycle_at: datetime | None

    @classmethod
    def from_record(cls, record: asyncpg.Record) -> GraphSubscription:
        return cls(**dict(record.items()))


def stronger_event(a: str | None, b: str | None) -> str | None:
    """The stronger of two lifecycle events (None and unknown values are weakest)."""
    return a if _rank(a) >= _rank(b) else b


def _rank(event: str | None) -> int:
    return LIFECYCLE_EVENTS.index(event) + 1 if event in LIFECYCLE_EVENTS else 0


async def subscriptions_of(
    conn: asyncpg.Connection | asyncpg.Pool, tenant_id: str, mailbox_id: str
) -> list[GraphSubscription]:
    """The mailbox's subscriptions, by folder."""
    rows = await conn.fetch(
        f"SELECT {_COLUMNS} FROM graph_subscriptions"
        " WHERE tenant_id = $1 AND mailbox_id = $2 ORDER BY folder",
        tenant_id,
        mailbox_id,
    )
    return [GraphSubscription.from_record(r) for r in rows]


async def subscriptions_by_id(
    conn: asyncpg.Connection | asyncpg.Pool, tenant_id: str, subscription_ids: Iterable[str]
) -> dict[str, GraphSubscription]:
    """subscription id → row, for the ids of `tenant_id` among `subscription_ids`, in
    one query. An id of another tenant, or of none, is simply absent."""
    ids = list(dict.fromkeys(subscription_ids))
    if not ids:
        return {}
    rows = await conn.fetch(
        f"SELECT {_COLUMNS} FROM graph_subscriptions"
        " WHERE tenant_id = $1 AND subscription_id = ANY($2::text[])",
        tenant_id,
        ids,
    )
    return {r["subscription_id"]: GraphSubscription.from_record(r) for r in rows}


async def save_subscription(
    conn: asyncpg.Connection | asyncpg.Pool,
    tenant_id: str,
    mailbox_id: str,
    folder: str,
    subscription_id: str,
    client_state: str,
    expires_at: datetime,
) -> None:
    """A subscription Graph created for the folder: insert, or replace the folder's
    previous one (a recreation). Renewal health is reset; a pending lifecycle event
    is kept, for the source to clear once it has acted on all of it (a recreation
    after subscriptionRemoved still owes the delta resync)."""
    validate_id("tenant", tenant_id)
    validate_id("mailbox", mailbox_id)
    if not client_state:
        raise ValueError("client_state must be a non-empty secret")
    await conn.execute(
        """
        INSERT INTO graph_subscriptions
               (tenant_id, mailbox_id, folder, subscription_id, client_state, expires_at)
        VALUES ($1, $2, $3, $4, $5, $6)
        ON CONFLICT (tenant_id, mailbox_id, folder) DO UPDATE
           SET subscription_id = EXCLUDED.subscription_id,
               client_state = EXCLUDED.client_state,
               expires_at = EXCLUDED.expires_at,
               created_at = now(), renewed_at = NULL, renew_failures = 0, last_error = NULL
        """,
        tenant_id,
        mailbox_id,
        folder,
        subscription_id,
        client_state,
        expires_at,
    )


async def record_renewal(
    conn: asyncpg.Connection | asyncpg.Pool,
    tenant_id: str,
    mailbox_id: str,
    folder: str,
    expires_at: datetime,
) -> bool:
    """Graph renewed the folder's subscription until `expires_at`: failures reset.
    False: no such subscription."""
    return bool(
        await conn.fetchval(
            "UPDATE graph_subscriptions SET expires_at = $4, renewed_at = now(),"
            " renew_failures = 0, last_error = NULL"
            " WHERE tenant_id = $1 AND mailbox_id = $2 AND folder = $3 RETURNING true",
            tenant_id,
            mailbox_id,
            folder,
            expires_at,
        )
    )


async def record_renew_failure(
    conn: asyncpg.Connection | asyncpg.Pool,
    tenant_id: str,
    mailbox_id: str,
    folder: str,
    error: str,
) -> int | None:
    """A create or renewal of the folder's subscription failed: `renew_failures` + 1,
    `last_error` = `error` as one short line (the caller keeps secrets out of it).
    Returns the failures in a row, None when there is no such subscription."""
    count: int | None = await conn.fetchval(
        "UPDATE graph_subscriptions SET renew_failures = renew_failures + 1, last_error = $4"
        " WHERE tenant_id = $1 AND mailbox_id = $2 AND folder = $3 RETURNING renew_failures",
        tenant_id,
        mailbox_id,
        folder,
        one_line(error),
    )
    return count


async def record_lifecycle(
    conn: asyncpg.Connection | asyncpg.Pool, tenant_id: str, events: Mapping[str, str]
) -> list[tuple[str, str]]:
    """Store lifecycle events, subscription id → event (one of LIFECYCLE_EVENTS), in
    one statement: each row keeps the stronger of its pending event and the new one,
    and `lifecycle_at = now()`. Returns the (mailbox_id, folder) of the rows found;
    ids of another tenant, or of none, change nothing. ValueError for an unknown event."""
    unknown = sorted(set(events.values()) - set(LIFECYCLE_EVENTS))
    if unknown:
        raise ValueError(f"unknown lifecycle events: {unknown}")
    if not events:
        return []
    rows = await conn.fetch(
        """
        UPDATE graph_subscriptions g
           SET lifecycle_event = CASE
                   WHEN coalesce(array_position($4::text[], g.lifecycle_event), 0)
                        > array_position($4::text[], n.event)
                   THEN g.lifecycle_event ELSE n.event END,
               lifecycle_at = now()
          FROM unnest($2::text[], $3::text[]) AS n(subscription_id, event)
         WHERE g.tenant_id = $1 AND g.subscription_id = n.subscription_id
        RETURNING g.mailbox_id, g.folder
        """,
        tenant_id,
        list(events),
        list(events.values()),
        list(LIFECYCLE_EVENTS),
    )
    return [(r["mailbox_id"], r["folder"]) for r in rows]


async def clear_lifecycle(
    conn: asyncpg.Connection | asyncpg.Pool,
    tenant_id: str,
    mailbox_id: str,
    folder: str,
    *,
    seen_at: datetime | None = None,
) -> bool:
    """The source acted on the folder's pending lifecycle event: clear it. With
    `seen_at` (the `lifecycle_at` it read), only if no event arrived since. True
    when an event was cleared."""
    return bool(
        await conn.fetchval(
            "UPDATE graph_subscriptions SET lifecycle_event = NULL, lifecycle_at = NULL"
            " WHERE tenant_id = $1 AND mailbox_id = $2 AND folder = $3"
            " AND lifecycle_event IS NOT NULL"
            " AND ($4::timestamptz IS NULL OR lifecycle_at <= $4::timestamptz)"
            " RETURNING true",
            tenant_id,
            mailbox_id,
            folder,
            seen_at,
        )
    )


async def delete_subscriptions(
    conn: asyncpg.Connection | asyncpg.Pool,
    tenant_id: str,
    mailbox_id: str,
    folders: Collection[str] | None = None,
) -> list[str]:
    """Forget the mailbox's subscriptions (only `folders`' when given); returns the
    subscription ids removed. Deleting them at Graph is the source's business."""
    if folders is not None and not folders:
        return []
    rows = await conn.fetch(
        "DELETE FROM graph_subscriptions WHERE tenant_id = $1 AND mailbox_id = $2"
        " AND ($3::text[] IS NULL OR folder = ANY($3::text[])) RETURNING subscription_id",
        tenant_id,
        mailbox_id,
        None if folders is None else list(folders),
    )
    return sorted(r["subscription_id"] for r in rows)


async def load_refresh_token(
    pool: asyncpg.Pool, tenant_id: str, mailbox_id: str, configured_sha256: str
) -> str | None:
    """The stored refresh token of the mailbox, None when there is none or it was
    stored for another configured token."""
    validate_id("tenant", tenant_id)
    validate_id("mailbox", mailbox_id)
    value = await pool.fetchval(
        "SELECT refresh_token FROM graph_refresh_tokens"
        " WHERE tenant_id = $1 AND mailbox_id = $2 AND configured_sha256 = $3",
        tenant_id,
        mailbox_id,
        configured_sha256,
    )
    return value if isinstance(value, str) else None


async def save_refresh_token(
    pool: asyncpg.Pool,
    tenant_id: str,
    mailbox_id: str,
    configured_sha256: str,
    refresh_token: str,
) -> None:
    """Keep `refresh_token` as the mailbox's newest, durably: the commit is flushed
    (synchronous_commit on) before this returns. Raises asyncpg/OS errors."""
    validate_id("tenant", tenant_id)
    validate_id("mailbox", mailbox_id)
    if not refresh_token:
        raise ValueError("refresh_token must be a non-empty secret")
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("SET LOCAL synchronous_commit = on")
        await conn.execute(
            """
            INSERT INTO graph_refresh_tokens
                   (tenant_id, mailbox_id, refresh_token, configured_sha256)
            VALUES ($1, $2, $3, $4)
            ON CONFLICT (tenant_id, mailbox_id) DO UPDATE
               SET refresh_token = EXCLUDED.refresh_token,
                   configured_sha256 = EXCLUDED.configured_sha256,
                   updated_at = now()
            """,
            tenant_id,
            mailbox_id,
            refresh_token,
            configured_sha256,
        )
