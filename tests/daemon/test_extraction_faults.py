"""The extraction stage against faults (daemon/extraction/): a reload that changes
nothing, a result PostgreSQL cannot store, a revoked token that comes back, a load
that fails, two outcomes of one job, rows of a tenant without processors.

In-process, real PostgreSQL, FakeParseApi over HTTP; waits are conditions with
deadlines, never sleeps.
"""

from __future__ import annotations

import asyncpg
import pytest
from extraction_rig import (
    DEADLINE_S,
    T,
    all_in,
    builtin,
    completed_events,
    http,
    ingest_raws,
    jobs,
    raw_mail,
    running,
    states,
    tenant,
)
from fakes.parse_api import Answer, FakeParseApi, Received
from helpers import eventually

import inboxd.adapters.extraction.http as http_backend
import inboxd.daemon.extraction.gate as gate_module
import inboxd.daemon.extraction.locked_runner as locked_runner_module
import inboxd.daemon.extraction.runner as runner_module
from inboxd.daemon.config.tenant import TenantConfig
from inboxd.daemon.extraction.outcomes import LOST, Done, write_outcomes
from inboxd.pipeline.extraction import claims
from inboxd.pipeline.extraction.enqueue import enqueue
from inboxd.pipeline.extraction.inbox import note_new


@pytest.fixture(autouse=True)
def parse_token(monkeypatch) -> None:
    monkeypatch.setenv("TEST_PARSE_TOKEN", "s3cret")


async def test_reload_with_the_same_config_keeps_calls_in_flight(
    pool, store, make_mailbox, tmp_path
) -> None:
    await make_mailbox(T, "inbox", provider="import")
    async with FakeParseApi() as api:
        api.hold = True
        tenants = tenant(tmp_path, http(tmp_path, api.url))
        async with running(pool, store, tenants) as (stage, ingest):
            await ingest_raws(ingest, [raw_mail(1)])
            await eventually(lambda: len(api.received), DEADLINE_S, what="the call")
            before = stage.runners[(T, "parser")]
            stage.reload(tenant(tmp_path, http(tmp_path, api.url)))  # parsed anew, equal
            assert stage.runners[(T, "parser")] is before
            api.answer = Answer.json(200, {"order": "A-1"})
            api.hold = False
            api.release_held()
            await eventually(
                lambda: states(pool), DEADLINE_S, what="done", until=all_in("completed", 1)
            )
            # a changed config does restart it
            stage.reload(tenant(tmp_path, http(tmp_path, api.url, concurrency=3)))
            assert stage.runners[(T, "parser")] is not before
    assert len(api.received) == 1


async def test_a_result_with_a_nul_goes_to_review_and_the_others_commit(
    pool, store, make_mailbox, tmp_path
) -> None:
    await make_mailbox(T, "inbox", provider="import")

    def answer(received: Received) -> Answer:
        order = "bad\u0000" if b"Order A-2" in received.raw_mime else "good"
        return Answer.json(200, {"order": order})

    async with FakeParseApi() as api:
        api.answer = answer
        async with running(pool, store, tenant(tmp_path, http(tmp_path, api.url))) as (_, ingest):
            await ingest_raws(ingest, [raw_mail(i) for i in range(4)])
            await eventually(
                lambda: states(pool),
                DEADLINE_S,
                what="3 completed, 1 in review",
                until=lambda got: sorted(got) == ["completed"] * 3 + ["needs_review"],
            )
    rows = await jobs(pool)
    (review,) = [r for r in rows if r["state"] == "needs_review"]
    assert "NUL" in review["review_reason"]
    assert len(api.received) == 4  # nothing was called twice
    assert [e["result"]["order"] for e in await completed_events(pool)] == ["good"] * 3


async def test_a_revoked_token_pauses_the_processor_then_it_resumes(
    pool, store, make_mailbox, tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(http_backend, "UNAUTHORIZED_RETRY_AFTER_S", 0.5)
    await make_mailbox(T, "inbox", provider="import")
    async with FakeParseApi() as api:
        api.script = [Answer.json(401, {"error": "token revoked"})]
        api.answer = Answer.json(200, {"order": "A-1"})
        processor = http(tmp_path, api.url, concurrency=1)
        async with running(pool, store, tenant(tmp_path, processor)) as (_, ingest):
            await ingest_raws(ingest, [raw_mail(1)])
            await eventually(
                lambda: states(pool), DEADLINE_S, what="done", until=all_in("completed", 1)
            )
    (job,) = await jobs(pool)
    assert job["attempts"] == 1  # the refused call was not charged to the message
    assert len(api.received) == 2


async def test_an_endpoint_down_pauses_the_processor_instead_of_charging_the_backlog(
    pool, store, make_mailbox, tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(gate_module, "ENDPOINT_PAUSE_MIN_S", 3600.0)  # no probe in this test
    await make_mailbox(T, "inbox", provider="import")
    async with FakeParseApi() as api:
        api.answer = Answer.json(503, {"error": "upstream down"})
        processor = http(tmp_path, api.url, concurrency=4)
        async with running(pool, store, tenant(tmp_path, processor)) as (_, ingest):
            await ingest_raws(ingest, [raw_mail(i) for i in range(20)])
            settled = await eventually(
                lambda: states(pool),
                DEADLINE_S,
                what="the held jobs given back",
                until=lambda got: (
                    len(got) == 20
                    and "running" not in got
                    and got.count("retry_wait") >= gate_module.PAUSE_AFTER_FAILURES
                ),
            )
    # the calls made until it tripped were charged (a caller whose call failed before
    # the third failure took another job); the rest of the backlog was not walked into
    # the outage (without the pause all 20 are charged within a second)
    assert len(api.received) <= processor.concurrency + gate_module.PAUSE_AFTER_FAILURES - 1
    assert settled.count("retry_wait") == len(api.received)
    assert settled.count("pending") == 20 - len(api.received)


async def test_a_429_with_retry_after_pauses_then_everything_completes(
    pool, store, make_mailbox, tmp_path
) -> None:
    await make_mailbox(T, "inbox", provider="import")
    async with FakeParseApi() as api:
        api.script = [Answer.json(429, {"error": "slow down"}, **{"Retry-After": "1"})]
        api.answer = Answer.json(200, {"order": "A-1"})
        processor = http(tmp_path, api.url, concurrency=1)
        async with running(pool, store, tenant(tmp_path, processor)) as (_, ingest):
            await ingest_raws(ingest, [raw_mail(i) for i in range(5)])
            await eventually(
                lambda: states(pool), DEADLINE_S, what="done", until=all_in("completed", 5)
            )
    assert len(api.received) == 6  # one call refused, then one each
    assert sorted(j["attempts"] for j in await jobs(pool)) == [1, 1, 1, 1, 2]
    assert api.received[1].at - api.received[0].at >= 1.0  # nothing sent before Retry-After


async def test_a_load_that_fails_charges_the_attempt_and_is_retried(
    pool, store, make_mailbox, tmp_path, monkeypatch
) -> None:
    await make_mailbox(T, "inbox", provider="import")
    real = runner_module.load_messages
    # two: with two rounds side by side, the round that finds the job after the first
    # failure's rollback fails as well, so the job is charged before it can complete
    failures = [RuntimeError("parse worker died"), RuntimeError("parse worker died")]

    async def flaky(*args, **kwargs):
        if failures:
            raise failures.pop()
        return await real(*args, **kwargs)

    monkeypatch.setattr(runner_module, "load_messages", flaky)
    monkeypatch.setattr(locked_runner_module, "load_messages", flaky)
    async with running(pool, store, tenant(tmp_path, builtin(tmp_path))) as (_, ingest):
        await ingest_raws(ingest, [raw_mail(1)])
        # the failed load went to retry_wait (backoff ≤ 4 s), then the job completed
        await eventually(
            lambda: states(pool), DEADLINE_S * 2, what="done", until=all_in("completed", 1)
        )
    (job,) = await jobs(pool)
    assert job["attempts"] >= 2  # a failed load was charged: a poison message is bounded
    assert not failures


async def test_two_outcomes_of_one_job_keep_the_newest_claims(pool, stage, make_mailbox) -> None:
    await make_mailbox(T, "inbox", provider="import")
    [(_, message_id)] = await ingest_raws(stage, [raw_mail(1)])
    assert (await enqueue(pool, T, "orders", "1", [message_id])).queued == [message_id]
    [stale] = await claims.claim_due(pool, [T], "a", 30.0, 1)
    await pool.execute("UPDATE extraction_jobs SET next_attempt_at = now() - interval '1 s'")
    [fresh] = await claims.claim_due(pool, [T], "a", 30.0, 1)
    assert fresh.job_id == stale.job_id and fresh.token > stale.token
    fates = await write_outcomes(
        pool, [(stale, Done({"order": "stale"})), (fresh, Done({"order": "fresh"}))]
    )
    assert fates[(stale.job_id, stale.token)] == LOST
    assert fates[(fresh.job_id, fresh.token)] == "completed"
    assert [e["result"] for e in await completed_events(pool)] == [{"order": "fresh"}]


async def test_rows_of_a_tenant_without_processors_wait_for_one(
    pool, store, stage, make_mailbox, tmp_path
) -> None:
    await make_mailbox(T, "inbox", provider="import")
    await make_mailbox("other", "inbox", provider="import")
    [(_, message_id)] = await ingest_raws(stage, [raw_mail(1)])
    async with pool.acquire() as conn:
        await note_new(conn, T, [message_id])  # e.g. noted by an import that read a newer file
    other = TenantConfig("other", "Other", tmp_path / "other.toml", processors=(builtin(tmp_path),))
    async with running(pool, store, {"other": other}) as (s, _):
        await s.feeder.feed_once()
        assert await pool.fetchval("SELECT count(*) FROM extraction_inbox") == 1
        s.reload(tenant(tmp_path, builtin(tmp_path)))  # the processor arrives
        await eventually(
            lambda: states(pool), DEADLINE_S, what="done", until=all_in("completed", 1)
        )


async def test_many_builtin_processors_on_a_small_pool_never_starve_it(
    db_dsn, store, make_mailbox, tmp_path
) -> None:
    """Each locked round holds a connection while it loads on another: with eight
    processors (sixteen rounds) on a pool of four, unbounded rounds would all hold
    one and wait for one more, forever."""
    await make_mailbox(T, "inbox", provider="import")
    processors = [builtin(tmp_path, id=f"orders{i}") for i in range(8)]
    async with asyncpg.create_pool(db_dsn, min_size=1, max_size=4) as small:
        async with running(small, store, tenant(tmp_path, *processors)) as (_, ingest):
            await ingest_raws(ingest, [raw_mail(i) for i in range(20)])
            await eventually(
                lambda: states(small),
                DEADLINE_S,
                what="160 completed",
                until=all_in("completed", 160),
            )
