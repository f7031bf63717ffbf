"""What the HTTP listener is given, and the helpers every route shares.

`HttpState` is the listener's whole dependency list, built by the supervisor.
The daemon's handlers reach it through `request.app[HTTP_STATE]`. The webhook
routes (`HttpState.webhooks`) follow the contract of adapters/webhook_routes.py,
where `WebhookRoutes`, `ApiError`, `json_error` and `json_response` live so a
door's routes can answer like the built-in ones without importing the daemon;
they are named here too, for the daemon's handlers and the error middleware.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import asyncpg
from aiohttp import hdrs, web

from inboxd.adapters.webhook_routes import ApiError, WebhookRoutes, json_error, json_response
from inboxd.daemon.config.main import FORWARDED_HEADERS, TrustedProxies
from inboxd.daemon.metrics.registry import Metrics
from inboxd.pipeline.objectstore.store import ObjectStore

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "HTTP_STATE",
    "ApiError",
    "HttpState",
    "TokenTable",
    "WebhookRoutes",
    "authenticate",
    "body_limit_for",
    "json_error",
    "json_response",
]

#: Default request-body limit: an outbound record with a large HTML body fits;
#: ESP webhook batches (SES/SNS 256 KiB, Postmark, SendGrid) are far below it.
DEFAULT_MAX_BODY_BYTES = 1024 * 1024


@dataclass(slots=True, kw_only=True)
class HttpState:
    """Everything the listener needs. Built once by the supervisor.

    `tenant_for_token` maps a presented bearer token to its tenant id, or None;
    it must compare in constant time (`TokenTable` does). `ready` answers
    `/readyz` (database reachable, config loaded) and should return quickly; the
    listener gives it `READY_TIMEOUT_S`. `dsn` opens the one LISTEN connection
    of the SSE hub (a pooled connection cannot hold a LISTEN). `webhooks`
    are served with the same error format and metrics as the built-in routes.
    """

    pool: asyncpg.Pool
    dsn: str = field(repr=False)
    store: ObjectStore
    metrics: Metrics
    tenant_for_token: Callable[[str], str | None] = field(repr=False)
    ready: Callable[[], Awaitable[bool]] = field(repr=False)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    webhooks: WebhookRoutes | None = field(default=None, repr=False)
    #: Reverse proxies whose forwarding header names the client (http/forwarded.py).
    trusted_proxies: TrustedProxies = ()
    forwarded_header: str = FORWARDED_HEADERS[0]

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, not {self.max_body_bytes}")


HTTP_STATE = web.AppKey("inboxd_http_state", HttpState)


def body_limit_for(request: web.Request) -> int:
    """The body limit of `request`: its route's own when smaller, else the listener's."""
    state = request.app[HTTP_STATE]
    own = state.webhooks.body_limit(request) if state.webhooks is not None else None
    return state.max_body_bytes if own is None else min(own, state.max_body_bytes)


class TokenTable:
    """Bearer token → tenant id, compared in constant time.

    Built from `{tenant_id: token}`. A lookup compares the presented token with
    every tenant's token using `hmac.compare_digest` and never stops early, so
    the answer time depends neither on which tenant matched nor on how much of
    a token was right. Tokens never appear in `repr`. `replace` swaps the
    whole table (SIGHUP reload) atomically for readers on the event loop.
    """

    __slots__ = ("_entries",)

    def __init__(self, tokens: Mapping[str, str]) -> None:
        self._entries: tuple[tuple[str, bytes], ...] = ()
        self.replace(tokens)

    def replace(self, tokens: Mapping[str, str]) -> None:
        """Use `tokens` from now on. Raises ValueError for an empty or shared token."""
        entries: list[tuple[str, bytes]] = []
        seen: set[bytes] = set()
        for tenant_id, token in tokens.items():
            raw = token.encode("utf-8")
            if not raw:
                raise ValueError(f"tenant {tenant_id!r} has an empty API token")
            if raw in seen:
                raise ValueError(f"tenant {tenant_id!r} shares its API token with another tenant")
            seen.add(raw)
            entries.append((tenant_id, raw))
        self._entries = tuple(entries)

    def __call__(self, token: str) -> str | None:
        presented = token.encode("utf-8", "surrogateescape")
        found: str | None = None
        for tenant_id, expected in self._entries:
            if hmac.compare_digest(presented, expected):
                found = tenant_id
        return found

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"TokenTable({len(self._entries)} tenants)"


def authenticate(request: web.Request) -> str:
    """The tenant of the request's `Authorization: Bearer <token>`; 401 otherwise.

    The 401 body is the same for a missing header, another scheme and an unknown
    token, and the token is never logged or echoed (RFC 6750 §3). More than one
    `Authorization` field is 400 `{"error": "ambiguous_authorization"}` before
    any token is looked at: RFC 9110 §5.3 allows repeating a field only when
    its value is a list, which Authorization's is not, and a proxy in front
    may have authorised the request by the other one (aiohttp's `get` would
    take the first). Every /v1 route calls this before it reads or writes.
    """
    fields = request.headers.getall(hdrs.AUTHORIZATION, ())
    if len(fields) > 1:
        json_error(400, "ambiguous_authorization")
    header = fields[0] if fields else ""
    scheme, _, token = header.partition(" ")
    tenant: str | None = None
    if scheme.lower() == "bearer" and token.strip():
        tenant = request.app[HTTP_STATE].tenant_for_token(token.strip())
    if tenant is None:
        json_error(401, "unauthorized", headers={hdrs.WWW_AUTHENTICATE: 'Bearer realm="inboxd"'})
    return tenant
