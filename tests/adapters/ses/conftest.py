"""A queue and a bucket on moto's server (or on the in-memory stand-in,
tests/fakes/ses_aws.py, where a test must hold one S3 object), and a poller wired
to a real ingest stage."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import asyncpg
import pytest
from fakes.ses_aws import FakeSesAws
from helpers.moto_server import isolate_aws_environment
from helpers.ses_queue import REGION, TEST_DOOR, Aws, make_queue

from inboxd.adapters.base import Unrouted
from inboxd.adapters.ses import AwsClients, Router, SesMailbox, SesPoller, SesSettings
from inboxd.adapters.ses.tables import record_unrouted
from inboxd.pipeline.copies import known_copies
from inboxd.pipeline.ingest.stage import IngestBatch, IngestStage
from inboxd.pipeline.outcomes import ItemResult


@dataclass
class Sink:
    """A QueueSink (adapters/base.py) over the test's ingest stage and database, that
    remembers the counters and errors it heard. `ingest` / `pool` (where unrouted
    records are written and copies looked up) / `ready` replace the real ones."""

    ingest_with: Callable[[IngestBatch], Awaitable[list[ItemResult]]]
    pool: asyncpg.Pool
    ready: Callable[[], Awaitable[bool]] | None = None
    counts: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    async def ingest(self, batch: IngestBatch) -> list[ItemResult]:
        return await self.ingest_with(batch)

    async def wait_for_room(self) -> None:
        return None

    async def record_unrouted(self, item: Unrouted) -> None:
        await record_unrouted(
            self.pool,
            TEST_DOOR,
            item.external_id,
            item.reason,
            item.detail,
            item.body,
            item.recipients,
        )

    async def stored_in(self, mailboxes: Sequence[tuple[str, str]], external_id: str) -> bool:
        for tenant, mailbox in mailboxes:
            if await known_copies(self.pool, tenant, mailbox, [external_id]):
                return True
        return False

    async def database_ready(self) -> bool:
        return True if self.ready is None else await self.ready()

    def counted(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n

    def failed(self, error: str) -> None:
        self.errors.append(error)


@pytest.fixture
def aws(moto_endpoint: str) -> Aws:
    """A fresh queue and bucket of this test's own."""
    return make_queue(moto_endpoint)


@pytest.fixture
def make_poller(aws: Aws, pool: asyncpg.Pool, stage: IngestStage):
    """Factory: `async with make_poller(mailboxes, **settings) as (poller, events)`, an
    SesPoller on the test's queue with a `Sink` (its `counts`, `errors`); mailboxes as
    (tenant, mailbox, SesMailbox).
    `ingest` / `unrouted_pool` / `ready` replace the real ingest stage / the pool
    unrouted records are written to / the database probe (a database that is down);
    `check_body` is the SNS envelope check (none by default)."""

    @asynccontextmanager
    async def make(
        mailboxes: Sequence[tuple[str, str, SesMailbox]],
        *,
        ingest: Callable | None = None,
        unrouted_pool: asyncpg.Pool | None = None,
        ready: Callable | None = None,
        check_body: Callable | None = None,
        **settings: object,
    ) -> AsyncIterator[tuple[SesPoller, Sink]]:
        config = SesSettings.from_settings(
            {
                "queue_url": aws.queue_url,
                "endpoint_url": aws.endpoint,
                "region": REGION,
                "wait_time_s": 0,
                **settings,
            }
        )
        sink = Sink(ingest or stage.ingest, unrouted_pool or pool, ready)
        async with AwsClients(config) as clients:
            yield (
                SesPoller(
                    config, clients, router=Router(mailboxes), sink=sink, check_body=check_body
                ),
                sink,
            )

    return make


@dataclass
class FakeQueue:
    """The stand-in (tests/fakes/ses_aws.py) with one queue and one bucket."""

    fake: FakeSesAws
    queue_url: str
    bucket: str

    def counts(self) -> tuple[int, int]:
        """(visible, in flight) messages of the queue."""
        return self.fake.counts(self.queue_url)


@pytest.fixture
async def fake_aws(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FakeQueue]:
    """The in-memory SQS/S3 stand-in on a free port, with fake credentials in the
    environment (it checks none; botocore wants some) and no developer's profile."""
    isolate_aws_environment(monkeypatch, REGION)
    # every request's SigV4 signature checked: the door's own object GETs (aws.py
    # ObjectReader) are signed as the SDK's are
    async with FakeSesAws(secret_key="testing") as fake:
        queue_url = fake.create_queue("inbound")
        fake.buckets["mail-bucket"] = {}
        yield FakeQueue(fake, queue_url, "mail-bucket")


@pytest.fixture
def make_fake_poller(fake_aws: FakeQueue, pool: asyncpg.Pool, stage: IngestStage):
    """`make_poller` on the stand-in's queue: `async with make_fake_poller(mailboxes,
    ingest=…, **settings) as (poller, sink)`."""

    @asynccontextmanager
    async def make(
        mailboxes: Sequence[tuple[str, str, SesMailbox]],
        *,
        ingest: Callable | None = None,
        **settings: object,
    ) -> AsyncIterator[tuple[SesPoller, Sink]]:
        config = SesSettings.from_settings(
            {
                "queue_url": fake_aws.queue_url,
                "endpoint_url": fake_aws.fake.url,
                "region": REGION,
                "wait_time_s": 0,
                "verify_sns_signature": False,
                **settings,
            }
        )
        sink = Sink(ingest or stage.ingest, pool)
        async with AwsClients(config) as clients:
            yield SesPoller(config, clients, router=Router(mailboxes), sink=sink), sink

    return make
