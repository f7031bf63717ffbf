"""The extraction claim protocol on a real server (pipeline/extraction/; architecture §10).

Lease expiry and backoff ends are reached by moving the job's times into the
past with SQL, never by sleeping.
"""

from __future__ import annotations

import anyio
import anyio.lowlevel
import asyncpg
import orjson
import pytest
from factories import message
from helpers.plans import plan_nodes

from inboxd.pipeline.extraction import claims, results, review
from inboxd.pipeline.extraction.claims import ClaimedJob, JobState
from inboxd.pipeline.extraction.enqueue import enqueue
from inboxd.pipeline.ingest.stage import IngestBatch, IngestStage
from inboxd.pipeline.outcomes import Outcome

T = "acme"
P = "invoices"
V1 = "1"
LEASE_S = 60.0
TENANTS = [T]


@pytest.fixture
async def inbox(make_mailbox) -> tuple[str, str]:
    return await make_mailbox(T, "inbox", provider="import")


async def ingest(stage: IngestStage, mailbox: str, *items) -> list[tuple[Outcome, int]]:
    results = await stage.ingest(IngestBatch(T, mailbox, list(items)))
    return [(r.outcome, r.message_id) for r in results]


async def new_messages(stage: IngestStage, n: int, mailbox: str = "inbox") -> list[int]:
    results = await ingest(stage, mailbox, *(message(mailbox=mailbox) for _ in range(n)))
    assert all(outcome is Outcome.NEW for outcome, _ in results)
    return [message_id for _, message_id in results]


async def job_row(pool: asyncpg.Pool, job_id: int) -> asyncpg.Record:
    return await pool.fetchrow(
        "SELECT * FROM extraction_jobs WHERE tenant_id = $1 AND job_id = $2", T, job_id
    )


async def completed_events(pool: asyncpg.Pool) -> list[dict]:
    rows = await pool.fetch(
        "SELECT payload FROM events WHERE tenant_id = $1 AND kind = 'extraction.completed' "
        "ORDER BY event_id",
        T,
    )
    return [orjson.loads(r["payload"]) for r in rows]


async def expire(pool: asyncpg.Pool, job_id: int) -> None:
    """The lease ran out (or the backoff ended): as if its time had passed."""
    await pool.execute(
        "UPDATE extraction_jobs SET lease_expires_at = now() - interval '1 second', "
        "next_attempt_at = now() - interval '1 second' WHERE tenant_id = $1 AND job_id = $2",
        T,
        job_id,
    )


async def claim_one(pool: asyncpg.Pool, owner: str = "w1", **kw) -> ClaimedJob:
    jobs = await claims.claim_due(pool, TENANTS, owner, LEASE_S, 1, **kw)
    assert len(jobs) == 1, jobs
    return jobs[0]


# --- enqueue -----------------------------------------------------------------------------


async def test_enqueue_twice_is_one_job_per_message(pool, stage, inbox) -> None:
    ids = sorted(await new_messages(stage, 3))  # ingest may number a batch in any order
    first = await enqueue(pool, T, P, V1, ids)
    again = await enqueue(pool, T, P, V1, [*ids, 999_999])
    assert first.queued == ids and not first.linked and not first.conflicts
    assert again.queued == [] and again.linked == ids and again.missing == [999_999]
    assert await pool.fetchval("SELECT count(*) FROM extraction_jobs") == 3
    jobs = await pool.fetch("SELECT * FROM extraction_jobs ORDER BY message_id")
    assert [j["state"] for j in jobs] == ["pending"] * 3
    assert [j["dedup_key"] for j in jobs] == [
        f"mid:{k}"
        for k in await pool.fetchval(
            "SELECT array_agg(message_id_norm ORDER BY message_id) FROM messages"
        )
    ]


async def test_reused_message_id_with_other_content_is_a_payload_conflict(
    pool, stage, inbox
) -> None:
    [(o1, first)] = await ingest(stage, "inbox", message(mid="<same@x.org>", text="first body"))
    [(o2, second)] = await ingest(
        stage, "inbox", message(mid="<same@x.org>", text="another body", thread="t2")
    )
    assert (o1, o2) == (Outcome.NEW, Outcome.CONFLICT)  # the cascade keeps both rows
    assert (await enqueue(pool, T, P, V1, [first])).queued == [first]
    before = await pool.fetchrow("SELECT * FROM extraction_jobs")
    result = await enqueue(pool, T, P, V1, [second])
    assert result.conflicts == [second] and not result.queued and not result.linked
    assert await enqueue(pool, T, P, V1, [second]) == result  # recorded once, reported again
    after = await pool.fetchrow("SELECT * FROM extraction_jobs")
    assert dict(after) == dict(before)  # the original job is untouched
    conflicts = await pool.fetch("SELECT * FROM extraction_payload_conflicts")
    assert len(conflicts) == 1
    c = conflicts[0]
    fps = dict(await pool.fetch("SELECT message_id, content_fingerprint FROM messages"))
    assert (c["job_id"], c["existing_message_id"], c["new_message_id"]) == (
        before["job_id"],
        first,
        second,
    )
    assert (c["existing_fingerprint"], c["new_fingerprint"]) == (fps[first], fps[second])


async def test_conflict_inside_one_batch_is_detected(pool, stage, inbox) -> None:
    [(_, first)] = await ingest(stage, "inbox", message(mid="<dup@x.org>", text="one"))
    other = message(mid="<dup@x.org>", text="two", thread="t9")
    [(_, second)] = await ingest(stage, "inbox", other)
    result = await enqueue(pool, T, P, V1, [second, first])
    assert result.queued == [first] and result.conflicts == [second]


async def test_second_door_copy_of_an_extracted_message_is_linked(
    pool, stage, make_mailbox
) -> None:
    await make_mailbox(T, "gmail", provider="gmail")
    await make_mailbox(T, "maildir", provider="maildir")
    text = "Invoice 77, total 120.00 EUR"
    gmail_copy = message(mailbox="gmail", external_id="18c2f0a1b2", mid="<inv77@x.org>", text=text)
    maildir_copy = message(
        mailbox="maildir", external_id="1700000000.M1P2.host", mid="<inv77@x.org>", text=text
    )
    [(o1, gmail_id)] = await ingest(stage, "gmail", gmail_copy)
    assert (await enqueue(pool, T, P, V1, [gmail_id])).queued == [gmail_id]
    job = await claim_one(pool)
    assert job.dedup_key == "gmail:gmail:18c2f0a1b2"
    assert await results.complete(pool, job, {"number": "77"})
    [(o2, maildir_id)] = await ingest(stage, "maildir", maildir_copy)
    assert (o1, o2) == (Outcome.NEW, Outcome.MERGED) and maildir_id == gmail_id
    # whichever door queues it, the key is the message row's: linked, not re-extracted
    linked = await enqueue(pool, T, P, V1, [maildir_id])
    assert linked.linked == [gmail_id] and not linked.queued and not linked.conflicts
    assert await pool.fetchval("SELECT count(*) FROM extraction_jobs") == 1
    assert await claims.claim_due(pool, TENANTS, "w2", LEASE_S, 10) == []
    assert len(await completed_events(pool)) == 1


async def test_new_schema_version_re_extracts(pool, stage, inbox) -> None:
    [mid] = await new_messages(stage, 1)
    await enqueue(pool, T, P, V1, [mid])
    assert await results.complete(pool, await claim_one(pool), {"v": 1})
    assert (await enqueue(pool, T, P, "2", [mid])).queued == [mid]
    job = await claim_one(pool)
    assert (job.schema_version, job.message_id) == ("2", mid)
    assert await results.complete(pool, job, {"v": 2})
    rows = await pool.fetch(
        "SELECT schema_version, result FROM extraction_jobs ORDER BY schema_version"
    )
    assert [(r["schema_version"], orjson.loads(r["result"])) for r in rows] == [
        ("1", {"v": 1}),
        ("2", {"v": 2}),
    ]


# --- claims, fencing, completion ---------------------------------------------------------


async def test_the_longest_due_jobs_are_claimed_first_and_returned_by_id(
    pool, stage, inbox
) -> None:
    ids = await new_messages(stage, 3)
    await enqueue(pool, T, P, V1, ids)
    job_ids = [r["job_id"] for r in await pool.fetch("SELECT job_id FROM extraction_jobs")]
    for job_id, age_s in zip(sorted(job_ids), (60.0, 0.0, 3600.0), strict=True):
        await pool.execute(
            "UPDATE extraction_jobs SET next_attempt_at = next_attempt_at "
            "- make_interval(secs => $2) WHERE tenant_id = $1 AND job_id = $3",
            T,
            age_s,
            job_id,
        )
    claimed = await claims.claim_due(pool, TENANTS, "w", LEASE_S, 2)
    first, _, third = sorted(job_ids)
    assert [j.job_id for j in claimed] == [first, third]


async def test_a_claim_reads_the_due_index_in_order_without_sorting(pool) -> None:
    """Not one sort of the whole due backlog per claim (a job_id tiebreak did that:
    300k due jobs sharing a timestamp, 192 ms per claim of 100): the order can come
    from extraction_jobs_due_order_idx. Sequential scans and sorts are priced out, as a
    large backlog prices them: an empty table's plan would be a scan and a sort."""
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("SET LOCAL enable_seqscan = off; SET LOCAL enable_sort = off")
        nodes = await plan_nodes(
            conn, claims._CLAIM_DUE, TENANTS, P, "w", LEASE_S, 100, claims.MAX_ATTEMPTS, "1"
        )
    assert not [n["Node Type"] for n in nodes if "Sort" in n["Node Type"]]
    assert "extraction_jobs_due_order_idx" in {n.get("Index Name") for n in nodes}


async def test_two_workers_racing_claim_each_job_once(pool, db_dsn, stage, inbox) -> None:
    ids = await new_messages(stage, 30)
    await enqueue(pool, T, P, V1, ids)
    claimed: dict[str, list[int]] = {"a": [], "b": []}

    async def worker(owner: str) -> None:
        conn = await asyncpg.connect(db_dsn)
        try:
            while jobs := await claims.claim_due(conn, TENANTS, owner, LEASE_S, 2):
                claimed[owner].extend(j.job_id for j in jobs)
                await anyio.lowlevel.checkpoint()  # let the other worker in between claims
        finally:
            await conn.close()

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker, "a")
        tg.start_soon(worker, "b")
    everything = claimed["a"] + claimed["b"]
    assert len(everything) == 30 and len(set(everything)) == 30
    assert await pool.fetchval("SELECT count(*) FROM extraction_jobs WHERE lease_token = 1") == 30


async def test_one_claim_raced_by_two_workers_gives_one_result(pool, db_dsn, stage, inbox) -> None:
    [mid] = await new_messages(stage, 1)
    await enqueue(pool, T, P, V1, [mid])
    won: list[str] = []

    async def worker(owner: str) -> None:
        conn = await asyncpg.connect(db_dsn)
        try:
            for job in await claims.claim_due(conn, TENANTS, owner, LEASE_S, 1):
                if await results.complete(conn, job, {"by": owner}):
                    won.append(owner)
        finally:
            await conn.close()

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker, "a")
        tg.start_soon(worker, "b")
    assert len(won) == 1
    assert [e["result"] for e in await completed_events(pool)] == [{"by": won[0]}]


async def test_worker_past_its_lease_cannot_commit_and_the_reclaimer_stands(
    pool, stage, inbox
) -> None:
    [mid] = await new_messages(stage, 1)
    await enqueue(pool, T, P, V1, [mid])
    slow = await claim_one(pool, "slow")
    assert await claims.claim_due(pool, TENANTS, "other", LEASE_S, 1) == []  # held: pending
    await expire(pool, slow.job_id)
    # expired but not yet reclaimed: the late commit still changes nothing
    assert not await results.complete(pool, slow, {"by": "slow"})
    assert not await claims.renew(pool, slow, LEASE_S)
    reclaimer = await claim_one(pool, "other")
    assert reclaimer.token == slow.token + 1 and reclaimer.attempts == 2
    before = dict(await job_row(pool, slow.job_id))
    for late in (
        results.complete(pool, slow, {"by": "slow"}),
        claims.fail_terminal(pool, slow, "late"),
        claims.release(pool, slow),
    ):
        assert not await late
    assert await claims.fail_retryable(pool, slow, "late") is None
    assert dict(await job_row(pool, slow.job_id)) == before
    assert await results.complete(pool, reclaimer, {"by": "other"})
    assert not await results.complete(pool, slow, {"by": "slow"})
    row = await job_row(pool, slow.job_id)
    assert row["state"] == "completed" and orjson.loads(row["result"]) == {"by": "other"}
    assert row["lease_owner"] is None
    events = await completed_events(pool)
    assert [e["result"] for e in events] == [{"by": "other"}]
    assert events[0]["job_id"] == slow.job_id and events[0]["processor"] == P


async def test_completed_event_names_the_message_in_the_outbox(pool, stage, inbox) -> None:
    [mid] = await new_messages(stage, 1)
    await enqueue(pool, T, P, V1, [mid])
    job = await claim_one(pool)
    assert await results.complete(pool, job, {"total": "120.00"})
    event = await pool.fetchrow("SELECT * FROM events WHERE kind = 'extraction.completed'")
    thread = await pool.fetchval("SELECT thread_id FROM messages WHERE message_id = $1", mid)
    assert (event["message_id"], event["mailbox_id"], event["thread_id"]) == (mid, "inbox", thread)
    assert orjson.loads(event["payload"]) == {
        "job_id": job.job_id,
        "processor": P,
        "schema_version": V1,
        "dedup_key": job.dedup_key,
        "result": {"total": "120.00"},
    }


async def test_renew_keeps_the_claim(pool, stage, inbox) -> None:
    [mid] = await new_messages(stage, 1)
    await enqueue(pool, T, P, V1, [mid])
    job = await claim_one(pool)
    assert await claims.renew(pool, job, 600.0)
    assert await pool.fetchval(
        "SELECT lease_expires_at > now() + interval '500 seconds' FROM extraction_jobs"
    )


# --- failures ----------------------------------------------------------------------------


async def test_429_then_success_is_one_result(pool, stage, inbox) -> None:
    [mid] = await new_messages(stage, 1)
    await enqueue(pool, T, P, V1, [mid])
    job = await claim_one(pool)
    state = await claims.fail_retryable(pool, job, "429 Too Many Requests", retry_after_s=30.0)
    assert state is JobState.RETRY_WAIT
    row = await job_row(pool, job.job_id)
    wait_s = await pool.fetchval(
        "SELECT extract(epoch FROM next_attempt_at - updated_at) FROM extraction_jobs"
    )
    assert 30.0 <= wait_s <= 30.5  # Retry-After, above the first backoff step (≤ 4 s)
    assert row["lease_owner"] is None and row["last_error"] == "429 Too Many Requests"
    assert await claims.claim_due(pool, TENANTS, "w", LEASE_S, 1) == []  # not before Retry-After
    await expire(pool, job.job_id)
    again = await claim_one(pool)
    assert (again.token, again.attempts) == (2, 2)
    assert await results.complete(pool, again, {"ok": True})
    assert len(await completed_events(pool)) == 1
    assert await pool.fetchval("SELECT count(*) FROM extraction_jobs") == 1


def test_backoff_is_bounded_jittered_and_honours_retry_after() -> None:
    for attempts in range(1, 30):
        delay = claims.backoff_s(attempts)
        cap = min(claims.RETRY_MAX_S, claims.RETRY_BASE_S * 2 ** (attempts - 1))
        assert 0.0 <= delay <= cap
    assert claims.backoff_s(1, retry_after_s=120.0) >= 120.0
    assert claims.backoff_s(1, retry_after_s=10 * 86400.0) <= claims.RETRY_AFTER_MAX_S
    assert claims.backoff_s(1, retry_after_s=float("nan")) <= claims.RETRY_BASE_S


async def test_retryable_failures_exhausted_go_to_review(pool, stage, inbox) -> None:
    [mid] = await new_messages(stage, 1)
    await enqueue(pool, T, P, V1, [mid])
    job = await claim_one(pool, max_attempts=2)
    assert await claims.fail_retryable(pool, job, "503", max_attempts=2) is JobState.RETRY_WAIT
    await expire(pool, job.job_id)
    job = await claim_one(pool, max_attempts=2)
    assert await claims.fail_retryable(pool, job, "503", max_attempts=2) is JobState.NEEDS_REVIEW
    row = await job_row(pool, job.job_id)
    assert row["review_reason"] == "retries exhausted (2 attempts): 503"
    # an operational failure is never a duplicate or a conflict
    assert await pool.fetchval("SELECT count(*) FROM extraction_payload_conflicts") == 0


async def test_a_holder_that_died_on_its_last_attempt_goes_to_review(pool, stage, inbox) -> None:
    [mid] = await new_messages(stage, 1)
    await enqueue(pool, T, P, V1, [mid])
    job = await claim_one(pool, max_attempts=1)
    await expire(pool, job.job_id)
    assert await claims.claim_due(pool, TENANTS, "w2", LEASE_S, 1, max_attempts=1) == []
    row = await job_row(pool, job.job_id)
    assert row["state"] == "needs_review" and row["lease_owner"] is None
    assert "attempts exhausted (1)" in row["review_reason"]


async def test_terminal_failure_waits_for_a_deliberate_retry(pool, stage, inbox) -> None:
    [mid] = await new_messages(stage, 1)
    await enqueue(pool, T, P, V1, [mid])
    job = await claim_one(pool)
    assert await claims.fail_terminal(pool, job, "result does not validate: 'total' is required")
    row = await job_row(pool, job.job_id)
    assert row["state"] == "needs_review" and "'total' is required" in row["review_reason"]
    await expire(pool, job.job_id)  # whatever the clock says, it is not retried blindly
    assert await claims.claim_due(pool, TENANTS, "w", LEASE_S, 10) == []
    assert await review.retry(pool, T, job.job_id) is JobState.PENDING
    again = await claim_one(pool)
    assert (again.job_id, again.attempts, again.token) == (job.job_id, 1, 2)
    assert await results.complete(pool, again, {"total": "1"})
    # a completed result is never overwritten by a retry
    assert await review.retry(pool, T, job.job_id) is JobState.COMPLETED
    assert await review.retry(pool, T, 999_999) is None
    assert await review.retry(pool, "other-tenant", job.job_id) is None


async def test_release_hands_the_job_back_at_once(pool, stage, inbox) -> None:
    [mid] = await new_messages(stage, 1)
    await enqueue(pool, T, P, V1, [mid])
    job = await claim_one(pool)
    assert await claims.release(pool, job)
    row = await job_row(pool, job.job_id)
    assert (row["state"], row["attempts"], row["lease_owner"]) == ("pending", 0, None)
    again = await claim_one(pool, "w2")
    assert (again.token, again.attempts) == (2, 1)
    assert not await results.complete(pool, job, {})  # the released claim is fenced off


# --- backlog -----------------------------------------------------------------------------


async def test_backlog_counts_jobs_by_state(pool, stage, inbox) -> None:
    ids = await new_messages(stage, 4)
    await enqueue(pool, T, P, V1, ids)
    await enqueue(pool, T, "receipts", V1, ids[:1])
    done, failed, waiting = await claims.claim_due(pool, TENANTS, "w", LEASE_S, 3, processor_id=P)
    assert await results.complete(pool, done, {})
    assert await claims.fail_terminal(pool, failed, "bad")
    assert await claims.fail_retryable(pool, waiting, "timeout", retry_after_s=60.0)
    [invoices, receipts] = await review.backlog(pool, TENANTS)
    assert (invoices.processor_id, invoices.pending, invoices.running) == (P, 1, 0)
    assert (invoices.retry_wait, invoices.needs_review, invoices.due) == (1, 1, 1)
    assert invoices.oldest_due_s >= 0.0
    assert (receipts.processor_id, receipts.pending, receipts.due) == ("receipts", 1, 1)
    assert await review.backlog(pool, ["nobody"]) == []
