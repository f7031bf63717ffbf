"""One group of delivery-intake requests written in one statement.

The statement (`_WRITE_GROUP`) runs in autocommit, so it is its own
transaction: replay tokens first, then the event rows of requests whose token
was new (or that carry none), ON CONFLICT DO NOTHING on the dedup key, then
one NOTIFY when anything was new. Rows and tokens go in key order, so
concurrent groups cannot deadlock on each other.

Per request, in group order, `write_group` answers how many of its rows were
new to the table (a key repeated across requests counts once, for the first),
or None when its token was used before: by an earlier request of the same
group, or by one already committed. ``intake.py`` owns the group commit (who
waits, retries, bisection on data errors) and turns these into outcomes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import asyncpg

from inboxd.pipeline.delivery.intake_rows import ROW_FIELDS

# One statement per group, in autocommit: a single statement is its own
# transaction, so the group costs one round trip instead of four (BEGIN, INSERT,
# NOTIFY, COMMIT) — each of which waits for a turn of a busy event loop
# (bench/webhooks.py: p50 5.5 → see bench/README.md). The replay tokens go in
# first (CTE `tok`); an event row whose request carries a token is inserted only
# when that token was new. Every output row is an event (`e`) or token (`t`)
# that is new; the NOTIFY runs once, as an init plan, when there is any.
_WRITE_GROUP = """
WITH tok AS (
    INSERT INTO webhook_replay_tokens (tenant_id, scope, token_hash)
    SELECT * FROM unnest($18::text[], $19::text[], $20::text[])
    ON CONFLICT DO NOTHING
    RETURNING tenant_id, scope, token_hash
), ins AS (
    INSERT INTO delivery_events (tenant_id, source, dedup_key, provider, provider_type,
        event_type, occurred_at, received_at, provider_message_id, message_id_norm,
        message_key, recipient, recipient_hash, bounce_type, bounce_subtype, list_id, payload)
    SELECT t, s, k, p, pt, et, oa, ra, pm, mn, mk, r, rh, bt, bs, li, pl::jsonb
      FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[],
                  $7::timestamptz[], $8::timestamptz[], $9::text[], $10::text[], $11::text[],
                  $12::text[], $13::text[], $14::text[], $15::text[], $16::text[],
                  $17::text[], $21::text[])
           AS u(t, s, k, p, pt, et, oa, ra, pm, mn, mk, r, rh, bt, bs, li, pl, th)
     WHERE u.th IS NULL
        OR EXISTS (SELECT 1 FROM tok
                    WHERE tok.tenant_id = u.t AND tok.token_hash = u.th)
    ON CONFLICT (tenant_id, source, dedup_key) DO NOTHING
    RETURNING tenant_id, source, dedup_key
), new AS (
    SELECT 'e' AS kind, tenant_id, source, dedup_key AS key FROM ins
    UNION ALL
    SELECT 't', tenant_id, scope, token_hash FROM tok
)
SELECT kind, tenant_id, source, key, (SELECT pg_notify($22, '')) IS NULL AS notified
  FROM new
"""


class GroupRequest(Protocol):
    """One request of a group: its prepared rows (intake_rows.py) and token."""

    @property
    def tenant_id(self) -> str: ...
    @property
    def source(self) -> str: ...
    @property
    def rows(self) -> list[tuple[Any, ...]]: ...
    @property
    def token_hash(self) -> str | None: ...
    @property
    def token_scope(self) -> str: ...


async def write_group(
    pool: asyncpg.Pool, group: Sequence[GroupRequest], *, channel: str, bound_s: float
) -> list[int | None]:
    """Write `group` in one statement that NOTIFYs `channel`; per request, its new rows or
    None (replayed token). Taking a connection and the statement are each bounded
    by `bound_s` seconds."""
    refused = _repeated_tokens(group)
    rows: list[tuple[Any, ...]] = []
    token_keys: list[tuple[str, str, str]] = []
    for i, item in enumerate(group):
        if i in refused:
            continue
        if item.token_hash is not None:
            token_keys.append((item.tenant_id, item.token_scope, item.token_hash))
        rows.extend((*row, item.token_hash) for row in item.rows)
    # Key order: concurrent groups lock the unique-index entries they share in
    # the same order, so they can never deadlock on each other.
    rows.sort(key=lambda row: (row[0], row[1], row[2]))
    token_keys.sort()
    columns = (
        [list(column) for column in zip(*rows, strict=True)]
        if rows
        else [[] for _ in range(ROW_FIELDS + 1)]
    )
    tokens = (
        [list(column) for column in zip(*token_keys, strict=True)] if token_keys else [[], [], []]
    )
    async with pool.acquire(timeout=bound_s) as conn:
        written: list[asyncpg.Record] = await conn.fetch(
            _WRITE_GROUP,
            *columns[:ROW_FIELDS],
            *tokens,
            columns[ROW_FIELDS],
            channel,
            timeout=bound_s,
        )
    inserted = {(r["tenant_id"], r["source"], r["key"]) for r in written if r["kind"] == "e"}
    fresh = {(r["tenant_id"], r["source"], r["key"]) for r in written if r["kind"] == "t"}
    outcomes: list[int | None] = []
    for i, item in enumerate(group):
        if i in refused or (
            item.token_hash is not None
            and (item.tenant_id, item.token_scope, item.token_hash) not in fresh
        ):
            outcomes.append(None)
            continue
        keys = {(item.tenant_id, item.source, row[2]) for row in item.rows}
        new = len(keys & inserted)
        inserted -= keys  # a key repeated across requests counts once, for the first
        outcomes.append(new)
    return outcomes


def _repeated_tokens(group: Sequence[GroupRequest]) -> set[int]:
    """Positions of requests whose token an earlier request of the group carries:
    only the first of them may pass."""
    seen: set[tuple[str, str, str]] = set()
    repeated: set[int] = set()
    for i, item in enumerate(group):
        if item.token_hash is None:
            continue
        key = (item.tenant_id, item.token_scope, item.token_hash)
        if key in seen:
            repeated.add(i)
        seen.add(key)
    return repeated
