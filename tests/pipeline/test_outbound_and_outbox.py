"""Outbound reconciliation (cascade tier 0) and the transactional outbox."""

from __future__ import annotations

from datetime import timedelta

import anyio
import asyncpg
import orjson
import pytest
from factories import T0, message

from inboxd.pipeline.ingest.stage import IngestBatch
from inboxd.pipeline.outbound import record_outbound
from inboxd.pipeline.outcomes import Outcome


@pytest.fixture
async def inbox(make_mailbox) -> tuple[str, str]:
    return await make_mailbox("acme", "inbox", address="support@acme.test")


async def record(pool: asyncpg.Pool, **kw) -> int:
    defaults = dict(
        tenant_id="acme",
        mailbox_id="inbox",
        message_id_header="<out-1@acme.test>",
        placeholder_message_id="pending_abc",
        thread_id="pending_t1",
        from_address="support@acme.test",
        subject="Your order",
        sent_at=T0,
        text="Thanks for your order.",
    )
    defaults.update(kw)
    async with pool.acquire() as conn:
        return await record_outbound(conn, **defaults)


async def test_sync_back_promotes_placeholders_into_one_row(stage, pool, inbox) -> None:
    local_id = await record(pool)
    synced = message(
        mid="<out-1@ACME.test>",
        external_id="gm-900",
        thread="gt-77",
        sender="support@acme.test",
        subject="Your order",
        text="",
    )
    results = await stage.ingest(IngestBatch("acme", "inbox", [synced]))
    assert [(r.outcome, r.message_id) for r in results] == [(Outcome.MERGED, local_id)]
    async with pool.acquire() as conn:
        row = await conn.fetchrow("SELECT * FROM messages")
        thread = await conn.fetchrow("SELECT * FROM threads")
        assert await conn.fetchval("SELECT count(*) FROM messages") == 1
        kinds = [r[0] for r in await conn.fetch("SELECT kind FROM events")]
    assert row["external_id"] == "gm-900"
    assert row["send_status"] == "synced"
    assert row["text_body"] == "Thanks for your order."  # local body kept: provider's empty
    assert thread["external_thread_id"] == "gt-77"
    assert thread["message_count"] == 1
    assert kinds == ["message.synced"]
    # and a later re-sync of the same copy is a plain duplicate
    again = await stage.ingest(
        IngestBatch(
            "acme",
            "inbox",
            [message(mid="<out-1@acme.test>", external_id="gm-900", thread="gt-77")],
        )
    )
    assert again[0].outcome is Outcome.DUPLICATE


async def test_reply_into_existing_provider_thread_moves_out_of_placeholder(
    stage, pool, inbox
) -> None:
    first = message(external_id="gm-1", thread="gt-5")
    await stage.ingest(IngestBatch("acme", "inbox", [first]))
    await record(
        pool,
        thread_id="draft_t",
        message_id_header="<reply@acme.test>",
        placeholder_message_id="draft_r",
    )
    synced = message(
        mid="<reply@acme.test>",
        external_id="gm-2",
        thread="gt-5",
        sender="support@acme.test",
        sent_at=T0 + timedelta(minutes=1),
    )
    assert (await stage.ingest(IngestBatch("acme", "inbox", [synced])))[0].outcome is Outcome.MERGED
    async with pool.acquire() as conn:
        threads = await conn.fetch("SELECT external_thread_id, message_count FROM threads")
    assert [tuple(t) for t in threads] == [("gt-5", 2)]  # emptied placeholder thread removed


async def test_rewritten_message_id_falls_back_to_sender_subject_window(stage, pool, inbox) -> None:
    await record(pool, message_id_header="<ours@acme.test>")
    # SES/Outlook replaced our Message-ID on the way out
    synced = message(
        mid="<0100018c@email.amazonses.com>",
        external_id="ses-1",
        thread="gt-1",
        sender="support@acme.test",
        subject="Re: Your order",
        sent_at=T0 + timedelta(minutes=2),
        text="Thanks for your\r\norder.",
    )
    assert (await stage.ingest(IngestBatch("acme", "inbox", [synced])))[0].outcome is Outcome.MERGED
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM messages") == 1


async def test_fallback_never_folds_another_message_with_the_same_subject(
    stage, pool, inbox
) -> None:
    await record(
        pool, message_id_header="<quote@acme.test>", subject="Your quote", text="Total: 100 EUR"
    )
    # the agent sends a different quote from the mail client a minute later
    other = message(
        mid="<y@mail.gmail.com>",
        external_id="gm-7",
        thread="gt-3",
        sender="support@acme.test",
        subject="Your quote",
        sent_at=T0 + timedelta(minutes=1),
        text="Total: 900 EUR",
    )
    assert (await stage.ingest(IngestBatch("acme", "inbox", [other])))[0].outcome is Outcome.NEW
    async with pool.acquire() as conn:
        placeholder = await conn.fetchrow(
            "SELECT external_id, text_body FROM messages WHERE message_id_norm = 'quote@acme.test'"
        )
    assert tuple(placeholder) == ("pending_abc", "Total: 100 EUR")


async def test_colleagues_copy_of_our_message_merges_without_taking_it_over(
    stage, pool, make_mailbox, inbox
) -> None:
    await make_mailbox("acme", "teammate")
    await record(pool)
    cc_copy = message(
        mid="<out-1@acme.test>",
        external_id="tm-1",
        thread="tm-thread",
        mailbox="teammate",
        sender="support@acme.test",
        subject="Your order",
    )
    results = await stage.ingest(IngestBatch("acme", "teammate", [cc_copy]))
    assert results[0].outcome is Outcome.MERGED
    async with pool.acquire() as conn:
        row = await conn.fetchrow("SELECT mailbox_id, external_id, send_status FROM messages")
    assert tuple(row) == ("inbox", "pending_abc", "pending")  # still waiting for our own copy


async def test_fallback_never_matches_another_sender_or_outside_the_window(
    stage, pool, inbox
) -> None:
    await record(pool, message_id_header="<ours@acme.test>")
    other_sender = message(
        mid="<x1@gmail.com>",
        external_id="g1",
        sender="eve@example.com",
        subject="Your order",
        sent_at=T0 + timedelta(minutes=1),
    )
    too_late = message(
        mid="<x2@acme.test>",
        external_id="g2",
        sender="support@acme.test",
        subject="Your order",
        sent_at=T0 + timedelta(minutes=6),
    )
    outcomes = [
        r.outcome
        for r in await stage.ingest(IngestBatch("acme", "inbox", [other_sender, too_late]))
    ]
    assert outcomes == [Outcome.NEW, Outcome.NEW]


@pytest.mark.own_database  # creates a trigger
async def test_failed_batch_leaves_no_rows_and_no_events(stage, pool, inbox) -> None:
    # a serialization failure mid-batch (after messages were inserted) rolls back everything
    async with pool.acquire() as conn:
        await conn.execute("""
            CREATE FUNCTION fail_once() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN RAISE EXCEPTION 'injected' USING ERRCODE = '40001'; END $$;
            CREATE TRIGGER fail_participants BEFORE INSERT ON message_participants
                FOR EACH STATEMENT EXECUTE FUNCTION fail_once();""")
    results = await stage.ingest(IngestBatch("acme", "inbox", [message(), message()]))
    assert {r.outcome for r in results} == {Outcome.RETRIABLE_FAILURE}
    async with pool.acquire() as conn:
        for table in ("messages", "threads", "message_copies", "events"):
            assert await conn.fetchval(f"SELECT count(*) FROM {table}") == 0, table
        await conn.execute("DROP TRIGGER fail_participants ON message_participants")
    results = await stage.ingest(IngestBatch("acme", "inbox", [message(), message()]))
    assert {r.outcome for r in results} == {Outcome.NEW}


@pytest.mark.own_database  # creates a trigger
async def test_poison_item_is_isolated_and_neighbours_commit(stage, pool, inbox) -> None:
    async with pool.acquire() as conn:
        await conn.execute("""
            CREATE FUNCTION reject_poison() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN IF NEW.address = 'poison@x.org' THEN
                RAISE EXCEPTION 'bad row' USING ERRCODE = '22023'; END IF;
            RETURN NEW; END $$;
            CREATE TRIGGER reject_poison BEFORE INSERT ON message_participants
                FOR EACH ROW EXECUTE FUNCTION reject_poison();""")
    items = [message(), message(to=("poison@x.org",)), message()]
    results = await stage.ingest(IngestBatch("acme", "inbox", items))
    assert [r.outcome for r in results] == [Outcome.NEW, Outcome.PERMANENT_FAILURE, Outcome.NEW]
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM messages") == 2
        created = "SELECT count(*) FROM events WHERE kind = 'message.created'"
        assert await conn.fetchval(created) == 2
        dead = await conn.fetchrow("SELECT external_id, reason FROM dead_items")
    assert tuple(dead) == (items[1].external_id, "rejected")


@pytest.mark.own_database  # creates a trigger
async def test_server_trouble_is_never_blamed_on_an_item(stage, pool, inbox) -> None:
    # disk full (53100) fails the big insert but not a tiny dead-item insert: it
    # must not turn good mail into dead items
    async with pool.acquire() as conn:
        await conn.execute("""
            CREATE FUNCTION disk_full() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN RAISE EXCEPTION 'could not extend file' USING ERRCODE = '53100'; END $$;
            CREATE TRIGGER disk_full BEFORE INSERT ON message_participants
                FOR EACH STATEMENT EXECUTE FUNCTION disk_full();""")
    results = await stage.ingest(IngestBatch("acme", "inbox", [message(), message()]))
    assert {r.outcome for r in results} == {Outcome.RETRIABLE_FAILURE}
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM dead_items") == 0


async def test_events_are_notified_after_commit(stage, pool, db_dsn, inbox) -> None:
    listener = await asyncpg.connect(db_dsn)
    got: list[str] = []
    arrived = anyio.Event()

    def on_notify(_conn, _pid, _channel, payload: str) -> None:
        got.append(payload)
        arrived.set()

    await listener.add_listener("inboxd_events", on_notify)
    try:
        await stage.ingest(IngestBatch("acme", "inbox", [message()]))
        with anyio.fail_after(5):
            await arrived.wait()
    finally:
        await listener.close()
    async with pool.acquire() as conn:
        last = await conn.fetchval("SELECT max(event_id) FROM events")
    assert orjson.loads(got[0]) == {"tenant": "acme", "last_event_id": last}
