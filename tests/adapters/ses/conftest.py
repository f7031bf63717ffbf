"""A queue and a bucket on moto's server, and a poller wired to a real ingest stage."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import asyncpg
import pytest
from helpers.ses_queue import REGION, TEST_DOOR, Aws, make_queue

from inboxd.adapters.ses import AwsClients, Router, SesMailbox, SesPoller, SesSettings, Unrouted
from inboxd.pipeline.copies import known_copies
from inboxd.pipeline.ingest.stage import IngestStage
from inboxd.pipeline.queue_doors import record_unrouted


@dataclass
class Events:
    """PollerEvents that remembers what it heard."""

    counts: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

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
    SesPoller on the test's queue; mailboxes as (tenant, mailbox, SesMailbox).
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
    ) -> AsyncIterator[tuple[SesPoller, Events]]:
        config = SesSettings.from_settings(
            {
                "queue_url": aws.queue_url,
                "endpoint_url": aws.endpoint,
                "region": REGION,
                "wait_time_s": 0,
                **settings,
            }
        )
        events = Events()

        async def unrouted(item: Unrouted) -> None:
            await record_unrouted(
                unrouted_pool or pool,
                TEST_DOOR,
                item.external_id,
                item.reason,
                item.detail,
                item.body,
                item.recipients,
            )

        async def room() -> None:
            return None

        async def always_ready() -> bool:
            return True

        async def stored(mailboxes: list[tuple[str, str]], external_id: str) -> bool:
            for tenant, mailbox in mailboxes:
                if await known_copies(unrouted_pool or pool, tenant, mailbox, [external_id]):
                    return True
            return False

        async with AwsClients(config) as clients:
            yield (
                SesPoller(
                    config,
                    clients,
                    router=Router(mailboxes),
                    ingest=ingest or stage.ingest,
                    room=room,
                    record_unrouted=unrouted,
                    events=events,
                    stored=stored,
                    ready=ready or always_ready,
                    check_body=check_body,
                ),
                events,
            )

    return make
