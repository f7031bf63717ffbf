"""A mailbox's copies of stored messages, as a provider changes them after ingest.

Provider doors that report changes (Gmail history, Graph delta, IMAP flags and
expunges) tell the ingest stage about new mail and tell this module about the
rest, each call in one transaction with its outbox events:

    live_copies_under  the copies of one IMAP folder still in the mailbox, for a
                     server without QRESYNC (a periodic UID SEARCH comparison)
    known_copies     which of a page's provider ids this mailbox already stores,
                     asked once per page before any body is downloaded (a full
                     resync of a mailbox we hold downloads nothing again)
    record_removed   the copy left the mailbox (deleted at the provider, or in no
                     synced label/folder any more): `removed_at` is stamped and a
                     `message.removed` event written; the message row and its data
                     stay — other copies, or the application, may still need them
    update_labels    the copy's labels changed: stored, `message.labels_changed`
                     written only for a real change; a removed copy that is back
                     in a synced label is restored (`removed_at` cleared)

Every statement is scoped by tenant and mailbox, and repeats are no-ops: a
history page replayed after a crash writes nothing twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import asyncpg
import orjson

from inboxd.pipeline.outbox import EventBuffer

REMOVED_EVENT = "message.removed"
LABELS_EVENT = "message.labels_changed"


async def known_copies(
    conn: asyncpg.Connection | asyncpg.Pool,
    tenant_id: str,
    mailbox_id: str,
    external_ids: Iterable[str],
) -> set[str]:
    """The subset of `external_ids` this mailbox already has a copy of."""
    ids = list(dict.fromkeys(external_ids))
    if not ids:
        return set()
    rows = await conn.fetch(
        "SELECT external_id FROM message_copies "
        "WHERE tenant_id = $1 AND mailbox_id = $2 AND external_id = ANY($3::text[])",
        tenant_id,
        mailbox_id,
        ids,
    )
    return {r[0] for r in rows}


async def settled_copies(
    conn: asyncpg.Connection | asyncpg.Pool,
    tenant_id: str,
    mailbox_id: str,
    external_ids: Iterable[str],
) -> set[str]:
    """The subset of `external_ids` this mailbox has a copy of whose message has every
    attachment stored: seeing them again would change nothing, so a door may skip
    them unparsed. A copy with an unstored attachment is left out: its next sighting
    is what stores the attachment again (ingest_bytes, the cascade's duplicate path)."""
    ids = list(dict.fromkeys(external_ids))
    if not ids:
        return set()
    rows = await conn.fetch(
        "SELECT c.external_id FROM message_copies c "
        "WHERE c.tenant_id = $1 AND c.mailbox_id = $2 AND c.external_id = ANY($3::text[]) "
        "AND NOT EXISTS (SELECT 1 FROM attachments a WHERE a.tenant_id = c.tenant_id "
        "AND a.message_id = c.message_id AND NOT a.stored)",
        tenant_id,
        mailbox_id,
        ids,
    )
    return {r[0] for r in rows}


async def live_copies_under(
    conn: asyncpg.Connection | asyncpg.Pool, tenant_id: str, mailbox_id: str, prefix: str
) -> list[str]:
    """External ids starting with `prefix` (an IMAP folder's `folder:uidvalidity:`)
    of this mailbox's copies that have not left it; a range scan of the primary key."""
    if not prefix:
        raise ValueError("live_copies_under needs a non-empty prefix")
    upper = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    rows = await conn.fetch(
        "SELECT external_id FROM message_copies WHERE tenant_id = $1 AND mailbox_id = $2 "
        "AND external_id >= $3 AND external_id < $4 AND removed_at IS NULL",
        tenant_id,
        mailbox_id,
        prefix,
        upper,
    )
    return [r[0] for r in rows]


async def record_removed(
    conn: asyncpg.Connection,
    tenant_id: str,
    mailbox_id: str,
    external_ids: Sequence[str],
    reason: str,
    *,
    only_from: str | None = None,
) -> int:
    """Mark copies as gone from the mailbox (`reason`: deleted, unlabelled, expunged);
    returns how many changed. Copies already removed, or never stored, change nothing.

    `only_from`: the copies left this one label or folder. A copy whose labels no
    longer include it (recorded in another synced folder since) is left alone; one
    with other labels too loses only this one (`message.labels_changed`); one
    labelled only with it (or with nothing) is removed."""
    if not external_ids:
        return 0
    async with conn.transaction():
        events = EventBuffer()
        if only_from is not None:
            relabelled = await conn.fetch(
                "UPDATE message_copies SET labels = array_remove(labels, $4) "
                "WHERE tenant_id = $1 AND mailbox_id = $2 AND external_id = ANY($3::text[]) "
                "AND removed_at IS NULL AND $4 = ANY(labels) AND cardinality(labels) > 1 "
                "RETURNING external_id, message_id, labels",
                tenant_id,
                mailbox_id,
                list(external_ids),
                only_from,
            )
            for row in relabelled:
                events.add(
                    LABELS_EVENT,
                    message_id=row["message_id"],
                    payload={"external_id": row["external_id"], "labels": list(row["labels"])},
                )
        rows = await conn.fetch(
            "UPDATE message_copies SET removed_at = now(), removal_reason = $4 "
            "WHERE tenant_id = $1 AND mailbox_id = $2 AND external_id = ANY($3::text[]) "
            "AND removed_at IS NULL "
            "AND ($5::text IS NULL OR cardinality(labels) = 0 OR labels = ARRAY[$5::text]) "
            "RETURNING external_id, message_id",
            tenant_id,
            mailbox_id,
            list(external_ids),
            reason,
            only_from,
        )
        for row in rows:
            events.add(
                REMOVED_EVENT,
                message_id=row["message_id"],
                payload={"external_id": row["external_id"], "reason": reason},
            )
        await events.flush(conn, tenant_id, mailbox_id)
    return len(rows)


async def update_labels(
    conn: asyncpg.Connection,
    tenant_id: str,
    mailbox_id: str,
    labels: Mapping[str, Sequence[str]],
) -> int:
    """Store each copy's current labels (sorted, deduplicated); returns how many
    changed. A removed copy whose new labels are given is back: restored."""
    if not labels:
        return 0
    ids = list(labels)
    values = [sorted(set(labels[i])) for i in ids]
    async with conn.transaction():
        rows = await conn.fetch(
            "UPDATE message_copies c SET labels = v.labels, removed_at = NULL, "
            "removal_reason = NULL "
            "FROM (SELECT * FROM unnest($3::text[], $4::text[]) AS u (external_id, labels_json)) "
            "  AS s CROSS JOIN LATERAL (SELECT array(SELECT jsonb_array_elements_text("
            "  s.labels_json::jsonb)) AS labels) AS v "
            "WHERE c.tenant_id = $1 AND c.mailbox_id = $2 AND c.external_id = s.external_id "
            "AND (c.labels IS DISTINCT FROM v.labels OR c.removed_at IS NOT NULL) "
            "RETURNING c.external_id, c.message_id, c.labels",
            tenant_id,
            mailbox_id,
            ids,
            [_json_list(v) for v in values],
        )
        events = EventBuffer()
        for row in rows:
            events.add(
                LABELS_EVENT,
                message_id=row["message_id"],
                payload={"external_id": row["external_id"], "labels": list(row["labels"])},
            )
        await events.flush(conn, tenant_id, mailbox_id)
    return len(rows)


def _json_list(values: Sequence[str]) -> str:
    # text[][] cannot be ragged in PostgreSQL, so each copy's labels travel as JSON
    return orjson.dumps(list(values)).decode()
