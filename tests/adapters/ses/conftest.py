"""A queue and a bucket on moto's server, and a poller wired to a real ingest stage."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest
from helpers.ses_queue import REGION, Aws, make_queue

from inboxd.adapters.ses import AwsClients, Router, SesMailbox, SesPoller, SesSettings, Unrouted
from inboxd.pipeline.ingest import IngestStage
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
def make_poller(
    aws: Aws, pool, stage: IngestStage
) -> Callable[..., AsyncIterator[tuple[SesPoller, Events]]]:
    """Factory: an SesPoller on the test's queue, mailboxes as (tenant, mailbox, SesMailbox)."""

    def make(mailboxes: list[tuple[str, str, SesMailbox]], **settings: object):
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
                pool,
                "ses:test",
                item.external_id,
                item.reason,
                item.detail,
                item.body,
                item.recipients,
            )

        async def room() -> None:
            return None

        class _Ctx:
            async def __aenter__(self):
                self.clients = AwsClients(config)
                aws_clients = await self.clients.__aenter__()
                return SesPoller(
                    config,
                    aws_clients,
                    router=Router(mailboxes),
                    ingest=stage.ingest,
                    room=room,
                    record_unrouted=unrouted,
                    events=events,
                ), events

            async def __aexit__(self, *exc: object) -> None:
                await self.clients.__aexit__(*exc)

        return _Ctx()

    return make
