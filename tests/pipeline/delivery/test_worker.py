"""Applying events: order-independent evidence, suppressions, retries, dead letters, replay."""

from __future__ import annotations

import itertools

import asyncpg
import pytest
from delivery_helpers import (
    apply_all,
    event,
    evidence,
    store_events,
    suppressions,
    wait_until,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inboxd.pipeline.delivery.model import BounceType, EventType
from inboxd.pipeline.delivery.worker import MAX_ATTEMPTS, apply_due, replay_events

E = EventType


async def outbox(pool: asyncpg.Pool) -> list[tuple[str, dict]]:
    import orjson

    async with pool.acquire() as conn:
        rows = await conn.fetch("SELECT kind, payload FROM events ORDER BY event_id")
    return [(r["kind"], orjson.loads(r["payload"])) for r in rows]


async def reset(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        await conn.execute(
            "TRUNCATE suppressions, delivery_evidence, delivery_events, events, "
            "webhook_replay_tokens"
        )


FOUR = [
    event(E.DELIVERED, minute=2),
    event(E.DEFERRED, minute=1),
    event(E.OPENED, minute=5),
    event(E.BOUNCED, minute=9),
]


async def test_every_order_of_four_events_gives_the_same_evidence(pool: asyncpg.Pool) -> None:
    seen = []
    for order in itertools.permutations(FOUR):
        await reset(pool)
        for one in order:  # one request and one apply per event: the worst interleaving
            await store_events(pool, [one])
            await apply_all(pool)
        seen.append(await evidence(pool))
    assert all(view == seen[0] for view in seen)
    (row,) = seen[0]
    assert row["status"] == "bounced"  # the bounce came after the delivery
    assert row["last_opened_at"] is not None and row["bounce_type"] == "permanent"
    assert row["delivered_at"] < row["bounced_at"]


async def test_late_deferral_never_overwrites_delivered(pool: asyncpg.Pool) -> None:
    await store_events(pool, [event(E.DELIVERED, minute=2)])
    await apply_all(pool)
    await store_events(
        pool, [event(E.DEFERRED, minute=1), event(E.DEFERRED, minute=7), event(E.OPENED, minute=8)]
    )
    await apply_all(pool)
    (row,) = await evidence(pool)
    assert row["status"] == "delivered"
    assert row["last_deferred_at"].minute == 7


async def test_suppressions_follow_the_rules(pool: asyncpg.Pool) -> None:
    await store_events(
        pool,
        [
            event(E.BOUNCED, rcpt="hard@x.example", bounce=BounceType.PERMANENT),
            event(E.BOUNCED, rcpt="soft@x.example", bounce=BounceType.TRANSIENT),
            event(E.BOUNCED, rcpt="maybe@x.example", bounce=BounceType.UNDETERMINED),
            event(E.COMPLAINED, rcpt="angry@x.example"),
            event(E.UNSUBSCRIBED, rcpt="news@x.example", list_id="weekly"),
            event(E.UNSUBSCRIBED, rcpt="all@x.example"),
            event(E.SUPPRESSED, rcpt="listed@x.example", bounce=BounceType.PERMANENT),
            event(E.SUPPRESSED, rcpt="dropped@x.example"),
        ],
    )
    await apply_all(pool)
    assert await suppressions(pool) == [
        ("all@x.example", "source:esp", "unsubscribe", "id:unsubscribed-0-pm-1-all@x.example"),
        ("angry@x.example", "all", "complaint", "id:complained-0-pm-1-angry@x.example"),
        ("hard@x.example", "all", "hard_bounce", "id:bounced-0-pm-1-hard@x.example"),
        ("listed@x.example", "all", "hard_bounce", "id:suppressed-0-pm-1-listed@x.example"),
        (
            "news@x.example",
            "list:esp:weekly",
            "unsubscribe",
            "id:unsubscribed-0-pm-1-news@x.example",
        ),
    ]
    kinds = [kind for kind, _ in await outbox(pool)]
    assert kinds.count("suppression.added") == 5


async def test_replay_changes_nothing(pool: asyncpg.Pool) -> None:
    await store_events(pool, [*FOUR, event(E.COMPLAINED, minute=10, rcpt="b@x.example")])
    await apply_all(pool)
    before = (await evidence(pool), await suppressions(pool), await outbox(pool))
    async with pool.acquire() as conn:
        assert await replay_events(conn) == 5
    await apply_all(pool)
    assert (await evidence(pool), await suppressions(pool), await outbox(pool)) == before


async def test_earliest_event_owns_the_suppression_whatever_the_order(pool: asyncpg.Pool) -> None:
    late = event(E.BOUNCED, minute=30, eid="late")
    early = event(E.COMPLAINED, minute=10, eid="early")
    await store_events(pool, [late])
    await apply_all(pool)
    await store_events(pool, [early])
    await apply_all(pool)
    assert await suppressions(pool) == [("Ann@Example.com", "all", "complaint", "id:early")]
    kinds = [kind for kind, _ in await outbox(pool)]
    assert kinds.count("suppression.added") == 1  # the takeover is not a new suppression
    assert kinds.count("suppression.updated") == 1  # but the application hears of it


async def test_correlates_with_the_outbound_message(pool: asyncpg.Pool, make_mailbox) -> None:
    from inboxd.pipeline.outbound import record_outbound

    tenant, mailbox = await make_mailbox("acme", "sent")
    async with pool.acquire() as conn:
        message_id = await record_outbound(
            conn,
            tenant_id=tenant,
            mailbox_id=mailbox,
            message_id_header="<Out-1@App.Example>",
            placeholder_message_id="pending_1",
            thread_id="pending_t1",
            from_address="a@app",
        )
    await store_events(pool, [event(E.DELIVERED, mid="<Out-1@app.example>")])
    await apply_all(pool)
    (row,) = await evidence(pool)
    assert row["message_id"] == message_id
    updated = [p for kind, p in await outbox(pool) if kind == "delivery.updated"]
    assert updated and updated[0]["status"] == "delivered"


@pytest.mark.own_database  # creates a trigger
async def test_failing_event_retries_then_dies_and_replays(pool: asyncpg.Pool) -> None:
    # A poison condition the worker cannot get past: evidence for this recipient fails.
    async with pool.acquire() as conn:
        await conn.execute("""
            CREATE FUNCTION poison() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
              IF NEW.recipient = 'poison@x.example' THEN RAISE EXCEPTION 'poisoned'; END IF;
              RETURN NEW;
            END $$;
            CREATE TRIGGER poison BEFORE INSERT ON delivery_evidence
              FOR EACH ROW EXECUTE FUNCTION poison();""")
    await store_events(
        pool, [event(E.DELIVERED, rcpt="ok@x.example"), event(E.DELIVERED, rcpt="poison@x.example")]
    )
    await apply_all(pool)
    assert [r["recipient"] for r in await evidence(pool)] == ["ok@x.example"]
    for _ in range(MAX_ATTEMPTS):
        async with pool.acquire() as conn:
            await conn.execute(
                "UPDATE delivery_events SET next_attempt_at = now() WHERE state = 'pending'"
            )
        await apply_due(pool)
    async with pool.acquire() as conn:
        dead = await conn.fetchrow(
            "SELECT attempts, last_error FROM delivery_events WHERE state = 'dead'"
        )
        assert dead["attempts"] == MAX_ATTEMPTS and "poisoned" in dead["last_error"]
        await conn.execute("DROP TRIGGER poison ON delivery_evidence")
        assert await replay_events(conn, dead_only=True) == 1
    await apply_all(pool)
    assert sorted(r["recipient"] for r in await evidence(pool)) == [
        "ok@x.example",
        "poison@x.example",
    ]


async def test_backoff_is_bounded_and_jittered() -> None:
    import random

    from inboxd.pipeline.delivery.worker import BACKOFF_CAP_S, backoff_s

    rng = random.Random(4)
    delays = [backoff_s(n, rng=rng) for n in range(1, 30)]
    assert all(1.0 <= d <= BACKOFF_CAP_S for d in delays)
    assert len(set(delays)) == len(delays)


KINDS = [E.ACCEPTED, E.DELIVERED, E.DEFERRED, E.BOUNCED, E.OPENED, E.CLICKED, E.COMPLAINED]


@st.composite
def event_sets(draw: st.DrawFn) -> tuple[list, list[int]]:
    picks = draw(
        st.lists(
            st.tuples(
                st.sampled_from(KINDS),
                st.integers(0, 5),
                st.sampled_from([BounceType.PERMANENT, BounceType.TRANSIENT]),
            ),
            min_size=1,
            max_size=8,
        )
    )
    events = [
        event(
            kind,
            minute=minute,
            eid=f"e{i}",
            rcpt=f"r{i % 2}@x.example",
            bounce=bounce if kind is E.BOUNCED else None,
        )
        for i, (kind, minute, bounce) in enumerate(picks)
    ]
    order = draw(st.permutations(range(len(events))))
    split = draw(st.integers(1, len(events)))
    return events, list(order), split


@pytest.mark.slow
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=event_sets())
async def test_any_arrival_order_and_batching_gives_the_same_view(
    pool: asyncpg.Pool, case: tuple
) -> None:
    events, order, split = case
    await reset(pool)
    await store_events(pool, events)
    await apply_all(pool)
    expected = (await evidence(pool), await suppressions(pool))
    await reset(pool)
    shuffled = [events[i] for i in order]
    for chunk in (shuffled[:split], shuffled[split:]):
        if chunk:
            await store_events(pool, chunk)
            await apply_all(pool)
    assert (await evidence(pool), await suppressions(pool)) == expected


@pytest.mark.parametrize("dead_only", [True, False])
async def test_replay_filters(pool: asyncpg.Pool, dead_only: bool) -> None:
    await store_events(pool, [event(E.DELIVERED)], source="a")
    await store_events(pool, [event(E.DELIVERED)], source="b")
    await apply_all(pool)
    async with pool.acquire() as conn:
        assert await replay_events(conn, source="a", dead_only=dead_only) == (0 if dead_only else 1)


async def test_replay_in_small_batches_never_takes_evidence_back(pool: asyncpg.Pool) -> None:
    await store_events(
        pool,
        [event(E.ACCEPTED, minute=0), event(E.DELIVERED, minute=1), event(E.BOUNCED, minute=2)],
    )
    await apply_all(pool)
    before = (await evidence(pool), await outbox(pool))
    async with pool.acquire() as conn:
        assert await replay_events(conn) == 3
    while await apply_due(pool, limit=1):
        assert (await evidence(pool))[0]["status"] == "bounced"
    assert (await evidence(pool), await outbox(pool)) == before


@pytest.mark.own_database  # renames a table
async def test_worker_outlives_database_errors(pool: asyncpg.Pool, db_dsn: str) -> None:
    import anyio

    from inboxd.pipeline.delivery.worker import run_worker

    async with pool.acquire() as conn:
        await conn.execute("ALTER TABLE delivery_evidence RENAME TO delivery_evidence_away")
    await store_events(pool, [event(E.DELIVERED)])
    async with anyio.create_task_group() as tg:
        await tg.start(run_worker, pool, db_dsn)
        # The worker fails on the missing table, backs the row off, and lives on.
        await wait_until(pool, "SELECT attempts FROM delivery_events", lambda n: n > 0)
        async with pool.acquire() as conn:
            await conn.execute("ALTER TABLE delivery_evidence_away RENAME TO delivery_evidence")
            await conn.execute("UPDATE delivery_events SET next_attempt_at = now()")
            await conn.execute("NOTIFY inboxd_delivery")
        await wait_until(pool, "SELECT count(*) FROM delivery_evidence", lambda n: n == 1)
        tg.cancel_scope.cancel()


async def test_correlates_by_the_providers_message_id(pool: asyncpg.Pool, make_mailbox) -> None:
    from inboxd.pipeline.outbound import record_outbound

    tenant, mailbox = await make_mailbox("acme", "sent")
    async with pool.acquire() as conn:
        message_id = await record_outbound(
            conn,
            tenant_id=tenant,
            mailbox_id=mailbox,
            message_id_header="<o2@app.example>",
            placeholder_message_id="pending_2",
            thread_id="pending_t2",
            from_address="a@app",
            esp_message_id="pm-42",
        )
    await store_events(pool, [event(E.OPENED, msg="pm-42")])  # no Message-ID in the event
    await apply_all(pool)
    (row,) = await evidence(pool)
    assert row["message_id"] == message_id


async def test_concurrent_workers_apply_each_event_once(pool: asyncpg.Pool) -> None:
    import anyio

    events = [
        event(kind, minute=i % 7, eid=f"c{i}", msg=f"pm-{i % 10}", rcpt=f"r{i % 3}@x.example")
        for i, kind in enumerate([E.DELIVERED, E.OPENED, E.DEFERRED, E.BOUNCED] * 50)
    ]
    await store_events(pool, events)
    await apply_all(pool)
    expected = (await evidence(pool), await suppressions(pool))
    await reset(pool)
    await store_events(pool, events)

    async def work() -> None:
        while await apply_due(pool, limit=7):
            pass

    async with anyio.create_task_group() as tg:  # four workers, as four replicas would
        for _ in range(4):
            tg.start_soon(work)
    async with pool.acquire() as conn:
        attempts = await conn.fetch("SELECT DISTINCT attempts, state FROM delivery_events")
    assert [tuple(r) for r in attempts] == [(1, "applied")]
    assert (await evidence(pool), await suppressions(pool)) == expected
