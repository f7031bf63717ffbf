"""Backfill, listing and deliberate retry of extraction jobs on a real server
(pipeline/extraction/backfill.py, pipeline/extraction/review.py)."""

from __future__ import annotations

from functools import partial

import asyncpg
import pytest
from factories import message
from helpers.db import extraction_jobs

from inboxd.pipeline.extraction import claims
from inboxd.pipeline.extraction.backfill import (
    BackfillReport,
    BackfillScope,
    backfill_batch,
    count_scope,
)
from inboxd.pipeline.extraction.claims import JobState
from inboxd.pipeline.extraction.enqueue import enqueue
from inboxd.pipeline.extraction.inbox import FilterFields
from inboxd.pipeline.extraction.locked import lock_due
from inboxd.pipeline.extraction.review import list_conflicts, list_jobs, retry_job
from inboxd.pipeline.ingest.stage import IngestBatch, IngestStage
from inboxd.pipeline.outcomes import Outcome

T = "acme"
P = "invoices"
SCOPE = BackfillScope(T, P, "2")
VENDOR = "billing@vendor.example"
LEASE_S = 60.0


def from_vendor(fields: FilterFields) -> bool:
    return fields.sender == VENDOR


@pytest.fixture
async def mailboxes(make_mailbox) -> None:
    await make_mailbox(T, "inbox")
    await make_mailbox(T, "other")


async def ingest(stage: IngestStage, mailbox: str, *senders: str) -> list[int]:
    results = await stage.ingest(
        IngestBatch(T, mailbox, [message(mailbox=mailbox, sender=s) for s in senders])
    )
    assert all(r.outcome is Outcome.NEW for r in results)
    return [r.message_id for r in results]


async def backfill_all(
    pool: asyncpg.Pool, scope: BackfillScope, limit: int, after_id: int = 0
) -> tuple[BackfillReport, int]:
    """Every batch until none is left: the merged report and how many batches ran."""
    report, batches = BackfillReport(), 0
    while (
        batch := await backfill_batch(
            pool, scope, report.last_message_id or after_id, limit, from_vendor
        )
    ).examined:
        report.merge(batch)
        batches += 1
    return report, batches


#: `await jobs(pool)`: (message, processor, schema_version, state) of every job.
jobs = partial(
    extraction_jobs,
    columns="message_id, processor_id, schema_version, state",
    order_by="message_id, schema_version",
)


async def test_backfill_queues_what_the_filter_takes_batch_by_batch(pool, stage, mailboxes) -> None:
    ids = await ingest(stage, "inbox", VENDOR, "x@other.example", VENDOR, VENDOR, "y@o.example")
    vendor = sorted([ids[0], ids[2], ids[3]])

    report, batches = await backfill_all(pool, SCOPE, limit=2)
    again, _ = await backfill_all(pool, SCOPE, limit=500)

    assert batches == 3
    assert (report.examined, report.queued, report.not_matching) == (5, 3, 2)
    assert (report.linked, report.conflicts, report.missing) == (0, 0, 0)
    assert report.last_message_id == max(ids)
    assert await jobs(pool) == [(m, P, "2", "pending") for m in vendor]
    # run again from the start: every match is linked, nothing queued twice
    assert (again.queued, again.linked, again.not_matching) == (0, 3, 2)
    assert len(await jobs(pool)) == 3


async def test_resume_after_an_id_and_a_new_schema_version_requeues(pool, stage, mailboxes) -> None:
    ids = sorted(await ingest(stage, "inbox", VENDOR, VENDOR, VENDOR))  # backfill order

    first = await backfill_batch(pool, SCOPE, 0, 1, from_vendor)
    rest, _ = await backfill_all(pool, SCOPE, 500, after_id=first.last_message_id or 0)
    v3, _ = await backfill_all(pool, BackfillScope(T, P, "3"), 500)

    assert (first.examined, first.queued, first.last_message_id) == (1, 1, ids[0])
    assert (rest.examined, rest.queued, rest.linked) == (2, 2, 0)
    assert v3.queued == 3  # a new schema_version is a new key: history again
    assert [(m, v) for m, _, v, _ in await jobs(pool)] == [(m, v) for m in ids for v in ("2", "3")]


async def test_scope_is_the_mailbox_and_received_mail_only(pool, stage, mailboxes) -> None:
    inbox = await ingest(stage, "inbox", VENDOR, VENDOR)
    other = await ingest(stage, "other", VENDOR, VENDOR)
    # Mail the application sends is never noted by ingest, so never backfilled either.
    await pool.execute(
        "UPDATE messages SET send_status = 'sent' WHERE tenant_id = $1 AND message_id = $2",
        T,
        other[1],
    )
    scope = BackfillScope(T, P, "2", mailbox_id="other")

    assert await count_scope(pool, scope, 0) == 1
    assert await count_scope(pool, SCOPE, 0) == 3
    assert await count_scope(pool, SCOPE, max(inbox)) == 1
    report, _ = await backfill_all(pool, scope, 500)
    assert (report.examined, report.queued) == (1, 1)
    assert [m for m, *_ in await jobs(pool)] == [other[0]]


async def test_a_mailbox_scope_takes_mail_whose_first_copy_was_elsewhere(
    pool, stage, make_mailbox
) -> None:
    await make_mailbox(T, "gm", provider="gmail")
    await make_mailbox(T, "x", provider="maildir")
    copies = [
        message(
            mailbox=mailbox,
            external_id=external_id,
            mid="<inv7@vendor.example>",
            sender=VENDOR,
            text="Invoice 7",
        )
        for mailbox, external_id in (("gm", "18c2f0a1b2"), ("x", "1700000000.M1P2.host"))
    ]
    [first] = await stage.ingest(IngestBatch(T, "gm", copies[:1]))
    [second] = await stage.ingest(IngestBatch(T, "x", copies[1:]))
    scope = BackfillScope(T, P, "2", mailbox_id="x")

    assert (first.outcome, second.outcome) == (Outcome.NEW, Outcome.MERGED)
    assert await count_scope(pool, scope, 0) == 1
    report, _ = await backfill_all(pool, scope, 500)
    assert (report.examined, report.queued) == (1, 1)
    assert await jobs(pool) == [(first.message_id, P, "2", "pending")]


async def test_a_reused_message_id_with_other_content_is_a_conflict(pool, stage, mailboxes) -> None:
    first = await stage.ingest(IngestBatch(T, "inbox", [message(mid="<r@x>", sender=VENDOR)]))
    second = await stage.ingest(
        IngestBatch(T, "inbox", [message(mid="<r@x>", sender=VENDOR, text="other", thread="t2")])
    )
    assert second[0].outcome is Outcome.CONFLICT

    report, _ = await backfill_all(pool, SCOPE, 500)

    assert (report.queued, report.conflicts) == (1, 1)
    conflicts, total = await list_conflicts(pool, T)
    assert total == 1
    (c,) = conflicts
    assert (c.existing_message_id, c.new_message_id) == (first[0].message_id, second[0].message_id)
    assert (c.processor_id, c.schema_version, c.dedup_key) == (P, "2", "mid:r@x")
    assert await list_conflicts(pool, T, processor_id="receipts") == ([], 0)
    await pool.execute("UPDATE extraction_payload_conflicts SET resolved_at = now()")
    assert await list_conflicts(pool, T) == ([], 0)  # resolved ones are not listed


async def test_list_jobs_newest_first_by_state_and_processor(pool, stage, mailboxes) -> None:
    ids = await ingest(stage, "inbox", VENDOR, VENDOR, VENDOR)
    await enqueue(pool, T, P, "1", ids)
    await enqueue(pool, T, "receipts", "1", ids[:1])
    [job] = await claims.claim_due(pool, [T], "w", LEASE_S, 1, processor_id=P)
    assert await claims.fail_terminal(pool, job, "result does not validate: total")

    everything, total = await list_jobs(pool, T)
    review, review_total = await list_jobs(pool, T, state=JobState.NEEDS_REVIEW)
    limited, limited_total = await list_jobs(pool, T, processor_id=P, limit=1)

    assert total == 4 and [j.job_id for j in everything] == sorted(
        (j.job_id for j in everything), reverse=True
    )
    assert review_total == 1
    (r,) = review
    assert (r.job_id, r.state, r.attempts) == (job.job_id, JobState.NEEDS_REVIEW, 1)
    assert r.review_reason == "result does not validate: total"
    assert (r.processor_id, r.schema_version, r.mailbox_id) == (P, "1", "inbox")
    assert limited_total == 3 and len(limited) == 1 and limited[0].processor_id == P
    assert await list_jobs(pool, "globex") == ([], 0)


async def test_retry_job_tells_a_requeue_from_a_job_left_alone(pool, stage, mailboxes) -> None:
    ids = await ingest(stage, "inbox", VENDOR, VENDOR)
    await enqueue(pool, T, P, "1", ids)
    [job] = await claims.claim_due(pool, [T], "w", LEASE_S, 1)
    assert await claims.fail_terminal(pool, job, "bad")
    waiting = await pool.fetchval(
        "SELECT job_id FROM extraction_jobs WHERE job_id <> $1", job.job_id
    )

    requeued = await retry_job(pool, T, job.job_id)
    left = await retry_job(pool, T, waiting)

    assert (requeued.previous, requeued.retried) == (JobState.NEEDS_REVIEW, True)
    assert (left.previous, left.retried) == (JobState.PENDING, False)
    assert (await retry_job(pool, T, 999_999)).previous is None
    assert (await retry_job(pool, "globex", job.job_id)).previous is None
    row = await pool.fetchrow(
        "SELECT state, attempts, review_reason FROM extraction_jobs WHERE job_id = $1", job.job_id
    )
    assert tuple(row) == ("pending", 0, None)


async def test_new_mail_is_claimed_before_a_backfill_queued_earlier(pool, stage, mailboxes) -> None:
    history = await ingest(stage, "inbox", VENDOR, VENDOR, VENDOR)
    report, _ = await backfill_all(pool, SCOPE, 500)
    assert report.queued == 3
    [today] = await ingest(stage, "inbox", VENDOR)
    await enqueue(pool, T, P, "2", [today])  # the feeder, for mail that just arrived
    first = await claims.claim_due(pool, [T], "w", LEASE_S, 1, processor_id=P)
    async with pool.acquire() as conn, conn.transaction():
        [locked] = await lock_due(conn, T, P, 1)  # the builtin runners' order too
    assert [j.message_id for j in first] == [today]
    assert locked.message_id in history
    rest = await claims.claim_due(pool, [T], "w", LEASE_S, 10, processor_id=P)
    assert sorted(j.message_id for j in rest) == sorted(history)
