"""`POST /hooks/esp/{tenant}/{source}` over real sockets, with a real PostgreSQL.

The listener, the group-committing intake and the delivery worker run in
process on an ephemeral port (tests/daemon/esp_hooks_rig.py); requests are signed
here, independently of the adapters, by each scheme's published algorithm. Every
wait has a deadline.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time

import aiohttp
import anyio
import asyncpg
import orjson
import pytest
from esp_hooks_rig import HookServer, hook, post_hook, serving_hooks, stored_events
from helpers import eventually
from helpers.keys import make_certificate, rsa_key, sign_sns

from inboxd.adapters.esp.registry import build_esp_receiver
from inboxd.adapters.webhook_budgets import PeerBudgets, RateLimiter, peer_key
from inboxd.daemon.webhooks.esp import (
    FAILED_VERIFICATION_BURST,
    FAILED_VERIFICATION_RATE_PER_S,
    DeliveryHook,
    HookTable,
)
from inboxd.pipeline.delivery.intake import SourcePolicy
from inboxd.pipeline.delivery.worker import apply_due

DEADLINE_S = 60  # generous: every wait under it ends as soon as its condition holds
# Tokens per second a burst_only() budget earns back: one in 11 days.
NO_REFILL_PER_S = 1e-6
SW_KEY = b"inboxd-test-standard-webhooks-key"
SW_SECRET = "whsec_" + base64.b64encode(SW_KEY).decode()
MAILGUN_KEY = "key-inboxd-test-mailgun"


def sign_standard(
    body: bytes, *, msg_id: str = "msg_1", ts: int | None = None, key: bytes = SW_KEY
) -> dict[str, str]:
    ts = int(time.time()) if ts is None else ts
    mac = hmac.new(key, f"{msg_id}.{ts}.".encode() + body, hashlib.sha256).digest()
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(ts),
        "webhook-signature": "v1," + base64.b64encode(mac).decode(),
        "content-type": "application/json",
    }


def resend_event(
    kind: str = "email.delivered", email_id: str = "em_1", to: str = "ann@example.com"
) -> bytes:
    return orjson.dumps(
        {
            "type": kind,
            "created_at": "2026-11-30T09:00:00.000Z",
            "data": {
                "email_id": email_id,
                "to": [to],
                "subject": "private",
                "created_at": "2026-11-30T08:59:00.000Z",
            },
        }
    )


def mailgun_body(event_id: str, token: str, *, kind: str = "delivered") -> bytes:
    ts = str(int(time.time()))
    sig = hmac.new(MAILGUN_KEY.encode(), (ts + token).encode(), hashlib.sha256).hexdigest()
    return orjson.dumps(
        {
            "signature": {"timestamp": ts, "token": token, "signature": sig},
            "event-data": {
                "id": event_id,
                "event": kind,
                "timestamp": time.time(),
                "recipient": "bob@example.com",
                "message": {"headers": {"message-id": "m1@mg.example"}},
            },
        }
    )


def burst_only() -> PeerBudgets:
    """Peer failure budgets of FAILED_VERIFICATION_BURST that do not refill while a test
    runs: the real ones earn back FAILED_VERIFICATION_RATE_PER_S, so on a loaded machine
    the requests that spend a burst took long enough to earn the next one back and the
    429 a test counted on came late."""
    return PeerBudgets(NO_REFILL_PER_S, FAILED_VERIFICATION_BURST, max_keys=100)


def failures(served: HookServer) -> float:
    metric = served.state.metrics.webhook_verification_failures
    return sum(s.value for m in metric.collect() for s in m.samples if s.name.endswith("_total"))


@pytest.fixture
def sw() -> DeliveryHook:
    return hook("resend", {"provider": "resend", "secret": SW_SECRET})


async def test_signed_event_is_stored_once_and_applied(pool, db_dsn, store, sw) -> None:
    async with serving_hooks(pool, db_dsn, store, resend=sw) as served:
        body = resend_event()
        assert await post_hook(served, "resend", body, sign_standard(body)) == (
            200,
            {"stored": 1, "duplicates": 0},
        )
        assert await post_hook(served, "resend", body, sign_standard(body)) == (
            200,
            {"stored": 0, "duplicates": 1},
        )
    (row,) = await stored_events(pool)
    assert (row["event_type"], row["provider_message_id"]) == ("delivered", "em_1")
    assert b"private" not in row["payload"].encode()  # the subject is not allowlisted
    assert (
        row["recipient"] is None
        and row["recipient_hash"] == hashlib.sha256(b"ann@example.com").hexdigest()
    )
    await apply_due(pool)
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT status FROM delivery_evidence") == "delivered"


@pytest.mark.parametrize(
    "case",
    [
        "bad_signature",
        "missing_signature",
        "truncated",
        "stale",
        "future",
        "reserialised",
        "other_key",
    ],
)
async def test_verification_failures_are_401_and_store_nothing(
    pool, db_dsn, store, sw, case: str
) -> None:
    body = resend_event()
    headers = sign_standard(body)
    if case == "bad_signature":
        headers["webhook-signature"] = "v1," + base64.b64encode(b"x" * 32).decode()
    elif case == "missing_signature":
        del headers["webhook-signature"]
    elif case == "truncated":
        headers["webhook-signature"] = headers["webhook-signature"][:20]
    elif case == "stale":
        headers = sign_standard(body, ts=int(time.time()) - 330)  # clear of rounding
    elif case == "future":
        headers = sign_standard(body, ts=int(time.time()) + 330)
    elif case == "reserialised":
        body = orjson.dumps(orjson.loads(body), option=orjson.OPT_INDENT_2)
    elif case == "other_key":
        headers = sign_standard(body, key=b"another key entirely")
    async with serving_hooks(pool, db_dsn, store, resend=sw) as served:
        assert await post_hook(served, "resend", body, headers) == (401, {"error": "unauthorized"})
        assert failures(served) == 1
    assert await stored_events(pool) == []


async def test_checks_before_verification(pool, db_dsn, store, sw) -> None:
    small = hook(
        "small",
        {"provider": "resend", "secret": SW_SECRET},
        max_body_bytes=1024,
        limiter=RateLimiter(rate=0.001, burst=2),
    )
    async with serving_hooks(pool, db_dsn, store, resend=sw, small=small) as served:
        body = resend_event()
        assert (await post_hook(served, "nope", body, sign_standard(body)))[0] == 404
        assert (await post_hook(served, "resend", body, sign_standard(body), tenant="other"))[
            0
        ] == 404
        headers = {**sign_standard(body), "content-type": "application/x-www-form-urlencoded"}
        assert await post_hook(served, "resend", body, headers) == (
            415,
            {"error": "unsupported_media_type"},
        )
        big = b'{"pad": "' + b"x" * 2048 + b'"}'
        status, answer = await post_hook(served, "small", big, sign_standard(big))
        assert (status, answer["error"]) == (413, "body_too_large")
        assert answer["max_body_bytes"] == 1024
        assert (await post_hook(served, "small", body, sign_standard(body)))[0] == 200
        assert (await post_hook(served, "small", body, sign_standard(body, msg_id="m2")))[0] == 200
        assert (await post_hook(served, "small", body, sign_standard(body, msg_id="m3")))[0] == 429
        bad = b"{not json"
        assert await post_hook(served, "resend", bad, sign_standard(bad)) == (
            400,
            {"error": "malformed_payload"},
        )
        assert failures(served) == 0
    assert len(await stored_events(pool)) == 2  # msg_1 and m2: webhook-id is the event id


async def test_same_event_concurrently_is_one_row_and_one_effect(pool, db_dsn, store, sw) -> None:
    body = resend_event("email.complained")
    async with serving_hooks(pool, db_dsn, store, resend=sw) as served:
        results = []

        async def send() -> None:
            results.append(await post_hook(served, "resend", body, sign_standard(body)))

        async with anyio.create_task_group() as tg:
            for _ in range(16):
                tg.start_soon(send)
    assert sorted(r[1]["stored"] for r in results) == [0] * 15 + [1]
    assert len(await stored_events(pool)) == 1
    await apply_due(pool)
    async with pool.acquire() as conn:
        kinds = await conn.fetch("SELECT kind FROM events ORDER BY event_id")
        assert [k["kind"] for k in kinds] == ["delivery.updated", "suppression.added"]


async def test_mailgun_replayed_token_is_refused(pool, db_dsn, store) -> None:
    mailgun = hook("mg", {"provider": "mailgun", "signing_key": MAILGUN_KEY})
    async with serving_hooks(pool, db_dsn, store, mg=mailgun) as served:
        first = mailgun_body("ev-1", "token-aaaa")
        json_ct = {"content-type": "application/json"}
        assert (await post_hook(served, "mg", first, json_ct))[0] == 200
        assert await post_hook(served, "mg", first, json_ct) == (401, {"error": "unauthorized"})
        replay = mailgun_body("ev-2", "token-aaaa", kind="opened")
        assert (await post_hook(served, "mg", replay, json_ct))[0] == 401
        assert failures(served) == 2
    (row,) = await stored_events(pool)
    assert row["dedup_key"].startswith("id:ev-1:")  # Mailgun ids repeat across days: id + time


async def test_postmark_basic_credentials(pool, db_dsn, store) -> None:
    postmark = hook("pm", {"provider": "postmark", "username": "hooks", "password": "s3cret"})
    body = orjson.dumps(
        {
            "RecordType": "Delivery",
            "MessageID": "pm-1",
            "Recipient": "c@example.com",
            "DeliveredAt": "2026-11-30T09:00:00Z",
            "MessageStream": "outbound",
        }
    )

    def auth(user: str, password: str) -> dict[str, str]:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        return {"authorization": f"Basic {token}", "content-type": "application/json"}

    async with serving_hooks(pool, db_dsn, store, pm=postmark) as served:
        assert (await post_hook(served, "pm", body, auth("hooks", "wrong")))[0] == 401
        assert (await post_hook(served, "pm", body, auth("hooks", "s3cret")))[0] == 200
        assert (await post_hook(served, "pm", body, auth("hooks", "s3cret")))[1]["duplicates"] == 1
    assert len(await stored_events(pool)) == 1


@pytest.mark.own_database  # ALTER DATABASE … ALLOW_CONNECTIONS
async def test_database_outage_is_503_and_the_retry_is_stored(
    pool, db_dsn, server_dsn, store, sw
) -> None:
    database = db_dsn.rsplit("/", 1)[1]
    admin = await asyncpg.connect(server_dsn)
    try:
        async with serving_hooks(pool, db_dsn, store, resend=sw) as served:
            body = resend_event("email.bounced")
            await admin.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS false')
            await admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1",
                database,
            )
            status, answer = await post_hook(served, "resend", body, sign_standard(body))
            assert (status, answer) == (503, {"error": "unavailable"})
            await admin.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')
            # The provider retries the same delivery (as it would, with backoff);
            # the pool reconnects.
            statuses: list[int] = []

            async def retry() -> int:
                statuses.append((await post_hook(served, "resend", body, sign_standard(body)))[0])
                return statuses[-1]

            await eventually(
                retry, DEADLINE_S, what="a 200 for the retried delivery", until=lambda s: s == 200
            )
            assert statuses[-1] == 200 and set(statuses) <= {200, 503}
    finally:
        await admin.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')
        await admin.close()
    assert [r["event_type"] for r in await stored_events(pool)] == ["bounced"]


# --- SES (SNS) and SendGrid over HTTP ---------------------------------------------------------

TOPIC = "arn:aws:sns:eu-west-1:123456789012:ses-events"
CERT_URL = "https://sns.eu-west-1.amazonaws.com/SimpleNotificationService-0123abcd.pem"


def sns_signer():
    """A self-signed RSA certificate and a function signing SNS messages with it (v2)."""
    key = rsa_key()

    def sign(message: dict[str, str]) -> bytes:
        fields = {**message, "SignatureVersion": "2", "SigningCertURL": CERT_URL}
        return orjson.dumps(sign_sns(fields, key))

    return make_certificate(key), sign


async def test_ses_subscription_is_confirmed_only_when_verified(pool, db_dsn, store) -> None:
    pem, sign = sns_signer()
    fetched: list[str] = []

    async def fetch(url: str) -> bytes:
        fetched.append(url)
        return pem

    adapter = build_esp_receiver(
        "ses", {"id": "ses", "provider": "ses", "topic_arns": [TOPIC]}, str, fetch=fetch
    )
    ses = DeliveryHook(
        tenant_id="acme",
        source_id="ses",
        receiver=adapter,
        policy=SourcePolicy(adapter.default_payload_fields),
    )
    subscribe = "https://sns.eu-west-1.amazonaws.com/?Action=ConfirmSubscription&Token=t1"
    confirmation = {
        "Type": "SubscriptionConfirmation",
        "MessageId": "c-1",
        "Token": "t1",
        "TopicArn": TOPIC,
        "Message": "You have chosen to subscribe",
        "SubscribeURL": subscribe,
        "Timestamp": "2026-11-30T09:00:00.000Z",
    }
    text = {"content-type": "text/plain; charset=UTF-8"}
    async with serving_hooks(pool, db_dsn, store, ses=ses) as served:
        forged = orjson.loads(sign(confirmation))
        forged["SubscribeURL"] = "https://sns.eu-west-1.amazonaws.com/?Action=Evil"
        assert (await post_hook(served, "ses", orjson.dumps(forged), text))[0] == 401
        other_topic = sign({**confirmation, "TopicArn": TOPIC + "-other"})
        assert (await post_hook(served, "ses", other_topic, text))[0] == 401
        assert served.confirmed == []
        assert await post_hook(served, "ses", sign(confirmation), text) == (
            200,
            {"stored": 0, "duplicates": 0},
        )
        assert served.confirmed == [subscribe]
        bounce = {
            "eventType": "Bounce",
            "mail": {
                "messageId": "ses-1",
                "timestamp": "2026-11-30T09:00:00.000Z",
                "destination": ["x@example.com"],
                "commonHeaders": {"messageId": "<a@app>"},
            },
            "bounce": {
                "bounceType": "Permanent",
                "bounceSubType": "General",
                "timestamp": "2026-11-30T09:00:05.000Z",
                "bouncedRecipients": [{"emailAddress": "x@example.com"}],
            },
        }
        notification = sign(
            {
                "Type": "Notification",
                "MessageId": "n-1",
                "TopicArn": TOPIC,
                "Message": orjson.dumps(bounce).decode(),
                "Timestamp": "2026-11-30T09:00:06.000Z",
            }
        )
        assert (await post_hook(served, "ses", notification, text))[1] == {
            "stored": 1,
            "duplicates": 0,
        }
    assert fetched == [CERT_URL]  # once: the certificate is cached; never for a foreign topic
    (row,) = await stored_events(pool)
    assert (row["event_type"], row["bounce_type"], row["message_id_norm"]) == (
        "bounced",
        "permanent",
        "a@app",
    )


async def test_sendgrid_batch_with_a_duplicate_keeps_the_new_event(pool, db_dsn, store) -> None:
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    public = base64.b64encode(
        key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    ).decode()
    sendgrid = hook("sg", {"provider": "sendgrid", "public_key": public})

    def signed(events: list[dict]) -> tuple[bytes, dict[str, str]]:
        body = orjson.dumps(events)
        ts = str(int(time.time()))
        signature = key.sign(ts.encode() + body, ec.ECDSA(hashes.SHA256()))
        return body, {
            "X-Twilio-Email-Event-Webhook-Signature": base64.b64encode(signature).decode(),
            "X-Twilio-Email-Event-Webhook-Timestamp": ts,
            "content-type": "application/json",
        }

    def sg_event(event_id: str, kind: str) -> dict:
        return {
            "email": "d@example.com",
            "timestamp": int(time.time()),
            "event": kind,
            "sg_event_id": event_id,
            "sg_message_id": "abc.filter1.1",
            "smtp-id": "<s@a>",
        }

    async with serving_hooks(pool, db_dsn, store, sg=sendgrid) as served:
        assert (await post_hook(served, "sg", *signed([sg_event("e1", "delivered")])))[0] == 200
        body, headers = signed([sg_event("e1", "delivered"), sg_event("e2", "open")])
        assert await post_hook(served, "sg", body, headers) == (200, {"stored": 1, "duplicates": 1})
        tampered = body.replace(b'"open"', b'"click"')
        assert (await post_hook(served, "sg", tampered, headers))[0] == 401
    assert [r["dedup_key"] for r in await stored_events(pool)] == ["id:e1", "id:e2"]


async def test_refusals_come_before_the_body_is_read(pool, db_dsn, store, sw) -> None:
    """415 and 404 are answered to a request whose body never arrives."""
    async with serving_hooks(pool, db_dsn, store, resend=sw) as served:
        port = int(served.base.rsplit(":", 1)[1])
        for path, ctype, status in (
            ("/hooks/esp/acme/resend", "text/html", b"415"),
            ("/hooks/esp/acme/nope", "application/json", b"404"),
        ):
            with anyio.fail_after(DEADLINE_S):
                stream = await anyio.connect_tcp("127.0.0.1", port)
                async with stream:
                    await stream.send(
                        f"POST {path} HTTP/1.1\r\nHost: t\r\n"
                        f"Content-Type: {ctype}\r\nContent-Length: 1000\r\n\r\n".encode()
                    )  # and never the body
                    head = await stream.receive()
            assert head.startswith(b"HTTP/1.1 " + status), head[:40]


async def test_chunked_body_over_the_source_limit_is_413(pool, db_dsn, store) -> None:
    small = hook("small", {"provider": "resend", "secret": SW_SECRET}, max_body_bytes=4096)

    async def chunks():
        for _ in range(64):
            yield b"x" * 1024

    async with serving_hooks(pool, db_dsn, store, small=small) as served:
        with anyio.fail_after(DEADLINE_S):
            async with served.session.post(
                f"{served.base}/hooks/esp/acme/small",
                data=chunks(),
                headers={"content-type": "application/json"},
            ) as response:
                assert response.status == 413
    assert await stored_events(pool) == []


def test_reload_keeps_a_bucket_only_when_its_settings_are_unchanged(sw) -> None:
    table = HookTable({("acme", "resend"): sw})
    kept = hook("resend", {"provider": "resend", "secret": SW_SECRET})
    table.replace({("acme", "resend"): kept})
    assert table.get("acme", "resend").limiter is sw.limiter
    faster = hook(
        "resend",
        {"provider": "resend", "secret": SW_SECRET},
        limiter=RateLimiter(rate=5000, burst=9000),
    )
    table.replace({("acme", "resend"): faster})
    assert table.get("acme", "resend").limiter.settings == (5000, 9000)


async def test_confirm_subscription_requires_a_200() -> None:
    from inboxd.daemon.webhooks.esp_config import confirm_subscription

    seen: list[str] = []

    async def answer(request: aiohttp.web.Request) -> aiohttp.web.Response:
        seen.append(request.query.get("Token", ""))
        return aiohttp.web.Response(status=200 if request.query.get("Token") == "ok" else 403)

    app = aiohttp.web.Application()
    app.router.add_get("/", answer)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        await confirm_subscription(f"http://127.0.0.1:{port}/?Action=ConfirmSubscription&Token=ok")
        with pytest.raises(RuntimeError, match="403"):
            await confirm_subscription(f"http://127.0.0.1:{port}/?Token=expired")
    finally:
        await runner.cleanup()
    assert seen == ["ok", "expired"]


async def test_a_mailgun_token_is_single_use_across_sources_sharing_the_key(
    pool, db_dsn, store
) -> None:
    """Mailgun signs timestamp + token, not the event: a token seen at one source
    must not carry other event data into another source verified by the same key."""
    first = hook("mg", {"provider": "mailgun", "signing_key": MAILGUN_KEY})
    second = hook("mg2", {"provider": "mailgun", "signing_key": MAILGUN_KEY})
    json_ct = {"content-type": "application/json"}
    async with serving_hooks(pool, db_dsn, store, mg=first, mg2=second) as served:
        assert (await post_hook(served, "mg", mailgun_body("ev-1", "token-shared"), json_ct))[
            0
        ] == 200
        forged = mailgun_body("ev-forged", "token-shared", kind="failed")
        assert await post_hook(served, "mg2", forged, json_ct) == (401, {"error": "unauthorized"})
    assert len(await stored_events(pool)) == 1


# -- budgets: failed verifications cannot hold signed events back ----------------------

#: The flood's own bounds: loopback only, at most this many requests, for at most
#: this long, from this many concurrent requests at a time.
FLOOD_MAX_REQUESTS = 30_000
FLOOD_MAX_S = 20.0
FLOOD_CONCURRENCY = 32
#: Signed events sent one after another while the flood runs.
SIGNED_DURING_FLOOD = 60
#: The source's budget in the flood test: small, so a flood that spent it (as
#: every unsigned request did before per-peer failure budgets) would 429 the
#: signed events; the signed ones alone stay within its burst. Small enough that a
#: flood from a machine at load 20 still sends twice the budget (the test compares
#: the flood with the budget over the same window, not with a rate of its own).
FLOOD_SOURCE_RATE_PER_S = 10.0
FLOOD_SOURCE_BURST = 100.0
FLOOD_PEER = "127.0.0.2"  # all of 127.0.0.0/8 is loopback on Linux: a second peer
#: Through a proxy: every request's TCP peer is the proxy; the clients it forwards for
#: (documentation ranges, RFC 5737) are told apart by X-Forwarded-For alone.
PROXY = "127.0.0.1"
FLOOD_CLIENT = "203.0.113.66"
ESP_CLIENT = "198.51.100.7"


def garbage(n: int) -> tuple[bytes, dict[str, str]]:
    """An unsigned delivery event with signature headers that do not verify."""
    body = resend_event(email_id=f"forged_{n}")
    headers = {
        "webhook-id": f"forged_{n}",
        "webhook-timestamp": str(int(time.time())),
        "webhook-signature": "v1," + base64.b64encode(b"\x00" * 32).decode(),
        "content-type": "application/json",
    }
    return body, headers


@pytest.mark.slow
@pytest.mark.parametrize("path", ["direct", "through_a_proxy"])
async def test_signed_events_get_through_an_unsigned_flood(pool, db_dsn, store, path) -> None:
    """Directly, the flood comes from another address; through a proxy (the daemon's
    `[listener] trusted_proxies` naming it) flood and signed events share the proxy's
    address and only X-Forwarded-For tells the senders apart."""
    resend = hook(
        "resend",
        {"provider": "resend", "secret": SW_SECRET},
        limiter=RateLimiter(FLOOD_SOURCE_RATE_PER_S, FLOOD_SOURCE_BURST),
    )
    proxied = path == "through_a_proxy"
    trusted = (PROXY,) if proxied else ()
    flooder_via, sender_via = (FLOOD_CLIENT, ESP_CLIENT) if proxied else (None, None)
    flood: dict[int | str, int] = {"sent": 0}
    signed: list[int] = []
    async with serving_hooks(pool, db_dsn, store, trusted, resend=resend) as served:
        url = f"{served.base}/hooks/esp/acme/resend"
        connector = aiohttp.TCPConnector(
            local_addr=(PROXY if proxied else FLOOD_PEER, 0), limit=FLOOD_CONCURRENCY
        )
        started = time.monotonic()

        async def flooder(done: anyio.Event) -> None:
            while not done.is_set() and flood["sent"] < FLOOD_MAX_REQUESTS:
                if time.monotonic() - started > FLOOD_MAX_S:
                    return
                flood["sent"] += 1
                body, headers = garbage(flood["sent"])
                if flooder_via is not None:
                    headers["x-forwarded-for"] = flooder_via
                async with flooding.post(url, data=body, headers=headers) as response:
                    await response.read()
                    flood[response.status] = flood.get(response.status, 0) + 1

        async with aiohttp.ClientSession(connector=connector) as flooding:
            done = anyio.Event()
            with anyio.fail_after(FLOOD_MAX_S + DEADLINE_S):
                async with anyio.create_task_group() as tg:
                    for _ in range(FLOOD_CONCURRENCY):
                        tg.start_soon(flooder, done)
                    # The flood is well past the peer's failure budget before the first event.
                    await eventually(lambda: flood.get(429, 0), DEADLINE_S, what="flood 429s")
                    for n in range(SIGNED_DURING_FLOOD):
                        body = resend_event(email_id=f"em_{n}")
                        status, _ = await post_hook(
                            served,
                            "resend",
                            body,
                            sign_standard(body, msg_id=f"m{n}"),
                            via=sender_via,
                        )
                        signed.append(status)
                    flood_running = flood["sent"] < FLOOD_MAX_REQUESTS
                    done.set()
        elapsed_s = time.monotonic() - started
    accepted = signed.count(200)
    rows = await stored_events(pool)
    figures = f"signed {accepted}/{len(signed)}; flood {flood} in {elapsed_s:.1f} s"
    assert flood_running, figures  # every signed event was sent during the flood
    assert accepted >= 0.95 * SIGNED_DURING_FLOOD, figures
    assert sorted(r["dedup_key"] for r in rows) == sorted(
        f"id:m{n}" for n, s in enumerate(signed) if s == 200
    )
    # The flood was far above the source's budget over the same window: had it spent
    # that budget, the signed events would have got 429.
    source_budget = FLOOD_SOURCE_BURST + FLOOD_SOURCE_RATE_PER_S * elapsed_s
    assert flood["sent"] > 2 * source_budget, figures
    # CPU protection: bodies were read and verified only within the peer's failure budget
    # (plus the requests in flight when it ran out); the rest was 429 before the body.
    verified_at_most = (
        FAILED_VERIFICATION_BURST + FAILED_VERIFICATION_RATE_PER_S * elapsed_s + FLOOD_CONCURRENCY
    )
    assert flood.get(401, 0) <= verified_at_most, figures
    assert set(flood) <= {"sent", 401, 429}, figures
    assert failures(served) == flood.get(401, 0)
    print(figures)  # the figures of record, with -s


async def test_a_peer_over_its_failure_budget_gets_429_before_the_body(
    pool, db_dsn, store, sw
) -> None:
    """Only the failing peer is refused: signed events from another peer pass, and
    the source's budget was not spent by the failures."""
    sw.limiter = RateLimiter(rate=0.001, burst=2)  # two verified requests, then 429
    async with serving_hooks(pool, db_dsn, store, failures=burst_only(), resend=sw) as served:
        port = int(served.base.rsplit(":", 1)[1])
        connector = aiohttp.TCPConnector(local_addr=(FLOOD_PEER, 0))
        async with aiohttp.ClientSession(connector=connector) as other:
            for n in range(int(FAILED_VERIFICATION_BURST)):
                body, headers = garbage(n)
                async with other.post(
                    f"{served.base}/hooks/esp/acme/resend", data=body, headers=headers
                ) as r:
                    assert r.status == 401
            body, headers = garbage(99)
            async with other.post(
                f"{served.base}/hooks/esp/acme/resend", data=body, headers=headers
            ) as r:
                assert (r.status, r.headers["Retry-After"]) == (429, "5")
            # A correctly signed event from the failing peer is refused too: a peer is an
            # address (behind a proxy, everyone is the proxy; daemon/webhooks/esp.py).
            good = resend_event(email_id="em_x")
            async with other.post(
                f"{served.base}/hooks/esp/acme/resend",
                data=good,
                headers=sign_standard(good, msg_id="mx"),
            ) as r:
                assert r.status == 429
        # The 429 comes before the body: a request whose body never arrives gets it.
        with anyio.fail_after(DEADLINE_S):
            stream = await anyio.connect_tcp("127.0.0.1", port, local_host=FLOOD_PEER)
            async with stream:
                await stream.send(
                    b"POST /hooks/esp/acme/resend HTTP/1.1\r\nHost: t\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                )  # and never the body
                head = await stream.receive()
        assert head.startswith(b"HTTP/1.1 429"), head[:40]
        # Another peer's signed events spend the source's budget, untouched by the failures.
        for n in range(2):
            body = resend_event(email_id=f"em_{n}")
            assert (await post_hook(served, "resend", body, sign_standard(body, msg_id=f"m{n}")))[
                0
            ] == 200
        body = resend_event(email_id="em_2")
        assert (await post_hook(served, "resend", body, sign_standard(body, msg_id="m2")))[0] == 429
        assert failures(served) == FAILED_VERIFICATION_BURST
    assert len(await stored_events(pool)) == 2


def test_peer_budgets_are_bounded_and_separate() -> None:
    budgets = PeerBudgets(rate=0.001, burst=2, max_keys=3)
    for _ in range(2):
        budgets.charge(("acme", "resend", "10.0.0.1"))
    assert not budgets.allows(("acme", "resend", "10.0.0.1"))
    assert budgets.allows(("acme", "resend", "10.0.0.2"))  # another peer
    assert budgets.allows(("acme", "other", "10.0.0.1"))  # another source
    for n in range(2, 6):
        budgets.charge(("acme", "resend", f"10.0.0.{n}"))
    assert len(budgets) == 3  # the oldest dropped: its key has a full bucket again
    assert budgets.allows(("acme", "resend", "10.0.0.1"))
    assert peer_key("2001:db8::1") == peer_key("2001:db8::ffff") == "2001:db8::/64"
    assert peer_key("2001:db8:0:1::1") != peer_key("2001:db8::1")
    assert peer_key("::ffff:192.0.2.7") == peer_key("192.0.2.7") == "192.0.2.7"
    assert peer_key(None) == ""


async def test_forwarded_addresses_count_only_from_a_trusted_proxy(pool, db_dsn, store, sw) -> None:
    """A client's budget is its forwarded address when the TCP peer is a trusted proxy;
    a peer that is not one writes X-Forwarded-For in vain (its own address counts)."""
    async with serving_hooks(
        pool, db_dsn, store, (PROXY,), failures=burst_only(), resend=sw
    ) as served:

        async def forged(n: int, via: str, peer: str) -> int:
            body, headers = garbage(n)
            connector = aiohttp.TCPConnector(local_addr=(peer, 0))
            async with aiohttp.ClientSession(connector=connector) as session:
                async with session.post(
                    f"{served.base}/hooks/esp/acme/resend",
                    data=body,
                    headers={**headers, "x-forwarded-for": via},
                ) as r:
                    return r.status

        # The flooding client, through the proxy, spends its own failure budget ...
        for n in range(int(FAILED_VERIFICATION_BURST)):
            assert await forged(n, FLOOD_CLIENT, PROXY) == 401
        assert await forged(99, FLOOD_CLIENT, PROXY) == 429
        # ... a client that wrote the flooder's address to the left of its own is itself
        # (the proxy appends the address it saw), and another client is untouched.
        body = resend_event(email_id="em_1")
        spoofed = f"{FLOOD_CLIENT}, {ESP_CLIENT}"
        assert (
            await post_hook(served, "resend", body, sign_standard(body, msg_id="m1"), via=spoofed)
        )[0] == 200
        # A peer that is not a trusted proxy cannot pick a fresh budget per request.
        for n in range(int(FAILED_VERIFICATION_BURST)):
            assert await forged(200 + n, f"192.0.2.{n + 1}", FLOOD_PEER) == 401
        assert await forged(299, "192.0.2.250", FLOOD_PEER) == 429
    assert len(await stored_events(pool)) == 1


def test_the_failure_budgets_a_table_is_given_are_the_ones_it_uses() -> None:
    # An empty PeerBudgets has a length of 0: `failures or default` swapped the
    # caller's budgets for the default, refilling ones (and a test's burst_only()
    # budget refilled under load, so its 21st forged request got 401, not 429).
    given = burst_only()
    assert HookTable({}, failures=given).failures is given
