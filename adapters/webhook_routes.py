"""What a route set a provider calls is, what it is given, and how it answers.

A door that is pushed to (Gmail's Pub/Sub push, Graph's change notifications)
keeps its routes in its own folder (adapters/gmail/push_route.py,
adapters/outlook/notifications.py); the daemon's ESP hooks (daemon/webhooks/esp.py)
follow the same contract. The daemon joins the sets (`Webhooks`,
daemon/webhooks/__init__.py) and serves them with the listener's middlewares
(daemon/http/server.py):

    WebhookRoutes   routes(), body_limit(request), check_before_body(request): the
                    listener reads a request's body only after both said yes
    RouteContext    what a route needs of the process at run time (the pool, the
                    verification-failure counter), given to its constructor, so an
                    adapter imports nothing of the daemon
    ApiError        an error answer `{"error": …}`; `json_error` raises it and the
                    listener's error middleware turns it into the response, the same
                    JSON shape as every built-in route's
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import asyncpg
import orjson
from aiohttp import web

__all__ = [
    "ApiError",
    "RouteContext",
    "WebhookMetrics",
    "WebhookRoutes",
    "json_error",
    "json_response",
]


class WebhookRoutes(Protocol):
    """Routes a provider calls, served with the listener's middlewares.

    `body_limit(request)` may name a smaller limit than the listener's for a
    request (a webhook source's own); None means the listener's `max_body_bytes`.
    `check_before_body(request)` runs after the size check and before a byte of
    the body is read; it may raise `ApiError` (a webhook's 404/415/429) so that
    a request refused anyway costs no body read.
    """

    def routes(self) -> list[web.RouteDef]: ...

    def body_limit(self, request: web.Request) -> int | None: ...

    def check_before_body(self, request: web.Request) -> None: ...


class WebhookMetrics(Protocol):
    """The counter a route bumps for a request that failed to verify (the daemon's
    `Metrics`, daemon/metrics/registry.py, is one)."""

    def webhook_verification_failed(self, source: str) -> None:
        """A request to `source` (`tenant/source`, config ids only) failed to verify."""
        ...


@dataclass(frozen=True, slots=True)
class RouteContext:
    """What a door's routes need of the running process, built by the supervisor:
    the database pool their requests record into, and the metrics they count
    refused requests in."""

    pool: asyncpg.Pool
    metrics: WebhookMetrics


def json_response(
    body: Any, *, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    """A JSON response serialised with orjson."""
    return web.Response(
        body=orjson.dumps(body), status=status, headers=headers, content_type="application/json"
    )


class ApiError(Exception):
    """An error answer: `status` with the JSON body `{"error": error, **fields}`.

    Raised by handlers (through `json_error`) and turned into a response by the
    listener's error middleware, which gives aiohttp's own `web.HTTPException`s
    (404, 405, 413 …) the same JSON shape.
    """

    def __init__(
        self, status: int, error: str, *, headers: Mapping[str, str] | None = None, **fields: Any
    ) -> None:
        super().__init__(error)
        self.status = status
        self.body: dict[str, Any] = {"error": error, **fields}
        self.headers = dict(headers or {})

    def response(self) -> web.Response:
        return json_response(self.body, status=self.status, headers=self.headers)


def json_error(
    status: int, error: str, *, headers: Mapping[str, str] | None = None, **fields: Any
) -> NoReturn:
    """Raise `ApiError(status, error, **fields)`."""
    raise ApiError(status, error, headers=headers, **fields)


# The Retry-After of a push answered 503 (the database or a certificate host down):
# the provider retries, so a short wait costs it nothing and the push is not lost.
PUSH_RETRY_AFTER_S = 5


def answer_retry_later(status: int, error: str) -> NoReturn:
    """Answer a push the route cannot take now (429, 503), with PUSH_RETRY_AFTER_S."""
    json_error(status, error, headers={"Retry-After": str(PUSH_RETRY_AFTER_S)})
