"""The daemon's HTTP listener: probes, `/metrics`, SSE events and the application API.

The supervisor builds an `HttpState` and runs
`port = await tg.start(serve_http, host, port, state)`. Webhook routes live in
daemon/webhooks/ and reach the listener as `HttpState.webhooks`; their handlers
find the state at `request.app[HTTP_STATE]` and the size-checked body at
`await request.read()`.
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
