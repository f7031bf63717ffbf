"""The daemon's extraction stage in-process (daemon/extraction/): ingest hands new rows
over through the inbox, the feeder queues jobs by filter, runners extract and commit.

Real PostgreSQL and object store; the http backend talks to FakeParseApi over HTTP.
Waiting is on conditions with deadlines (helpers.eventually), never on sleeps.
"""

from __future__ import annotations

from extraction_rig import (
    DEADLINE_S,
    T,
    all_in,
    builtin,
    completed_events,
    http,
    ingest_raws,
    jobs,
    parsed,
    raw_mail,
    running,
    states,
    tenant,
)
from fakes.parse_api import Answer, FakeParseApi
from helpers import eventually

from inboxd.pipeline.extraction.enqueue import enqueue
from inboxd.pipeline.ingest.stage import IngestBatch, IngestStage
from inboxd.pipeline.outcomes import Outcome


async def test_new_mail_becomes_one_result_and_one_event_each(
    pool, store, make_mailbox, tmp_path
) -> None:
    await make_mailbox(T, "inbox", provider="import")
    async with running(pool, store, tenant(tmp_path, builtin(tmp_path))) as (_, ingest):
        outcomes = await ingest_raws(ingest, [raw_mail(i) for i in range(5)])
        assert [o for o, _ in outcomes] == [Outcome.NEW] * 5
        await eventually(
            lambda: states(pool), DEADLINE_S, what="5 completed", until=all_in("completed", 5)
        )
        # the same bytes again: duplicates, never extracted twice
        assert [o for o, _ in await ingest_raws(ingest, [raw_mail(0)])] == [Outcome.DUPLICATE]
    events = await completed_events(pool)
    assert sorted(e["result"]["order"] for e in events) == [f"A-{i}" for i in range(5)]
    assert {e["message_id"] for e in events} == {m for _, m in outcomes}
    assert all(e["result"]["sender"].endswith("@vendor.example") for e in events)
    assert await pool.fetchval("SELECT count(*) FROM extraction_inbox") == 0
    assert {r["lease_owner"] for r in await jobs(pool)} == {None}


async def test_filter_queues_only_matching_mail_of_its_mailboxes(
    pool, store, make_mailbox, tmp_path
) -> None:
    await make_mailbox(T, "inbox", provider="import")
    await make_mailbox(T, "other", provider="import")
    processor = builtin(tmp_path, mailboxes=["inbox"], filter={"subjects": ["order a-*"]})
    async with running(pool, store, tenant(tmp_path, processor)) as (_, ingest):
        await ingest_raws(ingest, [raw_mail(1), raw_mail(2, subject="Newsletter")])
        await ingest_raws(ingest, [raw_mail(3, tag="B")], mailbox="other")
        await ingest_raws(ingest, [raw_mail(4, tag="A")], mailbox="other")
        await eventually(
            lambda: states(pool), DEADLINE_S, what="1 completed", until=all_in("completed", 1)
        )
        await eventually(
            lambda: pool.fetchval("SELECT count(*) FROM extraction_inbox"),
            DEADLINE_S,
            what="inbox drained",
            until=lambda n: n == 0,
        )
    assert [e["result"]["order"] for e in await completed_events(pool)] == ["A-1"]


async def test_message_id_reuse_with_other_content_is_a_payload_conflict(
    pool, store, make_mailbox, tmp_path
) -> None:
    await make_mailbox(T, "inbox", provider="import")
    async with running(pool, store, tenant(tmp_path, builtin(tmp_path))) as (_, ingest):
        await ingest_raws(ingest, [raw_mail(1)])
        await eventually(
            lambda: states(pool), DEADLINE_S, what="completed", until=all_in("completed", 1)
        )
        reused = raw_mail(1, body="a different body under the same Message-ID")
        assert [o for o, _ in await ingest_raws(ingest, [reused])] == [Outcome.CONFLICT]
        await eventually(
            lambda: pool.fetchval("SELECT count(*) FROM extraction_payload_conflicts"),
            DEADLINE_S,
            what="payload conflict",
            until=lambda n: n == 1,
        )
    assert len(await jobs(pool)) == 1
    assert len(await completed_events(pool)) == 1


async def test_schema_invalid_result_goes_to_needs_review_once(
    pool, store, make_mailbox, tmp_path
) -> None:
    await make_mailbox(T, "inbox", provider="import")
    async with running(pool, store, tenant(tmp_path, builtin(tmp_path))) as (_, ingest):
        await ingest_raws(ingest, [raw_mail(1, subject="No order number here")])
        await eventually(
            lambda: states(pool), DEADLINE_S, what="needs_review", until=all_in("needs_review", 1)
        )
    (job,) = await jobs(pool)
    assert job["attempts"] == 1
    assert "order" in job["review_reason"]
    assert await completed_events(pool) == []


async def test_http_429_then_success_is_one_result(
    pool, store, make_mailbox, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("TEST_PARSE_TOKEN", "s3cret")
    await make_mailbox(T, "inbox", provider="import")
    async with FakeParseApi() as api:
        api.answer = Answer.json(429, {"error": "slow down"}, **{"Retry-After": "1"})
        processor = http(tmp_path, api.url)
        async with running(pool, store, tenant(tmp_path, processor)) as (_, ingest):
            await ingest_raws(ingest, [raw_mail(1)])
            await eventually(
                lambda: states(pool), DEADLINE_S, what="retry_wait", until=all_in("retry_wait", 1)
            )
            api.answer = Answer.json(200, {"order": "A-1"})
            await eventually(
                lambda: states(pool), DEADLINE_S, what="completed", until=all_in("completed", 1)
            )
    assert len(api.received) == 2
    assert api.received[0].authorization == "Bearer s3cret"
    assert api.received[1].raw_mime == raw_mail(1)
    assert [e["result"] for e in await completed_events(pool)] == [{"order": "A-1"}]


async def test_cancelled_stage_releases_the_claims_it_holds(
    pool, store, make_mailbox, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("TEST_PARSE_TOKEN", "s3cret")
    await make_mailbox(T, "inbox", provider="import")
    async with FakeParseApi() as api:
        api.hold = True  # the endpoint never answers: the jobs stay running
        processor = http(tmp_path, api.url, concurrency=2)
        async with running(pool, store, tenant(tmp_path, processor)) as (_, ingest):
            await ingest_raws(ingest, [raw_mail(i) for i in range(3)])
            await eventually(
                lambda: len(api.received), DEADLINE_S, what="2 calls", until=lambda n: n == 2
            )
    rows = await jobs(pool)
    assert [r["state"] for r in rows] == ["pending"] * 3
    assert {r["lease_owner"] for r in rows} == {None}
    assert {r["attempts"] for r in rows} == {0}


async def test_unauthorized_releases_without_charging_and_pauses(
    pool, store, make_mailbox, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("TEST_PARSE_TOKEN", "wrong")
    await make_mailbox(T, "inbox", provider="import")
    async with FakeParseApi() as api:
        api.answer = Answer.json(401, {"error": "bad token"})
        async with running(pool, store, tenant(tmp_path, http(tmp_path, api.url))) as (_, ingest):
            await ingest_raws(ingest, [raw_mail(i) for i in range(4)])
            await eventually(lambda: len(api.received), DEADLINE_S, what="a call", until=bool)
            await eventually(
                lambda: states(pool), DEADLINE_S, what="all pending", until=all_in("pending", 4)
            )
            calls = len(api.received)
        rows = await jobs(pool)
    assert calls <= 4  # paused: the backlog is not walked into the wall
    assert {r["attempts"] for r in rows} == {0}
    assert {r["review_reason"] for r in rows} == {None}


async def test_second_door_copy_is_linked_not_extracted_again(
    pool, store, make_mailbox, tmp_path
) -> None:
    await make_mailbox(T, "gm", provider="gmail")
    await make_mailbox(T, "inbox", provider="maildir")
    async with running(pool, store, tenant(tmp_path, builtin(tmp_path))) as (_, ingest):
        gmail_copy = parsed(raw_mail(7), "gm")
        gmail_copy.external_id = "18c2f0a1b2c3d4e5"
        [gmail] = await ingest.ingest(IngestBatch(T, "gm", [gmail_copy]))
        assert gmail.outcome is Outcome.NEW
        await eventually(
            lambda: states(pool), DEADLINE_S, what="completed", until=all_in("completed", 1)
        )
        # the same mail delivered to the Maildir (CRLF → LF: other bytes, same message)
        maildir_raw = raw_mail(7).replace(b"\r\n", b"\n")
        assert await ingest_raws(ingest, [maildir_raw]) == [(Outcome.MERGED, gmail.message_id)]
        # and queued again on purpose (a backfill over both mailboxes): linked
        result = await enqueue(pool, T, "orders", "1", [gmail.message_id])
        assert result.linked == [gmail.message_id]
    (job,) = await jobs(pool)
    assert (
        await pool.fetchval(
            "SELECT dedup_key FROM extraction_jobs WHERE job_id = $1", job["job_id"]
        )
        == "gmail:gm:18c2f0a1b2c3d4e5"
    )
    assert len(await completed_events(pool)) == 1


async def test_new_schema_version_extracts_history_again(
    pool, store, make_mailbox, tmp_path
) -> None:
    await make_mailbox(T, "inbox", provider="import")
    async with running(pool, store, tenant(tmp_path, builtin(tmp_path))) as (_, ingest):
        outcomes = await ingest_raws(ingest, [raw_mail(i) for i in range(3)])
        await eventually(lambda: states(pool), DEADLINE_S, what="v1", until=all_in("completed", 3))
    v2 = builtin(tmp_path, schema_version=2)
    async with running(pool, store, tenant(tmp_path, v2)) as (stage, _):
        result = await enqueue(pool, T, "orders", "2", [m for _, m in outcomes if m])
        assert len(result.queued) == 3
        stage.runners[(T, "orders")].ring()
        await eventually(lambda: states(pool), DEADLINE_S, what="v2", until=all_in("completed", 6))
    events = await completed_events(pool)
    assert sorted(e["schema_version"] for e in events) == ["1"] * 3 + ["2"] * 3


async def test_mail_queued_under_the_old_version_is_extracted_under_the_new_one(
    pool, store, make_mailbox, tmp_path
) -> None:
    await make_mailbox(T, "inbox", provider="import")
    v2 = builtin(tmp_path, schema_version=2)
    async with running(pool, store, tenant(tmp_path, builtin(tmp_path))) as (_, ingest):
        await ingest_raws(ingest, [raw_mail(i) for i in range(2)])
        await eventually(lambda: states(pool), DEADLINE_S, what="v1", until=all_in("completed", 2))
    # queued under v1 by a daemon that stopped before running them, then v2 deployed
    more = await ingest_raws(IngestStage(pool, store), [raw_mail(i) for i in (7, 8)])
    await enqueue(pool, T, "orders", "1", [m for _, m in more if m])
    async with running(pool, store, tenant(tmp_path, v2)):
        await eventually(lambda: states(pool), DEADLINE_S, what="v2", until=all_in("completed", 4))
    events = await completed_events(pool)
    # never a v2 result under the v1 label: the waiting jobs moved to v2 and ran there
    assert sorted(e["schema_version"] for e in events) == ["1", "1", "2", "2"]


async def test_two_stages_racing_extract_each_message_once(
    pool, store, make_mailbox, tmp_path
) -> None:
    await make_mailbox(T, "inbox", provider="import")
    tenants = tenant(tmp_path, builtin(tmp_path, concurrency=3))
    async with (
        running(pool, store, tenants, owner="one") as (_, ingest),
        running(pool, store, tenants, owner="two"),
    ):
        await ingest_raws(ingest, [raw_mail(i) for i in range(120)])
        await eventually(
            lambda: states(pool), DEADLINE_S, what="120 completed", until=all_in("completed", 120)
        )
    events = await completed_events(pool)
    assert len(events) == 120
    assert len({e["job_id"] for e in events}) == 120
