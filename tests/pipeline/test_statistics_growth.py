"""A backfill ANALYZEs the ingest tables once per tenfold growth, not at every half.

The ANALYZEs run inside the ingest path (the next batch waits for them); at a
growth of half the table a 20,000-message backfill paid for seven of them, 19 % of
bench/ingest.py (b). The planner only needs the order of magnitude.
"""

from __future__ import annotations

import pytest
from factories import message

from inboxd.pipeline.ingest.stage import IngestBatch, IngestStage
from inboxd.pipeline.statistics import ANALYZE_MIN_ROWS

#: Items per ingest call: the daemon's pages are of this order (bench/ingest.py's batches).
BATCH = 1_000


async def analyzed_rows(pool) -> float:
    """What the planner believes `messages` holds: the row count of its last ANALYZE."""
    return float(
        await pool.fetchval("SELECT reltuples FROM pg_class WHERE oid = 'messages'::regclass")
    )


async def store_new(stage: IngestStage, count: int, prefix: str) -> None:
    for start in range(0, count, BATCH):
        batch = [
            message(external_id=f"{prefix}-{n}", thread=f"{prefix}-t{n // 3}")
            for n in range(start, min(count, start + BATCH))
        ]
        results = await stage.ingest(IngestBatch("acme", "inbox", batch))
        assert {r.outcome.value for r in results} == {"new"}


@pytest.mark.slow  # ~5,000 messages through the stage
@pytest.mark.own_database  # counts on the planner's statistics of new tables
async def test_a_backfill_reanalyzes_when_the_table_is_ten_times_larger_not_before(
    pool, stage: IngestStage, make_mailbox
) -> None:
    await make_mailbox("acme", "inbox")
    await store_new(stage, ANALYZE_MIN_ROWS, "first")
    first_rows = ANALYZE_MIN_ROWS
    # the first ANALYZE: plans leave the empty table
    assert await analyzed_rows(pool) == first_rows

    # Three times the rows (the old rule, +50 %, ANALYZEd on the way): the planner
    # still has the first count, which it scales by the table's size in pages.
    await store_new(stage, 2 * first_rows, "more")
    assert await analyzed_rows(pool) == first_rows

    # Ten times the rows of the last ANALYZE: the statistics catch up.
    await store_new(stage, 7 * first_rows - 1, "most")
    assert await analyzed_rows(pool) == first_rows
    await store_new(stage, 1, "tenfold")
    assert await analyzed_rows(pool) == 10 * first_rows
