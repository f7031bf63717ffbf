"""Building delivery events and driving the intake and workers in tests."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import anyio
import asyncpg
from helpers import eventually

from inboxd.pipeline.delivery.intake import DeliveryIntake, SourcePolicy, Stored
from inboxd.pipeline.delivery.model import BounceType, DeliveryEvent, EventType
from inboxd.pipeline.delivery.worker import apply_due
from inboxd.pipeline.tenancy import ensure_tenants

T0 = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)
POLICY = SourcePolicy(payload_fields=("kind",), keep_recipients=True)


def event(
    kind: EventType,
    *,
    minute: int = 0,
    eid: str | None = None,
    msg: str = "pm-1",
    rcpt: str = "Ann@Example.com",
    bounce: BounceType | None = None,
    list_id: str | None = None,
    mid: str | None = None,
) -> DeliveryEvent:
    if kind is EventType.BOUNCED and bounce is None:
        bounce = BounceType.PERMANENT
    return DeliveryEvent(
        provider_event_id=eid if eid is not None else f"{kind}-{minute}-{msg}-{rcpt}",
        provider_type=f"x.{kind}",
        event_type=kind,
        occurred_at=T0 + timedelta(minutes=minute),
        provider_message_id=msg,
        message_id_header=mid,
        recipient=rcpt,
        bounce_type=bounce,
        bounce_subtype="General" if bounce else None,
        list_id=list_id,
        payload={"kind": str(kind), "secret_body": "never stored"},
    )


async def store_events(
    pool: asyncpg.Pool,
    events: list[DeliveryEvent],
    *,
    tenant: str = "acme",
    source: str = "esp",
    token: str | None = None,
) -> Stored:
    """Submit through a running intake (one request) and wait for its commit."""
    async with pool.acquire() as conn:
        await ensure_tenants(conn, [tenant])
    intake = DeliveryIntake(pool)
    outcome: Stored | Exception | None = None
    async with anyio.create_task_group() as tg:
        await tg.start(intake.run)
        try:
            outcome = await intake.submit(
                tenant, source, "test", events, POLICY, received_at=time.time(), replay_token=token
            )
        except Exception as exc:  # raised below, outside the task group
            outcome = exc
        tg.cancel_scope.cancel()
    if isinstance(outcome, Exception):
        raise outcome
    assert outcome is not None
    return outcome


async def apply_all(pool: asyncpg.Pool) -> None:
    while await apply_due(pool):
        pass


async def evidence(pool: asyncpg.Pool) -> list[dict]:
    async with pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT source, message_key, recipient_hash, recipient, message_id, status, "
            "accepted_at, last_deferred_at, delivered_at, bounced_at, bounce_type, "
            "bounce_subtype, complained_at, rejected_at, suppressed_at, unsubscribed_at, "
            "last_opened_at, last_clicked_at FROM delivery_evidence ORDER BY 1, 2, 3"
        )
    return [dict(r) for r in rows]


async def suppressions(pool: asyncpg.Pool) -> list[tuple]:
    async with pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT s.address, s.scope, s.reason, e.dedup_key FROM suppressions s "
            "JOIN delivery_events e USING (tenant_id, event_id) ORDER BY 1, 2"
        )
    return [tuple(r) for r in rows]


async def wait_until(
    pool: asyncpg.Pool, sql: str, predicate, *, deadline_s: float = 20.0, poll_s: float = 0.05
):
    """Poll `sql` (a single value, on one connection) until `predicate(value)`; fail after
    the deadline with the last value."""
    async with pool.acquire() as conn:
        return await eventually(
            lambda: conn.fetchval(sql),
            deadline_s,
            what=f"{sql!r} to satisfy the predicate",
            until=predicate,
            poll_s=poll_s,
        )
