"""The daemon's HTTP listener: probes, `/metrics`, SSE events and the application API.

The supervisor builds an `HttpState` and runs
`port = await tg.start(serve_http, host, port, state)`. Webhook routes (the ESP
hooks in daemon/webhooks/, the doors' push routes in their adapter folders) reach
the listener as `HttpState.webhooks`; their handlers find the size-checked body at
`await request.read()`, the ESP hooks the state at `request.app[HTTP_STATE]` and
a door's routes the pool and metrics in their `RouteContext`
(adapters/webhook_routes.py).
"""

from __future__ import annotations

from inboxd.daemon.http.api import ATTACHMENT_URL_TTL_S
from inboxd.daemon.http.events import SSE_HEARTBEAT_S, SSE_PAGE_SIZE
from inboxd.daemon.http.server import build_app, serve_http
from inboxd.daemon.http.state import (
    DEFAULT_MAX_BODY_BYTES,
    HTTP_STATE,
    ApiError,
    HttpState,
    TokenTable,
    WebhookRoutes,
    authenticate,
    json_error,
    json_response,
)

__all__ = [
    "ATTACHMENT_URL_TTL_S",
    "DEFAULT_MAX_BODY_BYTES",
    "HTTP_STATE",
    "SSE_HEARTBEAT_S",
    "SSE_PAGE_SIZE",
    "ApiError",
    "HttpState",
    "TokenTable",
    "WebhookRoutes",
    "authenticate",
    "build_app",
    "json_error",
    "json_response",
    "serve_http",
]
