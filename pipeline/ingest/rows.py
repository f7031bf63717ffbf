"""Set-based row writes of the ingest stage: one statement per table per batch.

Each function takes column arrays and issues a single INSERT … SELECT FROM
unnest(…), never a round trip per message (bench/ingest.py measures the
difference). Text is cleaned first: PostgreSQL text cannot hold NUL, and
asyncpg cannot encode lone surrogates, both of which hostile mail produces.
"""

from __future__ import annotations

from typing import overload

import asyncpg

from inboxd.pipeline.message import Address, DeadItem, MessageData

PLACEHOLDER_RE = (
    r"^(pending_|draft_|new_)|^[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?"
    r"[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}$"
)


# None stays None and a str stays a str, so callers keep their precise type.
@overload
def clean(value: str) -> str: ...
@overload
def clean(value: None) -> None: ...
@overload
def clean(value: str | None) -> str | None: ...
def clean(value: str | None) -> str | None:
    """Text PostgreSQL accepts: NUL → U+FFFD, lone surrogates → '?'."""
    if value is None or (value.isascii() and "\x00" not in value):
        return value
    if "\x00" in value:
        value = value.replace("\x00", "\ufffd")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        value = value.encode("utf-8", "replace").decode("utf-8")
    return value


def clean_item(item: MessageData) -> None:
    """Clean every text field of an item in place, before it is compared or stored.

    The cascade compares these values with stored ones, so they must be cleaned
    the same way on both paths; a NUL in a subject must not turn a message into
    a dead item.
    """
    item.external_id = clean(item.external_id) or ""
    item.external_thread_id = clean(item.external_thread_id)
    item.thread_key_derived = clean(item.thread_key_derived)
    item.internet_message_id = clean(item.internet_message_id)
    item.message_id_norm = clean(item.message_id_norm)
    item.in_reply_to = clean(item.in_reply_to)
    item.references = [clean(r) or "" for r in item.references]
    item.subject = clean(item.subject) or ""
    item.subject_norm = clean(item.subject_norm) or ""
    item.text = clean(item.text)
    item.html = clean(item.html)
    for people in (item.to, item.cc, item.bcc, item.reply_to):
        people[:] = [_clean_address(a) for a in people]
    if item.from_ is not None:
        item.from_ = _clean_address(item.from_)
    for att in item.attachments:
        att.filename = clean(att.filename) or ""
        att.content_type = clean(att.content_type) or "application/octet-stream"
        att.content_id = clean(att.content_id)


def _clean_address(address: Address) -> Address:
    email, name = clean(address.email) or "", clean(address.name) or ""
    if email is address.email and name is address.name:
        return address
    return Address(email, name)


_INSERT_MESSAGES = """
INSERT INTO messages (
    tenant_id, message_id, mailbox_id, thread_id, external_id, direction,
    internet_message_id, message_id_norm, in_reply_to, "references", subject, subject_norm,
    from_address, from_name, sent_at, received_at, text_body, html_body, html_key,
    has_attachments, content_fingerprint, raw_sha256, raw_key, conflict_of)
SELECT $1, u.id, $2, u.thread_id, u.ext, u.direction, u.mid_raw, u.mid, u.irt,
       CASE WHEN u.refs = '' THEN '{}'::text[] ELSE string_to_array(u.refs, ' ') END,
       u.subject, u.subject_norm, u.from_address, u.from_name, u.sent_at,
       coalesce(u.received_at, now()), u.text_body, u.html_body, u.html_key, u.has_att,
       u.fp, u.raw_sha, u.raw_key, u.conflict_of
  FROM unnest($3::bigint[], $4::bigint[], $5::text[], $6::text[], $7::text[], $8::text[],
              $9::text[], $10::text[], $11::text[], $12::text[], $13::text[], $14::text[],
              $15::timestamptz[], $16::timestamptz[], $17::text[], $18::text[], $19::text[],
              $20::bool[], $21::text[], $22::text[], $23::text[], $24::bigint[])
       AS u(id, thread_id, ext, direction, mid_raw, mid, irt, refs, subject, subject_norm,
            from_address, from_name, sent_at, received_at, text_body, html_body, html_key,
            has_att, fp, raw_sha, raw_key, conflict_of)
ON CONFLICT DO NOTHING
RETURNING message_id
"""


async def insert_messages(
    conn: asyncpg.Connection,
    tenant_id: str,
    mailbox_id: str,
    items: list[tuple[int, MessageData]],
    message_ids: dict[int, int],
    thread_ids: dict[int, int],
    raw_keys: dict[int, str],
    html_keys: dict[int, str],
    conflict_of: dict[int, int | None],
) -> set[int]:
    """Insert new rows; returns the item keys actually inserted (tier-4 losers are not)."""
    if not items:
        return set()
    cols: list[list[object]] = [[] for _ in range(22)]
    for k, m in items:
        html_key = html_keys.get(k)
        row = (
            message_ids[k],
            thread_ids[k],
            m.external_id,
            m.direction,
            clean(m.internet_message_id),
            clean(m.message_id_norm),
            clean(m.in_reply_to),
            clean(" ".join(m.references)),
            clean(m.subject),
            clean(m.subject_norm),
            clean(m.from_.email) if m.from_ else "",
            clean(m.from_.name) if m.from_ else "",
            m.sent_at,
            m.received_at,
            clean(m.text),
            None if html_key else clean(m.html),
            html_key,
            bool(m.attachments),
            m.content_fingerprint,
            m.raw_sha256,
            raw_keys.get(k),
            conflict_of.get(k),
        )
        for col, value in zip(cols, row, strict=True):
            col.append(value)
    rows = await conn.fetch(_INSERT_MESSAGES, tenant_id, mailbox_id, *cols)
    got = {r[0] for r in rows}
    return {k for k, _ in items if message_ids[k] in got}


async def insert_participants(
    conn: asyncpg.Connection, tenant_id: str, items: list[tuple[int, MessageData]]
) -> None:
    ids: list[int] = []
    roles: list[str] = []
    positions: list[int] = []
    addresses: list[str | None] = []
    names: list[str | None] = []
    for message_id, m in items:
        for role, people in (
            ("from", [m.from_] if m.from_ else []),
            ("to", m.to),
            ("cc", m.cc),
            ("bcc", m.bcc),
            ("reply_to", m.reply_to),
        ):
            for pos, person in enumerate(people[:32_000]):  # smallint position
                ids.append(message_id)
                roles.append(role)
                positions.append(pos)
                addresses.append(clean(person.email))
                names.append(clean(person.name))
    if ids:
        await conn.execute(
            "INSERT INTO message_participants "
            "(tenant_id, message_id, role, position, address, display_name) "
            "SELECT $1, * FROM unnest($2::bigint[], $3::text[], $4::smallint[], $5::text[], "
            "$6::text[]) ON CONFLICT DO NOTHING",
            tenant_id,
            ids,
            roles,
            positions,
            addresses,
            names,
        )


async def insert_attachments(
    conn: asyncpg.Connection,
    tenant_id: str,
    items: list[tuple[int, MessageData, list[tuple[str | None, str | None]]]],
) -> None:
    """Attachment rows; `state` per attachment is (storage key or None, store error)."""
    cols: list[list[object]] = [[] for _ in range(12)]
    for message_id, m, state in items:
        for pos, att in enumerate(m.attachments[:32_000]):
            key, err = state[pos] if pos < len(state) else (None, "not stored")
            row = (
                message_id,
                pos,
                clean(att.filename) or "",
                clean(att.content_type),
                att.disposition,
                clean(att.content_id),
                att.size_bytes,
                att.sha256,
                key,
                key is not None and err is None,
                clean(err),
                att.provider_ref,
            )
            for col, value in zip(cols, row, strict=True):
                col.append(value)
    if cols[0]:
        await conn.execute(
            "INSERT INTO attachments (tenant_id, message_id, position, filename, content_type, "
            "disposition, content_id, size_bytes, sha256, storage_key, stored, store_error, "
            "provider_ref) SELECT $1, * FROM unnest($2::bigint[], $3::smallint[], $4::text[], "
            "$5::text[], $6::text[], $7::text[], $8::bigint[], $9::text[], $10::text[], "
            "$11::bool[], $12::text[], $13::text[]) ON CONFLICT DO NOTHING",
            tenant_id,
            *cols,
        )


async def insert_conflicts(
    conn: asyncpg.Connection, tenant_id: str, conflicts: list[tuple[int, int | None, str | None]]
) -> None:
    rows = [(new, old, mid) for new, old, mid in conflicts if old is not None and mid]
    if rows:
        await conn.execute(
            "INSERT INTO ingest_conflicts (tenant_id, new_message_id, existing_message_id, "
            "message_id_norm, reason) SELECT $1, n, o, m, 'content fingerprint differs' "
            "FROM unnest($2::bigint[], $3::bigint[], $4::text[]) AS u(n, o, m) "
            "ON CONFLICT DO NOTHING",
            tenant_id,
            [r[0] for r in rows],
            [r[1] for r in rows],
            [clean(r[2]) for r in rows],
        )


async def insert_copies(
    conn: asyncpg.Connection,
    tenant_id: str,
    mailbox_id: str,
    copies: list[tuple[int, MessageData, str | None]],
) -> set[str]:
    """Record copies; returns the external ids actually inserted (others existed)."""
    if not copies:
        return set()
    rows = await conn.fetch(
        "INSERT INTO message_copies (tenant_id, mailbox_id, external_id, message_id, labels, "
        "raw_sha256, raw_key, received_at) SELECT $1, $2, u.ext, u.id, "
        "CASE WHEN u.labels = '' THEN '{}'::text[] ELSE string_to_array(u.labels, E'\\x1f') "
        "END, u.sha, u.key, u.received_at FROM unnest($3::text[], $4::bigint[], $5::text[], "
        "$6::text[], $7::text[], $8::timestamptz[]) AS u(ext, id, labels, sha, key, "
        "received_at) ON CONFLICT DO NOTHING RETURNING external_id",
        tenant_id,
        mailbox_id,
        [m.external_id for _, m, _ in copies],
        [mid for mid, _, _ in copies],
        [clean("\x1f".join(m.labels)) for _, m, _ in copies],
        [m.raw_sha256 for _, m, _ in copies],
        [key for _, _, key in copies],
        [m.received_at for _, m, _ in copies],
    )
    return {row[0] for row in rows}


async def insert_dead_items(
    conn: asyncpg.Connection,
    tenant_id: str,
    mailbox_id: str,
    deads: list[tuple[int, DeadItem]],
    raw_keys: dict[int, str | None],
    not_stored: set[int],
) -> set[int]:
    """Record dead items (idempotent per external id); returns the batch indices stored.

    `not_stored`: indices whose raw bytes did not reach the object store; they are
    left out, to be recorded when the item comes again."""
    rows = [(i, d) for i, d in deads if i not in not_stored]
    if rows:
        await conn.execute(
            "INSERT INTO dead_items (tenant_id, mailbox_id, external_id, reason, detail, "
            "raw_sha256, raw_key) SELECT $1, $2, * FROM unnest($3::text[], $4::text[], "
            "$5::text[], $6::text[], $7::text[]) ON CONFLICT DO NOTHING",
            tenant_id,
            mailbox_id,
            [clean(d.external_id) for _, d in rows],
            [d.reason for _, d in rows],
            [clean(d.detail) for _, d in rows],
            [d.raw_sha256 for _, d in rows],
            [raw_keys.get(i) for i, _ in rows],
        )
    return {i for i, _ in rows}


_PROMOTE = """
UPDATE messages m
   SET mailbox_id = $2,
       external_id = u.ext,
       send_status = 'synced',
       direction = 'outbound',
       internet_message_id = coalesce(m.internet_message_id, u.mid_raw),
       message_id_norm = coalesce(m.message_id_norm, u.mid),
       sent_at = coalesce(u.sent_at, m.sent_at),
       received_at = coalesce(u.received_at, m.received_at),
       text_body = CASE WHEN coalesce(u.text_body, '') <> '' THEN u.text_body ELSE m.text_body END,
       html_body = CASE WHEN coalesce(u.html_body, '') <> '' THEN u.html_body ELSE m.html_body END,
       raw_sha256 = coalesce(u.raw_sha, m.raw_sha256),
       raw_key = coalesce(u.raw_key, m.raw_key),
       has_attachments = m.has_attachments OR u.has_att,
       content_fingerprint = CASE
           WHEN EXISTS (SELECT 1 FROM messages x
                         WHERE x.tenant_id = $1 AND x.message_id <> m.message_id
                           AND x.message_id_norm = coalesce(m.message_id_norm, u.mid)
                           AND x.content_fingerprint = u.fp)
           THEN m.content_fingerprint ELSE u.fp END,
       updated_at = now()
  FROM unnest($3::bigint[], $4::text[], $5::text[], $6::text[], $7::timestamptz[],
              $8::timestamptz[], $9::text[], $10::text[], $11::text[], $12::text[], $13::text[],
              $14::bool[])
       AS u(id, ext, mid_raw, mid, sent_at, received_at, text_body, html_body, raw_sha, raw_key,
            fp, has_att)
 WHERE m.tenant_id = $1 AND m.message_id = u.id
"""

_RENAME_PLACEHOLDER_THREADS = """
UPDATE threads t
   SET external_thread_id = u.key, mailbox_id = $2, updated_at = now()
  FROM (SELECT DISTINCT ON (m.thread_id) m.thread_id, u.key
          FROM unnest($3::bigint[], $4::text[]) AS u(id, key)
          JOIN messages m ON m.tenant_id = $1 AND m.message_id = u.id) AS u
 WHERE t.tenant_id = $1 AND t.thread_id = u.thread_id
   AND t.external_thread_id ~ $5
   AND NOT EXISTS (SELECT 1 FROM threads x WHERE x.tenant_id = $1 AND x.mailbox_id = $2
                                             AND x.external_thread_id = u.key)
"""

_MOVE_TO_PROVIDER_THREAD = """
UPDATE messages m
   SET thread_id = x.thread_id
  FROM unnest($3::bigint[], $4::text[]) AS u(id, key)
  JOIN threads x ON x.tenant_id = $1 AND x.mailbox_id = $2 AND x.external_thread_id = u.key
 WHERE m.tenant_id = $1 AND m.message_id = u.id AND m.thread_id <> x.thread_id
RETURNING x.thread_id
"""


async def promote_outbound(
    conn: asyncpg.Connection,
    tenant_id: str,
    mailbox_id: str,
    promoted: list[tuple[int, MessageData, str | None]],
) -> set[int]:
    """The provider's copy of a message the application sent replaces its placeholders.

    Provider ids and timestamps win; a non-empty local body is kept when the
    provider's is empty. A placeholder thread takes the provider's thread key,
    or, when the provider's thread already exists, the message moves there.
    Returns every thread id touched (old and new) for metadata recompute.
    """
    if not promoted:
        return set()
    ids = [mid for mid, _, _ in promoted]
    old = {
        r[0]
        for r in await conn.fetch(
            "SELECT thread_id FROM messages "
            "WHERE tenant_id = $1 AND message_id = ANY($2::bigint[])",
            tenant_id,
            ids,
        )
    }
    items = [m for _, m, _ in promoted]
    await conn.execute(
        _PROMOTE,
        tenant_id,
        mailbox_id,
        ids,
        [m.external_id for m in items],
        [clean(m.internet_message_id) for m in items],
        [m.message_id_norm for m in items],
        [m.sent_at for m in items],
        [m.received_at for m in items],
        [clean(m.text) for m in items],
        [clean(m.html) for m in items],
        [m.raw_sha256 for m in items],
        [key for _, _, key in promoted],
        [m.content_fingerprint for m in items],
        [bool(m.attachments) for m in items],
    )
    keys = [m.thread_key for m in items]
    await conn.execute(
        _RENAME_PLACEHOLDER_THREADS, tenant_id, mailbox_id, ids, keys, PLACEHOLDER_RE
    )
    moved = {
        r[0] for r in await conn.fetch(_MOVE_TO_PROVIDER_THREAD, tenant_id, mailbox_id, ids, keys)
    }
    return old | moved
