"""`serve_http` in the test's process on an ephemeral port of 127.0.0.1, and the
tenant API served on it.

`listening` starts the listener for an HttpState and opens a client session; every
in-process HTTP test module builds its app's state and serves it this way
(test_http, test_hooks through esp_hooks_rig, test_gmail_push, test_outlook_push,
test_http_properties). `doorbell_rings` records what the push routes ring.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import anyio
import asyncpg

from inboxd.adapters.webhook_routes import WebhookRoutes
from inboxd.daemon.http import HttpState, TokenTable, serve_http
from inboxd.daemon.metrics.registry import Metrics
from inboxd.daemon.webhooks import Webhooks
from inboxd.pipeline.doorbell import DOORBELL_CHANNEL, parse_doorbell
from inboxd.pipeline.objectstore.store import ObjectStore

#: Seconds the listener has to bind its port; it takes milliseconds, and the deadline
#: is generous because the machine running the suite may be busy.
START_DEADLINE_S = 60
#: The API's bearer tokens: tenant → token.
TOKENS = {"acme": "acme-secret-token-0001", "globex": "globex-secret-token-0002"}
ACME = {"Authorization": f"Bearer {TOKENS['acme']}"}
GLOBEX = {"Authorization": f"Bearer {TOKENS['globex']}"}
#: The API tests' request-body limit, below the daemon's 1 MiB default
#: (daemon/http/state.py) as it always was here; the tests of the limit pass their own.
MAX_BODY_BYTES = 64 * 1024


async def always_ready() -> bool:
    return True


@dataclass
class Listener:
    base: str  # http://127.0.0.1:<port>
    port: int
    state: HttpState
    session: aiohttp.ClientSession


@asynccontextmanager
async def listening(state: HttpState) -> AsyncIterator[Listener]:
    """serve_http for `state` on an ephemeral port until the block ends, with a
    client session to talk to it."""
    async with aiohttp.ClientSession() as session, anyio.create_task_group() as tg:
        with anyio.fail_after(START_DEADLINE_S):
            port = await tg.start(serve_http, "127.0.0.1", 0, state)
        yield Listener(f"http://127.0.0.1:{port}", port, state, session)
        tg.cancel_scope.cancel()


def webhook_state(
    pool: asyncpg.Pool,
    dsn: str,
    store: ObjectStore,
    routes: WebhookRoutes,
    metrics: Metrics,
    **settings: Any,
) -> HttpState:
    """An HttpState serving `routes` and no API tenant; `metrics` the one the routes
    count in; `settings` further HttpState fields (trusted_proxies)."""
    return HttpState(
        pool=pool,
        dsn=dsn,
        store=store,
        metrics=metrics,
        tenant_for_token=TokenTable({}),
        ready=always_ready,
        webhooks=Webhooks(routes),
        **settings,
    )


@asynccontextmanager
async def doorbell_rings(dsn: str) -> AsyncIterator[list[tuple[str, str] | None]]:
    """Every doorbell committed while the block runs, parsed, in commit order."""
    listener = await asyncpg.connect(dsn)
    rings: list[tuple[str, str] | None] = []
    await listener.add_listener(DOORBELL_CHANNEL, lambda *a: rings.append(parse_doorbell(a[-1])))
    try:
        yield rings
    finally:
        await listener.close()


def api_state(
    pool: asyncpg.Pool,
    dsn: str,
    store: ObjectStore,
    *,
    ready: Callable[[], Awaitable[bool]] = always_ready,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> HttpState:
    """The tenant API (/v1/..., /healthz, /readyz, /metrics) with TOKENS' tenants."""
    return HttpState(
        pool=pool,
        dsn=dsn,
        store=store,
        metrics=Metrics(),
        tenant_for_token=TokenTable(TOKENS),
        ready=ready,
        max_body_bytes=max_body_bytes,
    )


@asynccontextmanager
async def serving_api(
    pool: asyncpg.Pool,
    dsn: str,
    store: ObjectStore,
    *,
    ready: Callable[[], Awaitable[bool]] = always_ready,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> AsyncIterator[Listener]:
    """api_state served by `listening`."""
    state = api_state(pool, dsn, store, ready=ready, max_body_bytes=max_body_bytes)
    async with listening(state) as listener:
        yield listener


def outbound_body(**overrides: Any) -> dict[str, Any]:
    """A valid `POST /v1/outbound` body for acme's mailbox "inbox"; `overrides` replace fields."""
    body: dict[str, Any] = {
        "mailbox_id": "inbox",
        "message_id_header": "<out-1@acme.test>",
        "placeholder_message_id": "pending_abc",
        "thread_id": "pending_t1",
        "from_address": "support@acme.test",
        "subject": "Your order",
        "sent_at": "2026-11-02T09:30:00Z",
        "text": "Thanks for your order.",
        "html": None,
        "send_status": "pending",
    }
    body.update(overrides)
    return body
