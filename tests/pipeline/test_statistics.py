"""The ingest stage keeps the planner's statistics in step with a backfill."""

from __future__ import annotations

import pytest
from factories import message

from inboxd.pipeline.ingest.stage import IngestBatch, IngestStage
from inboxd.pipeline.statistics import ANALYZE_MIN_ROWS


async def reltuples(pool) -> float:
    return float(
        await pool.fetchval("SELECT reltuples FROM pg_class WHERE oid = 'messages'::regclass")
    )


@pytest.mark.own_database  # counts on the planner's statistics of new tables
async def test_a_backfill_analyzes_the_ingest_tables_once_they_have_rows(
    pool, stage: IngestStage, make_mailbox
) -> None:
    await make_mailbox("acme", "inbox")
    assert await reltuples(pool) <= 0  # never analyzed: plans would assume an empty table
    batch = [message(external_id=f"m-{n}") for n in range(ANALYZE_MIN_ROWS - 1)]
    await stage.ingest(IngestBatch("acme", "inbox", batch))
    assert await reltuples(pool) <= 0  # below the threshold: nothing yet

    more = [message(external_id=f"n-{n}") for n in range(10)]
    await stage.ingest(IngestBatch("acme", "inbox", more))
    assert await reltuples(pool) >= ANALYZE_MIN_ROWS  # the planner sees the rows now

    again = [message(external_id=f"m-{n}") for n in range(ANALYZE_MIN_ROWS)]
    await stage.ingest(IngestBatch("acme", "inbox", again))  # duplicates store nothing
    assert await reltuples(pool) < ANALYZE_MIN_ROWS + 20
