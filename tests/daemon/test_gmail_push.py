"""`POST /push/gmail/{tenant}` in-process: a verified push records and rings, nothing else does."""

from __future__ import annotations

import base64
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp
import asyncpg
import orjson
import pytest
from aiohttp import web
from helpers import eventually
from helpers.google_jwt import GoogleSigner
from http_rig import doorbell_rings, listening, webhook_state

from inboxd.adapters.gmail.push import GoogleCerts, PushVerifier
from inboxd.adapters.gmail.push_route import GmailPush, GmailPushTable, GmailPushTenant
from inboxd.adapters.webhook_routes import RouteContext
from inboxd.daemon.metrics.registry import Metrics
from inboxd.pipeline.objectstore.store import ObjectStore

DEADLINE_S = 15
AUDIENCE = "https://inboxd.example/push/gmail/acme"
PUSHER = "gmail-push@acme-project.iam.gserviceaccount.com"


@dataclass
class Served:
    base: str
    session: aiohttp.ClientSession
    signer: GoogleSigner
    rings: list[tuple[str, str] | None]


@asynccontextmanager
async def serving_gmail_push(
    pool: asyncpg.Pool, dsn: str, store: ObjectStore
) -> AsyncIterator[Served]:
    signer = GoogleSigner()

    async def certs(_request: web.Request) -> web.Response:
        return web.Response(
            body=signer.certs_json(),
            content_type="application/json",
            headers={"Cache-Control": "public, max-age=3600"},
        )

    certs_app = web.Application()
    certs_app.router.add_get("/certs", certs)
    certs_runner = web.AppRunner(certs_app)
    await certs_runner.setup()
    site = web.TCPSite(certs_runner, "127.0.0.1", 0)
    await site.start()
    certs_port = certs_runner.addresses[0][1]
    verifier = PushVerifier(GoogleCerts(f"http://127.0.0.1:{certs_port}/certs"), AUDIENCE, PUSHER)
    table = GmailPushTable(
        {"acme": GmailPushTenant("acme", verifier, {"support@acme.example": "support"})}
    )

    metrics = Metrics()
    state = webhook_state(pool, dsn, store, GmailPush(table, RouteContext(pool, metrics)), metrics)
    try:
        async with doorbell_rings(dsn) as rings, listening(state) as listener:
            yield Served(listener.base, listener.session, signer, rings)
    finally:
        await certs_runner.cleanup()


def push_body(address: str = "support@acme.example", history_id: object = "9876") -> bytes:
    data = orjson.dumps({"emailAddress": address, "historyId": history_id})
    return orjson.dumps(
        {
            "message": {
                "data": base64.b64encode(data).decode(),
                "messageId": "2070443601311540",
                "publishTime": "2026-12-01T17:00:00.000Z",
                "attributes": {},
            },
            "subscription": "projects/acme-project/subscriptions/gmail-push",
        }
    )


def token(served: Served, **changes: object) -> str:
    claims = served.signer.claims(audience=AUDIENCE, email=PUSHER, now=time.time())
    claims.update(changes)
    return served.signer.sign(claims)


async def post(
    served: Served, body: bytes, auth: str | list[str] | None, tenant: str = "acme"
) -> int:
    headers: list[tuple[str, str]] = [("Content-Type", "application/json")]
    for value in [auth] if isinstance(auth, str) else auth or []:
        headers.append(("Authorization", value))
    async with served.session.post(
        f"{served.base}/push/gmail/{tenant}", data=body, headers=headers
    ) as response:
        return response.status


@pytest.fixture
async def mailbox(make_mailbox) -> None:
    await make_mailbox("acme", "support", provider="gmail")


async def push_state(pool: asyncpg.Pool) -> asyncpg.Record:
    return await pool.fetchrow(
        "SELECT last_push_at, push_hint FROM mailboxes WHERE mailbox_id = 'support'"
    )


async def test_a_verified_push_records_the_history_id_and_rings_the_doorbell(
    pool, db_dsn, store, mailbox
) -> None:
    async with serving_gmail_push(pool, db_dsn, store) as served:
        assert await post(served, push_body(), f"Bearer {token(served)}") == 204
        row = await push_state(pool)
        assert row["last_push_at"] is not None and row["push_hint"] == "9876"
        await eventually(lambda: served.rings, DEADLINE_S, what="a doorbell ring")
        assert served.rings == [("acme", "support")]
        # historyId as a number, as Gmail also sends it
        assert await post(served, push_body(history_id=9999), f"Bearer {token(served)}") == 204
        assert (await push_state(pool))["push_hint"] == "9999"


async def test_an_unknown_address_is_acknowledged_without_recording(
    pool, db_dsn, store, mailbox
) -> None:
    async with serving_gmail_push(pool, db_dsn, store) as served:
        body = push_body(address="someone-else@acme.example")
        assert await post(served, body, f"Bearer {token(served)}") == 204
        assert (await push_state(pool))["last_push_at"] is None


@pytest.mark.parametrize(
    "forge",
    [
        "wrong_key",
        "expired",
        "wrong_audience",
        "wrong_email",
        "unverified",
        "unsigned",
        "alg_none",
        "no_header",
        "two_headers",
    ],
)
async def test_an_unverified_push_is_401_and_records_nothing(
    pool, db_dsn, store, mailbox, forge: str
) -> None:
    async with serving_gmail_push(pool, db_dsn, store) as served:
        now = time.time()
        good = token(served)
        auth: str | list[str] | None = {
            "wrong_key": lambda: (
                "Bearer "
                + served.signer.sign(
                    served.signer.claims(audience=AUDIENCE, email=PUSHER, now=now),
                    key=GoogleSigner.new_key(),
                )
            ),
            "expired": lambda: "Bearer " + token(served, iat=now - 7200, exp=now - 3600),
            "wrong_audience": lambda: "Bearer " + token(served, aud="https://evil.example"),
            "wrong_email": lambda: "Bearer " + token(served, email="x@evil.example"),
            "unverified": lambda: "Bearer " + token(served, email_verified=False),
            "unsigned": lambda: "Bearer " + good.rsplit(".", 1)[0] + ".",
            "alg_none": lambda: (
                "Bearer "
                + served.signer.sign(
                    served.signer.claims(audience=AUDIENCE, email=PUSHER, now=now), alg="none"
                )
            ),
            "no_header": lambda: None,
            "two_headers": lambda: [f"Bearer {good}", f"Bearer {good}"],
        }[forge]()
        assert await post(served, push_body(), auth) == 401
        assert (await push_state(pool))["last_push_at"] is None
        assert served.rings == []


async def test_a_verified_but_malformed_body_is_400_and_an_unknown_tenant_404(
    pool, db_dsn, store, mailbox
) -> None:
    async with serving_gmail_push(pool, db_dsn, store) as served:
        assert await post(served, b'{"message": {}}', f"Bearer {token(served)}") == 400
        assert await post(served, push_body(), f"Bearer {token(served)}", tenant="nope") == 404
        assert (await push_state(pool))["last_push_at"] is None
