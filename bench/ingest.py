#!/usr/bin/env python3
"""How fast does the ingest stage store mail, next to what the database can do at best?

    .venv/bin/python bench/ingest.py [--messages N] [--batch-size B] [--dsn DSN]
        [--raw-messages M] [--raw-batch B] [--only a,b,c,d,e] [--rtt-ms MS]
        [--no-analyze] [--auxx-messages M] [--no-s3] [--keep] [--smoke]

One run, one PostgreSQL server, one set of generated messages (realistic
MessageData of one tenant/mailbox: Gmail-style external ids, Message-IDs, threads
of 1-5 messages spread over two months, from/to/cc, subjects, 1-3 KB text, HTML
for ~40 %, no attachments, content fingerprints from inboxd.pipeline.identity),
each figure measured on a fresh database (schema.sql applied) so that they start
equal:

  (a) COPY ceiling: copy_records_to_table of exactly the rows the cascade ends up
      with (messages, threads with their final metadata, message_participants,
      message_copies, events: message.created + thread.created), one transaction
      per batch, records prepared beforehand: the physical ceiling of this work.
  (b) the full cascade, new messages: IngestStage.ingest(IngestBatch(...)) per batch.
  (c) the full cascade, complete re-sync: the same batches again (all duplicates).
  (d) "Auxx-style": one transaction per message with a round trip per step
      (select by Message-ID, select by (mailbox, provider id), thread upsert,
      insert message, insert participants (executemany), insert copy, thread
      metadata update, event insert(s)).
  (e) raw RFC 5322 -> rows end to end: stdlib-generated messages (plain, multipart/
      alternative, small attachment, iso-8859-1/windows-1252/iso-2022-jp/koi8-r,
      quoted-printable and base64), parse_raw + ingest (raw bytes kept as the daemon
      and the import door keep them: up to 64 KiB in PostgreSQL, in the ingest
      transaction, larger in a LocalDirectoryStore), parsing inline, in a thread,
      or in worker processes overlapping the database work; beside parse-only and
      ingest-only rates. Ingest-only is also measured with the raw bytes in an S3
      bucket on moto's server over HTTP (`python -m moto.server`, a subprocess on a
      free loopback port, fake credentials; --no-s3 skips it), opened as the daemon
      opens `[object_store] kind = "s3"` (adapters/objectstore open_object_store):
      its default, one object per message (database_max_bytes 0), and with
      database_max_bytes = 64 KiB; beside moto taking the same PUTs alone. moto's
      CPU (its process, all threads, from /proc) is printed beside each.

Only the work is timed, never the data generation. The machine is shared and
noisy, so every figure is printed beside a baseline of the same run (ratios),
with the CPU seconds it cost this process ("client") and the PostgreSQL backends
serving it ("server", read from /proc when the server is local). After the first
batch of every database an untimed ANALYZE stands in for autovacuum
(--no-analyze: plans of empty tables stay cached all run). --rtt-ms puts a
delaying TCP relay between client and server, for the ratios under a network
round trip instead of localhost. Databases are named bench_ingest_<pid>_<x> and
dropped at the end (unless --keep).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import http.client
import multiprocessing
import os
import queue
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Awaitable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.charset import BASE64, QP, Charset
from email.header import Header
from email.mime.application import MIMEApplication
from email.mime.multipart import MIMEMultipart
from email.mime.text import MIMEText
from email.utils import format_datetime, formataddr
from multiprocessing.connection import Connection
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import anyio
import anyio.to_process
import anyio.to_thread
import asyncpg
import orjson

from inboxd.adapters.objectstore import open_object_store
from inboxd.pipeline.identity import content_fingerprint, normalise_message_id, normalise_subject
from inboxd.pipeline.ingest.stage import IngestBatch, IngestStage
from inboxd.pipeline.message import Address, DeadItem, MessageData
from inboxd.pipeline.mime.parse import html_to_text, parse_raw
from inboxd.pipeline.objectstore.database_tier import DEFAULT_MAX_BYTES, DatabaseTierStore
from inboxd.pipeline.objectstore.local import LocalDirectoryStore
from inboxd.pipeline.objectstore.store import ObjectStore
from inboxd.pipeline.schema import apply_schema
from inboxd.pipeline.tenancy import ensure_mailbox

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
TENANT = "bench"
MAILBOX = "support"
OWNER = Address("support@acme-widgets.example", "Acme Support")

TARGET_B_OVER_A = 0.5
TARGET_B_OVER_D = 10.0
TARGET_C = 100_000.0
TARGET_E = 3_000.0
# (e) ingest with raw bytes stored ÷ without (issue 15)
TARGET_STORED_OVER_NOT = 0.80


def open_store(
    pool: asyncpg.Pool, store_dir: str, where: str, s3: Mapping[str, str] | None = None
) -> ObjectStore:
    """`files`: one file per object (LocalDirectoryStore alone); `database`: objects up
    to DEFAULT_MAX_BYTES in PostgreSQL, in the ingest transaction (the daemon's and
    `inboxd import`'s default for a local object store); `s3`: the daemon's store for
    `[object_store] kind = "s3"` and the fields of `s3` (its default database_max_bytes,
    0: one S3 object each); `s3-database`: the same with database_max_bytes =
    DEFAULT_MAX_BYTES."""
    if where in ("s3", "s3-database"):
        assert s3 is not None
        spec: dict[str, object] = {"kind": "s3", **s3}
        if where == "s3-database":
            spec["database_max_bytes"] = DEFAULT_MAX_BYTES
        return open_object_store(spec, pool=pool)
    files = LocalDirectoryStore(store_dir)
    if where == "files":
        return files
    return DatabaseTierStore(pool, files, max_bytes=DEFAULT_MAX_BYTES)


#: --smoke (CI): every figure at a size that runs in ~10 s. Several batches, so that
#: threads span batches and the ANALYZE after the first batch happens; enough raw
#: messages that every shape and charset of gen_raw occurs.
SMOKE_MESSAGES = 300
SMOKE_BATCH = 100
SMOKE_RAW_MESSAGES = 200
SMOKE_RAW_BATCH = 50
SMOKE_RESYNC_PASSES = 2

#: (e) S3: the bucket on moto's server, and how long moto may take to answer at start
#: (importing moto + flask takes 1-3 s; a loaded machine is several times slower).
S3_BUCKET = "bench-ingest"
S3_REGION = "us-east-1"
MOTO_START_TIMEOUT_S = 30.0
MOTO_STOP_TIMEOUT_S = 10.0

#: What made a figure meaningless (an outcome other than expected, rows that differ,
#: nothing timed). Targets MISSED are results, not problems; problems make the exit
#: status 1, so that a rotten benchmark cannot pass for a slow one.
PROBLEMS: list[str] = []


def problem(text: str) -> None:
    PROBLEMS.append(text)
    print(f"  PROBLEM: {text}", flush=True)


def expect_outcomes(what: str, counts: Counter[str], n: int, outcome: str = "new") -> None:
    if dict(counts) != {outcome: n}:
        problem(f"{what}: outcomes {dict(counts)}, expected {{{outcome!r}: {n}}}")


def expect_timed(what: str, clock: Clock) -> None:
    if not clock.wall > 0:
        problem(f"{what}: nothing was timed (wall {clock.wall} s)")


# --------------------------------------------------------------------------- data

from vocabulary import (  # noqa: E402 - bench/ is sys.path[0]
    _DOMAINS,
    _FIRST,
    _LAST,
    _LEGACY,
    _NAME_SUFFIX,
    _WORDS,
)


def _sentence(rng: random.Random, lo: int = 6, hi: int = 18) -> str:
    words = rng.choices(_WORDS, k=rng.randint(lo, hi))
    return " ".join(words).capitalize() + rng.choice(".....?!")


def _paragraphs(rng: random.Random, size: int) -> list[str]:
    paras: list[str] = []
    total = 0
    while total < size:
        para = " ".join(_sentence(rng) for _ in range(rng.randint(2, 6)))
        paras.append(para)
        total += len(para) + 2
    return paras


def _people(rng: random.Random, n: int) -> list[Address]:
    out = []
    for i in range(n):
        first, last = rng.choice(_FIRST), rng.choice(_LAST)
        domain = rng.choice(_DOMAINS)
        out.append(Address(f"{first}.{last}{i}@{domain}", f"{first.title()} {last.title()}"))
    return out


def _html_of(paras: list[str]) -> str:
    body = "".join(f"<p>{p}</p>\n" for p in paras)
    return (
        '<html><head><meta charset="utf-8"><style>p{margin:0 0 1em}</style></head>'
        '<body><div style="font-family:Arial,sans-serif;font-size:14px">\n'
        f'{body}<p>--<br><a href="https://acme-widgets.example/help">Help centre</a></p>'
        "</div></body></html>"
    )


def gen_messages(n: int, seed: int) -> list[MessageData]:
    """n MessageData in arrival order (sent_at), threads of 1-5 spread over 60 days."""
    rng = random.Random(seed)
    crowd = _people(rng, 600)
    base = datetime(2024, 3, 1, tzinfo=UTC)
    out: list[MessageData] = []
    serial = 0
    while len(out) < n:
        size = min(rng.randint(1, 5), n - len(out))
        thread_ext = f"{rng.getrandbits(60):015x}"
        subject = " ".join(rng.choices(_WORDS, k=rng.randint(3, 8))).capitalize()
        customer = rng.choice(crowd)
        others = [p for p in rng.sample(crowd, 5) if p != customer][:4]
        sent = base + timedelta(seconds=rng.uniform(0, 60 * 86400))
        refs: list[str] = []
        previous_text = ""
        for j in range(size):
            serial += 1
            inbound = j % 2 == 0 or rng.random() < 0.3
            sender = customer if inbound else OWNER
            to = [OWNER] if inbound else [customer]
            to += rng.sample(others, rng.randint(0, 2))
            pool = [p for p in others if p not in to and p != sender]
            cc = rng.sample(pool, min(len(pool), rng.randint(0, 2)))
            domain = sender.email.rpartition("@")[2]
            mid_domain = domain.upper() if rng.random() < 0.1 else domain
            mid_raw = f"<{rng.getrandbits(64):016x}.{serial}@{mid_domain}>"
            mid_norm = normalise_message_id(mid_raw)
            subj = subject if j == 0 else rng.choice(("Re: ", "RE: ", "AW: ")) + subject
            paras = _paragraphs(rng, rng.randint(900, 2500))
            text = f"Hello {to[0].name.split()[0] if to[0].name else 'there'},\n\n"
            text += "\n\n".join(paras) + f"\n\nBest regards,\n{sender.name}\n"
            if previous_text:  # quoted history, trimmed so the body stays 1-3 KB
                quote = previous_text[: max(0, 3000 - len(text))]
                text += "\n" + "\n".join("> " + line for line in quote.splitlines())
            html = _html_of(paras) if rng.random() < 0.4 else None
            subject_norm = normalise_subject(subj)
            recipients = [a.email for a in (*to, *cc)]
            fp = content_fingerprint(
                sender=sender.email,
                sender_name=f"{sender.email} {sender.name}",
                subject_norm=subject_norm,
                sent_at=sent,
                text=text,
                html_text=html_to_text(html),
                recipients=recipients,
            )
            out.append(
                MessageData(
                    tenant_id=TENANT,
                    mailbox_id=MAILBOX,
                    external_id=f"{rng.getrandbits(60):015x}{serial:05x}",
                    external_thread_id=thread_ext,
                    internet_message_id=mid_raw,
                    message_id_norm=mid_norm,
                    in_reply_to=refs[-1] if refs else None,
                    references=list(refs),
                    from_=sender,
                    to=to,
                    cc=cc,
                    subject=subj,
                    subject_norm=subject_norm,
                    sent_at=sent,
                    received_at=sent + timedelta(seconds=rng.uniform(1, 90)),
                    text=text,
                    html=html,
                    labels=["INBOX", "UNREAD"]
                    if inbound and rng.random() < 0.5
                    else (["INBOX"] if inbound else ["SENT"]),
                    content_fingerprint=fp,
                    direction="inbound" if inbound else "outbound",
                )
            )
            refs.append(mid_norm)  # type: ignore[arg-type]
            previous_text = text
            sent += timedelta(seconds=rng.uniform(120, 2 * 86400))
    out.sort(key=lambda m: (m.received_at, m.external_id))
    return out


# --------------------------------------------------------------------------- (a) rows


@dataclass(slots=True)
class CopyBatch:
    threads: list[tuple] = field(default_factory=list)
    messages: list[tuple] = field(default_factory=list)
    participants: list[tuple] = field(default_factory=list)
    copies: list[tuple] = field(default_factory=list)
    events: list[tuple] = field(default_factory=list)

    def rows(self) -> int:
        return (
            len(self.threads)
            + len(self.messages)
            + len(self.participants)
            + len(self.copies)
            + len(self.events)
        )


THREAD_COLS = (
    "tenant_id",
    "thread_id",
    "mailbox_id",
    "external_thread_id",
    "subject",
    "message_count",
    "participant_count",
    "first_message_at",
    "last_message_at",
    "latest_message_id",
)
MESSAGE_COLS = (
    "tenant_id",
    "message_id",
    "mailbox_id",
    "thread_id",
    "external_id",
    "direction",
    "internet_message_id",
    "message_id_norm",
    "in_reply_to",
    "references",
    "subject",
    "subject_norm",
    "from_address",
    "from_name",
    "sent_at",
    "received_at",
    "text_body",
    "html_body",
    "html_key",
    "has_attachments",
    "content_fingerprint",
    "raw_sha256",
    "raw_key",
    "conflict_of",
)
PARTICIPANT_COLS = ("tenant_id", "message_id", "role", "position", "address", "display_name")
COPY_COLS = (
    "tenant_id",
    "mailbox_id",
    "external_id",
    "message_id",
    "labels",
    "raw_sha256",
    "raw_key",
    "received_at",
)
EVENT_COLS = ("tenant_id", "kind", "mailbox_id", "thread_id", "message_id", "payload")


def _roles(m: MessageData) -> list[tuple[str, list[Address]]]:
    return [
        ("from", [m.from_] if m.from_ else []),
        ("to", m.to),
        ("cc", m.cc),
        ("bcc", m.bcc),
        ("reply_to", m.reply_to),
    ]


def copy_rows(batches: list[list[MessageData]]) -> list[CopyBatch]:
    """The rows the cascade ends up with, per batch (threads with final metadata)."""
    thread_ids: dict[str, int] = {}
    members: dict[int, list[tuple[int, MessageData]]] = {}
    next_mid = 0
    plan: list[tuple[list[tuple[int, MessageData]], list[str]]] = []
    for batch in batches:
        assigned, created = [], []
        for m in batch:
            next_mid += 1
            if m.thread_key not in thread_ids:
                thread_ids[m.thread_key] = len(thread_ids) + 1
                created.append(m.thread_key)
            members.setdefault(thread_ids[m.thread_key], []).append((next_mid, m))
            assigned.append((next_mid, m))
        plan.append((assigned, created))
    out: list[CopyBatch] = []
    for assigned, created in plan:
        cb = CopyBatch()
        for key in created:
            tid = thread_ids[key]
            msgs = members[tid]
            by_time = sorted(msgs, key=lambda x: (x[1].sent_at or x[1].received_at, x[0]))
            people = {p.email for _, m in msgs for _, ps in _roles(m) for p in ps if p.email}
            cb.threads.append(
                (
                    TENANT,
                    tid,
                    MAILBOX,
                    key,
                    by_time[0][1].subject,
                    len(msgs),
                    len(people),
                    by_time[0][1].sent_at,
                    by_time[-1][1].sent_at,
                    max(msgs, key=lambda x: (x[1].sent_at, x[0]))[0],
                )
            )
            cb.events.append((TENANT, "thread.created", MAILBOX, tid, None, "{}"))
        for mid, m in assigned:
            tid = thread_ids[m.thread_key]
            cb.messages.append(
                (
                    TENANT,
                    mid,
                    MAILBOX,
                    tid,
                    m.external_id,
                    m.direction,
                    m.internet_message_id,
                    m.message_id_norm,
                    m.in_reply_to,
                    m.references,
                    m.subject,
                    m.subject_norm,
                    m.from_.email if m.from_ else "",
                    m.from_.name if m.from_ else "",
                    m.sent_at,
                    m.received_at,
                    m.text,
                    m.html,
                    None,
                    bool(m.attachments),
                    m.content_fingerprint,
                    m.raw_sha256,
                    None,
                    None,
                )
            )
            for role, people in _roles(m):
                for pos, p in enumerate(people):
                    cb.participants.append((TENANT, mid, role, pos, p.email, p.name))
            cb.copies.append(
                (TENANT, MAILBOX, m.external_id, mid, m.labels, m.raw_sha256, None, m.received_at)
            )
            cb.events.append(
                (
                    TENANT,
                    "message.created",
                    MAILBOX,
                    tid,
                    mid,
                    orjson.dumps({"external_id": m.external_id}).decode(),
                )
            )
        out.append(cb)
    return out


async def run_copy(dsn: str, prepared: list[CopyBatch], analyze: bool) -> Clock:
    conn = await asyncpg.connect(dsn)
    try:
        clock = Clock([await conn.fetchval("SELECT pg_backend_pid()")])
        clock.start()
        for i, cb in enumerate(prepared):
            async with conn.transaction():
                await conn.copy_records_to_table("threads", records=cb.threads, columns=THREAD_COLS)
                await conn.copy_records_to_table(
                    "messages", records=cb.messages, columns=MESSAGE_COLS
                )
                await conn.copy_records_to_table(
                    "message_participants", records=cb.participants, columns=PARTICIPANT_COLS
                )
                await conn.copy_records_to_table(
                    "message_copies", records=cb.copies, columns=COPY_COLS
                )
                await conn.copy_records_to_table("events", records=cb.events, columns=EVENT_COLS)
            if i == 0 and analyze:
                await clock.paused(analyze_db(dsn))
        clock.stop()
        return clock
    finally:
        await conn.close()


# --------------------------------------------------------------------------- (b)/(c)


async def open_pool(dsn: str) -> tuple[asyncpg.Pool, list[int]]:
    """A pool of exactly two connections (ingest uses one at a time) and their backend pids."""
    pool = await asyncpg.create_pool(dsn, min_size=2, max_size=2)
    async with pool.acquire() as c1, pool.acquire() as c2:
        pids = [await c.fetchval("SELECT pg_backend_pid()") for c in (c1, c2)]
    return pool, pids


async def run_cascade(
    pool: asyncpg.Pool,
    pids: list[int],
    batches: Sequence[Sequence[MessageData | DeadItem]],
    store_dir: str,
    *,
    mailbox: str = MAILBOX,
    analyze_dsn: str | None = None,
    where: str = "files",
    s3: Mapping[str, str] | None = None,
) -> tuple[Clock, Counter[str]]:
    """Sequential IngestStage.ingest calls, one per batch, as one mailbox's consumer does."""
    store = open_store(pool, store_dir, where, s3)
    await store.start()  # S3: the client and its connection pool (no request); untimed
    try:
        stage = IngestStage(pool, store)
        counts: Counter[str] = Counter()
        clock = Clock(pids)
        clock.start()
        for i, items in enumerate(batches):
            for r in await stage.ingest(IngestBatch(TENANT, mailbox, items)):
                counts[r.outcome.value] += 1
            if i == 0 and analyze_dsn:
                await clock.paused(analyze_db(analyze_dsn))
        clock.stop()
        return clock, counts
    finally:
        await store.aclose()


# --------------------------------------------------------------------------- (d)

_D_BY_MID = """SELECT message_id, content_fingerprint FROM messages
 WHERE tenant_id = $1 AND message_id_norm = $2 AND content_fingerprint IS NOT NULL LIMIT 2"""
_D_BY_EXT = """SELECT message_id FROM message_copies
 WHERE tenant_id = $1 AND mailbox_id = $2 AND external_id = $3"""
_D_THREAD = """INSERT INTO threads (tenant_id, mailbox_id, external_thread_id, subject)
VALUES ($1, $2, $3, $4)
ON CONFLICT (tenant_id, mailbox_id, external_thread_id) DO UPDATE SET updated_at = now()
RETURNING thread_id, (xmax = 0) AS created"""
_D_MESSAGE = """INSERT INTO messages (
    tenant_id, mailbox_id, thread_id, external_id, direction, internet_message_id,
    message_id_norm, in_reply_to, "references", subject, subject_norm, from_address,
    from_name, sent_at, received_at, text_body, html_body, has_attachments,
    content_fingerprint, raw_sha256)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18,
        $19, $20)
RETURNING message_id"""
_D_PARTICIPANT = """INSERT INTO message_participants
    (tenant_id, message_id, role, position, address, display_name)
VALUES ($1, $2, $3, $4, $5, $6)"""
_D_COPY = """INSERT INTO message_copies (tenant_id, mailbox_id, external_id, message_id,
    labels, raw_sha256, received_at) VALUES ($1, $2, $3, $4, $5, $6, $7)"""
_D_THREAD_META = """UPDATE threads t
   SET message_count = t.message_count + 1,
       first_message_at = least(t.first_message_at, $3),
       last_message_at = greatest(t.last_message_at, $3),
       latest_message_id = CASE WHEN t.last_message_at IS NULL OR $3 >= t.last_message_at
                                THEN $4 ELSE t.latest_message_id END,
       participant_count = (SELECT count(DISTINCT p.address)
                              FROM messages m JOIN message_participants p
                                ON p.tenant_id = m.tenant_id AND p.message_id = m.message_id
                             WHERE m.tenant_id = $1 AND m.thread_id = $2 AND p.address <> ''),
       updated_at = now()
 WHERE t.tenant_id = $1 AND t.thread_id = $2"""
_D_EVENT = """INSERT INTO events (tenant_id, kind, mailbox_id, thread_id, message_id, payload)
VALUES ($1, $2, $3, $4, $5, $6::jsonb)"""


async def auxx_one(conn: asyncpg.Connection, m: MessageData) -> str:
    async with conn.transaction():
        hits = await conn.fetch(_D_BY_MID, TENANT, m.message_id_norm) if m.message_id_norm else []
        if await conn.fetchval(_D_BY_EXT, TENANT, MAILBOX, m.external_id) is not None:
            return "duplicate"
        agree = [r[0] for r in hits if r[1] == m.content_fingerprint]
        if agree:  # merged: one more copy row (does not happen with these messages)
            await conn.execute(
                _D_COPY,
                TENANT,
                MAILBOX,
                m.external_id,
                agree[0],
                m.labels,
                m.raw_sha256,
                m.received_at,
            )
            return "merged"
        tid, created = await conn.fetchrow(_D_THREAD, TENANT, MAILBOX, m.thread_key, m.subject)
        sender = m.from_ or Address("")
        mid = await conn.fetchval(
            _D_MESSAGE,
            TENANT,
            MAILBOX,
            tid,
            m.external_id,
            m.direction,
            m.internet_message_id,
            m.message_id_norm,
            m.in_reply_to,
            m.references,
            m.subject,
            m.subject_norm,
            sender.email,
            sender.name,
            m.sent_at,
            m.received_at,
            m.text,
            m.html,
            bool(m.attachments),
            m.content_fingerprint,
            m.raw_sha256,
        )
        await conn.executemany(
            _D_PARTICIPANT,
            [
                (TENANT, mid, role, pos, p.email, p.name)
                for role, people in _roles(m)
                for pos, p in enumerate(people)
            ],
        )
        await conn.execute(
            _D_COPY, TENANT, MAILBOX, m.external_id, mid, m.labels, m.raw_sha256, m.received_at
        )
        await conn.execute(_D_THREAD_META, TENANT, tid, m.sent_at, mid)
        if created:
            await conn.execute(_D_EVENT, TENANT, "thread.created", MAILBOX, tid, None, "{}")
        await conn.execute(
            _D_EVENT,
            TENANT,
            "message.created",
            MAILBOX,
            tid,
            mid,
            orjson.dumps({"external_id": m.external_id}).decode(),
        )
        return "conflict" if hits else "new"


async def run_auxx(
    dsn: str, messages: Sequence[MessageData], analyze_after: int
) -> tuple[Clock, Counter[str]]:
    conn = await asyncpg.connect(dsn)
    try:
        counts: Counter[str] = Counter()
        clock = Clock([await conn.fetchval("SELECT pg_backend_pid()")])
        clock.start()
        for i, m in enumerate(messages, 1):
            counts[await auxx_one(conn, m)] += 1
            if i == analyze_after:
                await clock.paused(analyze_db(dsn))
        clock.stop()
        return clock, counts
    finally:
        await conn.close()


# --------------------------------------------------------------------------- (e) raw MIME


def _charset(name: str, body_encoding: int | None) -> Charset:
    cs = Charset(name)
    cs.body_encoding = body_encoding
    return cs


def gen_raw(n: int, seed: int) -> list[bytes]:
    """n raw RFC 5322 messages, threads of 1-5, a corpus-like mix of shapes and charsets."""
    rng = random.Random(seed)
    crowd = _people(rng, 300)
    base = datetime(2024, 5, 1, tzinfo=UTC)
    out: list[tuple[datetime, bytes]] = []
    serial = 0
    while len(out) < n:
        size = min(rng.randint(1, 5), n - len(out))
        subject = " ".join(rng.choices(_WORDS, k=rng.randint(3, 8))).capitalize()
        customer, other = rng.sample(crowd, 2)
        sent = base + timedelta(seconds=rng.uniform(0, 30 * 86400))
        refs: list[str] = []
        for j in range(size):
            serial += 1
            sender, rcpt = (customer, OWNER) if j % 2 == 0 else (OWNER, customer)
            kind = rng.choices(
                ("plain", "alternative", "attachment", "legacy"), weights=(30, 30, 10, 30)
            )[0]
            paras = _paragraphs(rng, rng.randint(900, 2500))
            text = "\n\n".join(paras) + f"\n\nBest regards,\n{sender.name}\n"
            header_cs = "utf-8"
            if kind == "legacy":
                cs_name = rng.choice(tuple(_LEGACY))
                extra, enc = _LEGACY[cs_name]
                text = extra + "\n\n" + text + "\n" + extra + "\n"
                msg = MIMEText(text, "plain", _charset(cs_name, enc))  # type: ignore[arg-type]
                header_cs = cs_name
                subj = f"{extra[:24]} {subject}"
            else:
                enc = rng.choice((QP, BASE64, None))  # None = 8bit utf-8
                utf8 = _charset("utf-8", enc)
                if rng.random() < 0.3:
                    text = "Grüße – naïve café, ½ price ✓\n\n" + text
                plain = MIMEText(text, "plain", utf8)  # type: ignore[arg-type]
                if kind == "plain":
                    msg = plain
                else:
                    alt = MIMEMultipart("alternative")
                    alt.attach(plain)
                    alt.attach(MIMEText(_html_of(paras), "html", _charset("utf-8", QP)))  # type: ignore[arg-type]
                    msg = alt
                    if kind == "attachment":
                        mixed = MIMEMultipart("mixed")
                        mixed.attach(alt)
                        data = rng.randbytes(rng.randint(2_000, 30_000))
                        att = MIMEApplication(data, "pdf")
                        att.add_header(
                            "Content-Disposition", "attachment", filename=f"invoice-{serial}.pdf"
                        )
                        mixed.attach(att)
                        msg = mixed
                subj = subject
            if j:
                subj = "Re: " + subj
            msg["Subject"] = Header(subj, header_cs) if not subj.isascii() else subj
            msg["From"] = formataddr(
                (f"{sender.name} {_NAME_SUFFIX[header_cs]}".strip(), sender.email),
                charset=header_cs,
            )
            msg["To"] = formataddr((rcpt.name, rcpt.email))
            if rng.random() < 0.4:
                msg["Cc"] = formataddr((other.name, other.email))
            msg["Date"] = format_datetime(sent)
            mid = f"{rng.getrandbits(64):016x}.{serial}@{sender.email.rpartition('@')[2]}"
            msg["Message-ID"] = f"<{mid}>"
            if refs:
                msg["In-Reply-To"] = f"<{refs[-1]}>"
                msg["References"] = " ".join(f"<{r}>" for r in refs)
            msg["MIME-Version"] = "1.0"
            out.append((sent, msg.as_bytes()))
            refs.append(mid)
            sent += timedelta(seconds=rng.uniform(120, 86400))
    out.sort(key=lambda x: x[0])
    return [raw for _, raw in out]


def parse_chunk(raws: list[bytes], strip_raw: bool = False) -> list[MessageData | DeadItem]:
    """parse_raw over a chunk; in a worker process the raw bytes are not sent back."""
    out: list[MessageData | DeadItem] = []
    for raw in raws:
        item = parse_raw(raw, tenant_id=TENANT, mailbox_id="import", source="import")
        if strip_raw and isinstance(item, MessageData):
            item.raw = None
        out.append(item)
    return out


def _parse_chunk_stripped(raws: list[bytes]) -> list[MessageData | DeadItem]:
    return parse_chunk(raws, strip_raw=True)


def _reattach(items: list[MessageData | DeadItem], raws: list[bytes]) -> list:
    for item, raw in zip(items, raws, strict=True):
        if isinstance(item, MessageData):
            item.raw = raw
    return items


def _noop(x: int) -> int:
    return x


async def run_e2e(
    dsn: str,
    raws: list[bytes],
    chunk: int,
    store_dir: str,
    mode: str,
    *,
    executor: ProcessPoolExecutor | None = None,
    depth: int = 2,
    analyze: bool = True,
    where: str = "database",
) -> tuple[Clock, Counter[str]]:
    """parse_raw + ingest; parsing runs `depth` chunks ahead of the database work
    (except `inline`), in order, as `inboxd import` does."""
    chunks = [raws[i : i + chunk] for i in range(0, len(raws), chunk)]
    loop = asyncio.get_running_loop()

    def submit(ch: list[bytes]) -> Awaitable[list]:
        if mode == "thread":
            return asyncio.ensure_future(anyio.to_thread.run_sync(parse_chunk, ch))
        if mode == "anyio-process":
            return asyncio.ensure_future(anyio.to_process.run_sync(_parse_chunk_stripped, ch))
        assert executor is not None
        return loop.run_in_executor(executor, _parse_chunk_stripped, ch)

    pool, pids = await open_pool(dsn)
    try:
        stage = IngestStage(pool, open_store(pool, store_dir, where))
        counts: Counter[str] = Counter()
        clock = Clock(pids)
        clock.start()
        todo = deque(chunks)
        pending: deque[tuple[Awaitable[list], list[bytes]]] = deque()
        first = True
        while todo or pending:
            if mode == "inline":
                ch = todo.popleft()
                items = parse_chunk(ch)
            else:
                while todo and len(pending) < depth:
                    nxt = todo.popleft()
                    pending.append((submit(nxt), nxt))
                fut, ch = pending.popleft()
                items = await fut
                if mode != "thread":
                    _reattach(items, ch)
                if todo:
                    nxt = todo.popleft()
                    pending.append((submit(nxt), nxt))
            for r in await stage.ingest(IngestBatch(TENANT, "import", items)):
                counts[r.outcome.value] += 1
            if first and analyze:
                first = False
                await clock.paused(analyze_db(dsn))
        clock.stop()
        return clock, counts
    finally:
        await pool.close()


# --------------------------------------------------------------------------- clocks

_TICKS = os.sysconf("SC_CLK_TCK")


def backend_cpu(pids: Sequence[int]) -> float | None:
    """user+system CPU seconds of server backends (None when the server is not local)."""
    total = 0.0
    try:
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / _TICKS
    except (OSError, IndexError, ValueError):
        return None
    return total


class Clock:
    """Wall time, client CPU (this process, all threads) and server-backend CPU of the
    timed work only; `paused` keeps an awaitable (ANALYZE) off all three."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self.wall = self.client = 0.0
        self.server: float | None = 0.0
        self._mark: tuple[float, float, float | None] | None = None

    def start(self) -> None:
        self._mark = (time.perf_counter(), time.process_time(), backend_cpu(self.pids))

    def stop(self) -> None:
        assert self._mark is not None
        w0, c0, s0 = self._mark
        s1 = backend_cpu(self.pids)
        self.wall += time.perf_counter() - w0
        self.client += time.process_time() - c0
        if self.server is not None and s0 is not None and s1 is not None:
            self.server += s1 - s0
        else:
            self.server = None
        self._mark = None

    async def paused(self, work: Awaitable[object]) -> None:
        self.stop()
        await work
        self.start()


async def measure_rtt(dsn: str, n: int = 300) -> float:
    """Mean time of one `SELECT 1` round trip (after warm-up)."""
    conn = await asyncpg.connect(dsn)
    try:
        for _ in range(20):
            await conn.fetchval("SELECT 1")
        t0 = time.perf_counter()
        for _ in range(n):
            await conn.fetchval("SELECT 1")
        return (time.perf_counter() - t0) / n
    finally:
        await conn.close()


async def analyze_db(dsn: str) -> None:
    """What autovacuum does on a live server: statistics once the tables have rows.

    Without it, plans cached while the tables were empty (asyncpg prepared
    statements, foreign-key trigger queries) keep sequential scans for the rest of
    the run and every figure grows with the table instead of with the work.
    """
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("ANALYZE")
    finally:
        await conn.close()


# --------------------------------------------------------------------------- moto (S3)

# Loaded here, in the parent: moto's child only calls it between fork and exec.
try:
    _LIBC: ctypes.CDLL | None = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:
    _LIBC = None
_PR_SET_PDEATHSIG = 1  # prctl(2)


def _die_with_parent() -> None:
    """In moto's process before exec: SIGTERM when this script dies (as bench/ses.py), so
    a run killed by a deadline leaves no server behind. No allocation or import here."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def fake_aws_env() -> None:
    """Fake credentials for moto, for this process's botocore (tests/helpers/moto_server.py),
    and no profile or endpoint override of the user's."""
    fake = "testing"  # what moto accepts; no real credential is looked for
    os.environ.update(
        {
            "AWS_ACCESS_KEY_ID": fake,
            "AWS_SECRET_ACCESS_KEY": fake,
            "AWS_SECURITY_TOKEN": fake,
            "AWS_SESSION_TOKEN": fake,
            "AWS_DEFAULT_REGION": S3_REGION,
            "AWS_CONFIG_FILE": "/nonexistent/inboxd-bench-aws-config",
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/inboxd-bench-aws-credentials",
        }
    )
    for name in (
        "AWS_PROFILE",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_ENDPOINT_URL_SQS",
        "AWS_REGION",
    ):
        os.environ.pop(name, None)


class Moto:
    """moto's server (`python -m moto.server`) on a free loopback port, as
    tests/helpers/moto_server.py and bench/ses.py start it; its output goes to a file."""

    def __init__(self, log_path: Path) -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
            )

    async def ready(self) -> float:
        """Wait until moto answers; the seconds it took."""
        started = time.monotonic()
        while time.monotonic() - started < MOTO_START_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"moto exited with {self.proc.returncode}: {self.log_path.read_text()[-2000:]}"
                )
            if await anyio.to_thread.run_sync(self._probe):
                return time.monotonic() - started
            await anyio.sleep(0.1)
        raise RuntimeError(f"moto not answering after {MOTO_START_TIMEOUT_S:g} s")

    def _probe(self) -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=1.0)
        try:
            conn.request("GET", "/moto-api/data.json")
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()

    def cpu_s(self) -> float:
        """user+system CPU seconds of moto's process (all its threads), from /proc."""
        cpu = backend_cpu([self.proc.pid])
        return float("nan") if cpu is None else cpu

    def spec(self, prefix: str) -> dict[str, str]:
        """The `[object_store] kind = "s3"` fields of a store below `prefix` of the bucket."""
        return {
            "bucket": S3_BUCKET,
            "prefix": prefix,
            "endpoint_url": self.url,
            "region": S3_REGION,
        }

    async def create_bucket(self) -> None:
        import aioboto3  # ~0.5 s of imports, paid only when S3 is measured

        async with aioboto3.Session().client(
            "s3", endpoint_url=self.url, region_name=S3_REGION
        ) as client:
            await client.create_bucket(Bucket=S3_BUCKET)

    async def objects(self, prefix: str) -> tuple[int, int]:
        """(objects, bytes) moto holds below `prefix`: the PUTs a run made (every key of
        these runs is a distinct sha256)."""
        import aioboto3

        count = size = 0
        async with aioboto3.Session().client(
            "s3", endpoint_url=self.url, region_name=S3_REGION
        ) as client:
            pages = client.get_paginator("list_objects_v2").paginate(
                Bucket=S3_BUCKET, Prefix=prefix + "/"
            )
            async for page in pages:
                for obj in page.get("Contents", []):
                    count += 1
                    size += int(obj["Size"])
        return count, size

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(MOTO_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def run_puts(
    spec: Mapping[str, str], chunks: Sequence[Sequence[tuple[str, bytes, str]]]
) -> tuple[Clock, int]:
    """moto alone: the raw objects of the messages PUT by S3Store.put_many (16 at once), a
    chunk per call as ingest makes them; (clock, failed PUTs)."""
    store = open_object_store({"kind": "s3", **spec})  # without a pool: S3Store alone
    async with store:
        clock = Clock([])
        clock.start()
        failed = 0
        for chunk in chunks:
            failed += sum(1 for err in await store.put_many(chunk) if err is not None)
        clock.stop()
    clock.server = None
    return clock, failed


def moto_note(cpu: float, wall: float, objects: int) -> str:
    per = f", {cpu / objects * 1000:.2f} ms per PUT" if objects else ""
    return f"moto CPU {cpu:.2f}s ({cpu / wall:.0%} of a core){per}, {objects:,} objects in S3"


# --------------------------------------------------------------------------- databases


def _relay_pipe(src: socket.socket, dst: socket.socket, half: float) -> None:
    """Forward src -> dst, each chunk no earlier than `half` seconds after it arrived."""
    chunks: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()

    def send() -> None:
        while True:
            due, data = chunks.get()
            if not data:
                break
            if (wait := due - time.perf_counter()) > 0:
                time.sleep(wait)
            try:
                dst.sendall(data)
            except OSError:
                break
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        while data := src.recv(1 << 16):
            chunks.put((time.perf_counter() + half, data))
    except OSError:
        pass
    chunks.put((0.0, b""))
    sender.join()


def _relay_main(host: str, port: int, half: float, ready: Connection) -> None:
    """The delay relay's process: threads and time.sleep, for sub-millisecond delays
    that an event loop (epoll timeouts in whole milliseconds) cannot give."""
    listener = socket.create_server(("127.0.0.1", 0))
    ready.send(listener.getsockname()[1])
    while True:
        client, _ = listener.accept()
        upstream = socket.create_connection((host, port))
        for sock in (client, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=_relay_pipe, args=(a, b, half), daemon=True).start()


class DelayProxy:
    """A TCP relay (own process) that delays every chunk by rtt/2 in each direction.

    Simulates the round-trip time between an application host and its database
    (same-region cloud networks: ~0.2-1 ms) on a machine where both are local.
    Ordering and pipelining are kept: bytes are delayed, not throttled.
    """

    def __init__(self, host: str, port: int, rtt_s: float) -> None:
        self.host, self.port, self.half = host, port, rtt_s / 2
        self.listen_port = 0
        self._process: multiprocessing.Process | None = None

    async def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self._process = ctx.Process(
            target=_relay_main, daemon=True, args=(self.host, self.port, self.half, child)
        )
        self._process.start()
        self.listen_port = await anyio.to_thread.run_sync(parent.recv)

    async def close(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.join()


class Server:
    """Fresh databases on one server; all dropped at the end."""

    def __init__(self, dsn: str, keep: bool, rtt_ms: float = 0.0) -> None:
        self.dsn = dsn
        self.keep = keep
        self.created: list[str] = []
        self.rtt_ms = rtt_ms
        self.proxy: DelayProxy | None = None

    async def start(self) -> None:
        if self.rtt_ms > 0:
            parts = urlsplit(self.dsn)
            self.proxy = DelayProxy(
                parts.hostname or "127.0.0.1", parts.port or 5432, self.rtt_ms / 1000
            )
            await self.proxy.start()

    def dsn_of(self, name: str, *, direct: bool = False) -> str:
        """DSN of database `name`; through the delay proxy unless `direct`."""
        parts = urlsplit(self.dsn)._replace(path="/" + name)
        if self.proxy is not None and not direct:
            user = parts.netloc.rpartition("@")[0]
            parts = parts._replace(
                netloc=f"{user + '@' if user else ''}127.0.0.1:{self.proxy.listen_port}"
            )
        return urlunsplit(parts)

    async def fresh(
        self,
        tag: str,
        mailboxes: Sequence[tuple[str, str]] = ((MAILBOX, "gmail"),),
    ) -> str:
        name = f"bench_ingest_{os.getpid()}_{tag}"
        admin = await asyncpg.connect(self.dsn)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
            await admin.execute(f'CREATE DATABASE "{name}"')
        finally:
            await admin.close()
        self.created.append(name)
        conn = await asyncpg.connect(self.dsn_of(name, direct=True))
        try:
            await apply_schema(conn)
            for mailbox, provider in mailboxes:
                await ensure_mailbox(conn, TENANT, mailbox, provider=provider, address=OWNER.email)
        finally:
            await conn.close()
        await self.checkpoint()
        return self.dsn_of(name)

    async def checkpoint(self) -> None:
        """Flush dirty buffers so one measurement does not pay for the previous one."""
        admin = await asyncpg.connect(self.dsn)
        try:
            await admin.execute("CHECKPOINT")
        finally:
            await admin.close()

    async def drop_all(self) -> None:
        if self.proxy is not None:
            await self.proxy.close()
        if self.keep:
            print(f"kept databases: {', '.join(self.created)}")
            return
        admin = await asyncpg.connect(self.dsn)
        try:
            for name in self.created:
                await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()


async def summary(dsn: str) -> tuple:
    """Row counts and thread metadata totals: equal when two paths wrote the same rows."""
    conn = await asyncpg.connect(dsn)
    try:
        return tuple(
            await conn.fetchrow(
                "SELECT (SELECT count(*) FROM messages), (SELECT count(*) FROM threads), "
                "(SELECT count(*) FROM message_participants), "
                "(SELECT count(*) FROM message_copies), "
                "(SELECT count(*) FROM events), (SELECT sum(message_count) FROM threads), "
                "(SELECT sum(participant_count) FROM threads), "
                "(SELECT count(*) FROM threads t JOIN messages m ON m.tenant_id = t.tenant_id "
                "   AND m.message_id = t.latest_message_id "
                "   AND m.sent_at = t.last_message_at AND t.first_message_at <= t.last_message_at)"
            )
        )
    finally:
        await conn.close()


# --------------------------------------------------------------------------- output


def _moto_version() -> str:
    from importlib.metadata import version

    return version("moto")


def rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else float("inf")


def fmt_rate(x: float) -> str:
    return f"{x:,.0f}"


def verdict(value: float, target: float) -> str:
    return "ok" if value >= target else "MISSED"


HEADER = f"  {'':<50} {'msgs':>7} {'wall s':>8} {'msg/s':>9}  {'client CPU':>10} {'server CPU':>10}"


def row(label: str, n: int, clock: Clock, extra: str = "") -> str:
    server = f"{clock.server:>9.2f}s" if clock.server is not None else f"{'n/a':>10}"
    client = f"{clock.client:>9.2f}s" if clock.pids or clock.client else f"{'':>10}"
    return (
        f"  {label:<50} {n:>7,} {clock.wall:>8.3f} {fmt_rate(rate(n, clock.wall)):>9}  "
        f"{client} {server}  {extra}"
    ).rstrip()


def cpu_seconds(clock: Clock) -> float | None:
    """Client + server CPU of a timed path; None when the server's is unknown."""
    return None if clock.server is None else clock.client + clock.server


def ratio(name: str, value: float, target: float, fmt: str = ".2f") -> str:
    return f"{name} = {value:{fmt}} (target ≥ {target:g}: {verdict(value, target)})"


# --------------------------------------------------------------------------- main


async def main(args: argparse.Namespace) -> int:
    only = set(args.only.split(","))
    analyze = not args.no_analyze
    server = Server(args.dsn, args.keep, args.rtt_ms)
    await server.start()
    store_root = tempfile.mkdtemp(prefix="bench_ingest_store_")
    try:
        admin = await asyncpg.connect(args.dsn)
        version = await admin.fetchval("SHOW server_version")
        settings = dict(
            await admin.fetch(
                "SELECT name, setting || coalesce(unit, '') FROM pg_settings WHERE name IN "
                "('shared_buffers','synchronous_commit','fsync','max_wal_size','work_mem','jit')"
            )
        )
        await admin.close()
        shown = ", ".join(f"{k}={v}" for k, v in sorted(settings.items()))
        print(f"PostgreSQL {version} ({shown})")
        print(
            f"python {sys.version.split()[0]}, asyncpg {asyncpg.__version__}, "
            f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start"
        )
        rtts = [await measure_rtt(server.dsn_of("postgres", direct=True))]
        if args.rtt_ms:
            rtts.append(await measure_rtt(server.dsn_of("postgres")))
            print(
                f"every timed connection goes through a relay adding {args.rtt_ms:g} ms "
                "round-trip time (--rtt-ms)"
            )
        print(
            "measured round trip (SELECT 1): "
            + ", ".join(
                f"{label} {v * 1000:.3f} ms"
                for label, v in zip(("direct", "through the relay"), rtts, strict=False)
            )
        )
        print(
            "client CPU = this process (all threads); server CPU = the PostgreSQL backends "
            "serving the timed connections;\nANALYZE after the first batch "
            + (
                "(untimed, as autovacuum would on a live server)"
                if analyze
                else "disabled (--no-analyze)"
            )
        )
        if only & {"a", "b", "c", "d"}:
            await run_rows(args, server, store_root, analyze, only)
        if "e" in only:
            await run_raw(args, server, store_root, analyze)
        if PROBLEMS:
            print("\nFAILED: these figures are not measurements:", file=sys.stderr)
            for text in PROBLEMS:
                print(f"  {text}", file=sys.stderr)
            return 1
        return 0
    finally:
        await server.drop_all()
        shutil.rmtree(store_root, ignore_errors=True)


async def run_rows(
    args: argparse.Namespace, server: Server, store_root: str, analyze: bool, only: set[str]
) -> None:
    t0 = time.perf_counter()
    msgs = gen_messages(args.messages, args.seed)
    batches = [msgs[i : i + args.batch_size] for i in range(0, len(msgs), args.batch_size)]
    prepared = copy_rows(batches)
    n, n_rows = len(msgs), sum(cb.rows() for cb in prepared)
    print(
        f"\ngenerated {n:,} MessageData in {sum(len(cb.threads) for cb in prepared):,} threads "
        f"(1-5 messages); {n_rows:,} rows to write "
        f"({sum(len(cb.participants) for cb in prepared):,} participants); mean text "
        f"{statistics.mean(len(m.text or '') for m in msgs) / 1024:.1f} KB, "
        f"{sum(1 for m in msgs if m.html) / n:.0%} with HTML; batches of {args.batch_size} "
        f"({time.perf_counter() - t0:.1f} s, not timed)"
    )
    print("\nMessageData -> rows, each path on a fresh database:")
    print(HEADER)
    results: dict[str, float] = {}
    cpu: dict[str, float | None] = {}  # client + server CPU seconds of each path
    sums: dict[str, tuple] = {}
    if "a" in only:
        dsn = await server.fresh("a")
        clock = await run_copy(dsn, prepared, analyze)
        results["a"] = rate(n, clock.wall)
        cpu["a"] = cpu_seconds(clock)
        sums["a"] = await summary(dsn)
        expect_timed("(a)", clock)
        if sums["a"][0] != n:
            problem(f"(a) wrote {sums['a'][0]} messages, expected {n}")
        print(
            row(
                "(a) COPY ceiling (copy_records_to_table)",
                n,
                clock,
                f"{fmt_rate(rate(n_rows, clock.wall))} rows/s",
            )
        )
    if only & {"b", "c"}:
        dsn = await server.fresh("b")
        pool, pids = await open_pool(dsn)
        try:
            clock, counts = await run_cascade(
                pool, pids, batches, store_root, analyze_dsn=dsn if analyze else None
            )
            results["b"] = rate(n, clock.wall)
            cpu["b"] = cpu_seconds(clock)
            sums["b"] = await summary(dsn)
            expect_timed("(b)", clock)
            expect_outcomes("(b)", counts, n)
            print(
                row(
                    "(b) cascade, new messages",
                    n,
                    clock,
                    f"{fmt_rate(rate(n_rows, clock.wall))} rows/s  {dict(counts)}",
                )
            )
            if "c" in only:
                passes: list[Clock] = []
                for _ in range(args.resync_passes):
                    await server.checkpoint()
                    clock, counts = await run_cascade(pool, pids, batches, store_root)
                    expect_outcomes("(c) re-sync", counts, n, "duplicate")
                    expect_timed("(c)", clock)
                    passes.append(clock)
                best = min(passes, key=lambda c: c.wall)
                results["c"] = rate(n, best.wall)
                print(
                    row(
                        f"(c) cascade, re-sync (all duplicates), best of {len(passes)}",
                        n,
                        best,
                        "passes: "
                        + ", ".join(fmt_rate(rate(n, c.wall)) for c in passes)
                        + " msg/s",
                    )
                )
        finally:
            await pool.close()
    if "d" in only:
        dsn = await server.fresh("d")
        dm = msgs[: args.auxx_messages] if args.auxx_messages else msgs
        clock, counts = await run_auxx(dsn, dm, args.batch_size if analyze else 0)
        results["d"] = rate(len(dm), clock.wall)
        expect_timed("(d)", clock)
        expect_outcomes("(d)", counts, len(dm))
        if len(dm) == n:
            sums["d"] = await summary(dsn)
        print(
            row(
                "(d) per message: 1 transaction, ~11 round trips", len(dm), clock, f"{dict(counts)}"
            )
        )
    for k in ("b", "d"):
        if "a" in sums and k in sums:
            same = "same" if sums[k] == sums["a"] else f"DIFFERENT: {sums[k]}"
            if sums[k] != sums["a"]:
                problem(f"rows written by ({k}) differ from (a)'s")
            print(f"  rows written by ({k}) vs (a): {same}")
    if "a" in sums:
        print(
            "    (messages, threads, participants, copies, events, Σ message_count, "
            f"Σ participant_count, threads with a consistent latest message) = {sums['a']}"
        )
    out = []
    if {"a", "b"} <= set(results):
        out.append(ratio("b/a", results["b"] / results["a"], TARGET_B_OVER_A))
        cpu_a, cpu_b = cpu.get("a"), cpu.get("b")
        if cpu_a and cpu_b:
            # what the wall-time ratio tends to on an idle machine: (a) and (b) both
            # run client and server one after the other, so on a loaded one each
            # waits its turn for a core, (b) with its ~15 round trips per batch more
            # (bench/README.md, ingest.py "Measured")
            out.append(f"b/a by CPU (client + server) = {cpu_a / cpu_b:.2f}")
    if {"b", "d"} <= set(results):
        out.append(ratio("b/d", results["b"] / results["d"], TARGET_B_OVER_D, ".1f"))
    if "c" in results:
        out.append(
            f"c = {fmt_rate(results['c'])} msg/s (target ≥ {TARGET_C:,.0f}: "
            f"{verdict(results['c'], TARGET_C)})"
        )
        if "b" in results:
            out.append(f"c/b = {results['c'] / results['b']:.0f}")
    if "a" in results and "d" in results:
        out.append(f"a/d = {results['a'] / results['d']:.1f}")
    print("\n  ratios, same run: " + ";  ".join(out))


async def run_raw(args: argparse.Namespace, server: Server, store_root: str, analyze: bool) -> None:
    if args.no_s3:
        await _run_raw(args, server, store_root, analyze, None)
        return
    fake_aws_env()
    moto = Moto(Path(store_root) / "moto.log")
    try:
        await _run_raw(args, server, store_root, analyze, moto)
    finally:
        moto.stop()


async def _run_raw(
    args: argparse.Namespace, server: Server, store_root: str, analyze: bool, moto: Moto | None
) -> None:
    t0 = time.perf_counter()
    raws = gen_raw(args.raw_messages, args.seed + 1)
    n = len(raws)
    print(
        f"\ngenerated {n:,} raw RFC 5322 messages, mean "
        f"{statistics.mean(len(r) for r in raws) / 1024:.1f} KB "
        f"({time.perf_counter() - t0:.1f} s, not timed)"
    )
    print(
        f"raw MIME -> rows (import door: external id = raw sha256, raw bytes kept as the "
        f"daemon does: up to 64 KiB in PostgreSQL),\nchunks of {args.raw_batch} = one ingest "
        f"batch each, every "
        f"database fresh; worker-process CPU is not in 'client CPU':"
    )
    if moto is not None:
        started = await moto.ready()
        await moto.create_bucket()
        print(
            f"S3: moto {_moto_version()} server over HTTP on 127.0.0.1:{moto.port} (up in "
            f"{started:.1f} s, untimed), one bucket, the daemon's store for [object_store] "
            f'kind = "s3"\n(open_object_store; PUTs 16 at once); moto\'s CPU is in neither '
            "CPU column (--no-s3: no S3 rows):"
        )
    print(HEADER)
    chunks = [raws[i : i + args.raw_batch] for i in range(0, n, args.raw_batch)]
    boxes = ((MAILBOX, "gmail"), ("import", "import"))

    clock = Clock([])
    clock.start()
    parsed = [item for ch in chunks for item in parse_chunk(ch)]
    clock.stop()
    clock.server = None
    parse_rate = rate(n, clock.wall)
    dead = sum(1 for p in parsed if isinstance(p, DeadItem))
    expect_timed("(e) parse only", clock)
    if dead:
        problem(f"(e) parse_raw made {dead} dead items of generated (valid) messages")
    print(
        row(
            "parse_raw only, in this process (1 core)",
            n,
            clock,
            "baseline" + (f"; dead items: {dead}" if dead else ""),
        )
    )

    with ProcessPoolExecutor(max_workers=2) as ex:
        list(ex.map(_noop, range(4)))  # workers started outside the clock
        clock = Clock([])
        clock.start()
        for _ in ex.map(_parse_chunk_stripped, chunks):
            pass
        clock.stop()
        clock.server = None
    print(
        row(
            "parse_raw only, 2 worker processes",
            n,
            clock,
            f"{rate(n, clock.wall) / parse_rate:.2f}× parse-only",
        )
    )

    batches = [parsed[i : i + args.raw_batch] for i in range(0, n, args.raw_batch)]
    rates: dict[str, float] = {}
    variants = [
        ("files", "ingest only (pre-parsed), raw: one file each"),
        ("database", "ingest only (pre-parsed), raw: in PostgreSQL"),
    ]
    if moto is not None:
        variants += [
            ("puts", "S3 PUTs alone (S3Store.put_many), no ingest"),
            ("s3", "ingest only (pre-parsed), raw: one S3 object each"),
            ("s3-database", "ingest only (pre-parsed), raw: S3 + database tier"),
        ]
    variants.append(("none", "ingest only (pre-parsed), raw NOT stored"))
    moto_per_put: dict[str, float] = {}  # moto's CPU seconds per object it holds
    put_rates: dict[str, float] = {}  # objects PUT per second of the timed work
    for where, label in variants:
        if where == "puts":
            assert moto is not None
            objs = [
                (f"raw/{TENANT}/{item.raw_sha256}", item.raw, "message/rfc822")
                for item in parsed
                if isinstance(item, MessageData) and item.raw is not None
            ]
            m0 = moto.cpu_s()
            clock, failed = await run_puts(
                moto.spec(where),
                [objs[i : i + args.raw_batch] for i in range(0, len(objs), args.raw_batch)],
            )
            moto_cpu = moto.cpu_s() - m0
            stored, _ = await moto.objects(where)
            expect_timed(f"(e) {label}", clock)
            if failed or stored != len(objs):
                problem(f"(e) {label}: {failed} PUTs failed, {stored} of {len(objs)} in S3")
            rates[where] = put_rates[where] = rate(stored, clock.wall)
            if stored:
                moto_per_put[where] = moto_cpu / stored
            print(row(label, len(objs), clock, moto_note(moto_cpu, clock.wall, stored)))
            continue
        if where == "none":
            for item in parsed:
                if isinstance(item, MessageData):
                    item.raw = None
        dsn = await server.fresh(f"e_ingest_{where}", boxes)
        pool, pids = await open_pool(dsn)
        m0 = moto.cpu_s() if moto is not None else 0.0
        try:
            clock, counts = await run_cascade(
                pool,
                pids,
                batches,
                os.path.join(store_root, f"ingest_{where}"),
                mailbox="import",
                analyze_dsn=dsn if analyze else None,
                where="files" if where == "none" else where,
                s3=moto.spec(where) if moto is not None else None,
            )
        finally:
            await pool.close()
        expect_timed(f"(e) {label}", clock)
        expect_outcomes(f"(e) {label}", counts, n)
        rates[where] = rate(n, clock.wall)
        extra = f"{rate(n, clock.wall) / parse_rate:.2f}× parse-only  {dict(counts)}"
        if moto is not None and where.startswith("s3"):
            moto_cpu = moto.cpu_s() - m0
            stored, _ = await moto.objects(where)
            put_rates[where] = rate(stored, clock.wall)
            if stored:
                moto_per_put[where] = moto_cpu / stored
            extra += "  " + moto_note(moto_cpu, clock.wall, stored)
        print(row(label, n, clock, extra))
    ingest_rate = rates["database"]
    print(
        "  "
        + ratio(
            "stored in PostgreSQL ÷ not stored",
            rates["database"] / rates["none"],
            TARGET_STORED_OVER_NOT,
        )
        + f"; one file each ÷ not stored = {rates['files'] / rates['none']:.2f}"
    )
    if moto is not None:
        per_put = "/".join(
            f"{moto_per_put[k] * 1000:.2f}" for k in ("puts", "s3") if k in moto_per_put
        )
        print(
            "  "
            + ratio(
                "one S3 object each ÷ not stored",
                rates["s3"] / rates["none"],
                TARGET_STORED_OVER_NOT,
            )
            + f"; S3 + database tier ÷ not stored = {rates['s3-database'] / rates['none']:.2f}"
            + f"; its PUTs/s ÷ PUTs alone = {put_rates['s3'] / put_rates['puts']:.2f}"
            + (f"; moto CPU per PUT (alone/in ingest) {per_put} ms" if per_put else "")
        )
    del parsed, batches

    best = ("", 0.0)
    modes: list[tuple[str, str, int]] = [
        ("inline", "end to end: parse inline, no overlap", 0),
        ("thread", "end to end: parse in a thread (anyio.to_thread)", 0),
        ("process", "end to end: ProcessPoolExecutor(1)", 1),
        ("process", "end to end: ProcessPoolExecutor(2)", 2),
        ("anyio-process", "end to end: anyio.to_process (2 workers)", 0),
    ]
    for i, (mode, label, workers) in enumerate(modes):
        dsn = await server.fresh(f"e_{i}", boxes)
        store = os.path.join(store_root, f"e_{i}")
        if workers:
            with ProcessPoolExecutor(max_workers=workers) as ex:
                list(ex.map(_noop, range(workers * 2)))
                clock, counts = await run_e2e(
                    dsn,
                    raws,
                    args.raw_batch,
                    store,
                    mode,
                    executor=ex,
                    depth=workers + 1,
                    analyze=analyze,
                )
        elif mode == "anyio-process":
            async with anyio.create_task_group() as tg:  # start 2 workers outside the clock
                for _ in range(2):
                    tg.start_soon(anyio.to_process.run_sync, _noop, 0)
            clock, counts = await run_e2e(
                dsn, raws, args.raw_batch, store, mode, depth=3, analyze=analyze
            )
        else:
            clock, counts = await run_e2e(dsn, raws, args.raw_batch, store, mode, analyze=analyze)
        r = rate(n, clock.wall)
        expect_timed(f"(e) {label}", clock)
        expect_outcomes(f"(e) {label}", counts, n)
        if r > best[1]:
            best = (label, r)
        print(
            row(
                label,
                n,
                clock,
                f"{r / parse_rate:.2f}× parse-only, "
                f"{r / ingest_rate:.2f}× ingest-only  {dict(counts)}",
            )
        )
    print(
        f"\n  (e) best end to end = {fmt_rate(best[1])} msg/s ({best[0].split(': ', 1)[1]}) "
        f"(target ≥ {TARGET_E:,.0f}: {verdict(best[1], TARGET_E)}); beside parse-only "
        f"{fmt_rate(parse_rate)} msg/s and ingest-only {fmt_rate(ingest_rate)} msg/s"
    )


def cli() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=20_000)
    p.add_argument("--batch-size", type=int, default=1_000)
    p.add_argument(
        "--dsn",
        default=os.environ.get("INBOXD_BENCH_DSN", DEFAULT_DSN),
        help="admin DSN of the server; fresh bench_* databases are made there",
    )
    p.add_argument("--raw-messages", type=int, default=5_000, help="(e) raw MIME messages")
    p.add_argument("--raw-batch", type=int, default=500, help="(e) parse chunk = ingest batch")
    p.add_argument(
        "--auxx-messages", type=int, default=0, help="(d) only the first M messages (0 = all)"
    )
    p.add_argument("--resync-passes", type=int, default=3)
    p.add_argument("--only", default="a,b,c,d,e", help="comma list of a,b,c,d,e")
    p.add_argument("--seed", type=int, default=20240301)
    p.add_argument("--keep", action="store_true", help="keep the databases (for EXPLAIN)")
    p.add_argument(
        "--no-s3",
        action="store_true",
        help="(e) without the S3 rows (no moto server is started)",
    )
    p.add_argument(
        "--rtt-ms",
        type=float,
        default=0.0,
        help="add this round-trip time between client and server (TCP relay)",
    )
    p.add_argument(
        "--no-analyze",
        action="store_true",
        help="no ANALYZE after the first batch (plans stay those of empty tables)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help=f"CI size: {SMOKE_MESSAGES} messages in batches of {SMOKE_BATCH}, "
        f"{SMOKE_RAW_MESSAGES} raw, {SMOKE_RESYNC_PASSES} re-sync passes; every figure; "
        "exit 1 when any figure is not a measurement",
    )
    args = p.parse_args()
    if args.smoke:
        args.messages, args.batch_size = SMOKE_MESSAGES, SMOKE_BATCH
        args.raw_messages, args.raw_batch = SMOKE_RAW_MESSAGES, SMOKE_RAW_BATCH
        args.resync_passes = SMOKE_RESYNC_PASSES
    return anyio.run(main, args)


if __name__ == "__main__":
    sys.exit(cli())
