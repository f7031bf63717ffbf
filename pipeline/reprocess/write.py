"""Reprocess, row side: what a fresh parse derives, how it differs, how it is written.

`pipeline/reprocess/run.py` states the protocol; this module holds its two halves
that touch rows:

    derive         MessageData (cleaned like ingest cleans it) → the values ingest
                   would store: message columns, participants, attachment rows
    changed_fields the derived values against the stored row, field by field:
                   nothing else (thread, copies, labels, direction) is compared
    write_updates  one batch's changed messages, in the caller's transaction:
                   new HTML and attachment bytes into the object store first
                   (content-addressed keys, like pipeline/ingest/objects.py), the message
                   rows updated in place under a guard (the row is as it was read
                   and no other message holds the new Message-ID + fingerprint),
                   participants replaced, attachments upserted by position,
                   threads recomputed, one `message.updated` event per message.

Large HTML is compared by object key (the key is the sha256 of its bytes), so
an unchanged large body is never read back from the store.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import asyncpg
import structlog

from inboxd.pipeline import threads
from inboxd.pipeline.errors import describe
from inboxd.pipeline.ingest.objects import html_object
from inboxd.pipeline.ingest.rows import clean, insert_participants
from inboxd.pipeline.message import MessageData
from inboxd.pipeline.objectstore.store import ObjectStore
from inboxd.pipeline.outbox import EventBuffer

log = structlog.get_logger(__name__)

UPDATED_EVENT = "message.updated"
# rows.insert_participants / insert_attachments keep this many per header / message
# (smallint position); the comparison looks at the same slice.
MAX_POSITIONS = 32_000

# (role, position, address, display_name)
Participant = tuple[str, int, str, str]
# (position, filename, content_type, disposition, content_id, size_bytes, sha256)
AttachmentRow = tuple[int, str, str, str, str | None, int, str | None]


@dataclass(slots=True)
class StoredMessage:
    """A messages row as read for reprocessing (the columns a parse derives)."""

    message_id: int
    mailbox_id: str
    provider: str
    raw_key: str | None
    send_status: str | None
    seen_xmin: str
    columns: dict[str, object]
    participants: list[Participant] = field(default_factory=list)
    attachments: list[AttachmentRow] = field(default_factory=list)


@dataclass(slots=True)
class Derived:
    """What ingest would store for an item: message columns, participants, attachments."""

    columns: dict[str, object]
    html: str | None
    participants: list[Participant]
    attachments: list[AttachmentRow]


@dataclass(slots=True)
class Update:
    """One message to rewrite: the stored row, the fresh item, what differs."""

    stored: StoredMessage
    item: MessageData
    derived: Derived
    fields: list[str]


# Message columns compared one to one (html is compared apart: it may live in the store).
COLUMNS = (
    "subject",
    "subject_norm",
    "from_address",
    "from_name",
    "sent_at",
    "text_body",
    "in_reply_to",
    "references",
    "internet_message_id",
    "message_id_norm",
    "has_attachments",
    "content_fingerprint",
)


def derive(item: MessageData) -> Derived:
    """The stored form of a cleaned item, as rows.insert_messages & co. write it."""
    refs = clean(" ".join(item.references))
    columns: dict[str, object] = {
        "subject": clean(item.subject),
        "subject_norm": clean(item.subject_norm),
        "from_address": clean(item.from_.email) if item.from_ else "",
        "from_name": clean(item.from_.name) if item.from_ else "",
        "sent_at": item.sent_at,
        "text_body": clean(item.text),
        "in_reply_to": clean(item.in_reply_to),
        "references": refs.split(" ") if refs else [],
        "internet_message_id": clean(item.internet_message_id),
        "message_id_norm": clean(item.message_id_norm),
        "has_attachments": bool(item.attachments),
        "content_fingerprint": item.content_fingerprint,
    }
    people: list[Participant] = []
    for role, group in (
        ("from", [item.from_] if item.from_ else []),
        ("to", item.to),
        ("cc", item.cc),
        ("bcc", item.bcc),
        ("reply_to", item.reply_to),
    ):
        for pos, person in enumerate(group[:MAX_POSITIONS]):
            people.append((role, pos, clean(person.email), clean(person.name)))
    attachments: list[AttachmentRow] = [
        (
            pos,
            clean(a.filename) or "",
            clean(a.content_type) or "application/octet-stream",
            a.disposition,
            clean(a.content_id),
            a.size_bytes,
            a.sha256,
        )
        for pos, a in enumerate(item.attachments[:MAX_POSITIONS])
    ]
    return Derived(columns, clean(item.html), sorted(people), attachments)


def changed_fields(tenant: str, stored: StoredMessage, derived: Derived) -> list[str]:
    """Names of the stored fields the derivation changes (empty: nothing to write)."""
    fields = [name for name in COLUMNS if stored.columns[name] != derived.columns[name]]
    if not _html_matches(tenant, stored, derived.html):
        fields.append("html_body")
    if sorted(stored.participants) != derived.participants:
        fields.append("participants")
    if sorted(stored.attachments) != derived.attachments:
        fields.append("attachments")
    return fields


def _html_matches(tenant: str, stored: StoredMessage, html: str | None) -> bool:
    key = stored.columns["html_key"]
    if key is not None:
        obj = html_object(tenant, html)
        return obj is not None and obj[0] == key
    # inline: small, or a large body whose store failed at ingest (kept inline)
    return stored.columns["html_body"] == html


_UPDATE = """
UPDATE messages m
   SET subject = u.subject, subject_norm = u.subject_norm, from_address = u.from_address,
       from_name = u.from_name, sent_at = u.sent_at, text_body = u.text_body,
       html_body = u.html_body, html_key = u.html_key, in_reply_to = u.irt,
       "references" = CASE WHEN u.refs = '' THEN '{}'::text[]
                           ELSE string_to_array(u.refs, ' ') END,
       internet_message_id = u.mid_raw, message_id_norm = u.mid, has_attachments = u.has_att,
       content_fingerprint = u.fp, updated_at = now()
  FROM unnest($2::bigint[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[],
              $8::timestamptz[], $9::text[], $10::text[], $11::text[], $12::text[],
              $13::text[], $14::text[], $15::text[], $16::bool[], $17::text[])
       AS u(id, seen, subject, subject_norm, from_address, from_name, sent_at, text_body,
            html_body, html_key, irt, refs, mid_raw, mid, has_att, fp)
 WHERE m.tenant_id = $1 AND m.message_id = u.id AND m.xmin::text = u.seen
   AND NOT EXISTS (SELECT 1 FROM messages x
                    WHERE x.tenant_id = $1 AND x.message_id <> m.message_id
                      AND x.message_id_norm = u.mid AND x.content_fingerprint = u.fp)
RETURNING m.message_id, m.thread_id, m.mailbox_id
"""

_UPSERT_ATTACHMENTS = """
INSERT INTO attachments (tenant_id, message_id, position, filename, content_type,
                         disposition, content_id, size_bytes, sha256, storage_key, stored,
                         store_error)
SELECT $1, * FROM unnest($2::bigint[], $3::smallint[], $4::text[], $5::text[], $6::text[],
                         $7::text[], $8::bigint[], $9::text[], $10::text[], $11::bool[],
                         $12::text[])
ON CONFLICT (tenant_id, message_id, position) DO UPDATE
   SET filename = EXCLUDED.filename, content_type = EXCLUDED.content_type,
       disposition = EXCLUDED.disposition, content_id = EXCLUDED.content_id,
       size_bytes = EXCLUDED.size_bytes, sha256 = EXCLUDED.sha256,
       storage_key = EXCLUDED.storage_key, stored = EXCLUDED.stored,
       store_error = EXCLUDED.store_error, provider_ref = NULL
"""


async def write_updates(
    conn: asyncpg.Connection, store: ObjectStore, tenant: str, updates: Sequence[Update]
) -> set[int]:
    """Rewrite `updates` in the caller's transaction; returns the message ids written.

    A message missing from the result was changed by someone else since it was
    read, or another message took its new (Message-ID, fingerprint) meanwhile:
    nothing of it is written (the caller reports it).
    """
    if not updates:
        return set()
    html_keys, att_state = await _store_bytes(conn, store, tenant, updates)
    cols: list[list[object]] = [[] for _ in range(16)]
    for u in sorted(updates, key=lambda u: u.stored.message_id):
        c, key = u.derived.columns, html_keys.get(u.stored.message_id)
        row = (
            u.stored.message_id,
            u.stored.seen_xmin,
            c["subject"],
            c["subject_norm"],
            c["from_address"],
            c["from_name"],
            c["sent_at"],
            c["text_body"],
            None if key else u.derived.html,
            key,
            c["in_reply_to"],
            " ".join(c["references"]),  # type: ignore[arg-type]
            c["internet_message_id"],
            c["message_id_norm"],
            c["has_attachments"],
            c["content_fingerprint"],
        )
        for col, value in zip(cols, row, strict=True):
            col.append(value)
    written = {r[0]: (r[1], r[2]) for r in await conn.fetch(_UPDATE, tenant, *cols)}
    done = [u for u in updates if u.stored.message_id in written]
    await _replace_participants(conn, tenant, [u for u in done if "participants" in u.fields])
    await _replace_attachments(
        conn, tenant, [u for u in done if "attachments" in u.fields], att_state
    )
    await threads.recompute_threads(conn, tenant, {tid for tid, _ in written.values()})
    await _add_events(conn, tenant, done, written)
    return set(written)


async def _store_bytes(
    conn: asyncpg.Connection, store: ObjectStore, tenant: str, updates: Sequence[Update]
) -> tuple[dict[int, str], dict[tuple[int, int], tuple[str | None, str | None]]]:
    """Large HTML and attachment bytes of the changed parts, before the rows.

    Returns the HTML keys stored (a failed HTML store keeps the body inline, as
    ingest does) and (storage key, store error) per (message id, position)."""
    puts: list[tuple[str, bytes, str]] = []
    owners: list[tuple[int, int]] = []  # (message id, attachment position or -1: html)
    for u in updates:
        mid = u.stored.message_id
        obj = html_object(tenant, u.derived.html) if "html_body" in u.fields else None
        if obj is not None:
            puts.append((obj[0], obj[1], "text/html; charset=utf-8"))
            owners.append((mid, -1))
        if "attachments" not in u.fields:
            continue
        for pos in _changed_positions(u):
            att = u.item.attachments[pos]
            if att.content is not None and att.sha256:
                puts.append((f"att/{tenant}/{att.sha256}", att.content, att.content_type))
                owners.append((mid, pos))
    html_keys: dict[int, str] = {}
    att_state: dict[tuple[int, int], tuple[str | None, str | None]] = {}
    errors = await store.put_many(puts, conn=conn) if puts else []
    for (key, _, _), (mid, pos), err in zip(puts, owners, errors, strict=True):
        error = None if err is None else clean(describe(err))
        if pos < 0 and error is None:
            html_keys[mid] = key
        elif pos < 0:  # degrade like ingest: the body stays inline
            log.warning("html_body_inline_fallback", tenant=tenant, error=error)
        else:
            att_state[(mid, pos)] = (None, error) if error else (key, None)
    return html_keys, att_state


def _changed_positions(u: Update) -> list[int]:
    old = {row[0]: row for row in u.stored.attachments}
    return [row[0] for row in u.derived.attachments if old.get(row[0]) != row]


async def _replace_participants(
    conn: asyncpg.Connection, tenant: str, updates: Sequence[Update]
) -> None:
    if not updates:
        return
    await conn.execute(
        "DELETE FROM message_participants WHERE tenant_id = $1 AND message_id = ANY($2::bigint[])",
        tenant,
        [u.stored.message_id for u in updates],
    )
    await insert_participants(conn, tenant, [(u.stored.message_id, u.item) for u in updates])


async def _replace_attachments(
    conn: asyncpg.Connection,
    tenant: str,
    updates: Sequence[Update],
    att_state: dict[tuple[int, int], tuple[str | None, str | None]],
) -> None:
    """Changed positions upserted (attachment ids of kept positions stay), extra ones deleted."""
    cols: list[list[object]] = [[] for _ in range(11)]
    for u in updates:
        mid = u.stored.message_id
        for pos in _changed_positions(u):
            key, err = att_state.get((mid, pos), (None, "bytes not available"))
            _, filename, content_type, disposition, content_id, size, sha = u.derived.attachments[
                pos
            ]
            row = (mid, pos, filename, content_type, disposition, content_id, size, sha, key)
            for col, value in zip(cols, (*row, err is None, err), strict=True):
                col.append(value)
    if cols[0]:
        await conn.execute(_UPSERT_ATTACHMENTS, tenant, *cols)
    await conn.execute(
        "DELETE FROM attachments a USING unnest($2::bigint[], $3::int[]) AS u(id, n) "
        "WHERE a.tenant_id = $1 AND a.message_id = u.id AND a.position >= u.n",
        tenant,
        [u.stored.message_id for u in updates],
        [len(u.derived.attachments) for u in updates],
    )


async def _add_events(
    conn: asyncpg.Connection,
    tenant: str,
    done: Sequence[Update],
    written: dict[int, tuple[int, str]],
) -> None:
    """One `message.updated` per rewritten message, naming the changed fields (never values)."""
    by_mailbox: dict[str, EventBuffer] = {}
    for u in sorted(done, key=lambda u: u.stored.message_id):
        thread_id, mailbox = written[u.stored.message_id]
        by_mailbox.setdefault(mailbox, EventBuffer()).add(
            UPDATED_EVENT,
            thread_id=thread_id,
            message_id=u.stored.message_id,
            payload={"fields": sorted(u.fields), "reason": "reprocess"},
        )
    for mailbox in sorted(by_mailbox):
        await by_mailbox[mailbox].flush(conn, tenant, mailbox)


def stored_from_row(row: asyncpg.Record) -> StoredMessage:
    """A StoredMessage from a row of reprocess._SELECT_PAGE."""
    columns: dict[str, object] = {name: row[name] for name in (*COLUMNS, "html_body", "html_key")}
    columns["references"] = list(row["references"])
    return StoredMessage(
        message_id=row["message_id"],
        mailbox_id=row["mailbox_id"],
        provider=row["provider"],
        raw_key=row["raw_key"],
        send_status=row["send_status"],
        seen_xmin=row["seen_xmin"],
        columns=columns,
    )
