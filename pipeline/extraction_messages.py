"""The messages an extraction needs, read back from what ingest stored.

A parse backend reads the whole message: its raw MIME (header rules, the http
backend's `raw_mime`) and its parts (text, HTML, attachment bytes). Ingest kept
the raw bytes under `messages.raw_key` in the object store; they are read back
and parsed again in the parse workers (pipeline/parsing.py), grouped by the
mailbox and door they came through, and cleaned as ingest cleaned them, so an
extraction sees the message ingest saw.

A row with no raw bytes (a door that stored none, or an object that is gone)
is rebuilt from the row itself: subject, addresses, text and inline HTML
bodies, attachment names and types without bytes. Rules over those still work;
the http backend refuses it (it has nothing to send). A store that does not
answer raises StoreUnavailableError: retry later, the message is not at fault.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import asyncpg
import orjson

from inboxd.pipeline.message import Address, AttachmentData, MessageData
from inboxd.pipeline.objectstore import ObjectNotFound, ObjectStore, run_bounded
from inboxd.pipeline.parsing import parse_in_workers
from inboxd.pipeline.rows import clean_item

#: Object-store reads at once per call: the database tier answers each read on a
#: pool connection, S3 in parallel; four keeps a batch's reads off the critical path
#: without taking the daemon's pool (the reprocess command's figure, same reads).
RAW_READ_CONCURRENCY = 4

_ROWS = """
SELECT m.message_id, m.mailbox_id, mb.provider, m.external_id, m.raw_key,
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
    in_thread: bool = False,
) -> dict[int, MessageData]:
    """The tenant's messages among `message_ids`, parsed from their raw bytes where
    the store has them, else rebuilt from the row (module docstring). Ids that are
    not the tenant's messages are left out."""
    if not message_ids:
        return {}
    async with pool.acquire() as conn:
        rows = await conn.fetch(_ROWS, tenant_id, sorted(set(message_ids)))
    raws = await _read_raws(store, [r["raw_key"] for r in rows if r["raw_key"]])
    groups: dict[tuple[str, str], list[asyncpg.Record]] = defaultdict(list)
    out: dict[int, MessageData] = {}
    for row in rows:
        if row["raw_key"] in raws:
            groups[(row["mailbox_id"], row["provider"])].append(row)
        else:
            out[row["message_id"]] = _from_row(tenant_id, row)
    for (mailbox, provider), members in sorted(groups.items()):
        items = await parse_in_workers(
            [raws[r["raw_key"]] for r in members], tenant_id, mailbox, provider, in_thread=in_thread
        )
        for row, item in zip(members, items, strict=True):
            if isinstance(item, MessageData):
                clean_item(item)
                out[row["message_id"]] = item
            else:  # parsed at ingest, not now (a parser change): keep what the row has
                message = _from_row(tenant_id, row)
                message.raw = raws[row["raw_key"]]
                out[row["message_id"]] = message
    return out


async def _read_raws(store: ObjectStore, keys: list[str]) -> dict[str, bytes]:
    """Bytes by key; a key with no object is left out, a store error raised."""
    unique = sorted(set(keys))
    results = await run_bounded(store.get, unique, concurrency=RAW_READ_CONCURRENCY)
    raws: dict[str, bytes] = {}
    for key, result in zip(unique, results, strict=True):
        if isinstance(result, ObjectNotFound | ValueError):
            continue
        if isinstance(result, Exception):
            raise result
        raws[key] = result
    return raws


def _from_row(tenant_id: str, row: asyncpg.Record) -> MessageData:
    people: dict[str, list[Address]] = defaultdict(list)
    for role, address, name in orjson.loads(row["participants"] or "[]"):
        people[role].append(Address(address, name))
    attachments = [
        AttachmentData(filename=f, content_type=t, size_bytes=n, disposition=d)
        for f, t, n, d in orjson.loads(row["attachments"] or "[]")
    ]
    sender = Address(row["from_address"], row["from_name"]) if row["from_address"] else None
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
