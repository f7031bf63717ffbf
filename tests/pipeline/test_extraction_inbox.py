"""The hand-off from ingest to extraction on a real server (pipeline/extraction/inbox.py):
which outcomes ingest notes, which rows a feeder takes, what its filter reads.

A feeder round is driven through its pipeline pieces (take → load_filter_fields →
matches_fields → enqueue), as daemon/extraction/feeder.py runs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from factories import message
from helpers.db import extraction_jobs
from helpers.plans import plan_nodes

from inboxd.adapters.extraction import ProcessorConfig, matches_fields, parse_processor
from inboxd.pipeline.extraction import claims, results
from inboxd.pipeline.extraction import inbox as extraction_inbox
from inboxd.pipeline.extraction.enqueue import EnqueueResult, enqueue
from inboxd.pipeline.extraction.inbox import HandOff, load_filter_fields, take
from inboxd.pipeline.ingest.stage import IngestBatch, IngestStage
from inboxd.pipeline.message import MessageData
from inboxd.pipeline.mime.parse import parse_raw
from inboxd.pipeline.objectstore.local import LocalDirectoryStore
from inboxd.pipeline.outbound import record_outbound
from inboxd.pipeline.outcomes import Outcome

T = "acme"
OTHER = "globex"
#: A corpus message with a Message-ID, so a second door's copy merges into its row.
PLAIN = "axllent-mailpit/plain-text.eml"
GMAIL_ID = "18c2f0a1b2c3d4e5"
MAILDIR_NAME = "1733540000.M1P2.host:2,S"
#: Rows per take, as the feeder's FEED_BATCH (daemon/extraction/feeder.py).
ROUND = 2000
LEASE_S = 60.0


def processor(processor_id: str, **extra: Any) -> ProcessorConfig:
    table = {
        "id": processor_id,
        "backend": "builtin",
        "schema": {"type": "object"},
        "schema_version": 1,
        "rules": {"n": {"attachment": "count"}},
        **extra,
    }
    return parse_processor(table, Path())


@pytest.fixture
def handing_over(pool: asyncpg.Pool, store: LocalDirectoryStore) -> IngestStage:
    """An ingest stage whose every tenant has processors: it notes rows in the inbox."""
    return IngestStage(pool, store, extraction=HandOff(wants=lambda _tenant: True))


def corpus_copy(corpus: Path, mailbox: str, external_id: str) -> MessageData:
    raw = (corpus / "mime" / PLAIN).read_bytes()
    item = parse_raw(raw, tenant_id=T, mailbox_id=mailbox, external_id=external_id)
    assert isinstance(item, MessageData)
    return item


async def ingest(
    stage: IngestStage, tenant: str, mailbox: str, item: MessageData
) -> tuple[Outcome, int | None]:
    [result] = await stage.ingest(IngestBatch(tenant, mailbox, [item]))
    return result.outcome, result.message_id


async def feed(
    pool: asyncpg.Pool, processors: Sequence[ProcessorConfig]
) -> dict[str, EnqueueResult]:
    """One feeder round over T's rows: what enqueue answered per processor."""
    results: dict[str, EnqueueResult] = {}
    async with pool.acquire() as conn, conn.transaction():
        taken = await take(conn, ROUND, tenant_ids=[T])
        for tenant, message_ids in taken.items():
            fields = await load_filter_fields(conn, tenant, message_ids)
            for p in processors:
                chosen = [f.message_id for f in fields if matches_fields(p, f)]
                if chosen:
                    results[p.id] = await enqueue(conn, tenant, p.id, "1", chosen)
    return results


#: `await jobs(pool)`: (processor, message, state) of every job.
jobs = partial(extraction_jobs, columns="processor_id, message_id, state", order_by="processor_id")


async def inbox_rows(pool: asyncpg.Pool) -> list[tuple[str, int]]:
    rows = await pool.fetch(
        "SELECT tenant_id, message_id FROM extraction_inbox ORDER BY tenant_id, message_id"
    )
    return [tuple(r) for r in rows]


async def test_a_copy_in_a_scoped_mailbox_reaches_its_processor_once(
    pool, handing_over, make_mailbox, corpus
) -> None:
    await make_mailbox(T, "gm", provider="gmail")
    await make_mailbox(T, "x", provider="maildir")
    everywhere, scoped = processor("everywhere"), processor("scoped", mailboxes=["x"])

    gmail = await ingest(handing_over, T, "gm", corpus_copy(corpus, "gm", GMAIL_ID))
    first = await feed(pool, [everywhere, scoped])
    # the processor that sees every mailbox extracts it from the Gmail copy
    (job,) = await claims.claim_due(pool, [T], "w", LEASE_S, 10)
    assert await results.complete(pool, job, {"n": 0})
    # the same raw delivered to the Maildir "x": one row, a second copy
    maildir = await ingest(handing_over, T, "x", corpus_copy(corpus, "x", MAILDIR_NAME))
    async with pool.acquire() as conn:
        [fields] = await load_filter_fields(conn, T, [gmail[1]])
    second = await feed(pool, [everywhere, scoped])

    assert gmail[0] is Outcome.NEW and maildir == (Outcome.MERGED, gmail[1])
    assert first["everywhere"].queued == [gmail[1]] and "scoped" not in first
    assert fields.mailbox_ids == ("gm", "x")  # the primary copy's first
    assert "scoped" in second and second["scoped"].queued == [gmail[1]]
    assert second["everywhere"].linked == [gmail[1]] and not second["everywhere"].queued
    assert await jobs(pool) == [
        ("everywhere", gmail[1], "completed"),
        ("scoped", gmail[1], "pending"),
    ]
    # one key, the Gmail copy's, whichever door's copy queued it
    assert set(await pool.fetchval("SELECT array_agg(dedup_key) FROM extraction_jobs")) == {
        f"gmail:gm:{GMAIL_ID}"
    }
    assert await inbox_rows(pool) == []


async def test_the_same_copy_again_is_not_handed_over(
    pool, handing_over, make_mailbox, corpus
) -> None:
    await make_mailbox(T, "gm", provider="gmail")
    outcome, message_id = await ingest(handing_over, T, "gm", corpus_copy(corpus, "gm", GMAIL_ID))
    await feed(pool, [processor("everywhere")])
    again = await ingest(handing_over, T, "gm", corpus_copy(corpus, "gm", GMAIL_ID))

    assert (outcome, again) == (Outcome.NEW, (Outcome.DUPLICATE, message_id))
    assert await inbox_rows(pool) == []


async def test_application_mail_synced_back_is_not_extracted(pool, handing_over, make_mailbox):
    await make_mailbox(T, "gm", provider="gmail", address="support@acme.test")
    async with pool.acquire() as conn:
        recorded = await record_outbound(
            conn,
            tenant_id=T,
            mailbox_id="gm",
            message_id_header="<out-1@acme.test>",
            placeholder_message_id="pending_abc",
            thread_id="pending_t1",
            from_address="support@acme.test",
            subject="Your order",
        )
    synced = message(
        mailbox="gm", mid="<out-1@acme.test>", external_id="gm-900", sender="support@acme.test"
    )
    outcome = await ingest(handing_over, T, "gm", synced)
    fed = await feed(pool, [processor("everywhere")])

    # merged into the application's row, handed over like any merge, never queued
    assert outcome == (Outcome.MERGED, recorded)
    assert fed == {}
    assert await jobs(pool) == []
    assert await inbox_rows(pool) == []


async def test_take_leaves_the_rows_of_other_tenants(pool, handing_over, make_mailbox) -> None:
    await make_mailbox(T, "inbox")
    await make_mailbox(OTHER, "inbox")
    ours = [await ingest(handing_over, T, "inbox", message(tenant=T)) for _ in range(2)]
    theirs = await ingest(handing_over, OTHER, "inbox", message(tenant=OTHER))

    async with pool.acquire() as conn, conn.transaction():
        taken = await take(conn, ROUND, tenant_ids=[T])
        none = await take(conn, ROUND, tenant_ids=[])

    assert taken == {T: sorted(m for _, m in ours)}
    assert none == {}
    # an import noted it before this daemon had processors for OTHER: it waits for one
    assert await inbox_rows(pool) == [(OTHER, theirs[1])]
    async with pool.acquire() as conn, conn.transaction():
        assert await take(conn, ROUND, tenant_ids=[OTHER, T]) == {OTHER: [theirs[1]]}


async def test_take_reads_the_oldest_rows_through_an_index(pool) -> None:
    """Not one sort of the whole inbox per round (300k rows: 275 ms a round): the
    order can come from extraction_inbox_created_idx, and the rows are deleted where
    the locking scan found them. Sequential scans and sorts are priced out, as a large
    inbox prices them: an empty table's plan would be a scan and a sort whatever the
    indexes, and with no index in take's order the sort stays."""
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("SET LOCAL enable_seqscan = off; SET LOCAL enable_sort = off")
        nodes = await plan_nodes(conn, extraction_inbox._TAKE, ROUND, [T, OTHER])

    assert not [n for n in nodes if "Sort" in n["Node Type"]]
    scans = {
        (n["Node Type"], n.get("Index Name"))
        for n in nodes
        if n.get("Relation Name") == "extraction_inbox" and n["Node Type"] != "ModifyTable"
    }
    assert scans == {("Index Scan", "extraction_inbox_created_idx"), ("Tid Scan", None)}
