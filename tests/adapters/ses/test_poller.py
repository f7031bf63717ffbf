"""The poller against moto's SQS and S3 and a real PostgreSQL, in process.

Each test has a queue and bucket of its own (the `aws` fixture) and a fresh
database. What is asserted is what an operator would see: rows (message_copies,
messages, dead_items, unrouted_items), the queue's visible / in-flight counts, and
the objects left in the bucket.
"""

from __future__ import annotations

import hashlib
import uuid

import anyio
import anyio.abc
import asyncpg
import pytest
import structlog
from botocore.exceptions import ClientError
from helpers.corpus import corpus_files
from helpers.ses_queue import (
    TEST_DOOR,
    copies,
    corpus_file,
    dead,
    drain,
    s3_event,
    s3_test_event,
    ses_notification,
    sns_envelope,
    unrouted,
    versioned_pointer,
)
from helpers.waiting import eventually

from inboxd.adapters.ses import SesMailbox
from inboxd.adapters.ses.aws import S3_READ_CHUNK_BYTES
from inboxd.pipeline.ingest.stage import IngestBatch, IngestStage
from inboxd.pipeline.outcomes import ItemResult, Outcome

pytestmark = pytest.mark.slow

# Corpus messages whose headers the routing tests rely on (tests/corpus/mime):
# From me@test.org, To info@test.org, Delivered-To info@test.org
ISSUE_82 = "django-mailbox/email_issue_82.eml"
# From user2@yahoo.com, To user3@example.com, Delivered-To user1@example.com and
# user3@example.com
UTF8_CHAR = "django-mailbox/message_with_utf8_char.eml"
# From foo@example.com, To bar@example.com, Cc recipient1@ and recipient2@example.com
LONG_LINES = "apache-james-mime4j/basic-plain-very-long-lines.eml"

SUPPORT = "support@acme.test"


def mailbox(*addresses: str, **settings: object) -> SesMailbox:
    return SesMailbox.from_settings({"addresses": list(addresses), **settings})


def ses_id() -> str:
    return f"ses-{uuid.uuid4().hex}"


async def message_rows(pool: asyncpg.Pool) -> list[tuple[str, str, str]]:
    """(tenant, external id, raw sha256) of every stored message."""
    async with pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT tenant_id, external_id, raw_sha256 FROM messages ORDER BY 1, 2"
        )
    return [tuple(r) for r in rows]


async def dead_detail(pool: asyncpg.Pool) -> str:
    async with pool.acquire() as conn:
        return await conn.fetchval("SELECT detail FROM dead_items")


# --- each pointer shape end to end -----------------------------------------------------------

SHAPES = ["ses", "ses-sns", "s3-event", "s3-event-sns", "versioned", "versioned-sns"]


def pointer_body(shape: str, bucket: str, key: str, ses: str, recipients: list[str]) -> object:
    if shape.startswith("ses"):
        document = ses_notification(bucket, key, ses, recipients)
    elif shape.startswith("s3-event"):
        document = s3_event(bucket, key)  # no envelope: routed by the headers
    else:
        document = versioned_pointer(bucket, key, ses, recipients)
    return sns_envelope(document) if shape.endswith("-sns") else document


@pytest.mark.parametrize("shape", SHAPES)
async def test_each_pointer_shape_stores_the_object_byte_exact(
    shape, aws, make_poller, make_mailbox, pool, store, corpus
) -> None:
    await make_mailbox("acme", "support", provider="ses")
    raw = corpus_file(corpus, ISSUE_82)
    # a key that S3 event notifications must encode: space, plus, at sign
    key, ses = "in/2026 12/a+b@c", ses_id()
    aws.put(key, raw)
    aws.send(pointer_body(shape, aws.bucket, key, ses, [SUPPORT]))
    # the SES and versioned pointers route by their envelope (support@), the S3 event
    # by the message's To / Delivered-To (info@)
    routes = [("acme", "support", mailbox(SUPPORT, "info@test.org"))]
    async with make_poller(routes) as (poller, events):
        await drain(poller)
    external_id = key if shape.startswith("s3-event") else ses
    assert await copies(pool) == [("acme", "support", external_id)]
    [(_, _, sha)] = await message_rows(pool)
    assert sha == hashlib.sha256(raw).hexdigest()
    async with pool.acquire() as conn:
        raw_key = await conn.fetchval("SELECT raw_key FROM messages")
    assert await store.get(raw_key) == raw
    assert aws.queue_counts() == (0, 0)
    assert aws.keys() == [key]  # keep_objects defaults to true
    assert (events.counts.get("stored"), events.counts.get("deleted")) == (1, 1)
    assert await dead(pool) == [] and await unrouted(pool) == []


async def test_s3_event_with_several_records_stores_each(
    aws, make_poller, make_mailbox, pool, corpus
) -> None:
    await make_mailbox("acme", "inbox", provider="ses")
    keys = ["in/one", "in/two words", "in/three+four"]
    for key, name in zip(keys, [LONG_LINES, UTF8_CHAR, ISSUE_82], strict=True):
        aws.put(key, corpus_file(corpus, name))
    aws.send(s3_event(aws.bucket, *keys))
    routes = [("acme", "inbox", mailbox("@example.com", "info@test.org"))]
    async with make_poller(routes) as (poller, events):
        received = await drain(poller)
    assert len(received) == 1
    assert await copies(pool) == sorted(("acme", "inbox", k) for k in keys)
    assert aws.queue_counts() == (0, 0)
    assert events.counts.get("deleted") == 1


async def test_s3_test_event_is_deleted_and_recorded_nowhere(aws, make_poller, pool) -> None:
    aws.send(s3_test_event(aws.bucket))
    aws.send(sns_envelope(s3_test_event(aws.bucket)))
    async with make_poller([("acme", "support", mailbox(SUPPORT))]) as (poller, events):
        await drain(poller)
    assert aws.queue_counts() == (0, 0)
    assert events.counts.get("deleted") == 2
    assert await copies(pool) == [] and await dead(pool) == [] and await unrouted(pool) == []


async def test_run_receives_until_stopped(aws, make_poller, make_mailbox, pool, corpus) -> None:
    await make_mailbox("acme", "support", provider="ses")
    for i, raw in enumerate(p.read_bytes() for p in corpus_files(corpus / "mime", 4)):
        aws.put(f"in/{i}", raw)
        aws.send(ses_notification(aws.bucket, f"in/{i}", f"ses-{i}", [SUPPORT]))
    stop = anyio.Event()
    async with make_poller(
        [("acme", "support", mailbox(SUPPORT))], wait_time_s=1, max_messages=2, pollers=2
    ) as (poller, _):
        async with anyio.create_task_group() as tg:
            tg.start_soon(poller.run, stop)
            await eventually(lambda: copies(pool), 30, what="4 rows", until=lambda c: len(c) == 4)
            await eventually(aws.queue_counts, 30, what="an empty queue", until=(0, 0).__eq__)
            stop.set()  # the loops abandon their long polls and run returns
    assert await copies(pool) == [("acme", "support", f"ses-{i}") for i in range(4)]


# --- redelivery ------------------------------------------------------------------------------


async def test_redelivery_of_a_stored_message_is_a_duplicate(
    aws, make_poller, make_mailbox, pool, corpus, monkeypatch
) -> None:
    await make_mailbox("acme", "support", provider="ses")
    aws.put("in/m", corpus_file(corpus, ISSUE_82))
    aws.send(ses_notification(aws.bucket, "in/m", "ses-1", [SUPPORT]))
    async with make_poller([("acme", "support", mailbox(SUPPORT))]) as (poller, events):
        # committed, then the daemon died before DeleteMessageBatch
        async def lost(messages):
            return list(messages)

        monkeypatch.setattr(poller._aws, "delete", lost)
        received = await drain(poller)
        assert aws.queue_counts() == (0, 1)
        monkeypatch.undo()
        aws.release([m.receipt_handle for m in received])  # the visibility timeout ran out
        again = await drain(poller)
    assert [m.message_id for m in again] == [m.message_id for m in received]
    assert again[0].receive_count == 2
    assert (events.counts.get("stored"), events.counts.get("duplicate")) == (1, 1)
    assert await copies(pool) == [("acme", "support", "ses-1")]
    assert len(await message_rows(pool)) == 1
    assert aws.queue_counts() == (0, 0)


async def test_redelivery_after_a_lost_delete_with_keep_objects_false_is_a_duplicate(
    aws, make_poller, make_mailbox, pool, corpus, monkeypatch
) -> None:
    await make_mailbox("acme", "support", provider="ses")
    aws.put("in/m", corpus_file(corpus, ISSUE_82))
    aws.send(ses_notification(aws.bucket, "in/m", "ses-1", [SUPPORT]))
    routes = [("acme", "support", mailbox(SUPPORT, keep_objects=False))]
    async with make_poller(routes) as (poller, _):

        async def lost(messages):
            return list(messages)

        monkeypatch.setattr(poller._aws, "delete", lost)
        received = await drain(poller)
        monkeypatch.undo()
        aws.release([m.receipt_handle for m in received])
        await drain(poller)
    assert await copies(pool) == [("acme", "support", "ses-1")]
    assert aws.queue_counts() == (0, 0)
    assert await dead(pool) == []


async def test_one_notification_delivered_twice_is_stored_once(
    aws, make_poller, make_mailbox, pool, corpus
) -> None:
    # SQS standard queues deliver at least once; SES may notify twice: same SES id
    await make_mailbox("acme", "support", provider="ses")
    aws.put("in/m", corpus_file(corpus, ISSUE_82))
    aws.send(ses_notification(aws.bucket, "in/m", "ses-1", [SUPPORT]))
    aws.send(ses_notification(aws.bucket, "in/m", "ses-1", [SUPPORT], sns=True))
    async with make_poller([("acme", "support", mailbox(SUPPORT))], max_messages=1) as (
        poller,
        events,
    ):
        await drain(poller)
    assert await copies(pool) == [("acme", "support", "ses-1")]
    assert (events.counts.get("stored"), events.counts.get("duplicate")) == (1, 1)
    assert aws.queue_counts() == (0, 0)


# --- permanent failures: recorded, then deleted -----------------------------------------------


async def test_invalid_pointer_is_unrouted_and_deleted_and_the_queue_flows(
    aws, make_poller, make_mailbox, pool, corpus
) -> None:
    await make_mailbox("acme", "support", provider="ses")
    aws.put("in/good", corpus_file(corpus, ISSUE_82))
    bad = '{"version": 2, "provider": "ses", "s3Bucket": "b", "s3Key": "k"}'
    aws.send(bad)
    aws.send("this is not json")
    aws.send(ses_notification(aws.bucket, "in/good", "ses-good", [SUPPORT]))
    async with make_poller([("acme", "support", mailbox(SUPPORT))]) as (poller, events):
        received = await drain(poller)
    sqs_id = {m.body: m.message_id for m in received}
    records = await unrouted(pool)
    assert sorted((r["external_id"], r["reason"], r["body"], r["door"]) for r in records) == sorted(
        [
            (sqs_id[bad], "invalid_pointer", bad, TEST_DOOR),
            (sqs_id["this is not json"], "invalid_pointer", "this is not json", TEST_DOOR),
        ]
    )
    assert all(r["recipients"] == [] and r["resolved_at"] is None for r in records)
    assert await copies(pool) == [("acme", "support", "ses-good")]
    assert await dead(pool) == []
    assert aws.queue_counts() == (0, 0)
    assert events.counts.get("unrouted") == 2


async def test_poison_message_with_a_mailbox_becomes_a_dead_item_and_is_deleted(
    aws, make_poller, make_mailbox, pool, corpus
) -> None:
    await make_mailbox("acme", "support", provider="ses")
    aws.put("in/m", corpus_file(corpus, ISSUE_82))
    aws.send(ses_notification(aws.bucket, "in/m", "ses-poison", [SUPPORT]))
    for _ in range(2):  # two consumers took it and never finished
        assert aws.receive_and_release() == 1
    async with make_poller([("acme", "support", mailbox(SUPPORT))], max_receive_count=2) as (
        poller,
        events,
    ):
        [message] = await drain(poller)
    assert message.receive_count == 3
    assert await dead(pool) == [("acme", "support", "ses-poison", "poison")]
    assert "received 3 times" in await dead_detail(pool)
    assert await copies(pool) == []
    assert aws.queue_counts() == (0, 0)
    assert aws.keys() == ["in/m"]  # the object stays, for a replay
    assert events.counts.get("poison") == 1


async def test_poison_dead_item_names_its_object(
    aws, make_poller, make_mailbox, pool, corpus
) -> None:
    await make_mailbox("acme", "support", provider="ses")
    aws.put("in/m", corpus_file(corpus, ISSUE_82))
    aws.send(ses_notification(aws.bucket, "in/m", "ses-poison", [SUPPORT]))
    assert aws.receive_and_release() == 1
    async with make_poller([("acme", "support", mailbox(SUPPORT))], max_receive_count=1) as (
        poller,
        _,
    ):
        await drain(poller)
    assert f"s3://{aws.bucket}/in/m" in await dead_detail(pool)


async def test_poison_message_with_no_mailbox_is_unrouted_with_its_pointer(
    aws, make_poller, pool, corpus
) -> None:
    aws.put("in/m", corpus_file(corpus, ISSUE_82))
    event = s3_event(aws.bucket, "in/m")
    aws.send(event)
    assert aws.receive_and_release() == 1
    async with make_poller([("acme", "support", mailbox(SUPPORT))], max_receive_count=1) as (
        poller,
        _,
    ):
        await drain(poller)
    [record] = await unrouted(pool)
    assert (record["external_id"], record["reason"]) == ("in/m", "poison")
    assert record["body"] and "in/m" in record["body"]  # the pointer, to replay it
    assert aws.queue_counts() == (0, 0)


async def test_a_message_at_max_receive_count_is_still_processed(
    aws, make_poller, make_mailbox, pool, corpus
) -> None:
    await make_mailbox("acme", "support", provider="ses")
    aws.put("in/m", corpus_file(corpus, ISSUE_82))
    aws.send(ses_notification(aws.bucket, "in/m", "ses-1", [SUPPORT]))
    assert aws.receive_and_release() == 1
    async with make_poller([("acme", "support", mailbox(SUPPORT))], max_receive_count=2) as (
        poller,
        _,
    ):
        await drain(poller)  # received a 2nd time: not *more* than 2
    assert await copies(pool) == [("acme", "support", "ses-1")]
    assert await dead(pool) == []


@pytest.mark.parametrize("shape", ["ses", "s3-event"])
async def test_missing_object_is_dead_and_deleted(
    shape, aws, make_poller, make_mailbox, pool
) -> None:
    await make_mailbox("acme", "support", provider="ses")
    aws.send(pointer_body(shape, aws.bucket, "in/gone", "ses-gone", [SUPPORT]))
    async with make_poller([("acme", "support", mailbox(SUPPORT))]) as (poller, _):
        await drain(poller)
    if shape == "ses":
        assert await dead(pool) == [("acme", "support", "ses-gone", "object_missing")]
        assert await unrouted(pool) == []
    else:  # no envelope and no headers to read: nobody's
        assert [(r["external_id"], r["reason"]) for r in await unrouted(pool)] == [
            ("in/gone", "object_missing")
        ]
    assert await copies(pool) == []
    assert aws.queue_counts() == (0, 0)


def read_through_sdk(poller) -> None:
    """Objects of every bucket read through the SDK's GetObject (aws.py `_fetch_sdk`,
    the path of a bucket the door's own GETs hand over), so a test can bend it."""

    class Every(set):
        def __contains__(self, bucket: object) -> bool:
            return True

    poller._aws._objects.sdk_buckets = Every()


def spy_object_reads(monkeypatch, poller, *, hide_length: bool = False) -> list:
    """Count the body bytes the poller reads from each S3 object it gets through the
    SDK; with `hide_length`, answer without Content-Length (a stream of unknown
    size). The door's own GETs are bent on the wire instead (test_ses_run.py
    AwsProxy)."""
    read_through_sdk(poller)
    s3 = poller._aws._s3
    get_object = s3.get_object
    bodies: list[CountingBody] = []

    async def counting(**params):
        response = await get_object(**params)
        body = CountingBody(response["Body"])
        bodies.append(body)
        response = {**response, "Body": body}
        if hide_length:
            response.pop("ContentLength", None)
        return response

    monkeypatch.setattr(s3, "get_object", counting)
    return bodies


class CountingBody:
    def __init__(self, body) -> None:
        self._body = body
        self.bytes_read = 0

    async def read(self, amt: int | None = None) -> bytes:
        chunk = await self._body.read(amt)
        self.bytes_read += len(chunk)
        return chunk

    def close(self) -> None:
        self._body.close()


@pytest.mark.parametrize("hide_length", [False, True], ids=["content-length", "no-length"])
async def test_object_over_max_message_bytes_is_dead_without_reading_it_whole(
    hide_length, aws, make_poller, make_mailbox, pool, corpus, monkeypatch
) -> None:
    await make_mailbox("acme", "support", provider="ses")
    limit = 2048
    big = corpus_file(corpus, LONG_LINES) * 1000  # ~7 MB, well past the limit
    aws.put("in/big", big)
    aws.put("in/small", corpus_file(corpus, ISSUE_82)[:limit])
    aws.send(ses_notification(aws.bucket, "in/big", "ses-big", [SUPPORT]))
    async with make_poller([("acme", "support", mailbox(SUPPORT))], max_message_bytes=limit) as (
        poller,
        _,
    ):
        bodies = spy_object_reads(monkeypatch, poller, hide_length=hide_length)
        await drain(poller)
    assert await dead(pool) == [("acme", "support", "ses-big", "too_large")]
    [body] = bodies
    if hide_length:
        # refused as the stream passed the limit: one chunk past it at most
        assert body.bytes_read <= limit + S3_READ_CHUNK_BYTES
    else:
        # refused from Content-Length, before a byte of the body was read
        assert body.bytes_read == 0
        assert f"{len(big)} bytes" in await dead_detail(pool)
    assert await copies(pool) == []
    assert aws.queue_counts() == (0, 0)
    assert "in/big" in aws.keys()  # refused, not deleted


async def test_object_of_exactly_max_message_bytes_is_stored(
    aws, make_poller, make_mailbox, pool, corpus
) -> None:
    await make_mailbox("acme", "support", provider="ses")
    raw = corpus_file(corpus, ISSUE_82)
    aws.put("in/m", raw)
    aws.send(ses_notification(aws.bucket, "in/m", "ses-1", [SUPPORT]))
    async with make_poller([("acme", "support", mailbox(SUPPORT))], max_message_bytes=len(raw)) as (
        poller,
        _,
    ):
        await drain(poller)
    assert await copies(pool) == [("acme", "support", "ses-1")]


@pytest.mark.parametrize("shape", ["ses", "s3-event"])
async def test_unparseable_object_is_dead_and_deleted(
    shape, aws, make_poller, make_mailbox, pool
) -> None:
    await make_mailbox("acme", "support", provider="ses")
    aws.put("in/empty", b"")
    aws.send(pointer_body(shape, aws.bucket, "in/empty", "ses-empty", [SUPPORT]))
    async with make_poller([("acme", "support", mailbox(SUPPORT))]) as (poller, _):
        await drain(poller)
    if shape == "ses":
        assert await dead(pool) == [("acme", "support", "ses-empty", "empty")]
    else:  # no envelope, no headers: an unparseable message of nobody's
        assert [(r["external_id"], r["reason"]) for r in await unrouted(pool)] == [
            ("in/empty", "unparseable")
        ]
    assert await copies(pool) == []
    assert aws.queue_counts() == (0, 0)


async def test_s3_throttling_leaves_the_message_for_redelivery(
    aws, make_poller, make_mailbox, pool, corpus, monkeypatch
) -> None:
    await make_mailbox("acme", "support", provider="ses")
    aws.put("in/m", corpus_file(corpus, ISSUE_82))
    aws.send(ses_notification(aws.bucket, "in/m", "ses-1", [SUPPORT]))
    async with make_poller([("acme", "support", mailbox(SUPPORT))]) as (poller, events):

        async def slow_down(**params):
            raise ClientError(
                {
                    "Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."},
                    "ResponseMetadata": {"HTTPStatusCode": 503},
                },
                "GetObject",
            )

        read_through_sdk(poller)
        monkeypatch.setattr(poller._aws._s3, "get_object", slow_down)
        await drain(poller)
    assert aws.queue_counts() == (0, 1)
    assert events.counts.get("left") == 1
    assert any("SlowDown" in e for e in events.errors)
    assert await dead(pool) == [] and await unrouted(pool) == [] and await copies(pool) == []
    assert aws.keys() == ["in/m"]


async def test_no_mailbox_for_any_recipient_is_unrouted_with_the_recipients(
    aws, make_poller, make_mailbox, pool, corpus
) -> None:
    await make_mailbox("acme", "support", provider="ses")
    aws.put("in/m", corpus_file(corpus, ISSUE_82))
    recipients = ["someone@elsewhere.test", "Other@Elsewhere.test"]
    aws.send(ses_notification(aws.bucket, "in/m", "ses-stray", recipients))
    async with make_poller([("acme", "support", mailbox(SUPPORT))]) as (poller, events):
        await drain(poller)
    [record] = await unrouted(pool)
    assert (record["external_id"], record["reason"], record["recipients"]) == (
        "ses-stray",
        "no_mailbox",
        ["someone@elsewhere.test", "other@elsewhere.test"],
    )
    assert "ses-stray" in record["body"]
    assert await copies(pool) == [] and await dead(pool) == []
    assert aws.queue_counts() == (0, 0)
    assert events.counts.get("unrouted") == 1


async def test_no_mailbox_for_the_header_recipients_is_unrouted_with_them(
    aws, make_poller, pool, corpus
) -> None:
    aws.put("in/m", corpus_file(corpus, ISSUE_82))
    aws.send(s3_event(aws.bucket, "in/m"))
    async with make_poller([("acme", "support", mailbox(SUPPORT))]) as (poller, _):
        await drain(poller)
    [record] = await unrouted(pool)
    assert (record["external_id"], record["reason"]) == ("in/m", "no_mailbox")
    assert record["recipients"] == ["info@test.org"]
    assert aws.queue_counts() == (0, 0)


async def test_unrouted_again_counts_attempts_in_one_record(aws, make_poller, pool, corpus) -> None:
    aws.put("in/m", corpus_file(corpus, ISSUE_82))
    aws.send(ses_notification(aws.bucket, "in/m", "ses-stray", ["x@elsewhere.test"]))
    aws.send(ses_notification(aws.bucket, "in/m", "ses-stray", ["x@elsewhere.test"]))
    async with make_poller([("acme", "support", mailbox(SUPPORT))], max_messages=1) as (
        poller,
        _,
    ):
        await drain(poller)
    [record] = await unrouted(pool)
    assert record["attempts"] == 2
    assert aws.queue_counts() == (0, 0)


# --- sender allowlists ------------------------------------------------------------------------


async def test_sender_refused_is_a_dead_item_in_that_mailbox(
    aws, make_poller, make_mailbox, pool, corpus
) -> None:
    # ISSUE_82 is from me@test.org
    await make_mailbox("acme", "support", provider="ses")
    await make_mailbox("acme", "open", provider="ses")
    await make_mailbox("acme", "friends", provider="ses")
    aws.put("in/m", corpus_file(corpus, ISSUE_82))
    aws.send(
        ses_notification(
            aws.bucket,
            "in/m",
            "ses-1",
            [SUPPORT, "open@acme.test", "friends@acme.test"],
        )
    )
    routes = [
        ("acme", "support", mailbox(SUPPORT, allowed_senders=["*@vendor.example"])),
        ("acme", "open", mailbox("open@acme.test")),
        ("acme", "friends", mailbox("friends@acme.test", allowed_senders=["*@test.org"])),
    ]
    async with make_poller(routes) as (poller, events):
        await drain(poller)
    assert await dead(pool) == [("acme", "support", "ses-1", "sender_refused")]
    assert await copies(pool) == [("acme", "friends", "ses-1"), ("acme", "open", "ses-1")]
    assert aws.queue_counts() == (0, 0)
    assert events.counts.get("dead") == 1


async def test_sender_refused_everywhere_stores_no_message(
    aws, make_poller, make_mailbox, pool, corpus
) -> None:
    await make_mailbox("acme", "support", provider="ses")
    aws.put("in/m", corpus_file(corpus, UTF8_CHAR))  # from user2@yahoo.com
    aws.send(ses_notification(aws.bucket, "in/m", "ses-1", [SUPPORT]))
    routes = [("acme", "support", mailbox(SUPPORT, allowed_senders=["boss@yahoo.com"]))]
    async with make_poller(routes) as (poller, _):
        await drain(poller)
    assert await dead(pool) == [("acme", "support", "ses-1", "sender_refused")]
    assert await message_rows(pool) == []
    assert aws.queue_counts() == (0, 0)


async def test_exact_public_address_allowed(aws, make_poller, make_mailbox, pool, corpus) -> None:
    await make_mailbox("acme", "support", provider="ses")
    aws.put("in/m", corpus_file(corpus, UTF8_CHAR))  # from user2@yahoo.com
    aws.send(ses_notification(aws.bucket, "in/m", "ses-1", [SUPPORT]))
    routes = [("acme", "support", mailbox(SUPPORT, allowed_senders=["User2@Yahoo.com"]))]
    async with make_poller(routes) as (poller, _):
        await drain(poller)
    assert await copies(pool) == [("acme", "support", "ses-1")]
    assert await dead(pool) == []


# --- keep_objects -----------------------------------------------------------------------------


@pytest.mark.parametrize("keep", [True, False])
async def test_keep_objects(keep, aws, make_poller, make_mailbox, pool, corpus) -> None:
    await make_mailbox("acme", "support", provider="ses")
    aws.put("in/m", corpus_file(corpus, ISSUE_82))
    aws.put("in/unrelated", b"not announced")
    aws.send(ses_notification(aws.bucket, "in/m", "ses-1", [SUPPORT]))
    async with make_poller([("acme", "support", mailbox(SUPPORT, keep_objects=keep))]) as (
        poller,
        _,
    ):
        await drain(poller)
    assert await copies(pool) == [("acme", "support", "ses-1")]
    assert aws.keys() == (["in/m", "in/unrelated"] if keep else ["in/unrelated"])
    assert aws.queue_counts() == (0, 0)


async def test_keep_objects_false_keeps_the_object_until_the_rows_commit(
    aws, make_poller, make_mailbox, pool, corpus
) -> None:
    await make_mailbox("acme", "support", provider="ses")
    aws.put("in/m", corpus_file(corpus, ISSUE_82))
    aws.send(ses_notification(aws.bucket, "in/m", "ses-1", [SUPPORT]))
    routes = [("acme", "support", mailbox(SUPPORT, keep_objects=False))]
    async with make_poller(routes, ingest=database_down) as (poller, _):
        received = await drain(poller)
    assert aws.keys() == ["in/m"]  # nothing committed: the object is still the only copy
    aws.release([m.receipt_handle for m in received])
    async with make_poller(routes) as (poller, _):
        await drain(poller)
    assert await copies(pool) == [("acme", "support", "ses-1")]
    assert aws.keys() == []
    assert aws.queue_counts() == (0, 0)


async def test_keep_objects_false_elsewhere_does_not_delete_a_kept_object(
    aws, make_poller, make_mailbox, pool, corpus
) -> None:
    await make_mailbox("acme", "support", provider="ses")
    await make_mailbox("globex", "sales", provider="ses")
    aws.put("in/m", corpus_file(corpus, ISSUE_82))
    aws.send(ses_notification(aws.bucket, "in/m", "ses-1", [SUPPORT, "sales@globex.test"]))
    routes = [
        ("acme", "support", mailbox(SUPPORT)),  # keep_objects = true
        ("globex", "sales", mailbox("sales@globex.test", keep_objects=False)),
    ]
    async with make_poller(routes) as (poller, _):
        await drain(poller)
    assert len(await copies(pool)) == 2
    assert aws.keys() == ["in/m"]  # acme keeps the S3 object as its raw copy


async def test_keep_objects_false_duplicate_delivery_is_no_dead_item(
    aws, make_poller, make_mailbox, pool, corpus
) -> None:
    # SQS delivers at least once: the second delivery comes after the object is gone
    await make_mailbox("acme", "support", provider="ses")
    aws.put("in/m", corpus_file(corpus, ISSUE_82))
    aws.send(ses_notification(aws.bucket, "in/m", "ses-1", [SUPPORT]))
    aws.send(ses_notification(aws.bucket, "in/m", "ses-1", [SUPPORT]))
    routes = [("acme", "support", mailbox(SUPPORT, keep_objects=False))]
    async with make_poller(routes, max_messages=1) as (poller, _):
        await drain(poller)
    assert await copies(pool) == [("acme", "support", "ses-1")]
    assert aws.queue_counts() == (0, 0)
    assert await dead(pool) == []  # the message is stored: nothing is dead


# --- the database unavailable: nothing deleted, nothing dead ----------------------------------


async def database_down(batch: IngestBatch) -> list[ItemResult]:
    """What IngestStage answers when PostgreSQL does not (every item retriable)."""
    return [
        ItemResult(i, Outcome.RETRIABLE_FAILURE, detail="ConnectionRefusedError")
        for i in range(len(batch.items))
    ]


async def test_ingest_retriable_leaves_the_message_in_flight_then_stores_it_once(
    aws, make_poller, make_mailbox, pool, corpus
) -> None:
    await make_mailbox("acme", "support", provider="ses")
    aws.put("in/m", corpus_file(corpus, ISSUE_82))
    aws.send(ses_notification(aws.bucket, "in/m", "ses-1", [SUPPORT]))
    routes = [("acme", "support", mailbox(SUPPORT))]
    async with make_poller(routes, ingest=database_down) as (poller, events):
        received = await drain(poller)
    assert aws.queue_counts() == (0, 1)  # not deleted: in flight until its visibility ends
    assert events.counts.get("left") == 1 and events.errors
    assert "deleted" not in events.counts or events.counts["deleted"] == 0
    assert await dead(pool) == [] and await unrouted(pool) == [] and await copies(pool) == []
    aws.release([m.receipt_handle for m in received])  # SQS shows it again
    assert aws.queue_counts() == (1, 0)
    async with make_poller(routes) as (poller, _):
        await drain(poller)
    assert await copies(pool) == [("acme", "support", "ses-1")]
    assert aws.queue_counts() == (0, 0)


async def test_an_outage_longer_than_the_receive_budget_does_not_make_poison(
    aws, make_poller, make_mailbox, pool, stage, corpus
) -> None:
    """While the database is down the poller stops receiving, so an outage longer
    than max_receive_count visibility timeouts does not turn the message into poison:
    it is stored once the database is back."""
    await make_mailbox("acme", "support", provider="ses")
    aws.put("in/m", corpus_file(corpus, ISSUE_82))
    aws.send(ses_notification(aws.bucket, "in/m", "ses-1", [SUPPORT]))
    routes = [("acme", "support", mailbox(SUPPORT))]
    outage_s = 25.0  # 2.5 visibility timeouts: a poller receiving on would use 3 receives
    started: list[float] = []

    def back() -> bool:
        return bool(started) and anyio.current_time() - started[0] > outage_s

    async def ingest(batch: IngestBatch) -> list[ItemResult]:
        if not started:
            started.append(anyio.current_time())
        return await stage.ingest(batch) if back() else await database_down(batch)

    async def ready() -> bool:
        return back()

    async with make_poller(
        routes, ingest=ingest, ready=ready, visibility_timeout_s=10, max_receive_count=2
    ) as (poller, events):
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(poller.run, stop)
            await eventually(
                lambda: events.counts.get("deleted"), 90, what="stored after the outage"
            )
            stop.set()
    assert events.counts.get("received") == 2  # once before the outage, once after
    assert events.counts.get("poison") is None
    assert await copies(pool) == [("acme", "support", "ses-1")]
    assert await dead(pool) == [] and await unrouted(pool) == []


@pytest.fixture
async def gone_pool(server_dsn: str):
    """A pool whose database was dropped: every connection attempt fails."""
    name = f"inboxd_gone_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(server_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        dsn = server_dsn.rsplit("/", 1)[0] + f"/{name}"
        gone = await asyncpg.create_pool(dsn, min_size=0, max_size=2)
        await admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
    finally:
        await admin.close()
    try:
        yield gone
    finally:
        await gone.close()


async def test_database_gone_leaves_every_message_and_records_nothing(
    aws, make_poller, make_mailbox, pool, store, gone_pool, corpus
) -> None:
    await make_mailbox("acme", "support", provider="ses")
    aws.put("in/m", corpus_file(corpus, ISSUE_82))
    aws.send(ses_notification(aws.bucket, "in/m", "ses-1", [SUPPORT]))  # to store
    aws.send("not a pointer")  # to record as unrouted
    aws.send(ses_notification(aws.bucket, "in/gone", "ses-2", [SUPPORT]))  # dead item
    aws.send(ses_notification(aws.bucket, "in/m", "ses-3", ["x@elsewhere.test"]))  # unrouted
    routes = [("acme", "support", mailbox(SUPPORT, keep_objects=False))]
    down_stage = IngestStage(gone_pool, store)
    async with make_poller(routes, ingest=down_stage.ingest, unrouted_pool=gone_pool) as (
        poller,
        events,
    ):
        received = await drain(poller)
    assert len(received) == 4
    assert aws.queue_counts() == (0, 4)  # none deleted
    assert events.counts.get("left") == 4
    assert aws.keys() == ["in/m"]
    assert await copies(pool) == [] and await dead(pool) == [] and await unrouted(pool) == []
    # the database is back: SQS redelivers, each is settled once
    aws.release([m.receipt_handle for m in received])
    async with make_poller(routes) as (poller, _):
        await drain(poller)
    assert await copies(pool) == [("acme", "support", "ses-1")]
    assert await dead(pool) == [("acme", "support", "ses-2", "object_missing")]
    assert sorted(r["reason"] for r in await unrouted(pool)) == ["invalid_pointer", "no_mailbox"]
    assert aws.queue_counts() == (0, 0)


# --- routing -----------------------------------------------------------------------------------


async def test_two_recipients_of_two_tenants_one_row_in_each(
    aws, make_poller, make_mailbox, pool, corpus
) -> None:
    await make_mailbox("acme", "support", provider="ses")
    await make_mailbox("globex", "sales", provider="ses")
    raw = corpus_file(corpus, ISSUE_82)
    aws.put("in/m", raw)
    aws.send(
        ses_notification(
            aws.bucket, "in/m", "ses-1", ["Support+Case-7@acme.test", "sales@globex.test"]
        )
    )
    routes = [
        ("acme", "support", mailbox(SUPPORT)),
        ("globex", "sales", mailbox("@globex.test")),
    ]
    async with make_poller(routes) as (poller, events):
        await drain(poller)
    assert await copies(pool) == [("acme", "support", "ses-1"), ("globex", "sales", "ses-1")]
    sha = hashlib.sha256(raw).hexdigest()
    assert await message_rows(pool) == [("acme", "ses-1", sha), ("globex", "ses-1", sha)]
    assert aws.queue_counts() == (0, 0)
    assert (events.counts.get("stored"), events.counts.get("deleted")) == (2, 1)


async def test_two_recipients_of_one_mailbox_one_row(
    aws, make_poller, make_mailbox, pool, corpus
) -> None:
    await make_mailbox("acme", "support", provider="ses")
    aws.put("in/m", corpus_file(corpus, ISSUE_82))
    aws.send(ses_notification(aws.bucket, "in/m", "ses-1", [SUPPORT, "help@acme.test"]))
    async with make_poller([("acme", "support", mailbox(SUPPORT, "help@acme.test"))]) as (
        poller,
        _,
    ):
        await drain(poller)
    assert await copies(pool) == [("acme", "support", "ses-1")]


async def test_envelope_recipients_win_over_the_headers(
    aws, make_poller, make_mailbox, pool, corpus
) -> None:
    # a Bcc'd mailbox: the envelope names it, the headers name someone else
    await make_mailbox("acme", "support", provider="ses")
    await make_mailbox("acme", "user3", provider="ses")
    aws.put("in/m", corpus_file(corpus, UTF8_CHAR))  # To user3@example.com
    aws.send(ses_notification(aws.bucket, "in/m", "ses-1", [SUPPORT]))
    routes = [
        ("acme", "support", mailbox(SUPPORT)),
        ("acme", "user3", mailbox("user3@example.com")),
    ]
    async with make_poller(routes) as (poller, _):
        await drain(poller)
    assert await copies(pool) == [("acme", "support", "ses-1")]


@pytest.mark.parametrize(
    ("name", "address"),
    [
        (UTF8_CHAR, "user1@example.com"),  # Delivered-To only
        (UTF8_CHAR, "user3@example.com"),  # To (and Delivered-To)
        (LONG_LINES, "recipient2@example.com"),  # Cc
        (ISSUE_82, "info@test.org"),  # To
    ],
)
async def test_recipients_from_headers_when_the_pointer_names_none(
    name, address, aws, make_poller, make_mailbox, pool, corpus
) -> None:
    await make_mailbox("acme", "box", provider="ses")
    aws.put("in/m", corpus_file(corpus, name))
    aws.send(s3_event(aws.bucket, "in/m"))
    async with make_poller([("acme", "box", mailbox(address))]) as (poller, _):
        await drain(poller)
    assert await copies(pool) == [("acme", "box", "in/m")]
    assert aws.queue_counts() == (0, 0)


async def test_header_recipients_of_two_mailboxes_one_row_in_each(
    aws, make_poller, make_mailbox, pool, corpus
) -> None:
    await make_mailbox("acme", "one", provider="ses")
    await make_mailbox("globex", "three", provider="ses")
    aws.put("in/m", corpus_file(corpus, UTF8_CHAR))
    aws.send(versioned_pointer(aws.bucket, "in/m", None, []))
    routes = [
        ("acme", "one", mailbox("user1@example.com")),
        ("globex", "three", mailbox("user3@example.com")),
    ]
    async with make_poller(routes) as (poller, _):
        await drain(poller)
    assert await copies(pool) == [("acme", "one", "in/m"), ("globex", "three", "in/m")]


# --- the visibility heartbeat ------------------------------------------------------------------


async def test_a_heartbeat_racing_the_delete_of_its_batch_warns_of_no_lost_message(
    aws, make_poller, make_mailbox, stage, corpus, monkeypatch
) -> None:
    """The heartbeat takes the messages in flight, the batch ends and deletes them,
    then the heartbeat's ChangeMessageVisibilityBatch reaches SQS: the handles it
    names are gone because this poller deleted them, and that is no visibility
    lost (issue 22). The beat is held at the moment that race opens."""
    await make_mailbox("acme", "support", provider="ses")
    for i in range(3):
        aws.put(f"in/{i}", corpus_file(corpus, ISSUE_82))
        aws.send(ses_notification(aws.bucket, f"in/{i}", f"ses-{i}", [SUPPORT]))
    taken, deleted = anyio.Event(), anyio.Event()
    beats: list[anyio.abc.TaskGroup] = []

    async def ingest(batch: IngestBatch) -> list[ItemResult]:
        if not taken.is_set():  # a beat while the batch is in flight
            beats[0].start_soon(poller._extend)
            await taken.wait()
        return await stage.ingest(batch)

    async with make_poller([("acme", "support", mailbox(SUPPORT))], ingest=ingest) as (
        poller,
        events,
    ):
        real_delete, real_extend = poller._aws.delete, poller._aws.set_visibility

        async def delete(messages):
            stale = await real_delete(messages)
            deleted.set()
            return stale

        async def set_visibility(messages, seconds):
            taken.set()  # the beat has its list of messages in flight
            await deleted.wait()
            return await real_extend(messages, seconds)

        monkeypatch.setattr(poller._aws, "delete", delete)
        monkeypatch.setattr(poller._aws, "set_visibility", set_visibility)
        with structlog.testing.capture_logs() as logged:
            async with anyio.create_task_group() as tg:
                beats.append(tg)
                batch = await poller._aws.receive()
                assert len(batch) == 3
                await poller.process(batch)
    assert events.counts.get("deleted") == 3
    assert aws.queue_counts() == (0, 0)
    assert [e for e in logged if e["event"] == "ses_visibility_lost"] == []
