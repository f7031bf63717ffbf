"""The hand-off from ingest to extraction on a real server (pipeline/extraction_inbox.py):
which rows a feeder takes, and how it finds them.
"""

from __future__ import annotations

import asyncpg
import pytest
from factories import message
from helpers.plans import plan_nodes

from inboxd.pipeline import extraction_inbox
from inboxd.pipeline.extraction_inbox import HandOff, take
from inboxd.pipeline.ingest import IngestBatch, IngestStage
from inboxd.pipeline.message import MessageData
from inboxd.pipeline.objectstore_local import LocalDirectoryStore
from inboxd.pipeline.outcomes import Outcome

T = "acme"
OTHER = "globex"
#: Rows per take, as the feeder's FEED_BATCH (daemon/extraction/feeder.py).
ROUND = 2000


@pytest.fixture
def handing_over(pool: asyncpg.Pool, store: LocalDirectoryStore) -> IngestStage:
    """An ingest stage whose every tenant has processors: it notes rows in the inbox."""
    return IngestStage(pool, store, extraction=HandOff(wants=lambda _tenant: True))


async def ingest(
    stage: IngestStage, tenant: str, mailbox: str, item: MessageData
) -> tuple[Outcome, int | None]:
    [result] = await stage.ingest(IngestBatch(tenant, mailbox, [item]))
    return result.outcome, result.message_id


async def inbox_rows(pool: asyncpg.Pool) -> list[tuple[str, int]]:
    rows = await pool.fetch(
        "SELECT tenant_id, message_id FROM extraction_inbox ORDER BY tenant_id, message_id"
    )
    return [tuple(r) for r in rows]


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
