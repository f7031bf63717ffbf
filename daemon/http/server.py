"""The daemon's one HTTP listener (aiohttp): probes, metrics and the application API.

Routes:

    GET  /healthz               200 {"status": "ok"} while the process serves
    GET  /readyz                200 / 503 from HttpState.ready() (database + config)
    GET  /metrics               Prometheus text format (daemon/metrics/registry.py)
    GET  /v1/events             Server-Sent Events per tenant (http/events.py)
    POST /v1/outbound           record a send for reconciliation (http/api.py)
    GET  /v1/attachments/{id}   attachment bytes or a presigned redirect (http/api.py)
    POST /hooks/…               HttpState.webhooks (daemon/webhooks/)

Middlewares, outermost first: the client's address when the TCP peer is one of
`[listener] trusted_proxies` (http/forwarded.py; absent without any), metrics
(every answer counted by route template, method and status), errors (every
error answer is JSON `{"error": …}`), body limit. The body limit rejects a declared Content-Length
above `max_body_bytes` with 413 before a byte of the body is read (also for
`Expect: 100-continue`, where it answers 413 instead of `100 Continue`), and
reads any other body — chunked included — only up to the limit, under
`BODY_READ_TIMEOUT_S`. Handlers then get the buffered body from
`await request.read()`. After an early 413 the connection is closed; aiohttp
discards what the client still sends for at most `LINGERING_CLOSE_S` first,
so the client can read the 413 instead of a TCP reset (the lingering close
of RFC 9112 §9.6).

Lifecycle: `serve_http` is started by the supervisor with `tg.start`; it reports
the bound port once the socket listens. Cancelling it ends every SSE stream,
stops accepting, lets in-flight requests finish for `SHUTDOWN_GRACE_S` and
releases everything under a shielded scope bounded by `SHUTDOWN_DEADLINE_S`.
Request handlers are tasks of aiohttp's server, which that cleanup awaits.

Requests aiohttp's own HTTP parser refuses (a request line or header field
over `MAX_FIELD_BYTES`, a NUL in a header value, malformed framing) never reach
the middlewares: `_QuietRequestHandler.handle_error` answers them 400
`{"error": "bad_request"}` (or `"line_too_long"`) and logs the exception's class
only. aiohttp's own answer and log line quote the offending bytes, which for an
`Authorization` header are the credential; ours carry no byte of the request.
No log line of this module carries a header value.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import anyio
import structlog
from aiohttp import hdrs, web, web_server
from aiohttp.http import HttpVersion11
from aiohttp.http_exceptions import BadHttpMethod, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from anyio.abc import TaskStatus
from prometheus_client import CONTENT_TYPE_LATEST

from inboxd.daemon.http.api import attachment_handler, outbound_handler
from inboxd.daemon.http.events import EVENT_HUB, EventHub, events_handler
from inboxd.daemon.http.forwarded import client_middleware
from inboxd.daemon.http.state import (
    HTTP_STATE,
    ApiError,
    HttpState,
    body_limit_for,
    json_response,
)
from inboxd.daemon.metrics.registry import HTTP_UNMATCHED_ROUTE
from inboxd.pipeline.errors import DATABASE_ERRORS, DbFault, db_fault, describe

__all__ = ["build_app", "serve_http"]

log = structlog.get_logger(__name__)

READY_TIMEOUT_S = 2.0  # a readiness probe that waits longer is a failed probe anyway
BODY_READ_TIMEOUT_S = 30.0  # slow-loris bound: 1 MiB in 30 s is 35 KB/s
LINGERING_CLOSE_S = 2.0
SHUTDOWN_GRACE_S = 5.0
SHUTDOWN_DEADLINE_S = 10.0
KEEPALIVE_TIMEOUT_S = 75.0  # longer than common load balancers' 60 s idle timeout
RETRY_AFTER_S = 5  # for 503s: a restarting PostgreSQL is usually back within seconds
#: Longest request line and header field the parser takes, bytes: aiohttp's
#: default, and the 8 KiB of nginx's large_client_header_buffers, so anything a
#: proxy in front passes fits. Longer ones are refused by the parser (400,
#: `_QuietRequestHandler`), before any middleware runs.
MAX_FIELD_BYTES = 8190

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_STREAMING_ROUTES = frozenset({"/v1/events"})


def _route_label(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else HTTP_UNMATCHED_ROUTE


def _too_large(limit: int) -> web.Response:
    response = json_response({"error": "body_too_large", "max_body_bytes": limit}, status=413)
    response.force_close()  # the unread body makes the connection unusable
    return response


@web.middleware
async def _observe(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """Count every answer by route template; log it at debug (never headers or query).

    A request cancelled before it was answered (server shutdown) got no answer and
    is not counted.
    """
    started = time.perf_counter()
    status: int | None = None
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    finally:
        route = _route_label(request)
        elapsed_s = time.perf_counter() - started
        if status is not None:
            request.app[HTTP_STATE].metrics.observe_http(
                route, request.method, status, None if route in _STREAMING_ROUTES else elapsed_s
            )
        log.debug(
            "http_request",
            route=route,
            method=request.method,
            status=status,
            duration_ms=round(elapsed_s * 1000, 1),
        )


@web.middleware
async def _errors(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """Every error answer as JSON; infrastructure failures as 503, bugs as 500."""
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise  # redirects are answers
        headers = {
            k: v
            for k, v in exc.headers.items()
            if k not in (hdrs.CONTENT_TYPE, hdrs.CONTENT_LENGTH)
        }
        slug = (exc.reason or "error").lower().replace(" ", "_").replace("-", "_")
        response = json_response({"error": slug}, status=exc.status, headers=headers)
        if exc.status == 413:
            response.force_close()
        return response
    except ConnectionResetError:
        raise  # the client is gone; nothing to answer
    except DATABASE_ERRORS as exc:
        return _database_error_response(request, exc)
    except Exception:
        log.exception("http_handler_failed", route=_route_label(request))
        return json_response({"error": "internal"}, status=500)


def _database_error_response(request: web.Request, exc: BaseException) -> web.Response:
    """A database error reaching the listener, by what it means (pipeline/errors.py):
    the request's content → 422, a defect → 500, the database away → 503."""
    fault = db_fault(exc)
    route = _route_label(request)
    if fault is DbFault.DATA:
        log.info("http_content_rejected", route=route, error=type(exc).__name__)
        return json_response({"error": "unprocessable_content"}, status=422)
    if fault is DbFault.BUG:
        log.error("http_handler_failed", route=route, error=describe(exc))
        return json_response({"error": "internal"}, status=500)
    log.warning("http_dependency_unavailable", route=route, error=type(exc).__name__)
    return json_response(
        {"error": "unavailable"}, status=503, headers={hdrs.RETRY_AFTER: str(RETRY_AFTER_S)}
    )


@web.middleware
async def _limit_body(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """413 before reading a declared-too-large body; read others up to the limit."""
    limit = body_limit_for(request)
    if request.content_length is not None and request.content_length > limit:
        return _too_large(limit)
    webhooks = request.app[HTTP_STATE].webhooks
    if webhooks is not None:
        webhooks.check_before_body(request)
    if request.body_exists:
        if limit < request.app[HTTP_STATE].max_body_bytes:
            # aiohttp's clone forgets an earlier clone's `remote` (the forwarded client)
            remote = request.remote
            request = (
                request.clone(client_max_size=limit + 1)
                if remote is None
                else request.clone(client_max_size=limit + 1, remote=remote)
            )
        # Application(client_max_size=limit + 1): read() raises 413 as soon as it
        # has more than `limit` bytes, whatever the framing (chunked included).
        try:
            if request.content.is_eof():
                await request.read()  # all of it is buffered already: nothing to wait for
            else:
                with anyio.fail_after(BODY_READ_TIMEOUT_S):
                    await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _too_large(limit)
        except TimeoutError:
            response = json_response({"error": "body_timeout"}, status=408)
            response.force_close()
            return response
    return await handler(request)


async def _expect(request: web.Request) -> web.StreamResponse | None:
    """`Expect: 100-continue` (RFC 9110 §10.1.1): 413 instead of 100 when too large.

    Runs before the middlewares, so it counts its own 413.
    """
    state = request.app[HTTP_STATE]
    limit = body_limit_for(request)
    if request.content_length is not None and request.content_length > limit:
        state.metrics.observe_http(_route_label(request), request.method, 413)
        return _too_large(limit)
    if request.version != HttpVersion11:
        return None
    if request.headers.get(hdrs.EXPECT, "").lower() != "100-continue":
        state.metrics.observe_http(_route_label(request), request.method, 417)
        return json_response({"error": "expectation_failed"}, status=417)
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # as aiohttp's default handler: the body is yet to come
    return None


async def _healthz(_request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    state = request.app[HTTP_STATE]
    try:
        with anyio.fail_after(READY_TIMEOUT_S):
            ready = bool(await state.ready())
    except Exception as exc:
        log.warning("ready_probe_failed", error=type(exc).__name__)
        ready = False
    if ready:
        return json_response({"status": "ready"})
    return json_response({"status": "not_ready"}, status=503)


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[HTTP_STATE].metrics.render()
    return web.Response(body=body, headers={hdrs.CONTENT_TYPE: CONTENT_TYPE_LATEST})


class _QuietRequestHandler(RequestHandler):
    """aiohttp's connection protocol, except that a request its parser refuses is
    answered and logged without a byte of that request.

    Why: aiohttp 3.14 (web_protocol.RequestHandler.handle_error) answers a parser
    error with the exception's message as a text/plain body and logs it with
    its traceback on `aiohttp.server`; the message quotes the request —
    `LineTooLong` the first 100 bytes of an over-long header field (`b'Bearer
    xxx…'`), `InvalidHeader` a whole header value, llhttp's errors the bytes
    around the fault. A credential must not appear in an answer or a log line,
    whatever its size, so parser errors (status < 500) get a fixed JSON body and
    a log line with the exception's class only. 5xx (a handler failure that
    escaped the middlewares, a handler timeout) keep aiohttp's handling: their
    text is generic and their traceback is of our code, not of the request.
    """

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            return super().handle_error(request, status, exc, message)
        # A non-HTTP client (TLS on the HTTP port) is noise on a public port: debug,
        # as aiohttp does.
        level = log.debug if isinstance(exc, BadHttpMethod) else log.info
        level(
            "http_request_unparsable",
            status=status,
            error=type(exc).__name__ if exc is not None else None,
            peer=request.remote,
        )
        if request.writer.output_size > 0:  # as aiohttp: a started answer cannot become a 400
            raise ConnectionError("response already started; cannot answer the parser error")
        slug = "line_too_long" if isinstance(exc, LineTooLong) else "bad_request"
        response = json_response({"error": slug}, status=status)
        response.force_close()  # the parser lost its place in the stream
        return response


class _QuietServer(web_server.Server):
    """aiohttp's `Server` (the protocol factory of the listening socket), making
    `_QuietRequestHandler`s. aiohttp offers no public way to choose the protocol
    class, hence this and `_Runner._make_server`."""

    def __call__(self) -> RequestHandler:
        return _QuietRequestHandler(self, loop=self._loop, **self._kwargs)


class _Runner(web.AppRunner):
    """`web.AppRunner` whose server makes `_QuietRequestHandler`s.

    Pinned by tests/daemon/test_http.py ("ambiguity"): an aiohttp upgrade that changes
    these private names fails there (a quoted header), not silently.
    """

    async def _make_server(self) -> web_server.Server:
        made = await super()._make_server()
        return _QuietServer(
            made.request_handler,
            request_factory=made.request_factory,
            handler_cancellation=made.handler_cancellation,
            loop=made._loop,
            **made._kwargs,
        )


def build_app(state: HttpState) -> web.Application:
    """The aiohttp application for `state` (routes, middlewares, SSE hub)."""
    # The client's address first, so every budget, log line and metric sees it.
    forwarded = (
        [client_middleware(state.trusted_proxies, state.forwarded_header)]
        if state.trusted_proxies
        else []
    )
    app = web.Application(
        middlewares=[*forwarded, _observe, _errors, _limit_body],
        client_max_size=state.max_body_bytes + 1,
    )
    app[HTTP_STATE] = state
    app[EVENT_HUB] = EventHub(state.dsn, state.metrics)
    router = app.router
    router.add_get("/healthz", _healthz, expect_handler=_expect)
    router.add_get("/readyz", _readyz, expect_handler=_expect)
    router.add_get("/metrics", _metrics, expect_handler=_expect)
    router.add_get("/v1/events", events_handler, allow_head=False, expect_handler=_expect)
    router.add_post("/v1/outbound", outbound_handler, expect_handler=_expect)
    router.add_get(r"/v1/attachments/{id:\d{1,19}}", attachment_handler, expect_handler=_expect)
    for route in state.webhooks.routes() if state.webhooks is not None else ():
        web.RouteDef(
            route.method, route.path, route.handler, {"expect_handler": _expect, **route.kwargs}
        ).register(router)
    return app


async def serve_http(
    host: str,
    port: int,
    app_state: HttpState,
    *,
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled; `task_status.started(port)` once the socket listens.

    Start with `port = await tg.start(serve_http, host, port, state)` (or
    keyword arguments through `functools.partial`). `port` 0 binds an
    ephemeral port; the port reported is the one really bound (of the first
    socket, when `host` resolves to several addresses: give a fixed port
    then). Raises `OSError` before reporting started when the address cannot
    be bound. Cancellation ends the SSE streams and shuts the server down
    gracefully (see the module docstring), then propagates.
    """
    app = build_app(app_state)
    hub = app[EVENT_HUB]
    runner = _Runner(
        app,
        handle_signals=False,
        access_log=None,
        max_line_size=MAX_FIELD_BYTES,
        max_field_size=MAX_FIELD_BYTES,
        shutdown_timeout=SHUTDOWN_GRACE_S,
        lingering_time=LINGERING_CLOSE_S,
        keepalive_timeout=KEEPALIVE_TIMEOUT_S,
    )
    await runner.setup()
    try:
        # Bound before the task group exists, so a taken port raises a plain OSError.
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_port = int(runner.addresses[0][1])
        async with anyio.create_task_group() as tg:
            # SSE clients that connect before the LISTEN is in place are woken once it is.
            await tg.start(hub.run)
            log.info("http_listening", host=host, port=bound_port)
            task_status.started(bound_port)
            await anyio.sleep_forever()
    finally:
        hub.close()
        with anyio.CancelScope(shield=True), anyio.move_on_after(SHUTDOWN_DEADLINE_S) as scope:
            try:
                await runner.cleanup()
            except Exception as exc:  # shutting down: report, never mask the cancellation
                log.warning("http_cleanup_failed", error=type(exc).__name__)
        if scope.cancelled_caught:
            log.warning("http_cleanup_timed_out", deadline_s=SHUTDOWN_DEADLINE_S)
        log.info("http_stopped")
