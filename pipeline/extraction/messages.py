"""The messages an extraction needs, read back from what ingest stored.

A backend says how much of a message it reads (`Reads`), and only that is paid for:

    ROW     the row as ingest wrote it: subject, addresses, text body, HTML body
            (inline, or from the object store under html_key), attachment names,
            types and sizes — one query for a whole claim batch;
    RAW     ROW plus the raw MIME bytes (`messages.raw_key`; one statement for a
            batch in the database tier): header rules, the http backend's raw_mime;
    PARSED  the raw bytes parsed again in the parse workers (pipeline/mime/workers.py),
            grouped by mailbox and door and cleaned as ingest cleaned them: rules
            that read attachment bytes.

Re-parsing was the stage's bound: a claim batch of builtin rules spent ~1.3 ms of
a parse worker per message to use nothing but the subject and sender; ROW reads
what ingest already derived (bench/extraction.py (b)). The fields ROW builds are
the ones ingest stored from the same parse, so a rule sees the same values.

A row with no raw bytes (a door that stored none, an object that is gone, one
whose bytes do not hash to its key — `objectstore.read_many` never hands those out
— or one the store cannot give, ObjectUnreadable) is the row alone in every mode:
rules over its fields still work; the http backend and rules over attachments
refuse it (needs_review, `inboxd extract retry` once the object is back). A large
HTML body in the same state is left out. A store that does not answer at all
raises StoreUnavailableError: retry later, the message is not at fault.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from enum import StrEnum

import asyncpg
import orjson

from inboxd.pipeline.ingest.rows import clean_item
from inboxd.pipeline.message import Address, AttachmentData, MessageData
from inboxd.pipeline.mime.workers import parse_in_workers
from inboxd.pipeline.objectstore.store import ObjectStore, read_many


class Reads(StrEnum):
    """How much of a message a backend reads (module docstring)."""

    ROW = "row"
    RAW = "raw"
    PARSED = "parsed"


_ROWS = """
SELECT m.message_id, m.mailbox_id, mb.provider, m.external_id, m.raw_key, m.html_key,
       m.internet_message_id, m.in_reply_to, m.subject, m.from_address, m.from_name,
       m.sent_at, m.received_at, m.text_body, m.html_body,
       (SELECT json_agg(json_build_array(p.role, p.address, p.display_name)
                        ORDER BY p.role, p.position)
          FROM message_participants p
         WHERE p.tenant_id = m.tenant_id AND p.message_id = m.message_id) AS participants,
       (SELECT json_agg(json_build_array(a.filename, a.content_type, a.size_bytes,
                                         a.disposition) ORDER BY a.position)
          FROM attachments a
         WHERE a.tenant_id = m.tenant_id AND a.message_id = m.message_id) AS attachments
  FROM messages m
  JOIN mailboxes mb ON mb.tenant_id = m.tenant_id AND mb.mailbox_id = m.mailbox_id
 WHERE m.tenant_id = $1 AND m.message_id = ANY($2::bigint[])
"""


async def load_messages(
    pool: asyncpg.Pool,
    store: ObjectStore,
    tenant_id: str,
    message_ids: Sequence[int],
    *,
    reads: Reads = Reads.PARSED,
    in_thread: bool = False,
) -> dict[int, MessageData]:
    """The tenant's messages among `message_ids`, as much of each as `reads` says
    (module docstring). Ids that are not the tenant's messages are left out."""
    if not message_ids:
        return {}
    async with pool.acquire() as conn:
        rows = await conn.fetch(_ROWS, tenant_id, sorted(set(message_ids)))
    keys = [r["raw_key"] for r in rows if r["raw_key"] and reads is not Reads.ROW]
    if reads is not Reads.PARSED:
        keys += [r["html_key"] for r in rows if r["html_key"] and r["html_body"] is None]
    got = await read_many(store, keys)
    # a missing, corrupt or unreadable object (read_many logged it) is left out: the
    # row alone. Raising for an unreadable one gave its claim batch back uncharged
    # and claimed it again, for ever: one object stalled every job claimed with it.
    objects = got.found
    out: dict[int, MessageData] = {}
    to_parse: dict[tuple[str, str], list[asyncpg.Record]] = defaultdict(list)
    for row in rows:
        raw = objects.get(row["raw_key"]) if row["raw_key"] else None
        if reads is Reads.PARSED and raw is not None:
            to_parse[(row["mailbox_id"], row["provider"])].append(row)
            continue
        message = _from_row(tenant_id, row)
        message.raw = raw
        if message.html is None and row["html_key"] in objects:
            message.html = objects[row["html_key"]].decode("utf-8", "replace")
        out[row["message_id"]] = message
    for (mailbox, provider), members in sorted(to_parse.items()):
        items = await parse_in_workers(
            [objects[r["raw_key"]] for r in members],
            tenant_id,
            mailbox,
            provider,
            in_thread=in_thread,
        )
        for row, item in zip(members, items, strict=True):
            if isinstance(item, MessageData):
                clean_item(item)
                out[row["message_id"]] = item
            else:  # parsed at ingest, not now (a parser change): keep what the row has
                message = _from_row(tenant_id, row)
                message.raw = objects[row["raw_key"]]
                out[row["message_id"]] = message
    return out


def _from_row(tenant_id: str, row: asyncpg.Record) -> MessageData:
    people: dict[str, list[Address]] = defaultdict(list)
    for role, address, name in orjson.loads(row["participants"] or "[]"):
        people[role].append(Address(address, name))
    attachments = [
        AttachmentData(filename=f, content_type=t, size_bytes=n, disposition=d)
        for f, t, n, d in orjson.loads(row["attachments"] or "[]")
    ]
    # A sender with a name but no address ("From: MAILER-DAEMON <>", "<moderator>"
    # without a domain) is parsed as Address("", name) and stored as from_address ''
    # with its from_name: keep it, or from.name would find nothing here and the name
    # in a re-parse (tests/pipeline/test_extraction_reads.py).
    has_sender = row["from_address"] or row["from_name"]
    sender = Address(row["from_address"], row["from_name"]) if has_sender else None
    return MessageData(
        tenant_id=tenant_id,
        mailbox_id=row["mailbox_id"],
        external_id=row["external_id"],
        internet_message_id=row["internet_message_id"],
        in_reply_to=row["in_reply_to"],
        from_=sender,
        to=people["to"],
        cc=people["cc"],
        bcc=people["bcc"],
        reply_to=people["reply_to"],
        subject=row["subject"],
        sent_at=row["sent_at"],
        received_at=row["received_at"],
        text=row["text_body"],
        html=row["html_body"],
        attachments=attachments,
    )
