"""The door as a pipeline (issue 25): receives go on while earlier messages are
fetched and ingested, a slow S3 object delays only its own message, ingest batches
and deletions gather across receives, and a cancel anywhere loses nothing.

Against the in-memory SQS/S3 stand-in (tests/fakes/ses_aws.py), which can hold one
object's GET until the test lets it go, and a real PostgreSQL (ingest stage, rows).
"""

from __future__ import annotations

import uuid
from email.message import EmailMessage

import anyio
import orjson
import pytest
from helpers.ses_queue import copies, dead, unrouted, versioned_pointer
from helpers.waiting import eventually

from inboxd.adapters.ses import SesMailbox
from inboxd.pipeline.ingest.stage import IngestBatch, IngestStage
from inboxd.pipeline.outcomes import ItemResult

pytestmark = pytest.mark.slow

SUPPORT = "support@acme.test"
ROUTES = [("acme", "support", SesMailbox.from_settings({"addresses": [SUPPORT]}))]
WAIT_S = 30


def raw_message(n: int, tag: str) -> bytes:
    msg = EmailMessage()
    msg["From"] = f"sender{n}@example.org"
    msg["To"] = SUPPORT
    msg["Subject"] = f"{tag} {n}"
    msg["Message-ID"] = f"<{tag}-{n}-{uuid.uuid4().hex}@example.org>"
    msg["Date"] = "Tue, 01 Dec 2026 10:00:00 +0000"
    msg.set_content(f"message {n} of {tag}\n")
    return msg.as_bytes()


def queue_mail(fake_aws, tag: str, n: int, start: int = 0) -> list[str]:
    """Upload n messages and queue a pointer to each; answers their SES ids."""
    ids = []
    for i in range(start, start + n):
        key, ses = f"in/{tag}/{i}", f"{tag}-{i}"
        fake_aws.fake.put(fake_aws.bucket, key, raw_message(i, tag))
        pointer = versioned_pointer(fake_aws.bucket, key, ses, [SUPPORT])
        fake_aws.fake.send(fake_aws.queue_url, orjson.dumps(pointer).decode())
        ids.append(ses)
    return ids


def stored_ids(rows) -> list[str]:
    return sorted(r[2] for r in rows)


async def test_a_slow_object_delays_only_its_own_message(
    fake_aws, make_fake_poller, make_mailbox, pool
) -> None:
    """One receive of ten, the first object's GET stalled: the other nine become rows
    and leave the queue, and so do the messages of later receives, while the slow
    one stays in flight; once its GET answers it is stored too. One receive loop, so
    a loop waiting for its batch would store none of them."""
    await make_mailbox("acme", "support", provider="ses")
    first = queue_mail(fake_aws, "first", 10)
    slow_key = "in/first/0"
    fake_aws.fake.hold[slow_key] = anyio.Event()
    stop = anyio.Event()
    async with make_fake_poller(ROUTES, pollers=1, max_messages=10) as (poller, sink):
        async with anyio.create_task_group() as tg:
            tg.start_soon(poller.run, stop)
            await eventually(
                lambda: fake_aws.fake.gets.get(slow_key, 0), WAIT_S, what="the slow GET"
            )
            assert len(fake_aws.fake.receives[0]) == 10  # the slow one's receive
            later = queue_mail(fake_aws, "later", 15)  # later receives
            want = sorted(first[1:] + later)
            await eventually(
                lambda: copies(pool),
                WAIT_S,
                what="every message but the slow one stored",
                until=lambda rows: stored_ids(rows) == want,
            )
            await eventually(
                fake_aws.counts, WAIT_S, what="all but the slow one deleted", until=(0, 1).__eq__
            )
            assert sink.counts.get("deleted") == 24
            fake_aws.fake.hold[slow_key].set()
            await eventually(
                lambda: copies(pool), WAIT_S, what="the slow one", until=lambda r: len(r) == 25
            )
            await eventually(fake_aws.counts, WAIT_S, what="an empty queue", until=(0, 0).__eq__)
            stop.set()
    assert stored_ids(await copies(pool)) == sorted(first + later)
    assert fake_aws.fake.gets[slow_key] == 1
    assert sink.counts.get("left") is None and sink.counts.get("released") is None
    assert await dead(pool) == [] and await unrouted(pool) == []


async def test_ingest_batches_and_deletions_gather_across_receives(
    fake_aws, make_fake_poller, make_mailbox, pool, stage: IngestStage
) -> None:
    """Receives of two messages each; while the first ingest batch is held, later
    receives' messages are fetched and wait: the next batch holds the copies of
    several receives, and one DeleteMessageBatch names messages of several."""
    await make_mailbox("acme", "support", provider="ses")
    ids = queue_mail(fake_aws, "gather", 12)
    sizes: list[int] = []
    held = anyio.Event()

    async def ingest(batch: IngestBatch) -> list[ItemResult]:
        sizes.append(len(batch.items))
        if len(sizes) == 1:
            await held.wait()
        return await stage.ingest(batch)

    stop = anyio.Event()
    async with make_fake_poller(
        ROUTES, ingest=ingest, pollers=1, max_messages=2, max_in_flight=20
    ) as (poller, sink):
        async with anyio.create_task_group() as tg:
            tg.start_soon(poller.run, stop)
            # every message received and fetched while the first batch is held
            await eventually(
                lambda: sum(len(r) for r in fake_aws.fake.receives),
                WAIT_S,
                what="all twelve received",
                until=lambda n: n == 12,
            )
            await eventually(
                lambda: len(fake_aws.fake.gets), WAIT_S, what="all fetched", until=(12).__eq__
            )
            held.set()
            await eventually(fake_aws.counts, WAIT_S, what="an empty queue", until=(0, 0).__eq__)
            stop.set()
    assert stored_ids(await copies(pool)) == sorted(ids)
    assert max(fake_aws.fake.receives, key=len) and all(len(r) <= 2 for r in fake_aws.fake.receives)
    assert max(sizes) > 2, sizes  # one batch holds copies of more than one receive
    assert sum(sizes) == 12
    receive_of = {mid: n for n, r in enumerate(fake_aws.fake.receives) for mid in r}
    spans = [len({receive_of[mid] for mid in call}) for call in fake_aws.fake.deletes]
    assert max(spans) > 1, fake_aws.fake.deletes  # a deletion of several receives
    assert sink.counts.get("deleted") == 12 and sink.counts.get("stored") == 12


async def test_receiving_stops_at_max_in_flight(
    fake_aws, make_fake_poller, make_mailbox, pool
) -> None:
    """Objects that do not come: the loop receives until max_in_flight messages are
    in flight and then waits, whatever is visible; once they come, it goes on."""
    await make_mailbox("acme", "support", provider="ses")
    ids = queue_mail(fake_aws, "bound", 12)
    for i in range(12):
        fake_aws.fake.hold[f"in/bound/{i}"] = anyio.Event()
    stop = anyio.Event()
    async with make_fake_poller(ROUTES, pollers=2, max_messages=2, max_in_flight=5) as (
        poller,
        _,
    ):
        async with anyio.create_task_group() as tg:
            tg.start_soon(poller.run, stop)
            await eventually(
                lambda: fake_aws.counts()[1], WAIT_S, what="messages in flight", until=(5).__ge__
            )
            await anyio.sleep(0.5)  # room for a loop that would receive more
            visible, in_flight = fake_aws.counts()
            assert in_flight <= 5 and visible + in_flight == 12
            # two loops, never more than max_in_flight between them (each receive
            # takes its share before it goes out)
            assert sum(len(r) for r in fake_aws.fake.receives) <= 5
            for event in fake_aws.fake.hold.values():
                event.set()
            await eventually(fake_aws.counts, WAIT_S, what="an empty queue", until=(0, 0).__eq__)
            stop.set()
    assert stored_ids(await copies(pool)) == sorted(ids)


@pytest.mark.parametrize("where", ["fetching", "ingesting", "deleting"])
async def test_cancelled_mid_pipeline_releases_every_message_and_loses_nothing(
    where: str, fake_aws, make_fake_poller, make_mailbox, pool, stage: IngestStage
) -> None:
    """The drain deadline cancels the door with messages at each stage: every object
    held; or one held and the others in an ingest that does not answer, or
    committed with their deletion held. Every message is released at once
    (visible again, none deleted); a second run stores them all once, what had
    committed coming back as `duplicate`."""
    await make_mailbox("acme", "support", provider="ses")
    ids = queue_mail(fake_aws, "cut", 8)
    for i in range(8 if where == "fetching" else 1):
        fake_aws.fake.hold[f"in/cut/{i}"] = anyio.Event()
    reached = anyio.Event()
    never = anyio.Event()

    async def ingest(batch: IngestBatch) -> list[ItemResult]:
        if where == "ingesting":
            reached.set()
            await never.wait()
        return await stage.ingest(batch)

    stop = anyio.Event()
    async with make_fake_poller(ROUTES, ingest=ingest, pollers=1, max_messages=10) as (
        poller,
        sink,
    ):
        if where == "deleting":
            real_delete = poller._aws.delete

            async def delete(messages):
                reached.set()
                await never.wait()
                return await real_delete(messages)

            poller._aws.delete = delete  # type: ignore[method-assign]
        elif where == "fetching":
            reached.set()
        with anyio.move_on_after(WAIT_S) as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(poller.run, stop)
                await reached.wait()
                await eventually(
                    lambda: fake_aws.fake.gets.get("in/cut/0", 0), WAIT_S, what="the held GET"
                )
                await eventually(fake_aws.counts, WAIT_S, what="all in flight", until=(0, 8).__eq__)
                if where == "deleting":  # every message but the held one committed
                    await eventually(
                        lambda: copies(pool), WAIT_S, what="7 rows", until=lambda r: len(r) == 7
                    )
                tg.cancel_scope.cancel()  # the drain deadline
        assert not scope.cancelled_caught
    assert fake_aws.counts() == (8, 0)  # released, none deleted
    assert sink.counts.get("released") == 8
    assert sink.counts.get("deleted") is None
    committed = len(await copies(pool))
    assert committed == (7 if where == "deleting" else 0)
    for event in fake_aws.fake.hold.values():
        event.set()  # the objects come (to the second run)
    stop = anyio.Event()
    async with make_fake_poller(ROUTES) as (poller, again):
        async with anyio.create_task_group() as tg:
            tg.start_soon(poller.run, stop)
            await eventually(fake_aws.counts, WAIT_S, what="an empty queue", until=(0, 0).__eq__)
            stop.set()
    assert stored_ids(await copies(pool)) == sorted(ids)
    assert (again.counts.get("stored", 0), again.counts.get("duplicate", 0)) == (
        8 - committed,
        committed,
    )
    assert await dead(pool) == []


async def test_a_slow_object_past_the_visibility_timeout_stays_ours(
    fake_aws, make_fake_poller, make_mailbox, pool
) -> None:
    """The heartbeat covers a message waiting on its object: held past its visibility
    timeout, it is not received again, and is stored once when the object comes."""
    await make_mailbox("acme", "support", provider="ses")
    ids = queue_mail(fake_aws, "late", 3)
    fake_aws.fake.hold["in/late/0"] = anyio.Event()
    stop = anyio.Event()
    visibility_s = 10  # the least [ses] takes
    async with make_fake_poller(ROUTES, visibility_timeout_s=visibility_s) as (poller, sink):
        async with anyio.create_task_group() as tg:
            tg.start_soon(poller.run, stop)
            await eventually(fake_aws.counts, WAIT_S, what="two deleted", until=(0, 1).__eq__)
            await anyio.sleep(visibility_s * 1.5)
            assert fake_aws.counts() == (0, 1)  # still ours
            fake_aws.fake.hold["in/late/0"].set()
            await eventually(fake_aws.counts, WAIT_S, what="an empty queue", until=(0, 0).__eq__)
            stop.set()
    assert stored_ids(await copies(pool)) == sorted(ids)
    assert sink.counts.get("received") == 3  # none received twice
    assert fake_aws.fake.gets["in/late/0"] == 1
