"""`POST /push/outlook/{tenant}[/lifecycle]` in-process: Graph's validation is echoed,
notifications whose clientState matches their subscription record and ring, nothing
else does.

"Nothing rang" is shown without waiting for a ring that never comes: after the
request under test, a valid notification for the marker mailbox is posted and its
ring awaited. Doorbells arrive in commit order, so a ring of the earlier request
would have arrived first.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import orjson
import pytest
import structlog
from harness import DaemonProcess, write_config
from helpers import eventually
from http_rig import doorbell_rings, listening, webhook_state

from inboxd.adapters.outlook import tables as graph_subscriptions
from inboxd.adapters.outlook.notifications import (
    OutlookPush,
    OutlookPushTable,
    OutlookPushTenant,
)
from inboxd.adapters.webhook_routes import RouteContext
from inboxd.daemon.config.main import load_main, load_tenants
from inboxd.daemon.metrics.registry import Metrics
from inboxd.daemon.webhooks.outlook_config import build_outlook_push

DEADLINE_S = 15
EXPIRES = datetime(2026, 12, 3, 17, 0, tzinfo=UTC)
# subscription id → (mailbox, folder, clientState)
SUBSCRIPTIONS = {
    "sub-support-inbox": ("support", "inbox", "s3cret-support-inbox-7Qx"),
    "sub-support-sent": ("support", "sentitems", "s3cret-support-sent-9Kd"),
    "sub-sales-inbox": ("sales", "inbox", "s3cret-sales-inbox-2Pw"),
    "sub-marker-inbox": ("marker", "inbox", "s3cret-marker-inbox-5Lm"),
}
GLOBEX_SUB = ("sub-globex-inbox", "support", "inbox", "s3cret-globex-inbox-4Hz")
FORGED = "forged-client-state-8Yt"


@dataclass
class Served:
    base: str
    session: aiohttp.ClientSession
    rings: list[tuple[str, str] | None]
    metrics: Metrics


@asynccontextmanager
async def serving_outlook_push(pool: asyncpg.Pool, dsn: str, store) -> AsyncIterator[Served]:
    table = OutlookPushTable(
        {
            "acme": OutlookPushTenant("acme", frozenset({"support", "sales", "marker"})),
            "globex": OutlookPushTenant("globex", frozenset({"support"})),
        }
    )

    metrics = Metrics()
    state = webhook_state(
        pool, dsn, store, OutlookPush(table, RouteContext(pool, metrics)), metrics
    )
    async with doorbell_rings(dsn) as rings, listening(state) as listener:
        yield Served(listener.base, listener.session, rings, metrics)


@pytest.fixture
async def subscribed(pool, make_mailbox) -> None:
    for mailbox in ("support", "sales", "marker"):
        await make_mailbox("acme", mailbox, provider="outlook")
    await make_mailbox("globex", "support", provider="outlook")
    for sub_id, (mailbox, folder, secret) in SUBSCRIPTIONS.items():
        await graph_subscriptions.save_subscription(
            pool, "acme", mailbox, folder, sub_id, secret, EXPIRES
        )
    sub_id, mailbox, folder, secret = GLOBEX_SUB
    await graph_subscriptions.save_subscription(
        pool, "globex", mailbox, folder, sub_id, secret, EXPIRES
    )


def note(sub_id: str, client_state: str | None = None, **extra: Any) -> dict[str, Any]:
    """One notification as Graph sends it (changeNotification, v1.0)."""
    secret = client_state if client_state is not None else SUBSCRIPTIONS[sub_id][2]
    item: dict[str, Any] = {
        "subscriptionId": sub_id,
        "clientState": secret,
        "subscriptionExpirationDateTime": "2026-12-03T17:00:00+00:00",
        "tenantId": "0c9e4d1a-7b7e-4f5c-9a4e-2b1f3c5d6e7f",
    }
    if "lifecycleEvent" not in extra:
        item.update(
            changeType="created",
            resource="Users/ops/Messages/AAMkAD",
            resourceData={"@odata.type": "#Microsoft.Graph.Message", "id": "AAMkAD"},
        )
    item.update(extra)
    return item


async def post(
    served: Served,
    body: bytes | list[dict[str, Any]],
    *,
    tenant: str = "acme",
    lifecycle: bool = False,
    params: dict[str, str] | None = None,
    content_type: str = "application/json; charset=utf-8",
) -> aiohttp.ClientResponse:
    data = body if isinstance(body, bytes) else orjson.dumps({"value": body})
    url = f"{served.base}/push/outlook/{tenant}" + ("/lifecycle" if lifecycle else "")
    async with served.session.post(
        url, data=data, params=params, headers={"Content-Type": content_type}
    ) as response:
        await response.read()
        return response


async def status_of(served: Served, body: bytes | list[dict[str, Any]], **kw: Any) -> int:
    return (await post(served, body, **kw)).status


async def rings_until_marker(served: Served) -> list[tuple[str, str] | None]:
    """Every ring up to the marker mailbox's (see the module docstring)."""
    assert await status_of(served, [note("sub-marker-inbox")]) == 202
    await eventually(
        lambda: ("acme", "marker") in served.rings, DEADLINE_S, what="the marker's ring"
    )
    return served.rings[: served.rings.index(("acme", "marker"))]


async def last_push(pool: asyncpg.Pool, mailbox: str, tenant: str = "acme") -> datetime | None:
    return await pool.fetchval(
        "SELECT last_push_at FROM mailboxes WHERE tenant_id = $1 AND mailbox_id = $2",
        tenant,
        mailbox,
    )


def rejected_requests(served: Served, tenant: str = "acme") -> float:
    value = served.metrics.registry.get_sample_value(
        "inboxd_webhook_verification_failures_total", {"source": f"{tenant}/outlook"}
    )
    return value or 0.0


# --- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize("lifecycle", [False, True], ids=["notifications", "lifecycle"])
async def test_a_validation_token_is_echoed_as_text_before_anything_else(
    pool, db_dsn, store, lifecycle: bool
) -> None:
    token = "Validation: Testing client application reachability for subscription Request-Id: 9e0"
    async with serving_outlook_push(pool, db_dsn, store) as served:
        # as Graph sends it: text/plain, no body
        r = await post(
            served, b"", lifecycle=lifecycle, params={"validationToken": token},
            content_type="text/plain; charset=utf-8",
        )  # fmt: skip
        assert (r.status, r.content_type, await r.text()) == (200, "text/plain", token)
        # a body and a content type the notifications would refuse change nothing
        r = await post(
            served, b"\x00junk", lifecycle=lifecycle, params={"validationToken": "a+b&c=d/é"},
            content_type="application/octet-stream",
        )  # fmt: skip
        assert (r.status, r.content_type, await r.text()) == (200, "text/plain", "a+b&c=d/é")
        too_long = {"validationToken": "x" * 1025}
        assert await status_of(served, b"", lifecycle=lifecycle, params=too_long) == 400
        # a tenant without [outlook] creates no subscription: nothing to validate
        assert (
            await status_of(served, b"", tenant="hooli", params={"validationToken": token}) == 404
        )


# --- change notifications --------------------------------------------------------------------


async def test_a_valid_notification_records_the_push_and_rings_the_mailbox(
    pool, db_dsn, store, subscribed
) -> None:
    async with serving_outlook_push(pool, db_dsn, store) as served:
        r = await post(served, [note("sub-support-inbox")])
        assert r.status == 202
        assert await last_push(pool, "support") is not None
        assert await last_push(pool, "sales") is None
        await eventually(lambda: served.rings, DEADLINE_S, what="a doorbell ring")
        assert served.rings == [("acme", "support")]


async def test_fifty_notifications_for_one_mailbox_ring_it_once(
    pool, db_dsn, store, subscribed
) -> None:
    batch = [note("sub-support-inbox") for _ in range(40)]
    batch += [note("sub-support-sent") for _ in range(10)]
    async with serving_outlook_push(pool, db_dsn, store) as served:
        assert await status_of(served, batch) == 202
        assert await rings_until_marker(served) == [("acme", "support")]


async def test_notifications_for_two_mailboxes_ring_both(pool, db_dsn, store, subscribed) -> None:
    batch = [note("sub-sales-inbox"), note("sub-support-inbox"), note("sub-sales-inbox")]
    async with serving_outlook_push(pool, db_dsn, store) as served:
        assert await status_of(served, batch) == 202
        assert await rings_until_marker(served) == [("acme", "sales"), ("acme", "support")]
        assert await last_push(pool, "sales") is not None
        assert await last_push(pool, "support") is not None


async def test_a_wrong_client_state_is_401_counted_and_never_logged(
    pool, db_dsn, store, subscribed, caplog, capfd
) -> None:
    caplog.set_level(logging.DEBUG)
    with structlog.testing.capture_logs() as events:
        async with serving_outlook_push(pool, db_dsn, store) as served:
            r = await post(served, [note("sub-support-inbox", FORGED), note("sub-sales-inbox", "")])
            assert r.status == 401
            assert await rings_until_marker(served) == []
            assert await last_push(pool, "support") is None
            assert await last_push(pool, "sales") is None
            assert rejected_requests(served) == 1
    (rejected,) = [e for e in events if e["event"] == "outlook_push_rejected"]
    assert rejected["tenant"] == "acme" and rejected["rejected"] == 2
    assert rejected["subscriptions"] == ["sub-support-inbox", "sub-sales-inbox"]
    captured = capfd.readouterr()
    logged = "\n".join([repr(events), caplog.text, captured.out, captured.err])
    for secret in (FORGED, SUBSCRIPTIONS["sub-support-inbox"][2], "s3cret"):
        assert secret not in logged


async def test_valid_and_invalid_in_one_post_is_202_and_rings_only_the_valid(
    pool, db_dsn, store, subscribed
) -> None:
    batch = [note("sub-support-inbox", FORGED), note("sub-sales-inbox"), note("sub-nobody", "x")]
    async with serving_outlook_push(pool, db_dsn, store) as served:
        assert await status_of(served, batch) == 202
        assert await rings_until_marker(served) == [("acme", "sales")]
        assert await last_push(pool, "support") is None
        assert rejected_requests(served) == 1  # counted, though the request was accepted


async def test_another_tenants_subscription_is_unknown_here(
    pool, db_dsn, store, subscribed
) -> None:
    sub_id, _, _, secret = GLOBEX_SUB
    async with serving_outlook_push(pool, db_dsn, store) as served:
        assert await status_of(served, [note(sub_id, secret)], tenant="acme") == 401
        assert await rings_until_marker(served) == []
        assert await last_push(pool, "support", tenant="globex") is None
        # and at its own tenant's URL it is accepted
        assert await status_of(served, [note(sub_id, secret)], tenant="globex") == 202
        assert await last_push(pool, "support", tenant="globex") is not None


@pytest.mark.parametrize(
    "body",
    [b"{not json", b"[]", b'{"value": []}', b'{"value": {}}', b'{"value": [{"clientState": "x"}]}'],
    ids=["not-json", "array", "empty", "not-a-list", "no-subscription-id"],
)
async def test_a_malformed_body_is_400_and_rings_nothing(
    pool, db_dsn, store, subscribed, body: bytes
) -> None:
    async with serving_outlook_push(pool, db_dsn, store) as served:
        assert await status_of(served, body) == 400
        assert await rings_until_marker(served) == []


async def test_refusals_before_the_body(pool, db_dsn, store, subscribed) -> None:
    async with serving_outlook_push(pool, db_dsn, store) as served:
        assert await status_of(served, [note("sub-support-inbox")], tenant="hooli") == 404
        assert (
            await status_of(served, [note("sub-support-inbox")], content_type="text/plain") == 415
        )
        # a peer that keeps failing is refused before its body is read
        statuses = [await status_of(served, [note("sub-support-inbox", FORGED)]) for _ in range(25)]
        assert statuses[:20] == [401] * 20 and statuses[-1] == 429
        assert await last_push(pool, "support") is None


# --- lifecycle notifications -----------------------------------------------------------------


@pytest.mark.parametrize("event", ["missed", "subscriptionRemoved", "reauthorizationRequired"])
async def test_a_lifecycle_event_is_stored_and_rings_the_mailbox(
    pool, db_dsn, store, subscribed, event: str
) -> None:
    async with serving_outlook_push(pool, db_dsn, store) as served:
        batch = [note("sub-support-sent", lifecycleEvent=event)]
        assert await status_of(served, batch, lifecycle=True) == 202
        assert await rings_until_marker(served) == [("acme", "support")]
    rows = {
        r.folder: r for r in await graph_subscriptions.subscriptions_of(pool, "acme", "support")
    }
    assert rows["sentitems"].lifecycle_event == event
    assert rows["sentitems"].lifecycle_at is not None
    assert rows["inbox"].lifecycle_event is None


async def test_lifecycle_keeps_the_strongest_event_and_ignores_unknown_ones(
    pool, db_dsn, store, subscribed
) -> None:
    async with serving_outlook_push(pool, db_dsn, store) as served:
        batch = [
            note("sub-support-inbox", lifecycleEvent="missed"),
            note("sub-support-inbox", lifecycleEvent="subscriptionRemoved"),
            note("sub-support-inbox", lifecycleEvent="reauthorizationRequired"),
            note("sub-sales-inbox", lifecycleEvent="somethingNew"),
        ]
        assert await status_of(served, batch, lifecycle=True) == 202
        # only an unknown event: acknowledged, nothing stored, nothing rung
        only_new = [note("sub-sales-inbox", lifecycleEvent="somethingNew")]
        assert await status_of(served, only_new, lifecycle=True) == 202
        # a lifecycle event with a wrong clientState is rejected like any notification
        forged = [note("sub-support-sent", FORGED, lifecycleEvent="subscriptionRemoved")]
        assert await status_of(served, forged, lifecycle=True) == 401
        assert await rings_until_marker(served) == [("acme", "support")]
    by_folder = {
        (r.mailbox_id, r.folder): r.lifecycle_event
        for m in ("support", "sales")
        for r in await graph_subscriptions.subscriptions_of(pool, "acme", m)
    }
    assert by_folder == {
        ("support", "inbox"): "subscriptionRemoved",
        ("support", "sentitems"): None,
        ("sales", "inbox"): None,
    }


# --- the database away -----------------------------------------------------------------------


@pytest.mark.own_database  # ALTER DATABASE … ALLOW_CONNECTIONS
async def test_database_outage_is_503_and_the_retry_rings(
    pool, db_dsn, server_dsn, store, subscribed
) -> None:
    database = db_dsn.rsplit("/", 1)[1]
    admin = await asyncpg.connect(server_dsn)
    try:
        async with serving_outlook_push(pool, db_dsn, store) as served:
            await admin.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS false')
            await admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = $1 AND pid <> pg_backend_pid()",
                database,
            )
            r = await post(served, [note("sub-support-inbox")])
            assert r.status == 503 and r.headers["Retry-After"].isdigit()
            await admin.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')
            await eventually(
                lambda: status_of(served, [note("sub-support-inbox")]),
                DEADLINE_S,
                what="a 202 once the database is back",
                until=lambda s: s == 202,
            )
        assert await last_push(pool, "support") is not None
    finally:
        await admin.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')
        await admin.close()


# --- which tenants are served ----------------------------------------------------------------

OUTLOOK = """[outlook]
directory_id = "0c9e4d1a-7b7e-4f5c-9a4e-2b1f3c5d6e7f"
client_id = "5f1a2b3c-4d5e-4f60-8a9b-0c1d2e3f4a5b"
client_secret = "env:GRAPH_SECRET"
{extra}
"""


def test_tenants_with_an_outlook_table_are_served(tmp_path: Path) -> None:
    (tmp_path / "tenants").mkdir()
    files = {
        "acme": 'id = "acme"\n'
        + OUTLOOK.format(extra='notification_url = "https://inboxd.example"')
        + '[[mailboxes]]\nid = "ops"\nprovider = "outlook"\naddress = "ops@acme.example"\n'
        + '[[mailboxes]]\nid = "files"\nprovider = "maildir"\npath = "/srv/mail"\n',
        "initech": 'id = "initech"\n' + OUTLOOK.format(extra=""),
        "hooli": 'id = "hooli"\n',
    }
    for name, text in files.items():
        (tmp_path / "tenants" / f"{name}.toml").write_text(text)
    (tmp_path / "main.toml").write_text("")
    tenants = load_tenants(load_main(tmp_path / "main.toml"))
    assert tenants.problems == []

    served, problems = build_outlook_push(tenants.tenants)

    assert problems == []
    # initech polls today, but subscriptions it made earlier still verify until they expire
    assert sorted(served) == ["acme", "initech"]
    assert served["acme"].mailboxes == frozenset({"ops"})


@pytest.mark.own_database  # a daemon subprocess
@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_inboxd_run_serves_the_outlook_routes_and_a_reload_adds_a_tenant(
    tmp_path, db_dsn
) -> None:
    config = write_config(tmp_path, tenants={"acme": [], "globex": []})
    secret = tmp_path / "graph-secret"
    secret.write_text("app-secret")
    table = OUTLOOK.replace("env:GRAPH_SECRET", f"file:{secret}").format(extra="")
    (tmp_path / "tenants" / "acme.toml").write_text('id = "acme"\n' + table)
    daemon = DaemonProcess(config, db_dsn, tmp_path / "daemon.log")
    port = daemon.wait_ready()

    async def validate(tenant: str) -> tuple[int, str]:
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"http://127.0.0.1:{port}/push/outlook/{tenant}/lifecycle",
                params={"validationToken": "hello"},
            ) as r,
        ):
            return r.status, await r.text()

    try:
        assert await validate("acme") == (200, "hello")
        assert (await validate("globex"))[0] == 404
        (tmp_path / "tenants" / "globex.toml").write_text('id = "globex"\n' + table)
        daemon.signal(signal.SIGHUP)
        await daemon.eventually(
            lambda: validate("globex"), 60, what="globex served after SIGHUP",
            until=lambda answer: answer == (200, "hello"),
        )  # fmt: skip
    finally:
        daemon.signal(signal.SIGTERM)
        assert daemon.wait_exit(60) == 0
