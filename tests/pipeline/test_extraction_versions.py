"""A processor's schema_version changes: runners claim only their version's jobs, and
the jobs still waiting under another version are carried over, never run under the
wrong label and never left behind (pipeline/extraction/versions.py)."""

from __future__ import annotations

from functools import partial

import pytest
from factories import message
from helpers.db import extraction_jobs

from inboxd.pipeline.extraction import claims, results
from inboxd.pipeline.extraction.enqueue import enqueue
from inboxd.pipeline.extraction.locked import lock_due
from inboxd.pipeline.extraction.versions import carry_over
from inboxd.pipeline.ingest.stage import IngestBatch, IngestStage
from inboxd.pipeline.outcomes import Outcome

T = "acme"
P = "invoices"
LEASE_S = 60.0


@pytest.fixture
async def inbox(make_mailbox) -> tuple[str, str]:
    return await make_mailbox(T, "inbox", provider="import")


async def new_messages(stage: IngestStage, n: int) -> list[int]:
    results = await stage.ingest(IngestBatch(T, "inbox", [message() for _ in range(n)]))
    assert all(r.outcome is Outcome.NEW for r in results)
    return [r.message_id for r in results]


#: `await jobs(pool)`: (message, schema_version, state, attempts) of every job of T.
jobs = partial(
    extraction_jobs,
    columns="message_id, schema_version, state, attempts",
    order_by="message_id, schema_version",
    tenant=T,
)


async def test_a_runner_claims_only_the_jobs_of_its_schema_version(pool, stage, inbox) -> None:
    old, new = await new_messages(stage, 2)
    await enqueue(pool, T, P, "1", [old])
    await enqueue(pool, T, P, "2", [new])
    claimed = await claims.claim_due(
        pool, [T], "w", LEASE_S, 10, processor_id=P, schema_version="2"
    )
    assert [(j.message_id, j.schema_version) for j in claimed] == [(new, "2")]
    async with pool.acquire() as conn, conn.transaction():
        assert await lock_due(conn, T, P, 10, schema_version="2") == []  # v2 is leased
        [locked] = await lock_due(conn, T, P, 10, schema_version="1")
        assert locked.message_id == old


async def test_waiting_jobs_of_an_old_version_move_to_the_new_one(pool, stage, inbox) -> None:
    pending, retrying, crashed, done = await new_messages(stage, 4)
    await enqueue(pool, T, P, "1", [pending, retrying, crashed, done])
    by_message = {j.message_id: j for j in await claims.claim_due(pool, [T], "w", LEASE_S, 10)}
    await claims.fail_retryable(pool, by_message[retrying], "HTTP 503")
    assert await results.complete(pool, by_message[done], {"total": "1"})
    await claims.release(pool, by_message[pending])
    # the holder of `crashed` died: its lease ran out
    await pool.execute(
        "UPDATE extraction_jobs SET lease_expires_at = now() - interval '1 second' "
        "WHERE tenant_id = $1 AND message_id = $2",
        T,
        crashed,
    )
    carried = await carry_over(pool, T, P, "2")
    assert len(carried.moved) == 3 and carried.superseded == []
    assert await jobs(pool) == sorted(  # by message id: ingest may number them in any order
        [
            (pending, "2", "pending", 0),
            (retrying, "2", "pending", 0),
            (crashed, "2", "pending", 0),
            (done, "1", "completed", 1),  # a result is history: it stays where it is
        ]
    )
    claimed = await claims.claim_due(
        pool, [T], "w", LEASE_S, 10, processor_id=P, schema_version="2"
    )
    assert sorted(j.message_id for j in claimed) == sorted([pending, retrying, crashed])
    assert (await carry_over(pool, T, P, "2")).moved == []  # nothing waits any more


async def test_a_job_held_by_a_live_lease_of_the_old_version_is_left_alone(
    pool, stage, inbox
) -> None:
    [mid] = await new_messages(stage, 1)
    await enqueue(pool, T, P, "1", [mid])
    [held] = await claims.claim_due(pool, [T], "old-daemon", LEASE_S, 1)
    carried = await carry_over(pool, T, P, "2")
    assert (carried.moved, carried.superseded) == ([], [])
    assert await results.complete(pool, held, {"v": 1})  # its holder still commits, as v1


async def test_an_old_job_whose_key_is_queued_under_the_new_version_is_superseded(
    pool, stage, inbox
) -> None:
    [mid] = await new_messages(stage, 1)
    await enqueue(pool, T, P, "1", [mid])
    await enqueue(pool, T, P, "2", [mid])  # the feeder, after the bump, for the same mail
    carried = await carry_over(pool, T, P, "2")
    assert carried.moved == [] and len(carried.superseded) == 1
    assert await jobs(pool) == [(mid, "1", "needs_review", 0), (mid, "2", "pending", 0)]
    reason = await pool.fetchval(
        "SELECT review_reason FROM extraction_jobs WHERE schema_version = '1'"
    )
    assert reason.startswith("superseded by job ") and reason.endswith("(schema_version 2)")


async def test_carry_over_keeps_the_payload_conflicts_of_the_job(pool, stage, inbox) -> None:
    [first] = [
        r.message_id
        for r in await stage.ingest(
            IngestBatch(T, "inbox", [message(mid="<same@x.org>", text="first")])
        )
    ]
    [second] = [
        r.message_id
        for r in await stage.ingest(
            IngestBatch(T, "inbox", [message(mid="<same@x.org>", text="other", thread="t2")])
        )
    ]
    await enqueue(pool, T, P, "1", [first, second])
    assert await pool.fetchval("SELECT count(*) FROM extraction_payload_conflicts") == 1
    assert len((await carry_over(pool, T, P, "2")).moved) == 1
    assert await pool.fetchval("SELECT count(*) FROM extraction_payload_conflicts") == 1
    assert await jobs(pool) == [(first, "2", "pending", 0)]


async def test_two_old_versions_of_one_key_move_once(pool, stage, inbox) -> None:
    [mid] = await new_messages(stage, 1)
    await enqueue(pool, T, P, "1", [mid])
    await enqueue(pool, T, P, "2", [mid])
    carried = await carry_over(pool, T, P, "3")
    assert len(carried.moved) == 1 and len(carried.superseded) == 1
    # the older job (v1) moves; the v2 one is superseded by it
    assert sorted((v, s) for _, v, s, _ in await jobs(pool)) == [
        ("2", "needs_review"),
        ("3", "pending"),
    ]
