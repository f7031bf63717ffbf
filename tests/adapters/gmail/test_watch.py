"""WatchKeeper (adapters/gmail/watch.py) against the fake Gmail: the schedule, its
retries after refusals, and the ring after a lapse."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from datetime import datetime

import anyio
import pytest
from helpers import eventually

from inboxd.adapters.gmail.watch import WATCH_RENEW_JITTER, WATCH_RENEW_PERIOD_S, WatchKeeper

from .conftest import ALICE, make_client, needs_fake

pytestmark = needs_fake

TOPIC = "projects/acme-project/topics/gmail"
DEADLINE_S = 30.0


@pytest.fixture
async def fake() -> AsyncIterator[object]:
    from fakes.gmail import FakeGmail

    async with FakeGmail([ALICE], quota_units_per_s=None) as server:
        yield server


async def test_refused_renewals_are_retried_with_backoff_until_one_is_recorded(fake, http) -> None:
    client = make_client(fake, http)
    recorded: list[datetime] = []

    async def record(expires_at: datetime) -> None:
        recorded.append(expires_at)

    # a topic Gmail may not publish to yet (403), then a 500 past the client's retries
    fake.faults.fail_next_calls(2, status=403, methods={"users.watch"})
    keeper = WatchKeeper("m", TOPIC, ["INBOX"], record, retry_initial_s=0.01, retry_max_s=0.05)
    rings: list[None] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(keeper.run, lambda: client, lambda: rings.append(None))
        await eventually(lambda: recorded, DEADLINE_S, what="a recorded watch")
        tg.cancel_scope.cancel()
    assert fake.counters.calls_of("users.watch", ALICE) == 3
    assert fake.mailbox(ALICE).watch is not None
    assert keeper.expires_at == recorded[0].timestamp()
    assert rings == []  # the first watch: nothing lapsed


async def test_a_renewal_after_a_lapse_rings_for_a_sync(fake, http) -> None:
    client = make_client(fake, http)
    fake.watch_ttl_ms = 2000
    keeper = WatchKeeper("m", TOPIC, ["INBOX"], retry_initial_s=0.01, retry_max_s=0.05)
    keeper.expires_at = time.time() - 1  # the last watch lapsed while renewals failed
    rings: list[None] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(keeper.run, lambda: client, lambda: rings.append(None))
        await eventually(lambda: rings, DEADLINE_S, what="a ring")
        tg.cancel_scope.cancel()
    assert len(rings) == 1


def test_the_next_renewal_is_a_day_or_half_the_remaining_life_less_jitter() -> None:
    keeper = WatchKeeper("m", TOPIC, ["INBOX"])
    now = 1_000_000.0
    keeper.expires_at = now + 7 * 24 * 3600
    wait_s = keeper.next_wait_s(now)
    assert WATCH_RENEW_PERIOD_S * (1 - WATCH_RENEW_JITTER) <= wait_s <= WATCH_RENEW_PERIOD_S
    keeper.expires_at = now + 10
    assert 5 * (1 - WATCH_RENEW_JITTER) <= keeper.next_wait_s(now) <= 5
    keeper.expires_at = now - 10  # lapsed: renew soon, never in a hot loop
    assert keeper.next_wait_s(now) == 1.0
