"""Persist first: one row per provider event, one transaction per request."""

from __future__ import annotations

import hashlib
import time

import anyio
import asyncpg
import pytest
from delivery_helpers import POLICY, event, store_events, wait_until
from helpers.db import rows_in

from inboxd.pipeline.delivery.intake import (
    DeliveryIntake,
    IntakeUnavailable,
    ReplayedToken,
    Stored,
)
from inboxd.pipeline.delivery.model import DeliveryEvent, EventType
from inboxd.pipeline.tenancy import ensure_tenants


async def test_batch_with_one_duplicate_keeps_the_new_event(pool: asyncpg.Pool) -> None:
    first = event(EventType.DELIVERED, eid="sg-1")
    assert (await store_events(pool, [first])).new == 1
    stored = await store_events(pool, [first, event(EventType.OPENED, eid="sg-2", minute=3)])
    assert (stored.new, stored.duplicates) == (1, 1)
    assert await rows_in(pool, "delivery_events") == 2


async def test_row_holds_the_minimised_payload_and_hashed_key(pool: asyncpg.Pool) -> None:
    await store_events(pool, [event(EventType.BOUNCED, eid="b-1", mid="<ABC@Mail.Example>")])
    async with pool.acquire() as conn:
        row = await conn.fetchrow("SELECT * FROM delivery_events")
    assert row["payload"] == '{"kind": "bounced"}'  # secret_body was not allowlisted
    assert row["dedup_key"] == "id:b-1"
    assert row["state"] == "pending"
    assert row["message_id_norm"] == "ABC@mail.example"
    assert row["recipient_hash"] == hashlib.sha256(b"ann@example.com").hexdigest()
    assert row["bounce_type"] == "permanent"


async def test_events_without_ids_are_fingerprinted(pool: asyncpg.Pool) -> None:
    a = DeliveryEvent(
        provider_event_id=None,
        provider_type="Open",
        event_type=EventType.OPENED,
        occurred_at=None,
        payload={"MessageID": "m1", "ReceivedAt": "t1"},
    )
    b = DeliveryEvent(
        provider_event_id=None,
        provider_type="Open",
        event_type=EventType.OPENED,
        occurred_at=None,
        payload={"MessageID": "m1", "ReceivedAt": "t2"},
    )
    assert (await store_events(pool, [a, b])).new == 2
    assert (await store_events(pool, [a])).new == 0  # the provider's retry
    assert await rows_in(pool, "delivery_events") == 2


async def test_same_event_concurrently_is_one_row(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        await ensure_tenants(conn, ["acme"])
    intake = DeliveryIntake(pool)
    outcomes = []
    async with anyio.create_task_group() as tg:
        await tg.start(intake.run)

        async def post() -> None:
            outcomes.append(
                await intake.submit(
                    "acme",
                    "esp",
                    "test",
                    [event(EventType.DELIVERED, eid="same")],
                    POLICY,
                    received_at=time.time(),
                )
            )

        async with anyio.create_task_group() as posts:
            for _ in range(20):
                posts.start_soon(post)
        tg.cancel_scope.cancel()
    assert sorted(o.new for o in outcomes) == [0] * 19 + [1]
    assert await rows_in(pool, "delivery_events") == 1


async def test_replayed_token_is_refused_and_stores_nothing(pool: asyncpg.Pool) -> None:
    await store_events(pool, [event(EventType.DELIVERED, eid="mg-1")], token="tok-1")
    with pytest.raises(ReplayedToken):
        await store_events(pool, [event(EventType.OPENED, eid="mg-2")], token="tok-1")
    assert await rows_in(pool, "delivery_events") == 1
    assert await rows_in(pool, "webhook_replay_tokens") == 1


async def test_nul_characters_are_stored_not_refused(pool: asyncpg.Pool) -> None:
    bad = DeliveryEvent(
        provider_event_id="n\x00ul",
        provider_type="t\x00",
        event_type=EventType.UNKNOWN,
        occurred_at=None,
        payload={"kind": "a\x00b"},
    )
    assert (await store_events(pool, [bad])).new == 1


async def test_lost_database_raises_unavailable(db_dsn: str) -> None:
    pool = await asyncpg.create_pool(db_dsn, min_size=0, max_size=2)
    async with pool.acquire() as conn:
        await ensure_tenants(conn, ["acme"])
    intake = DeliveryIntake(pool)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(intake.run)
            await pool.expire_connections()
            await pool.close()
            with pytest.raises(IntakeUnavailable):
                await intake.submit(
                    "acme",
                    "esp",
                    "test",
                    [event(EventType.DELIVERED)],
                    POLICY,
                    received_at=time.time(),
                )
            tg.cancel_scope.cancel()
    finally:
        pool.terminate()


async def test_stopping_while_isolating_a_bad_request_settles_every_waiter(
    pool: asyncpg.Pool,
) -> None:
    """A group with a request of an unknown tenant (FK violation) is retried one
    request at a time; the intake stops while a good request of it is blocked.
    Every waiter must get an answer, none may hang."""
    async with pool.acquire() as conn:
        await ensure_tenants(conn, ["acme"])
    intake = DeliveryIntake(pool, writers=1)  # one writer: the three requests form one group
    outcomes: list[object] = []
    async with pool.acquire() as locker:
        locker_tx = locker.transaction()
        await locker_tx.start()
        # The FK check of acme's rows needs KEY SHARE on this row: they wait.
        await locker.execute("SELECT 1 FROM tenants WHERE tenant_id = 'acme' FOR UPDATE")

        async def post(tenant: str, eid: str) -> None:
            try:
                outcomes.append(
                    await intake.submit(
                        tenant,
                        "esp",
                        "test",
                        [event(EventType.DELIVERED, eid=eid)],
                        POLICY,
                        received_at=time.time(),
                    )
                )
            except (IntakeUnavailable, asyncpg.ForeignKeyViolationError) as exc:
                outcomes.append(exc)

        with anyio.fail_after(20):
            async with anyio.create_task_group() as posts:  # outlives the intake
                async with anyio.create_task_group() as tg:
                    await tg.start(intake.run)
                    # "aaa" sorts first: its FK violation fails the group at once.
                    for tenant, eid in (("aaa", "bad"), ("acme", "g1"), ("acme", "g2")):
                        posts.start_soon(post, tenant, eid)
                    # waits of this database's sessions only: other xdist workers' tests
                    # wait on locks of their own (a row lock's wait names no database)
                    await wait_until(
                        pool,
                        "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
                        "WHERE NOT l.granted AND a.datname = current_database()",
                        lambda n: n > 0,
                    )
                    tg.cancel_scope.cancel()  # the intake stops mid-isolation
        await locker_tx.rollback()
    assert len(outcomes) == 3  # nobody hangs
    assert sum(isinstance(o, asyncpg.ForeignKeyViolationError) for o in outcomes) == 1
    assert sum(isinstance(o, IntakeUnavailable) for o in outcomes) == 2


async def test_one_bad_request_fails_alone_and_its_group_commits(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        await ensure_tenants(conn, ["acme"])
    intake = DeliveryIntake(pool, writers=1)  # one writer: the requests form one group
    outcomes: dict[str, object] = {}

    async def post(tenant: str, eid: str) -> None:
        try:
            outcomes[eid] = await intake.submit(
                tenant,
                "esp",
                "test",
                [event(EventType.DELIVERED, eid=eid)],
                POLICY,
                received_at=time.time(),
            )
        except asyncpg.ForeignKeyViolationError as exc:
            outcomes[eid] = exc

    async with anyio.create_task_group() as tg:
        await tg.start(intake.run)
        async with anyio.create_task_group() as posts:
            for i in range(8):
                posts.start_soon(post, "nobody" if i == 5 else "acme", f"e{i}")
        tg.cancel_scope.cancel()
    assert isinstance(outcomes.pop("e5"), asyncpg.ForeignKeyViolationError)
    assert all(o == Stored(1, 0) for o in outcomes.values()) and len(outcomes) == 7
    assert await rows_in(pool, "delivery_events") == 7
