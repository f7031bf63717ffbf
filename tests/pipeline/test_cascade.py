"""The dedup cascade's tiers and the traps other systems fell into (docs/architecture.md §3)."""

from __future__ import annotations

import hashlib
from datetime import timedelta

import anyio
import pytest
from factories import T0, CountingStore, message
from helpers.db import count

from inboxd.pipeline.copies import settled_copies
from inboxd.pipeline.ingest.stage import IngestBatch, IngestStage
from inboxd.pipeline.message import AttachmentData
from inboxd.pipeline.outcomes import Outcome


@pytest.fixture
async def inbox(make_mailbox) -> tuple[str, str]:
    return await make_mailbox("acme", "inbox")


async def ingest(stage: IngestStage, *items, backfill: bool = False) -> list[Outcome]:
    results = await stage.ingest(IngestBatch("acme", "inbox", list(items), backfill=backfill))
    return [r.outcome for r in results]


async def test_reused_message_id_with_other_content_is_a_conflict_not_a_merge(
    stage, pool, inbox
) -> None:
    first = message(mid="<same@x.org>", text="first body")
    second = message(mid="<same@x.org>", text="a different body entirely", thread="thread-2")
    assert await ingest(stage, first) == [Outcome.NEW]
    assert await ingest(stage, second) == [Outcome.CONFLICT]
    sql = "SELECT count(*) FROM messages WHERE message_id_norm = 'same@x.org'"
    assert await count(pool, sql) == 2
    async with pool.acquire() as conn:
        conflict = await conn.fetchrow("SELECT * FROM ingest_conflicts")
        new_row = await conn.fetchrow(
            "SELECT message_id, conflict_of FROM messages WHERE external_id = $1",
            second.external_id,
        )
    assert conflict["new_message_id"] == new_row["message_id"]
    assert new_row["conflict_of"] == conflict["existing_message_id"]


async def test_same_message_id_same_content_from_another_mailbox_merges(
    stage, pool, make_mailbox, inbox
) -> None:
    await make_mailbox("acme", "outlook")
    gmail_copy = message(mid="<shared@x.org>", external_id="gmail-1")
    outlook_copy = message(
        mid="<shared@x.org>", external_id="AAMk-1", mailbox="outlook", thread="conv-9"
    )
    outlook_copy.sent_at = gmail_copy.sent_at
    outlook_copy.content_fingerprint = gmail_copy.content_fingerprint
    assert await ingest(stage, gmail_copy) == [Outcome.NEW]
    results = await stage.ingest(IngestBatch("acme", "outlook", [outlook_copy]))
    assert [r.outcome for r in results] == [Outcome.MERGED]
    assert await count(pool, "SELECT count(*) FROM messages") == 1
    assert await count(pool, "SELECT count(*) FROM message_copies") == 2


async def test_same_subject_from_two_senders_within_minutes_never_merges(
    stage, pool, inbox
) -> None:
    a = message(mid=None, sender="alice@example.com", subject="Quick question")
    b = message(
        mid=None,
        sender="bob@example.com",
        subject="Quick question",
        sent_at=T0 + timedelta(minutes=3),
    )
    assert await ingest(stage, a) == [Outcome.NEW]
    assert await ingest(stage, b) == [Outcome.NEW]
    assert await count(pool, "SELECT count(*) FROM messages") == 2


@pytest.mark.parametrize("subject", ["", "Re:", "RE: ", "Fwd: Re:"])
async def test_empty_or_bare_reply_subject_matches_nothing(stage, pool, inbox, subject) -> None:
    # same sender, same thread, same minute, same body, no Message-ID: only the
    # subject could tie them, and an empty subject must not
    a = message(mid=None, subject=subject, text="ok")
    b = message(mid=None, subject=subject, text="ok")
    assert await ingest(stage, a) == [Outcome.NEW]
    assert await ingest(stage, b) == [Outcome.NEW]
    assert await count(pool, "SELECT count(*) FROM messages") == 2


async def test_message_without_message_id_reingested_is_a_duplicate(stage, pool, inbox) -> None:
    item = message(mid=None, external_id="uid-77", text="same")
    assert await ingest(stage, item) == [Outcome.NEW]
    again = message(mid=None, external_id="uid-77", text="same")
    assert await ingest(stage, again) == [Outcome.DUPLICATE]
    assert await count(pool, "SELECT count(*) FROM messages") == 1


async def test_fresh_rows_carry_their_external_id(stage, pool, inbox) -> None:
    items = [message(external_id=f"gm-{i}") for i in range(5)]
    await ingest(stage, *items)
    async with pool.acquire() as conn:
        got = {r[0] for r in await conn.fetch("SELECT external_id FROM messages")}
        copies = {r[0] for r in await conn.fetch("SELECT external_id FROM message_copies")}
    assert got == copies == {f"gm-{i}" for i in range(5)}


async def test_mangled_message_id_merges_inside_the_thread_only(stage, pool, inbox) -> None:
    original = message(mid="<a1@relay.example>", external_id="e1")
    mangled = message(mid="<a1-rewritten@relay.example>", external_id="e2")
    mangled.content_fingerprint = original.content_fingerprint
    mangled.sent_at = original.sent_at + timedelta(seconds=40)
    elsewhere = message(mid="<a1-other@relay.example>", external_id="e3", thread="thread-9")
    elsewhere.content_fingerprint = original.content_fingerprint
    assert await ingest(stage, original) == [Outcome.NEW]
    assert await ingest(stage, mangled) == [Outcome.MERGED]
    assert await ingest(stage, elsewhere) == [Outcome.NEW]


async def test_two_concurrent_ingests_of_one_batch_store_each_message_once(
    pool, store, inbox
) -> None:
    items = [message(thread=f"t-{i % 7}") for i in range(60)]
    outcomes: list[list[Outcome]] = []

    async def run() -> None:
        stage = IngestStage(pool, store)
        outcomes.append(await ingest(stage, *items))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        tg.start_soon(run)
    assert await count(pool, "SELECT count(*) FROM messages") == 60
    assert await count(pool, "SELECT count(*) FROM message_copies") == 60
    assert await count(pool, "SELECT count(*) FROM threads") == 7
    for i in range(60):
        pair = sorted(o[i] for o in outcomes)
        assert pair == [Outcome.DUPLICATE, Outcome.NEW], (i, pair)
    assert await count(pool, "SELECT count(*) FROM events WHERE kind = 'message.created'") == 60


async def test_in_batch_repeats_are_resolved(stage, pool, inbox) -> None:
    a = message(mid="<x@y.z>", external_id="e1", text="one")
    again = message(mid="<x@y.z>", external_id="e1", text="one")
    other_copy = message(mid="<x@y.z>", external_id="e2")
    other_copy.content_fingerprint = a.content_fingerprint
    reuse = message(mid="<x@y.z>", external_id="e3", text="something else")
    assert await ingest(stage, a, again, other_copy, reuse) == [
        Outcome.NEW,
        Outcome.DUPLICATE,
        Outcome.MERGED,
        Outcome.CONFLICT,
    ]
    assert await count(pool, "SELECT count(*) FROM messages") == 2
    assert await count(pool, "SELECT count(*) FROM ingest_conflicts") == 1


async def test_thread_metadata_is_right_whatever_the_arrival_order(stage, pool, inbox) -> None:
    msgs = [
        message(thread="conv", sent_at=T0 + timedelta(hours=h), to=(f"p{h}@x.org",))
        for h in range(3)
    ]
    for m in (msgs[2], msgs[0], msgs[1]):
        await ingest(stage, m)
    async with pool.acquire() as conn:
        t = await conn.fetchrow("SELECT * FROM threads WHERE external_thread_id = 'conv'")
        latest = await conn.fetchval(
            "SELECT external_id FROM messages WHERE message_id = $1", t["latest_message_id"]
        )
    assert t["message_count"] == 3
    assert t["first_message_at"] == T0
    assert t["last_message_at"] == T0 + timedelta(hours=2)
    assert latest == msgs[2].external_id
    assert t["participant_count"] == 4  # alice + p0, p1, p2


async def test_backfill_writes_one_sync_completed_event(stage, pool, inbox) -> None:
    await ingest(stage, *[message() for _ in range(10)], backfill=True)
    async with pool.acquire() as conn:
        kinds = [r[0] for r in await conn.fetch("SELECT kind FROM events")]
    assert kinds == ["mailbox.sync_completed"]


async def test_attachments_are_stored_once_and_not_on_reingest(pool, tmp_path, inbox) -> None:
    store = CountingStore(tmp_path / "objects")
    stage = IngestStage(pool, store)
    data = b"%PDF-1.4 invoice"
    sha = hashlib.sha256(data).hexdigest()
    att = AttachmentData("invoice.pdf", "application/pdf", len(data), sha, data)
    item = message(external_id="m1", attachments=[att], text="see attached")
    assert await ingest(stage, item) == [Outcome.NEW]
    assert store.put_keys == [f"att/acme/{sha}"]
    assert await store.get(f"att/acme/{sha}") == data
    assert await ingest(
        stage, message(external_id="m1", attachments=[att], text="see attached")
    ) == [Outcome.DUPLICATE]
    assert store.put_keys == [f"att/acme/{sha}"]  # no attachment work on re-ingest


async def test_failed_attachment_store_is_retried_on_next_sighting(pool, tmp_path, inbox) -> None:
    store = CountingStore(tmp_path / "objects", fail_prefixes=("att/",))
    stage = IngestStage(pool, store)
    data = b"PK\x03\x04 zip"
    att = AttachmentData(
        "a.zip", "application/zip", len(data), hashlib.sha256(data).hexdigest(), data
    )
    assert await ingest(stage, message(external_id="m1", attachments=[att])) == [Outcome.NEW]
    assert await count(pool, "SELECT count(*) FROM attachments WHERE NOT stored") == 1
    # a door that skips copies it holds (import) must still see this one again
    tenant, mailbox = inbox
    assert await settled_copies(pool, tenant, mailbox, ["m1"]) == set()
    store.fail_prefixes = ()
    assert await ingest(stage, message(external_id="m1", attachments=[att])) == [Outcome.DUPLICATE]
    assert await count(pool, "SELECT count(*) FROM attachments WHERE stored") == 1
    assert await settled_copies(pool, tenant, mailbox, ["m1", "m2"]) == {"m1"}


async def test_failed_html_upload_degrades_to_inline(pool, tmp_path, inbox) -> None:
    store = CountingStore(tmp_path / "objects", fail_prefixes=("html/",))
    big = "<p>" + "newsletter " * 20_000 + "</p>"
    assert await ingest(IngestStage(pool, store), message(html=big)) == [Outcome.NEW]
    async with pool.acquire() as conn:
        row = await conn.fetchrow("SELECT html_body, html_key FROM messages")
    assert row["html_key"] is None and row["html_body"] == big


async def test_large_html_goes_to_the_object_store(stage, pool, store, inbox) -> None:
    big = "<p>" + "newsletter " * 20_000 + "</p>"
    await ingest(stage, message(html=big))
    async with pool.acquire() as conn:
        row = await conn.fetchrow("SELECT html_body, html_key FROM messages")
    assert row["html_body"] is None
    assert (await store.get(row["html_key"])).decode() == big


async def test_raw_bytes_not_stored_means_retriable_and_nothing_written(
    pool, tmp_path, inbox
) -> None:
    store = CountingStore(tmp_path / "objects", fail_prefixes=("raw/",))
    item = message()
    item.raw = b"From: a@b\r\n\r\nhi"
    item.raw_sha256 = hashlib.sha256(item.raw).hexdigest()
    ok = message()
    outcomes = await ingest(IngestStage(pool, store), item, ok)
    assert outcomes == [Outcome.RETRIABLE_FAILURE, Outcome.NEW]
    assert await count(pool, "SELECT count(*) FROM messages") == 1


async def test_nul_and_lone_surrogates_in_keys_do_not_kill_a_message(stage, pool, inbox) -> None:
    item = message(subject="Invoice\x00 42 \udcff", text="body\x00 text")
    item.subject_norm = "invoice\x00 42 \udcff"
    assert await ingest(stage, item) == [Outcome.NEW]
    again = message(
        subject="Invoice\x00 42 \udcff", text="body\x00 text", external_id=item.external_id
    )
    again.subject_norm = "invoice\x00 42 \udcff"
    assert await ingest(stage, again) == [Outcome.DUPLICATE]
    assert await count(pool, "SELECT count(*) FROM dead_items") == 0


async def test_follower_of_a_follower_whose_leader_failed_is_retriable(
    pool, tmp_path, inbox
) -> None:
    store = CountingStore(tmp_path / "objects", fail_prefixes=("raw/",))
    lead = message(mid="<chain@x.org>", external_id="L", text="same")
    lead.raw, lead.raw_sha256 = b"raw", hashlib.sha256(b"raw").hexdigest()
    f1 = message(mid="<chain@x.org>", external_id="F1", text="same")
    f1.content_fingerprint = lead.content_fingerprint
    f2 = message(mid="<chain@x.org>", external_id="F1", text="same")
    f2.content_fingerprint = lead.content_fingerprint
    outcomes = await ingest(IngestStage(pool, store), lead, f1, f2)
    assert outcomes == [Outcome.RETRIABLE_FAILURE] * 3
    assert await count(pool, "SELECT count(*) FROM messages") == 0
