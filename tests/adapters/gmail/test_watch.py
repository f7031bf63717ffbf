"""WatchKeeper (adapters/gmail/watch.py) against the fake Gmail: the schedule, its
retries after refusals, and the ring after a lapse."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from datetime import datetime

import anyio
import pytest
from helpers import eventually

from inboxd.adapters.gmail.config import GmailMailbox, GmailSettings
from inboxd.adapters.gmail.source import GmailSource
from inboxd.adapters.gmail.watch import WATCH_RENEW_JITTER, WATCH_RENEW_PERIOD_S, WatchKeeper

from .conftest import ALICE, Ref, make_client, needs_fake

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
    # nothing lapsed (the first watch); the failure and the recovery each rang a
    # sync, so that the status says the watch is failing, then no more
    assert len(rings) == 2


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


async def test_a_mailbox_removed_while_a_renewal_is_on_its_way_is_left_without_a_watch(
    fake,
) -> None:
    """The fleet calls forget() (users.stop) while the mailbox's runner, and so its
    watch schedule, still runs. A renewal already sent must not reach Gmail after
    the stop, and none may start after it: Gmail would go on publishing the removed
    mailbox's changes for 7 days."""
    settings = GmailSettings(
        client_id=fake.client_id,
        client_secret=Ref(fake.client_secret),
        topic=TOPIC,
        api_url=fake.base_url,
        token_url=fake.token_url,
    )
    mailbox = GmailMailbox(address=ALICE, refresh_token=Ref(fake.issue_refresh_token(ALICE)))

    async def known(ids: list[str]) -> set[str]:
        return set()

    source = GmailSource("acme", "alice", settings, mailbox, known, watch_renew_period_s=0.05)
    box = fake.mailbox(ALICE)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(source.watch, lambda: None)
            await eventually(lambda: box.watch, DEADLINE_S, what="the first watch")
            # the next renewal is on its way when the mailbox is removed
            gate = fake.hold("users.watch")
            await eventually(lambda: fake.held.get("users.watch"), DEADLINE_S, what="a renewal")
            forgotten = anyio.Event()

            async def forget() -> None:
                await source.forget()
                forgotten.set()

            tg.start_soon(forget)
            calls = getattr(source._watch, "_calls", None)  # the keeper's call lock

            def under_way() -> bool:
                if fake.counters.calls_of("users.stop", ALICE):
                    return True  # users.stop reached Gmail while the renewal was held
                return calls is not None and calls.statistics().tasks_waiting > 0

            # forget() under way: its users.stop answered, or it waits for the renewal
            await eventually(
                under_way,
                DEADLINE_S,
                what="forget() under way",
            )
            gate.set()
            await eventually(forgotten.is_set, DEADLINE_S, what="forget() done")
            # the held renewal reached Gmail by now, before or after the stop
            await eventually(
                lambda: fake.counters.calls_of("users.watch", ALICE) >= 2,
                DEADLINE_S,
                what="the held renewal answered",
            )
            assert fake.counters.calls_of("users.stop", ALICE) == 1
            # a schedule still running after forget() renews nothing
            renewals = fake.counters.calls_of("users.watch", ALICE)
            stopped_at = time.monotonic()
            await eventually(
                lambda: time.monotonic() - stopped_at > 20 * 0.05,
                DEADLINE_S,
                what="twenty renewal periods",
            )
            assert fake.counters.calls_of("users.watch", ALICE) == renewals
            tg.cancel_scope.cancel()
    finally:
        await source.aclose()
    assert box.watch is None
