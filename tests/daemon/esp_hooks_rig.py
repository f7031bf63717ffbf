"""`POST /hooks/esp/{tenant}/{source}` in the test's process: the listener, the
group-committing intake and the hook table of tenant "acme", and what the tests
post and read back.

Shared by test_hooks and test_http_properties (a test module never imports
another test module).
"""

from __future__ import annotations

import ipaddress
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import anyio
import asyncpg
from helpers.db import fetch
from http_rig import listening, webhook_state

from inboxd.adapters.esp.registry import build_esp_receiver
from inboxd.adapters.webhook_budgets import PeerBudgets
from inboxd.daemon.http import HttpState
from inboxd.daemon.metrics.registry import Metrics
from inboxd.daemon.webhooks.esp import DeliveryHook, EspHooks, HookTable
from inboxd.pipeline.delivery.intake import DeliveryIntake, SourcePolicy
from inboxd.pipeline.objectstore.store import ObjectStore
from inboxd.pipeline.tenancy import ensure_tenants

#: Seconds a request and the intake's start may take: generous, every wait under it
#: ends as soon as its answer comes.
DEADLINE_S = 60


@dataclass
class HookServer:
    base: str
    state: HttpState
    session: aiohttp.ClientSession
    confirmed: list[str]  # the SNS subscription URLs the hooks confirmed
    table: HookTable


def hook(source_id: str, table: dict[str, Any], **kw: Any) -> DeliveryHook:
    """Tenant acme's hook for the ESP source `source_id`, its config table `table`."""
    adapter = build_esp_receiver(source_id, {"id": source_id, **table}, str)
    return DeliveryHook(
        tenant_id="acme",
        source_id=source_id,
        receiver=adapter,
        policy=SourcePolicy(adapter.default_payload_fields),
        **kw,
    )


@asynccontextmanager
async def serving_hooks(
    pool: asyncpg.Pool,
    dsn: str,
    store: ObjectStore,
    trusted_proxies: tuple[str, ...] = (),
    *,
    failures: PeerBudgets | None = None,
    **sources: DeliveryHook,
) -> AsyncIterator[HookServer]:
    """The ESP hook routes of tenant acme, one per keyword (source name → hook)."""
    confirmed: list[str] = []

    async def confirm(url: str) -> None:
        confirmed.append(url)

    async with pool.acquire() as conn:
        await ensure_tenants(conn, ["acme"])
    table = HookTable({("acme", name): src for name, src in sources.items()}, failures=failures)
    intake = DeliveryIntake(pool)
    proxies = tuple(ipaddress.ip_network(p) for p in trusted_proxies)
    hooks = EspHooks(table, intake, confirm)
    state = webhook_state(pool, dsn, store, hooks, Metrics(), trusted_proxies=proxies)
    async with anyio.create_task_group() as tg:
        with anyio.fail_after(DEADLINE_S):
            await tg.start(intake.run)
        async with listening(state) as listener:
            yield HookServer(listener.base, state, listener.session, confirmed, table)
        tg.cancel_scope.cancel()


async def post_hook(
    served: HookServer,
    source: str,
    body: bytes,
    headers: Mapping[str, str],
    tenant: str = "acme",
    *,
    via: str | None = None,
) -> tuple[int, dict]:
    """POST a delivery event; `via`: the client's address as a proxy would forward it.
    The answer's status and JSON body."""
    if via is not None:
        headers = {**headers, "x-forwarded-for": via}
    with anyio.fail_after(DEADLINE_S):
        async with served.session.post(
            f"{served.base}/hooks/esp/{tenant}/{source}", data=body, headers=headers
        ) as response:
            return response.status, await response.json(content_type=None)


async def stored_events(pool: asyncpg.Pool) -> list[asyncpg.Record]:
    """Every stored delivery event, in the order stored."""
    return await fetch(pool, "SELECT * FROM delivery_events ORDER BY event_id")
