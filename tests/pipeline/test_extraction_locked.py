"""Row-lock claims for in-process backends (pipeline/extraction/locked.py), on a real server."""

from __future__ import annotations

import orjson
from factories import message

from inboxd.pipeline.extraction import claims, results
from inboxd.pipeline.extraction.enqueue import enqueue
from inboxd.pipeline.extraction.locked import LockedFailure, finish_locked, lock_due
from inboxd.pipeline.ingest.stage import IngestBatch

T = "acme"
P = "rules"


async def queued(pool, stage, make_mailbox, n: int) -> list[int]:
    await make_mailbox(T, "inbox", provider="import")
    results = await stage.ingest(IngestBatch(T, "inbox", [message() for _ in range(n)]))
    ids = [r.message_id for r in results]
    assert len((await enqueue(pool, T, P, "1", ids)).queued) == n
    return ids


async def rows(pool) -> list:
    return await pool.fetch(
        "SELECT job_id, state, attempts, result, review_reason, lease_owner "
        "FROM extraction_jobs ORDER BY job_id"
    )


async def test_two_transactions_lock_disjoint_jobs_and_each_completes_its_own(
    pool, stage, make_mailbox
) -> None:
    await queued(pool, stage, make_mailbox, 6)
    async with pool.acquire() as a, pool.acquire() as b:
        tx_a, tx_b = a.transaction(), b.transaction()
        await tx_a.start()
        await tx_b.start()
        first = await lock_due(a, T, P, 4)
        second = await lock_due(b, T, P, 4)  # skips a's locked rows, never waits for them
        assert len(first) == 4 and len(second) == 2
        assert not {j.job_id for j in first} & {j.job_id for j in second}
        # one after the other: the tenant's event writes are serialised until commit
        await finish_locked(a, T, [(j, {"by": "a"}) for j in first])
        await tx_a.commit()
        await finish_locked(b, T, [(j, {"by": "b"}) for j in second])
        await tx_b.commit()
    got = await rows(pool)
    assert [r["state"] for r in got] == ["completed"] * 6
    assert sorted(orjson.loads(r["result"])["by"] for r in got) == ["a"] * 4 + ["b"] * 2
    assert {r["attempts"] for r in got} == {1}
    events = await pool.fetchval("SELECT count(*) FROM events WHERE kind = 'extraction.completed'")
    assert events == 6


async def test_a_rolled_back_round_leaves_the_jobs_as_they_were(pool, stage, make_mailbox) -> None:
    await queued(pool, stage, make_mailbox, 2)
    async with pool.acquire() as conn:
        tx = conn.transaction()
        await tx.start()
        jobs = await lock_due(conn, T, P, 10)
        await finish_locked(conn, T, [(jobs[0], {"x": 1})], [(jobs[1], LockedFailure("no", True))])
        await tx.rollback()  # a crash or a cancellation before the commit
    got = await rows(pool)
    assert [(r["state"], r["attempts"]) for r in got] == [("pending", 0), ("pending", 0)]
    assert (
        await pool.fetchval("SELECT count(*) FROM events WHERE kind = 'extraction.completed'") == 0
    )


async def test_failures_go_to_review_or_retry_and_spent_attempts_to_review(
    pool, stage, make_mailbox
) -> None:
    await queued(pool, stage, make_mailbox, 3)
    await pool.execute(
        "UPDATE extraction_jobs SET attempts = $1 - 1 WHERE job_id = "
        "(SELECT max(job_id) FROM extraction_jobs)",
        claims.MAX_ATTEMPTS,
    )
    async with pool.acquire() as conn, conn.transaction():
        terminal, retryable, last = await lock_due(conn, T, P, 10)
        states = await finish_locked(
            conn,
            T,
            [],
            [
                (terminal, LockedFailure("field total: 'abc' is not a number", True)),
                (retryable, LockedFailure("internal error: KeyError", False)),
                (last, LockedFailure("internal error: KeyError", False)),
            ],
        )
    assert states == {
        terminal.job_id: "needs_review",
        retryable.job_id: "retry_wait",
        last.job_id: "needs_review",
    }
    got = {r["job_id"]: r for r in await rows(pool)}
    assert got[terminal.job_id]["review_reason"] == "field total: 'abc' is not a number"
    assert got[last.job_id]["review_reason"].startswith("retries exhausted")
    async with pool.acquire() as conn, conn.transaction():
        assert await lock_due(conn, T, P, 10) == []  # retry_wait is not due yet


async def test_a_leased_claim_is_not_locked_and_its_fencing_still_holds(
    pool, stage, make_mailbox
) -> None:
    await queued(pool, stage, make_mailbox, 1)
    [leased] = await claims.claim_due(pool, [T], "http-worker", 60.0, 1)
    async with pool.acquire() as conn, conn.transaction():
        assert await lock_due(conn, T, P, 10) == []  # running with a live lease: not due
    assert await results.complete(pool, leased, {"by": "lease"})
