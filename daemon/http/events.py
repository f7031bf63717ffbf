"""`GET /v1/events`: the `events` outbox as Server-Sent Events, per tenant.

Protocol (WHATWG HTML "Server-sent events"): `text/event-stream`, one message
per outbox row, in event_id order::

    id: 1234
    event: message.created
    data: {"event_id":1234,"kind":"message.created","mailbox_id":"inbox",
           "thread_id":7,"message_id":42,"payload":{…},"created_at":"…"}

(`data` is one line.) A comment `: keepalive` is written after
`SSE_HEARTBEAT_S` without events so proxies keep the connection open.

Resuming: the client's `Last-Event-ID` header (browsers' EventSource sends it
on reconnect) or the `?last_event_id=N` query parameter (header wins): events
with a larger event_id are replayed first, then new ones follow. Without
either the stream starts at the tenant's newest event (live only);
`last_event_id=0` replays the whole outbox.

`?exclude_client=<id>` skips events whose `payload.client_id` is that id, so
the browser tab that made a change is not told about it again. The
application puts its `client_id` there by passing it when it records
outbound mail (`POST /v1/outbound {"client_id": …}`,
`pipeline.outbound.record_outbound(client_id=…)`).

Fan-out: one `EventHub` per listener holds ONE dedicated PostgreSQL
connection that LISTENs on `inboxd_events` (pipeline/outbox.py; payload
`{"tenant": …, "last_event_id": …}`). A notification wakes that tenant's
connected clients; each then SELECTs its tenant's rows after its own last id
(`SSE_PAGE_SIZE` per read) from the pool. A client registers with the hub
before its first read, so a commit between the read and the wait still wakes
it. While the LISTEN connection is down, the hub reconnects (tenacity,
jittered backoff, unbounded: the listener must come back whenever the
database does) and wakes every client once it listens again, so nothing
committed in between is left unread. A tenant's stream only ever reads rows
`WHERE tenant_id = <the token's tenant>`.

Consuming the outbox without HTTP, with plain SQL (what this module does):

    LISTEN inboxd_events;                          -- payload names the tenant
    SELECT event_id, kind, mailbox_id, thread_id, message_id, payload, created_at
      FROM events WHERE tenant_id = $1 AND event_id > $2   -- your last processed id
     ORDER BY event_id LIMIT 500;                  -- repeat until fewer rows

and store the last event_id you processed with your own transaction.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import asyncpg
import orjson
import structlog
from aiohttp import hdrs, web
from anyio.abc import TaskStatus
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_random_exponential

from inboxd.daemon.http.state import HTTP_STATE, authenticate, json_error
from inboxd.daemon.metrics.registry import Metrics
from inboxd.pipeline.errors import DATABASE_ERRORS
from inboxd.pipeline.outbox import NOTIFY_CHANNEL, events_after, last_event_id

__all__ = ["EVENT_HUB", "SSE_HEARTBEAT_S", "SSE_PAGE_SIZE", "EventHub", "events_handler"]

log = structlog.get_logger(__name__)

#: Idle time after which a `: keepalive` comment is sent. Below the 30-60 s idle
#: timeouts of common proxies and load balancers (nginx proxy_read_timeout 60 s,
#: AWS ALB idle timeout 60 s).
SSE_HEARTBEAT_S = 15.0
#: Rows read per SELECT; a replay of a long backlog is several reads.
SSE_PAGE_SIZE = 500
#: A client that does not take a write within this time is dropped (its socket
#: buffer is full: it stopped reading). It resumes with Last-Event-ID.
SSE_WRITE_TIMEOUT_S = 30.0
#: EventSource reconnect delay announced to browsers (`retry:` field), in ms.
SSE_RETRY_MS = 2000
EVENTS_QUERY_TIMEOUT_S = 10.0
LISTEN_CONNECT_TIMEOUT_S = 10.0
#: A LISTEN connection that silently died (no FIN, e.g. a NAT dropped it) is only
#: noticed by using it: ping it this often.
LISTEN_PING_INTERVAL_S = 30.0
LISTEN_PING_TIMEOUT_S = 5.0
LISTEN_CLOSE_TIMEOUT_S = 2.0
LISTEN_RETRY_MAX_WAIT_S = 30.0
#: application_name of the LISTEN connection, so operators can find it in pg_stat_activity.
LISTENER_APP_NAME = "inboxd-sse-listener"
_MAX_EVENT_ID = 2**63 - 1  # events.event_id is bigint
_MAX_CLIENT_ID_LENGTH = 200


class _Subscriber:
    """One connected SSE client: woken by the hub, closed when the server stops."""

    __slots__ = ("_wakeup", "closed", "tenant")

    def __init__(self, tenant: str) -> None:
        self.tenant = tenant
        self.closed = False
        self._wakeup = anyio.Event()

    def wake(self) -> None:
        self._wakeup.set()

    async def wait(self) -> None:
        """Return once woken (immediately if woken since the last wait)."""
        await self._wakeup.wait()
        # Re-armed before the caller reads, so a wake-up during the read is kept.
        self._wakeup = anyio.Event()


class EventHub:
    """The listener's one LISTEN connection and the SSE clients it wakes, by tenant."""

    def __init__(self, dsn: str, metrics: Metrics) -> None:
        self._dsn = dsn
        self._metrics = metrics
        self._subscribers: dict[str, set[_Subscriber]] = {}
        self._closed = False
        #: True while the LISTEN connection is up (for tests and status output).
        self.listening = False

    def __repr__(self) -> str:
        return f"EventHub(clients={self.client_count}, listening={self.listening})"

    @property
    def client_count(self) -> int:
        return sum(len(subs) for subs in self._subscribers.values())

    @contextmanager
    def subscribe(self, tenant: str) -> Iterator[_Subscriber]:
        """Register a client of `tenant` for the duration of the block.

        Raises `ApiError` 503 once the hub is closed (the server is stopping).
        """
        if self._closed:
            json_error(503, "shutting_down")
        sub = _Subscriber(tenant)
        self._subscribers.setdefault(tenant, set()).add(sub)
        self._metrics.sse_client_connected()
        try:
            yield sub
        finally:
            subs = self._subscribers.get(tenant)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._subscribers[tenant]
            self._metrics.sse_client_disconnected()

    def wake_tenant(self, tenant: str) -> None:
        for sub in self._subscribers.get(tenant, ()):
            sub.wake()

    def wake_all(self) -> None:
        for subs in self._subscribers.values():
            for sub in subs:
                sub.wake()

    def close(self) -> None:
        """End every stream (each handler returns after its current write). Idempotent."""
        self._closed = True
        for subs in self._subscribers.values():
            for sub in subs:
                sub.closed = True
                sub.wake()

    def _on_notify(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        try:
            tenant = orjson.loads(payload)["tenant"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            # Someone else NOTIFYing on our channel: reading again is always safe.
            self.wake_all()
            return
        if isinstance(tenant, str):
            self.wake_tenant(tenant)
        else:
            self.wake_all()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Keep one LISTEN connection open until cancelled, reconnecting when it drops.

        Reports started at once: the listener must serve /healthz while the
        database is still unreachable; clients connected meanwhile are woken as
        soon as the LISTEN is in place.
        """
        task_status.started()
        while True:
            conn = await self._connect()
            try:
                await self._watch(conn)
            finally:
                self.listening = False
                with anyio.CancelScope(shield=True):
                    await _close_quietly(conn)
            log.warning("sse_listener_lost")

    async def _connect(self) -> asyncpg.Connection:
        """A new connection that LISTENs, retried with jittered backoff until one does."""
        unavailable = False

        def log_once(state: RetryCallState) -> None:
            nonlocal unavailable
            if not unavailable:  # CONTRIBUTING.md rule 8: "unavailable" once, not every attempt
                unavailable = True
                exc = state.outcome.exception() if state.outcome else None
                log.warning("sse_listener_unavailable", error=_describe(exc))

        retrying = AsyncRetrying(
            retry=retry_if_exception_type(DATABASE_ERRORS),
            wait=wait_random_exponential(multiplier=0.5, max=LISTEN_RETRY_MAX_WAIT_S),
            sleep=anyio.sleep,
            before_sleep=log_once,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                conn = await self._listen_on_new_connection()
        if unavailable:
            log.info("sse_listener_recovered")
        return conn

    async def _listen_on_new_connection(self) -> asyncpg.Connection:
        with anyio.fail_after(LISTEN_CONNECT_TIMEOUT_S):
            conn: asyncpg.Connection = await asyncpg.connect(
                self._dsn, server_settings={"application_name": LISTENER_APP_NAME}
            )
        try:
            with anyio.fail_after(LISTEN_PING_TIMEOUT_S):
                await conn.add_listener(NOTIFY_CHANNEL, self._on_notify)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await _close_quietly(conn)
            raise
        return conn

    async def _watch(self, conn: asyncpg.Connection) -> None:
        """Return when the LISTENing `conn` is lost or stops answering."""
        lost = anyio.Event()
        conn.add_termination_listener(lambda _conn: lost.set())
        if conn.is_closed():
            return
        self.listening = True
        # Anything committed while nobody listened is read now.
        self.wake_all()
        while True:
            with anyio.move_on_after(LISTEN_PING_INTERVAL_S):
                await lost.wait()
                return
            try:
                with anyio.fail_after(LISTEN_PING_TIMEOUT_S):
                    await conn.execute("SELECT 1")
            except DATABASE_ERRORS as exc:
                log.warning("sse_listener_ping_failed", error=_describe(exc))
                return


async def _close_quietly(conn: asyncpg.Connection) -> None:
    with anyio.move_on_after(LISTEN_CLOSE_TIMEOUT_S):
        try:
            await conn.close()
            return
        except DATABASE_ERRORS:
            pass
    conn.terminate()


def _describe(exc: BaseException | None) -> str:
    # asyncpg's and the socket layer's messages name host and port, never the password.
    return "" if exc is None else f"{type(exc).__name__}: {exc}"


EVENT_HUB = web.AppKey("inboxd_event_hub", EventHub)


def _resume_point(request: web.Request) -> int | None:
    """Last-Event-ID header, else ?last_event_id=, else None. 400 when malformed."""
    raw = request.headers.get("Last-Event-ID", "").strip()
    if not raw:
        raw = request.query.get("last_event_id", "").strip()
    if not raw:
        return None
    if not raw.isascii() or not raw.isdigit() or int(raw) > _MAX_EVENT_ID:
        json_error(400, "invalid_last_event_id")
    return int(raw)


def _encode(row: asyncpg.Record) -> bytes:
    kind = str(row["kind"]).replace("\r", " ").replace("\n", " ")
    data = orjson.dumps(
        {
            "event_id": row["event_id"],
            "kind": row["kind"],
            "mailbox_id": row["mailbox_id"],
            "thread_id": row["thread_id"],
            "message_id": row["message_id"],
            "payload": orjson.Fragment(row["payload"]),
            "created_at": row["created_at"],
        }
    )
    return b"id: %d\nevent: %s\ndata: %s\n\n" % (row["event_id"], kind.encode(), data)


class _ClientGone(Exception):
    """The client disconnected, or stopped reading for SSE_WRITE_TIMEOUT_S."""


async def _send(response: web.StreamResponse, data: bytes) -> None:
    try:
        with anyio.fail_after(SSE_WRITE_TIMEOUT_S):
            await response.write(data)
    except (ConnectionError, TimeoutError) as exc:
        raise _ClientGone(type(exc).__name__) from exc


async def events_handler(request: web.Request) -> web.StreamResponse:
    """`GET /v1/events`: see the module docstring."""
    state = request.app[HTTP_STATE]
    hub = request.app[EVENT_HUB]
    tenant = authenticate(request)
    after = _resume_point(request)
    exclude = request.query.get("exclude_client") or None
    if exclude is not None and len(exclude) > _MAX_CLIENT_ID_LENGTH:
        json_error(400, "invalid_exclude_client")
    with hub.subscribe(tenant) as sub:
        if after is None:
            with anyio.fail_after(EVENTS_QUERY_TIMEOUT_S):
                after = await last_event_id(state.pool, tenant)
        response = web.StreamResponse(
            headers={
                hdrs.CONTENT_TYPE: "text/event-stream",
                hdrs.CACHE_CONTROL: "no-cache, no-store",
                # nginx would otherwise buffer the stream (ngx_http_proxy_module, X-Accel-Buffering)
                "X-Accel-Buffering": "no",
            }
        )
        await response.prepare(request)
        bound = log.bind(tenant=tenant)
        bound.debug("sse_client_connected", after=after)
        try:
            # Also flushes the headers now rather than with the first event.
            await _send(response, b"retry: %d\n\n" % SSE_RETRY_MS)
            while not sub.closed:
                with anyio.fail_after(EVENTS_QUERY_TIMEOUT_S):
                    rows = await events_after(state.pool, tenant, after, SSE_PAGE_SIZE)
                if rows:
                    after = rows[-1]["event_id"]
                    chunk = [
                        _encode(r) for r in rows if exclude is None or r["client_id"] != exclude
                    ]
                    if chunk:
                        await _send(response, b"".join(chunk))
                        state.metrics.sse_event_sent(len(chunk))
                    if len(rows) == SSE_PAGE_SIZE:
                        continue  # more to replay
                if request.transport is None or request.transport.is_closing():
                    break
                with anyio.move_on_after(SSE_HEARTBEAT_S) as idle:
                    await sub.wait()
                if idle.cancelled_caught and not sub.closed:
                    await _send(response, b": keepalive\n\n")
        except _ClientGone as exc:
            # It resumes with Last-Event-ID when it comes back.
            bound.debug("sse_client_dropped", reason=str(exc))
        except DATABASE_ERRORS as exc:
            # Ending the stream is the honest answer: EventSource reconnects and
            # resumes from the last id it received.
            bound.warning("sse_read_failed", error=_describe(exc))
        bound.debug("sse_client_disconnected", after=after)
    return response
