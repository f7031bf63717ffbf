"""The HTTP listener against a real PostgreSQL and real sockets on 127.0.0.1.

Each test starts `serve_http` on an ephemeral port (tests/daemon/http_rig.py),
talks HTTP to it (aiohttp's client, or a raw socket where the client would be
too polite), and cancels the task group at the end. Every wait has a deadline;
nothing sleeps to synchronise.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import anyio
import asyncpg
import orjson
import pytest
import structlog
from http_rig import ACME, GLOBEX, TOKENS, Listener, api_state, outbound_body, serving_api
from multidict import CIMultiDict

import inboxd.daemon.http.events as sse_module
from inboxd.daemon.http import TokenTable, serve_http
from inboxd.daemon.http.api import ATTACHMENT_URL_TTL_S, content_disposition
from inboxd.daemon.metrics.registry import Metrics
from inboxd.pipeline.objectstore.local import LocalDirectoryStore
from inboxd.pipeline.objectstore.store import ObjectStore
from inboxd.pipeline.outcomes import ItemResult, Outcome

DEADLINE_S = 10


@pytest.fixture
async def tenants(make_mailbox) -> None:
    await make_mailbox("acme", "inbox", address="support@acme.test")
    await make_mailbox("globex", "sales", address="sales@globex.test")


async def emit(
    pool: asyncpg.Pool,
    tenant: str,
    kind: str,
    payload: dict[str, Any] | None = None,
    mailbox: str | None = None,
) -> int:
    """Commit one outbox row and its NOTIFY, as pipeline/outbox.py does."""
    async with pool.acquire() as conn, conn.transaction():
        event_id = await conn.fetchval(
            "INSERT INTO events (tenant_id, kind, mailbox_id, payload) VALUES ($1, $2, $3, $4) "
            "RETURNING event_id",
            tenant,
            kind,
            mailbox,
            orjson.dumps(payload or {}).decode(),
        )
        await conn.execute(
            "SELECT pg_notify('inboxd_events', $1)",
            orjson.dumps({"tenant": tenant, "last_event_id": event_id}).decode(),
        )
    return event_id


class EventStream:
    """A minimal SSE parser over an aiohttp response."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response
        self.comments: list[str] = []

    async def next(self) -> dict[str, Any]:
        fields: dict[str, str] = {}
        with anyio.fail_after(DEADLINE_S):
            while True:
                raw = await self.response.content.readline()
                if not raw:
                    raise EOFError("stream ended")
                line = raw.decode().rstrip("\r\n")
                if not line:
                    if "data" in fields:
                        return {
                            "id": int(fields["id"]),
                            "event": fields["event"],
                            "data": orjson.loads(fields["data"]),
                        }
                    fields = {}
                elif line.startswith(":"):
                    self.comments.append(line)
                else:
                    name, _, value = line.partition(":")
                    fields[name] = value.removeprefix(" ")


@asynccontextmanager
async def subscribe(
    srv: Listener, headers: dict[str, str], query: str = ""
) -> AsyncIterator[EventStream]:
    with anyio.fail_after(DEADLINE_S):
        response = await srv.session.get(f"{srv.base}/v1/events{query}", headers=headers)
    try:
        assert response.status == 200, await response.text()
        assert response.headers["Content-Type"].startswith("text/event-stream")
        with anyio.fail_after(DEADLINE_S):
            # the first line ("retry: …") is written once the client is registered
            assert (await response.content.readline()).startswith(b"retry:")
        yield EventStream(response)
    finally:
        response.release()


# -- probes and metrics ----------------------------------------------------------------


async def test_healthz_readyz_and_metrics(pool, db_dsn, store) -> None:
    answers = iter([True, False])

    async def ready() -> bool:
        try:
            return next(answers)
        except StopIteration:
            raise RuntimeError("probe crashed") from None

    async with serving_api(pool, db_dsn, store, ready=ready) as srv:
        async with srv.session.get(f"{srv.base}/healthz") as r:
            assert (r.status, await r.json()) == (200, {"status": "ok"})
        async with srv.session.get(f"{srv.base}/readyz") as r:
            assert (r.status, await r.json()) == (200, {"status": "ready"})
        async with srv.session.get(f"{srv.base}/readyz") as r:
            assert (r.status, await r.json()) == (503, {"status": "not_ready"})
        async with srv.session.get(f"{srv.base}/readyz") as r:
            assert r.status == 503  # a crashing probe is "not ready", not a 500
        async with srv.session.get(f"{srv.base}/no/such/path") as r:
            assert (r.status, await r.json()) == (404, {"error": "not_found"})

        metrics = srv.state.metrics
        metrics.observe_outcomes(
            [
                ItemResult(0, Outcome.NEW),
                ItemResult(1, Outcome.NEW),
                ItemResult(2, Outcome.PERMANENT_FAILURE),
            ]
        )
        metrics.set_queue(7, capacity=100)
        metrics.sync_started("gmail")
        metrics.sync_finished("gmail", duration_s=1.5, failed=True)
        metrics.clock = lambda: 1042.0
        metrics.mark_caught_up("acme", "inbox", at=1000.0)
        metrics.watch_mailbox("acme", "inbox")  # already watched: keeps its time
        metrics.webhook_verification_failed("ses")
        async with srv.session.get(f"{srv.base}/metrics") as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/plain; version=")
            text = await r.text()
    for line in (
        'inboxd_ingest_items_total{outcome="new"} 2.0',
        'inboxd_ingest_items_total{outcome="duplicate"} 0.0',
        "inboxd_dead_items_total 1.0",
        "inboxd_queue_depth 7.0",
        'inboxd_sync_runs_total{provider="gmail"} 1.0',
        'inboxd_sync_failures_total{provider="gmail"} 1.0',
        'inboxd_cursor_lag_seconds{mailbox="inbox",tenant="acme"} 42.0',
        'inboxd_webhook_verification_failures_total{source="ses"} 1.0',
        'inboxd_http_requests_total{method="GET",route="/readyz",status="503"} 2.0',
        'inboxd_http_requests_total{method="GET",route="unmatched",status="404"} 1.0',
        "inboxd_sse_clients 0.0",
    ):
        assert line in text, line
    assert "inboxd_http_request_duration_seconds_bucket" in text
    assert "/no/such/path" not in text  # unmatched paths never become label values


async def test_serves_probes_while_the_listen_database_is_unreachable(pool, store) -> None:
    async def not_ready() -> bool:
        return False

    unreachable = "postgresql://postgres@127.0.0.1:1/nowhere"  # nothing listens on port 1
    async with serving_api(pool, unreachable, store, ready=not_ready) as srv:
        async with srv.session.get(f"{srv.base}/healthz") as r:
            assert r.status == 200
        async with srv.session.get(f"{srv.base}/readyz") as r:
            assert r.status == 503


async def test_a_taken_port_fails_the_start(pool, db_dsn, store) -> None:
    state = api_state(pool, db_dsn, store)
    async with serving_api(pool, db_dsn, store) as srv:
        with pytest.raises(ExceptionGroup) as info, anyio.fail_after(DEADLINE_S):
            async with anyio.create_task_group() as tg:
                await tg.start(serve_http, "127.0.0.1", srv.port, state)
    assert info.group_contains(OSError)


def test_metrics_have_their_own_registry() -> None:
    first, second = Metrics(), Metrics()
    first.observe_outcomes([ItemResult(0, Outcome.DUPLICATE)])
    assert b'inboxd_ingest_items_total{outcome="duplicate"} 1.0' in first.render()
    assert b'inboxd_ingest_items_total{outcome="duplicate"} 0.0' in second.render()


# -- body limit and auth ---------------------------------------------------------------


async def _raw_request(port: int, head: bytes, body_start: bytes = b"") -> bytes:
    """Send a request head (and the first bytes of a body), return what the server answers
    before it closes the connection. The rest of the declared body is never sent."""
    with anyio.fail_after(DEADLINE_S):
        async with await anyio.connect_tcp("127.0.0.1", port) as stream:
            await stream.send(head + body_start)
            answer = b""
            while b"\r\n\r\n" not in answer or b"body_too_large" not in answer:
                try:
                    answer += await stream.receive()
                except anyio.EndOfStream:
                    break
            return answer


async def test_declared_oversized_body_gets_413_without_being_read(pool, db_dsn, store) -> None:
    async with serving_api(pool, db_dsn, store, max_body_bytes=1024) as srv:
        head = (
            b"POST /v1/outbound HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Authorization: Bearer " + TOKENS["acme"].encode() + b"\r\n"
            b"Content-Type: application/json\r\nContent-Length: 10000000000\r\n\r\n"
        )
        # 10 GB announced, 5 bytes sent: an answer at all proves the body was not awaited.
        answer = await _raw_request(srv.port, head, b'{"a":')
        assert answer.startswith(b"HTTP/1.1 413 "), answer[:80]
        assert b"Connection: close" in answer
        assert b'"max_body_bytes":1024' in answer

        # Expect: 100-continue gets the 413 instead of "100 Continue"
        expect_head = head.replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n")
        answer = await _raw_request(srv.port, expect_head)
        assert answer.startswith(b"HTTP/1.1 413 "), answer[:80]
        assert b"100 Continue" not in answer


async def test_chunked_body_is_cut_at_the_limit(pool, db_dsn, store, tenants) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(4):
            yield b"x" * 1000

    async with serving_api(pool, db_dsn, store, max_body_bytes=1024) as srv:
        async with srv.session.post(
            f"{srv.base}/v1/outbound",
            data=chunks(),
            headers={**ACME, "Content-Type": "application/json"},
        ) as r:
            assert r.status == 413
            assert (await r.json())["error"] == "body_too_large"
        # a body of exactly the limit is read and reaches the handler
        body = b'{"pad": "' + b"x" * (1024 - 11) + b'"}'
        assert len(body) == 1024
        async with srv.session.post(
            f"{srv.base}/v1/outbound",
            data=body,
            headers={**ACME, "Content-Type": "application/json"},
        ) as r:
            assert r.status == 422
            assert (await r.json())["fields"]["pad"] == "unknown field"
        counted = srv.state.metrics.render()
        assert b'route="/v1/outbound",status="413"' in counted


@pytest.mark.parametrize(
    "path, method", [("/v1/events", "GET"), ("/v1/outbound", "POST"), ("/v1/attachments/1", "GET")]
)
async def test_api_routes_need_a_known_bearer_token(pool, db_dsn, store, path, method) -> None:
    async with serving_api(pool, db_dsn, store) as srv:
        for headers in (
            {},
            {"Authorization": "Bearer wrong-token"},
            {"Authorization": f"Basic {TOKENS['acme']}"},
            {"Authorization": "Bearer "},
        ):
            async with srv.session.request(
                method, srv.base + path, headers=headers, json={} if method == "POST" else None
            ) as r:
                assert r.status == 401, headers
                assert await r.json() == {"error": "unauthorized"}
                assert r.headers["WWW-Authenticate"].startswith("Bearer")


def test_token_table_is_exact_and_keeps_tokens_out_of_repr() -> None:
    table = TokenTable(TOKENS)
    assert table(TOKENS["acme"]) == "acme"
    assert table(TOKENS["globex"]) == "globex"
    assert table(TOKENS["acme"][:-1]) is None
    assert table(TOKENS["acme"] + "x") is None
    assert table("") is None
    assert "secret" not in repr(table)
    with pytest.raises(ValueError, match="shares"):
        TokenTable({"a": "same-token-123456", "b": "same-token-123456"})
    with pytest.raises(ValueError, match="empty"):
        TokenTable({"a": ""})


# -- SSE -------------------------------------------------------------------------------


async def test_each_tenant_receives_only_its_own_events_in_order(
    pool, db_dsn, store, tenants
) -> None:
    async with serving_api(pool, db_dsn, store) as srv:
        async with subscribe(srv, ACME) as acme, subscribe(srv, GLOBEX) as globex:
            a1 = await emit(pool, "acme", "message.created", {"n": 1}, mailbox="inbox")
            g1 = await emit(pool, "globex", "message.created", {"n": 1}, mailbox="sales")
            a2 = await emit(pool, "acme", "thread.created", {"n": 2}, mailbox="inbox")
            g2 = await emit(pool, "globex", "message.merged", {"n": 2})
            a3 = await emit(pool, "acme", "message.merged", {"n": 3})
            got_acme = [await acme.next() for _ in range(3)]
            got_globex = [await globex.next() for _ in range(2)]
    assert [(e["id"], e["event"]) for e in got_acme] == [
        (a1, "message.created"),
        (a2, "thread.created"),
        (a3, "message.merged"),
    ]
    assert [(e["id"], e["event"]) for e in got_globex] == [
        (g1, "message.created"),
        (g2, "message.merged"),
    ]
    first = got_acme[0]["data"]
    assert first["event_id"] == a1
    assert first["kind"] == "message.created"
    assert first["mailbox_id"] == "inbox"
    assert first["payload"] == {"n": 1}
    assert set(first) == {
        "event_id",
        "kind",
        "mailbox_id",
        "thread_id",
        "message_id",
        "payload",
        "created_at",
    }


async def test_resume_replays_only_later_events(pool, db_dsn, store, tenants) -> None:
    ids = [await emit(pool, "acme", "message.created", {"n": n}) for n in range(4)]
    await emit(pool, "globex", "message.created")
    async with serving_api(pool, db_dsn, store) as srv:
        async with subscribe(srv, {**ACME, "Last-Event-ID": str(ids[1])}) as stream:
            assert [(await stream.next())["id"] for _ in range(2)] == ids[2:]
            live = await emit(pool, "acme", "message.created")
            assert (await stream.next())["id"] == live
        # query parameter (EventSource's first connect); the header wins over it
        async with subscribe(srv, ACME, f"?last_event_id={ids[2]}") as stream:
            assert (await stream.next())["id"] == ids[3]
        async with subscribe(
            srv, {**ACME, "Last-Event-ID": str(ids[2])}, "?last_event_id=0"
        ) as stream:
            assert (await stream.next())["id"] == ids[3]
        async with subscribe(srv, ACME, "?last_event_id=0") as stream:
            assert [(await stream.next())["id"] for _ in range(4)] == ids
        # no resume point: live events only
        async with subscribe(srv, ACME) as stream:
            newest = await emit(pool, "acme", "message.created")
            assert (await stream.next())["id"] == newest
        async with srv.session.get(f"{srv.base}/v1/events?last_event_id=abc", headers=ACME) as r:
            assert (r.status, await r.json()) == (400, {"error": "invalid_last_event_id"})


async def test_replay_longer_than_one_page(pool, db_dsn, store, tenants, monkeypatch) -> None:
    monkeypatch.setattr(sse_module, "SSE_PAGE_SIZE", 3)
    ids = [await emit(pool, "acme", "message.created", {"n": n}) for n in range(8)]
    async with serving_api(pool, db_dsn, store) as srv:
        async with subscribe(srv, ACME, "?last_event_id=0") as stream:
            assert [(await stream.next())["id"] for _ in range(8)] == ids


async def test_exclude_client_skips_the_callers_own_changes(pool, db_dsn, store, tenants) -> None:
    async with serving_api(pool, db_dsn, store) as srv:
        async with subscribe(srv, ACME, "?exclude_client=tab-1") as stream:
            mine = outbound_body(
                placeholder_message_id="pending_mine",
                client_id="tab-1",
                message_id_header="<mine@acme.test>",
            )
            theirs = outbound_body(
                placeholder_message_id="pending_theirs",
                client_id="tab-2",
                message_id_header="<theirs@acme.test>",
            )
            for body in (mine, theirs):
                async with srv.session.post(
                    f"{srv.base}/v1/outbound", json=body, headers=ACME
                ) as r:
                    assert r.status == 201, await r.text()
            marker = await emit(pool, "acme", "marker")
            got = [await stream.next() for _ in range(2)]
    assert got[0]["event"] == "message.recorded"
    assert got[0]["data"]["payload"]["client_id"] == "tab-2"
    assert got[0]["data"]["payload"]["placeholder_message_id"] == "pending_theirs"
    assert got[1]["id"] == marker


async def test_streams_survive_a_lost_listen_connection(pool, db_dsn, store, tenants) -> None:
    async with serving_api(pool, db_dsn, store) as srv, subscribe(srv, ACME) as stream:
        first = await emit(pool, "acme", "message.created")
        assert (await stream.next())["id"] == first  # the hub is listening
        async with pool.acquire() as conn:
            killed = await conn.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = $1 AND datname = current_database()",
                sse_module.LISTENER_APP_NAME,
            )
        assert killed == 1
        # committed while the hub may be reconnecting: read once it listens again
        second = await emit(pool, "acme", "message.created")
        assert (await stream.next())["id"] == second
        third = await emit(pool, "acme", "message.created")
        assert (await stream.next())["id"] == third


async def test_keepalive_comment_when_idle(pool, db_dsn, store, tenants, monkeypatch) -> None:
    monkeypatch.setattr(sse_module, "SSE_HEARTBEAT_S", 0.05)
    async with serving_api(pool, db_dsn, store) as srv, subscribe(srv, ACME) as stream:
        with anyio.fail_after(DEADLINE_S):
            assert await stream.response.content.readline() == b"\n"  # end of "retry:"
            assert await stream.response.content.readline() == b": keepalive\n"
        event_id = await emit(pool, "acme", "message.created")
        assert (await stream.next())["id"] == event_id


async def test_stopping_the_server_ends_the_streams(pool, db_dsn, store, tenants) -> None:
    state = api_state(pool, db_dsn, store)
    metrics = state.metrics
    async with aiohttp.ClientSession() as session:  # outlives the server
        # the whole start-stream-stop cycle, far below the 15 s heartbeat
        with anyio.fail_after(DEADLINE_S):
            async with anyio.create_task_group() as tg:
                port = await tg.start(serve_http, "127.0.0.1", 0, state)
                response = await session.get(f"http://127.0.0.1:{port}/v1/events", headers=ACME)
                assert (await response.content.readline()).startswith(b"retry:")
                assert b"inboxd_sse_clients 1.0" in metrics.render()
                tg.cancel_scope.cancel()
        try:
            with anyio.fail_after(DEADLINE_S):
                rest = await response.content.read()  # returns at the end of the stream
        finally:
            response.release()
    assert rest == b"\n"  # the blank line after "retry:", then the end of the stream
    assert b"inboxd_sse_clients 0.0" in metrics.render()


# -- POST /v1/outbound -----------------------------------------------------------------


async def test_outbound_is_recorded(pool, db_dsn, store, tenants) -> None:
    async with serving_api(pool, db_dsn, store) as srv:
        url = f"{srv.base}/v1/outbound"
        async with srv.session.post(
            url,
            json=outbound_body(client_id="tab-9", esp_message_id="pm-77"),
            headers=ACME,
            expect100=True,
        ) as r:
            assert r.status == 201
            message_id = (await r.json())["message_id"]
        # a retried request answers the same row
        async with srv.session.post(url, json=outbound_body(client_id="tab-9"), headers=ACME) as r:
            assert (r.status, await r.json()) == (200, {"message_id": message_id})
        # the placeholder already names another message
        async with srv.session.post(
            url, json=outbound_body(message_id_header="<x@acme.test>"), headers=ACME
        ) as r:
            assert (r.status, await r.json()) == (409, {"error": "placeholder_in_use"})
        # globex's mailbox is not acme's
        async with srv.session.post(url, json=outbound_body(mailbox_id="sales"), headers=ACME) as r:
            assert (r.status, await r.json()) == (404, {"error": "mailbox_not_found"})
    async with pool.acquire() as conn:
        row = await conn.fetchrow("SELECT * FROM messages WHERE message_id = $1", message_id)
        event = await conn.fetchrow("SELECT kind, message_id, payload FROM events")
        assert await conn.fetchval("SELECT count(*) FROM messages") == 1
    assert row["tenant_id"] == "acme"
    assert row["external_id"] == "pending_abc"
    assert (row["direction"], row["send_status"]) == ("outbound", "pending")
    assert row["message_id_norm"] == "out-1@acme.test"
    assert row["text_body"] == "Thanks for your order."
    assert row["esp_message_id"] == "pm-77"
    assert row["sent_at"].isoformat() == "2026-11-02T09:30:00+00:00"
    assert event["kind"] == "message.recorded"
    assert event["message_id"] == message_id
    assert orjson.loads(event["payload"])["client_id"] == "tab-9"


async def test_outbound_rejects_bad_bodies(pool, db_dsn, store, tenants) -> None:
    async with serving_api(pool, db_dsn, store) as srv:
        url = f"{srv.base}/v1/outbound"
        bad = outbound_body(
            placeholder_message_id="gm-123",
            sent_at="2026-11-02T09:30:00",
            send_status="failed",
            subject=5,
            colour="blue",
        )
        del bad["from_address"]
        async with srv.session.post(url, json=bad, headers=ACME) as r:
            assert r.status == 422
            answer = await r.json()
        async with srv.session.post(
            url, data=b"{not json", headers={**ACME, "Content-Type": "application/json"}
        ) as r:
            assert (r.status, (await r.json())["error"]) == (400, "invalid_json")
        async with srv.session.post(url, json=[1, 2], headers=ACME) as r:
            assert r.status == 400
        async with srv.session.post(
            url, data=b"a=b", headers={**ACME, "Content-Type": "application/x-www-form-urlencoded"}
        ) as r:
            assert r.status == 415
    assert answer["error"] == "invalid_request"
    assert set(answer["fields"]) == {
        "placeholder_message_id",
        "sent_at",
        "send_status",
        "subject",
        "colour",
        "from_address",
    }
    assert answer["fields"]["from_address"] == "required"
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM messages") == 0


# -- GET /v1/attachments/{id} ----------------------------------------------------------


class PresigningStore(LocalDirectoryStore):
    """A store that hands out URLs, like S3Store."""

    async def url_for(self, key: str, *, expires_s: int) -> str | None:
        return f"https://bucket.s3.example.test/{key}?X-Amz-Expires={expires_s}&X-Amz-Signature=f00"


async def add_attachment(
    pool: asyncpg.Pool,
    store: ObjectStore,
    tenant: str,
    mailbox: str,
    *,
    filename: str,
    data: bytes | None,
    content_type: str,
) -> int:
    key = f"att/{tenant}/{hashlib.sha256(data or b'').hexdigest()}"
    if data is not None:
        await store.put(key, data)
    async with pool.acquire() as conn, conn.transaction():
        thread_id = await conn.fetchval(
            "INSERT INTO threads (tenant_id, mailbox_id, external_thread_id) VALUES ($1, $2, $3) "
            "ON CONFLICT (tenant_id, mailbox_id, external_thread_id) DO UPDATE SET subject = '' "
            "RETURNING thread_id",
            tenant,
            mailbox,
            "t-1",
        )
        message_id = await conn.fetchval(
            "INSERT INTO messages (tenant_id, mailbox_id, thread_id, external_id) "
            "VALUES ($1, $2, $3, $4) RETURNING message_id",
            tenant,
            mailbox,
            thread_id,
            f"ext-{filename}-{data is None}",
        )
        return await conn.fetchval(
            "INSERT INTO attachments (tenant_id, message_id, position, filename, content_type, "
            "size_bytes, storage_key, stored) VALUES ($1, $2, 0, $3, $4, $5, $6, $7) "
            "RETURNING attachment_id",
            tenant,
            message_id,
            filename,
            content_type,
            len(data or b""),
            key if data is not None else None,
            data is not None,
        )


async def test_attachment_download_is_scoped_to_the_tenant(pool, db_dsn, store, tenants) -> None:
    data = b"%PDF-1.7\n" + bytes(range(256)) * 40
    stored = await add_attachment(
        pool,
        store,
        "acme",
        "inbox",
        filename="Rechnung März 2026.pdf",
        data=data,
        content_type="application/pdf; name=x.pdf",
    )
    pending = await add_attachment(
        pool,
        store,
        "acme",
        "inbox",
        filename="later.bin",
        data=None,
        content_type="application/octet-stream",
    )
    async with serving_api(pool, db_dsn, store) as srv:
        url = f"{srv.base}/v1/attachments"
        async with srv.session.get(f"{url}/{stored}", headers=ACME) as r:
            assert r.status == 200
            assert await r.read() == data
            assert r.headers["Content-Type"] == "application/pdf"
            assert r.headers["Content-Disposition"] == (
                'attachment; filename="Rechnung M_rz 2026.pdf"; '
                "filename*=UTF-8''Rechnung%20M%C3%A4rz%202026.pdf"
            )
            assert r.headers["X-Content-Type-Options"] == "nosniff"
        async with srv.session.get(f"{url}/{stored}", headers=GLOBEX) as r:
            assert (r.status, await r.json()) == (404, {"error": "not_found"})
        async with srv.session.get(f"{url}/{pending}", headers=ACME) as r:
            assert (r.status, (await r.json())["error"]) == (409, "not_stored")
        for missing in ("999999", "99999999999999999999", "abc"):
            async with srv.session.get(f"{url}/{missing}", headers=ACME) as r:
                assert r.status == 404, missing
        assert b'route="/v1/attachments/{id}",status="404"' in srv.state.metrics.render()


async def test_attachment_redirects_to_a_presigned_url(pool, db_dsn, tmp_path, tenants) -> None:
    presigning = PresigningStore(tmp_path / "s3")
    stored = await add_attachment(
        pool,
        presigning,
        "acme",
        "inbox",
        filename="a.txt",
        data=b"hello",
        content_type="text/plain",
    )
    async with serving_api(pool, db_dsn, presigning) as srv:
        async with srv.session.get(
            f"{srv.base}/v1/attachments/{stored}", headers=ACME, allow_redirects=False
        ) as r:
            assert r.status == 302
            location = r.headers["Location"]
            assert r.headers["Cache-Control"] == "no-store"
    assert location.startswith("https://bucket.s3.example.test/att/acme/")
    assert f"X-Amz-Expires={ATTACHMENT_URL_TTL_S}" in location


def test_content_disposition_encodes_any_name() -> None:
    assert content_disposition('a "quoted"\\name.txt', fallback="f") == (
        "attachment; filename=\"a _quoted__name.txt\"; filename*=UTF-8''a%20%22quoted%22_name.txt"
    )
    assert content_disposition("../../etc/passwd", fallback="f") == (
        "attachment; filename=\"_.._etc_passwd\"; filename*=UTF-8''_.._etc_passwd"
    )
    assert content_disposition("", fallback="attachment-7") == (
        "attachment; filename=\"attachment-7\"; filename*=UTF-8''attachment-7"
    )
    assert content_disposition("日本.txt\r\nX-Evil: 1", fallback="f").count("\n") == 0


# -- ambiguity: oversized, malformed and repeated Authorization ------------------------


def leaks(text: bytes | str, secret: str, window: int = 8) -> bool:
    """True when any `window` consecutive characters of `secret` occur in `text`.

    `secret` is high-entropy (token_urlsafe), so 8 of its characters in a row
    appearing anywhere means it was quoted, not a coincidence.
    """
    if isinstance(text, bytes):
        text = text.decode("latin-1")
    pieces = {secret[i : i + window] for i in range(len(secret) - window + 1)}
    return any(text[i : i + window] in pieces for i in range(len(text) - window + 1))


async def raw_exchange(port: int, request: bytes) -> bytes:
    """Send `request` as is and read the answer until the server closes."""
    received: list[bytes] = []
    with anyio.fail_after(DEADLINE_S):
        stream = await anyio.connect_tcp("127.0.0.1", port)
        async with stream:
            try:
                await stream.send(request)
            except (anyio.BrokenResourceError, ConnectionError):
                pass  # it may close before taking all of an oversized request
            try:
                while True:
                    received.append(await stream.receive())
            except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError):
                pass
    return b"".join(received)


@pytest.mark.parametrize(
    "size, prefix, expected",
    [
        (10 * 1024, "", "line_too_long"),  # aiohttp's LineTooLong quotes its first 100 bytes
        (100 * 1024, "", "line_too_long"),
        (64, "\x00", "bad_request"),  # InvalidHeader quotes the whole value
    ],
    ids=["10KB", "100KB", "nul-in-value"],
)
async def test_a_refused_authorization_header_is_never_echoed_or_logged(
    pool, db_dsn, store, caplog, capfd, size: int, prefix: str, expected: str
) -> None:
    token = secrets.token_urlsafe(size)[:size]
    caplog.set_level(logging.DEBUG)
    with structlog.testing.capture_logs() as events:
        async with serving_api(pool, db_dsn, store) as srv:
            for path in ("/v1/events", "/v1/attachments/1"):
                answer = await raw_exchange(
                    srv.port,
                    f"GET {path} HTTP/1.1\r\nHost: t\r\n"
                    f"Authorization: Bearer {prefix}{token}\r\n\r\n".encode("latin-1"),
                )
                head, _, body = answer.partition(b"\r\n\r\n")
                assert head.split(b" ", 2)[1] == b"400", head[:60]  # HTTP/1.0: aiohttp's ERROR
                assert orjson.loads(body) == {"error": expected}
                assert b"Bearer" not in answer and not leaks(answer, token)
    refused = [e for e in events if e["event"] == "http_request_unparsable"]
    assert len(refused) == 2 and refused[0]["status"] == 400  # the capture saw our lines
    captured = capfd.readouterr()
    logged = "\n".join([repr(events), caplog.text, captured.out, captured.err])
    assert "Bearer" not in logged
    assert not leaks(logged, token)


def test_token_leak_check_can_fail() -> None:
    token = secrets.token_urlsafe(1000)
    assert leaks(f"x b'Bearer {token[300:320]}...' y", token)
    assert not leaks("Bearer xxxxxxxx", token)


@pytest.mark.parametrize("order", ["right-wrong", "wrong-right", "right-right"])
async def test_two_authorization_headers_are_400_and_nothing_is_served(
    pool, db_dsn, store, tenants, order: str
) -> None:
    right, wrong = f"Bearer {TOKENS['acme']}", "Bearer wrong-token"
    first, second = {"right-wrong": (right, wrong), "wrong-right": (wrong, right)}.get(
        order, (right, right)
    )
    data = b"%PDF-1.7 attachment bytes " + secrets.token_bytes(32)
    attachment = await add_attachment(
        pool, store, "acme", "inbox", filename="a.pdf", data=data, content_type="application/pdf"
    )
    requests = [
        ("GET", "/v1/events?last_event_id=0", None),
        ("POST", "/v1/outbound", outbound_body()),
        ("GET", f"/v1/attachments/{attachment}", None),
    ]
    await emit(pool, "acme", "message.created")
    async with serving_api(pool, db_dsn, store) as srv:
        for method, path, body in requests:
            headers = CIMultiDict([("Authorization", first), ("Authorization", second)])
            with anyio.fail_after(DEADLINE_S):
                async with srv.session.request(
                    method, srv.base + path, headers=headers, json=body
                ) as r:
                    answer = await r.read()
            assert (r.status, orjson.loads(answer)) == (
                400,
                {"error": "ambiguous_authorization"},
            ), path
            assert data not in answer and b"message.created" not in answer
            assert r.headers["Content-Type"] == "application/json"
        # One of them alone is served: the 400s were the pair's doing.
        async with srv.session.get(f"{srv.base}/v1/attachments/{attachment}", headers=ACME) as r:
            assert (r.status, await r.read()) == (200, data)
    async with pool.acquire() as conn:
        assert (
            await conn.fetchval("SELECT count(*) FROM messages WHERE external_id = 'pending_abc'")
            == 0
        )
        assert (
            await conn.fetchval("SELECT count(*) FROM events WHERE kind = 'message.recorded'") == 0
        )


async def test_tokens_of_refused_requests_are_not_logged(
    pool, db_dsn, store, caplog, capfd
) -> None:
    """Our own lines (debug included) carry route, method and status, never a header."""
    wrong = secrets.token_urlsafe(40)
    caplog.set_level(logging.DEBUG)
    with structlog.testing.capture_logs() as events:
        async with serving_api(pool, db_dsn, store) as srv:
            for headers in (
                {"Authorization": f"Bearer {wrong}"},
                CIMultiDict([("Authorization", f"Bearer {wrong}"), *ACME.items()]),
            ):
                async with srv.session.get(f"{srv.base}/v1/attachments/1", headers=headers) as r:
                    assert r.status in (400, 401)
                    assert wrong not in await r.text()
    assert [e["status"] for e in events if e["event"] == "http_request"] == [401, 400]
    captured = capfd.readouterr()
    logged = "\n".join([repr(events), caplog.text, captured.out, captured.err])
    assert wrong not in logged and TOKENS["acme"] not in logged
