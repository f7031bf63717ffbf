"""Reprocess: re-derive stored messages from their raw bytes with the current parser.

A parser upgrade must be replayable (issue 15). `inboxd reprocess` drives this
module; it is written so that running it again, or after an interruption, is
always safe.

Which messages: those of one tenant, in message_id order, optionally only those
whose primary copy is in one mailbox (`messages.mailbox_id`: the row was derived
from that copy's bytes) and only those with `received_at` at or after a time
(when the provider received the message; for doors without that information,
such as import, when inboxd stored it).

Per batch of `REPROCESS_BATCH_MESSAGES` messages (keyset pagination by
message_id, so a batch is one index range and a run resumes after any id):

  read      the rows, their participants, attachments and copies (one query each)
  skip      a row without raw_key: `no_raw`; a row the application recorded
            (send_status set: its subject and sender are the application's, the
            provider's copy only completed it): `app_sent`; a raw_key whose
            object is gone: `raw_missing`, listed — never an error that stops the run
  parse     the primary copy's raw bytes, and those of every other copy with raw
            bytes of its own (`pipeline.mime.workers.parse_in_workers`, the doors'
            parser, with the mailbox's provider as source), then
            `rows.clean_item`, exactly as ingest does
  compare   subject, subject_norm, from address and name, sent_at, text and HTML
            bodies (a large HTML body by its content-addressed object key),
            In-Reply-To, References, Message-ID (raw and normalised),
            participants, attachments (position, name, type, disposition,
            Content-ID, size, sha256), has_attachments and the content
            fingerprint (`reprocess_write.changed_fields`). Threads, copies,
            labels and direction are not re-derived.
  report    left exactly as stored, listed with a reason, never split or merged:
            `copies_disagree` (another copy's bytes now give a different
            fingerprint: the copies would not have merged under this parser),
            `fingerprint_collision` (the new Message-ID + fingerprint is another
            message's, unique index messages_mid_key), `copy_raw_missing` (the
            fingerprint changes and a copy's bytes cannot be read to check it),
            `not_mail` (the parser now rejects the bytes), `changed_meanwhile`
            (the row changed between read and write; the next run looks again),
            `raw_corrupt` (the raw object's bytes do not hash to the sha256 its key
            names, i.e. messages.raw_sha256: truncated or overwritten, never parsed;
            the key in `detail`), `raw_unreadable` (the store answers but cannot
            give that one object: a directory in its place, EIO, S3 403; the error
            in `detail`). A store failing as a whole (an ObjectStoreError that is
            not `objectstore.ObjectUnreadable`) stops the run instead, resumable.
            A reported message gets no write at all, not even its other fields.
  write     unchanged: nothing, not even updated_at. Changed: one transaction
            per batch rewrites the rows in place (`reprocess_write.write_updates`:
            new bytes stored first, participants replaced, attachments upserted
            by position, threads recomputed) with one `message.updated` event
            per message naming the changed fields.

Interrupt and resume: every batch commits on its own; a batch that is cancelled
rolls back whole. `Report.last_message_id` is the last id examined by a
committed batch: starting again with `after_id` = that id continues where the
run stopped, and starting from the beginning is just as correct (what is
already right writes nothing).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime

import asyncpg

from inboxd.pipeline.ingest.rows import clean_item
from inboxd.pipeline.message import DeadItem, MessageData
from inboxd.pipeline.mime.workers import Item, parse_in_workers
from inboxd.pipeline.objectstore.store import READS_AT_ONCE, ObjectReads, ObjectStore, read_many
from inboxd.pipeline.reprocess.write import (
    StoredMessage,
    Update,
    changed_fields,
    derive,
    stored_from_row,
    write_updates,
)

# Messages per batch (one transaction). Each batch holds its raw bytes in memory;
# 200 is four parse chunks (parsing.PARSE_CHUNK_SIZE), which the parse workers take
# side by side (one chunk a batch left one core idle), ~1.2 MB for the corpus's
# mean 5.7 KB message, and a stop signal waits for at most one batch.
REPROCESS_BATCH_MESSAGES = 200
# Concurrent object-store reads per batch: the command's pool has a connection
# for each (database tier) and S3 answers reads in parallel.
RAW_READ_CONCURRENCY = READS_AT_ONCE

_SELECT_PAGE = """
SELECT m.message_id, m.mailbox_id, m.raw_key, m.send_status, m.xmin::text AS seen_xmin,
       m.subject, m.subject_norm, m.from_address, m.from_name, m.sent_at, m.text_body,
       m.html_body, m.html_key, m.in_reply_to, m."references", m.internet_message_id,
       m.message_id_norm, m.has_attachments, m.content_fingerprint,
       coalesce(b.provider, '') AS provider
  FROM messages m
  LEFT JOIN mailboxes b ON b.tenant_id = m.tenant_id AND b.mailbox_id = m.mailbox_id
 WHERE m.tenant_id = $1 AND m.message_id > $2
   AND ($3::text IS NULL OR m.mailbox_id = $3)
   AND ($4::timestamptz IS NULL OR m.received_at >= $4)
 ORDER BY m.message_id
 LIMIT $5
"""

_COUNT = """
SELECT count(*) FROM messages m
 WHERE m.tenant_id = $1 AND m.message_id > $2
   AND ($3::text IS NULL OR m.mailbox_id = $3)
   AND ($4::timestamptz IS NULL OR m.received_at >= $4)
"""


@dataclass(frozen=True, slots=True)
class Scope:
    """Which messages: a tenant's, optionally one mailbox's, received since a time."""

    tenant_id: str
    mailbox_id: str | None = None
    since: datetime | None = None


@dataclass(frozen=True, slots=True)
class Reported:
    """A message left as stored, and why (module docstring, "report")."""

    message_id: int
    reason: str
    detail: str | None = None


@dataclass(slots=True)
class Report:
    """What one batch, or a whole run, did. Every examined message is counted once,
    in unchanged, updated, reported, no_raw, app_sent or raw_missing."""

    examined: int = 0
    unchanged: int = 0
    updated: int = 0
    no_raw: int = 0
    app_sent: int = 0
    fields: Counter[str] = field(default_factory=Counter)
    reported: list[Reported] = field(default_factory=list)
    raw_missing: list[tuple[int, str]] = field(default_factory=list)
    last_message_id: int | None = None

    def merge(self, other: Report) -> None:
        """Add a later batch's counts to these."""
        self.examined += other.examined
        self.unchanged += other.unchanged
        self.updated += other.updated
        self.no_raw += other.no_raw
        self.app_sent += other.app_sent
        self.fields.update(other.fields)
        self.reported.extend(other.reported)
        self.raw_missing.extend(other.raw_missing)
        if other.last_message_id is not None:
            self.last_message_id = other.last_message_id


class Reprocessor:
    """Runs the protocol of the module docstring, one batch per call.

    `in_thread` parses in a worker thread instead of worker processes (tests that
    change the parser in this process; small runs).
    """

    def __init__(
        self,
        pool: asyncpg.Pool,
        store: ObjectStore,
        *,
        in_thread: bool = False,
        batch_size: int = REPROCESS_BATCH_MESSAGES,
    ) -> None:
        self._pool = pool
        self._store = store
        self._in_thread = in_thread
        self._batch_size = batch_size

    async def count(self, scope: Scope, after_id: int = 0) -> int:
        """Messages in scope after `after_id` (the progress bar's total)."""
        value = await self._pool.fetchval(
            _COUNT, scope.tenant_id, after_id, scope.mailbox_id, scope.since
        )
        return int(value or 0)

    async def next_batch(self, scope: Scope, after_id: int) -> Report:
        """Reprocess the next batch after `after_id`, committed when this returns.

        `examined == 0` means there is nothing left. Raises what the database
        raises, and ObjectStoreError for a store that does not answer (a missing,
        corrupt or unreadable object is not an error: reported per message);
        nothing of the batch is written then.
        """
        rows = await self._pool.fetch(
            _SELECT_PAGE, scope.tenant_id, after_id, scope.mailbox_id, scope.since, self._batch_size
        )
        report = Report(examined=len(rows))
        if not rows:
            return report
        report.last_message_id = rows[-1]["message_id"]
        stored = [stored_from_row(r) for r in rows]
        await self._read_details(scope.tenant_id, stored)
        wanted = [s for s in stored if s.raw_key and s.send_status is None]
        copies = await self._copy_keys(scope.tenant_id, wanted)
        sources = {s.raw_key: (s.mailbox_id, s.provider) for s in wanted if s.raw_key}
        for keys in (copies.get(s.message_id, []) for s in wanted):
            for key, mailbox, provider in keys:
                sources.setdefault(key, (mailbox, provider))
        raws = await read_many(self._store, sources)
        parsed = await self._parse(scope.tenant_id, raws.found, sources)
        updates: list[Update] = []
        for s in stored:
            update = self._classify(scope.tenant_id, s, parsed, raws, copies, report)
            if update is not None:
                updates.append(update)
        updates = await self._drop_collisions(scope.tenant_id, updates, report)
        await self._write(scope.tenant_id, updates, report)
        return report

    def _classify(
        self,
        tenant: str,
        s: StoredMessage,
        parsed: dict[str, Item],
        raws: ObjectReads,
        copies: dict[int, list[tuple[str, str, str]]],
        report: Report,
    ) -> Update | None:
        """Count `s` where it belongs; the Update when it is a candidate for a write."""
        if s.send_status is not None:
            report.app_sent += 1
            return None
        if s.raw_key is None:
            report.no_raw += 1
            return None
        if s.raw_key in raws.missing:
            report.raw_missing.append((s.message_id, s.raw_key))
            return None
        if s.raw_key in raws.corrupt:
            report.reported.append(Reported(s.message_id, "raw_corrupt", s.raw_key))
            return None
        if (error := raws.unreadable.get(s.raw_key)) is not None:
            report.reported.append(Reported(s.message_id, "raw_unreadable", str(error)))
            return None
        item = parsed[s.raw_key]
        if isinstance(item, DeadItem):
            report.reported.append(Reported(s.message_id, "not_mail"))
            return None
        derived = derive(item)
        fp = derived.columns["content_fingerprint"]
        copy_keys = [key for key, _, _ in copies.get(s.message_id, []) if key != s.raw_key]
        # a copy whose bytes cannot be used (gone, corrupt, unreadable) cannot be checked
        usable = [k for k in copy_keys if k in raws.found]
        if any(_fingerprint(parsed.get(k)) != fp for k in usable):
            report.reported.append(Reported(s.message_id, "copies_disagree"))
            return None
        fields = changed_fields(tenant, s, derived)
        if not fields:
            report.unchanged += 1
            return None
        if "content_fingerprint" in fields and len(usable) < len(copy_keys):
            report.reported.append(Reported(s.message_id, "copy_raw_missing"))
            return None
        return Update(s, item, derived, fields)

    async def _read_details(self, tenant: str, stored: list[StoredMessage]) -> None:
        """Participants and attachment rows of the batch's messages."""
        by_id = {s.message_id: s for s in stored}
        ids = sorted(by_id)
        for r in await self._pool.fetch(
            "SELECT message_id, role, position, address, display_name FROM message_participants "
            "WHERE tenant_id = $1 AND message_id = ANY($2::bigint[])",
            tenant,
            ids,
        ):
            by_id[r[0]].participants.append((r[1], r[2], r[3], r[4]))
        for r in await self._pool.fetch(
            "SELECT message_id, position, filename, content_type, disposition, content_id, "
            "size_bytes, sha256 FROM attachments "
            "WHERE tenant_id = $1 AND message_id = ANY($2::bigint[])",
            tenant,
            ids,
        ):
            by_id[r[0]].attachments.append((r[1], r[2], r[3], r[4], r[5], r[6], r[7]))

    async def _copy_keys(
        self, tenant: str, stored: list[StoredMessage]
    ) -> dict[int, list[tuple[str, str, str]]]:
        """(raw key, mailbox, provider) of each message's copies that have raw bytes."""
        out: dict[int, list[tuple[str, str, str]]] = {}
        if not stored:
            return out
        for r in await self._pool.fetch(
            "SELECT c.message_id, c.raw_key, c.mailbox_id, coalesce(b.provider, '') "
            "FROM message_copies c LEFT JOIN mailboxes b "
            "ON b.tenant_id = c.tenant_id AND b.mailbox_id = c.mailbox_id "
            "WHERE c.tenant_id = $1 AND c.message_id = ANY($2::bigint[]) "
            "AND c.raw_key IS NOT NULL ORDER BY c.message_id, c.raw_key",
            tenant,
            [s.message_id for s in stored],
        ):
            out.setdefault(r[0], []).append((r[1], r[2], r[3]))
        return out

    async def _parse(
        self, tenant: str, raws: dict[str, bytes], sources: dict[str, tuple[str, str]]
    ) -> dict[str, Item]:
        """Parse each raw object once, with its mailbox and provider, cleaned like ingest."""
        groups: dict[tuple[str, str], list[str]] = {}
        for key in sorted(raws):
            groups.setdefault(sources[key], []).append(key)
        parsed: dict[str, Item] = {}
        for (mailbox, provider), keys in sorted(groups.items()):
            items = await parse_in_workers(
                [raws[k] for k in keys], tenant, mailbox, provider, in_thread=self._in_thread
            )
            for key, item in zip(keys, items, strict=True):
                if isinstance(item, MessageData):
                    clean_item(item)
                parsed[key] = item
        return parsed

    async def _drop_collisions(
        self, tenant: str, updates: list[Update], report: Report
    ) -> list[Update]:
        """Updates whose new (Message-ID, fingerprint) no other message holds or takes."""
        moving = [
            u
            for u in updates
            if u.derived.columns["message_id_norm"] is not None
            and ("content_fingerprint" in u.fields or "message_id_norm" in u.fields)
        ]
        if not moving:
            return updates
        taken = {
            r[0]
            for r in await self._pool.fetch(
                "SELECT u.id FROM unnest($2::bigint[], $3::text[], $4::text[]) AS u(id, mid, fp) "
                "WHERE EXISTS (SELECT 1 FROM messages x WHERE x.tenant_id = $1 "
                "AND x.message_id <> u.id AND x.message_id_norm = u.mid "
                "AND x.content_fingerprint = u.fp)",
                tenant,
                [u.stored.message_id for u in moving],
                [u.derived.columns["message_id_norm"] for u in moving],
                [u.derived.columns["content_fingerprint"] for u in moving],
            )
        }
        claimed: set[tuple[object, object]] = set()
        kept: list[Update] = []
        for u in updates:  # in message_id order: the first of an in-batch pair keeps it
            key = (u.derived.columns["message_id_norm"], u.derived.columns["content_fingerprint"])
            if u.stored.message_id in taken or (key[0] is not None and key in claimed):
                report.reported.append(Reported(u.stored.message_id, "fingerprint_collision"))
                continue
            claimed.add(key)
            kept.append(u)
        return kept

    async def _write(self, tenant: str, updates: list[Update], report: Report) -> None:
        """The batch's one transaction; nothing at all when nothing changed."""
        if not updates:
            return
        async with self._pool.acquire() as conn, conn.transaction():
            # small objects (pipeline/objectstore/database_tier.py) commit here, durable like
            # ingest's
            await conn.execute("SET LOCAL synchronous_commit = on")
            written = await write_updates(conn, self._store, tenant, updates)
        for u in updates:
            if u.stored.message_id in written:
                report.updated += 1
                report.fields.update(u.fields)
            else:
                report.reported.append(Reported(u.stored.message_id, "changed_meanwhile"))


async def reprocess(
    pool: asyncpg.Pool,
    store: ObjectStore,
    scope: Scope,
    *,
    after_id: int = 0,
    in_thread: bool = False,
    batch_size: int = REPROCESS_BATCH_MESSAGES,
) -> Report:
    """Every batch of `scope` after `after_id`, one after another; the whole run's Report."""
    runner = Reprocessor(pool, store, in_thread=in_thread, batch_size=batch_size)
    total = Report()
    while True:
        batch = await runner.next_batch(scope, after_id)
        if not batch.examined:
            return total
        total.merge(batch)
        assert batch.last_message_id is not None
        after_id = batch.last_message_id


def _fingerprint(item: Item | None) -> str | None:
    return item.content_fingerprint if isinstance(item, MessageData) else None
