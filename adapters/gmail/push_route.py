"""`POST /push/gmail/{tenant}`: Gmail's Pub/Sub push, a doorbell and nothing more.

Order of checks, cheapest and least trusting first:

    body over MAX_PUSH_BODY_BYTES        413 before reading (listener middleware)
    tenant without a [gmail] table      404   ┐ before the body is read
    content type not JSON               415   │ (`check_before_body`)
    the peer's failure budget spent     429   ┘
    JWT not verified                    401, counted; nothing recorded
                                        (adapters/gmail/push.py PushVerifier)
    Google's certificates unavailable   503 + Retry-After (Pub/Sub retries)
    verified body not Gmail's shape     400 (`parse_push_body`)
    address of no configured mailbox    204: acknowledged, or Pub/Sub retries forever
    known address                       record_push (last_push_at, the historyId as
                                        hint, doorbell NOTIFY; one transaction) → 204
    database unavailable                503 + Retry-After

The handler never syncs: the doorbell rings the mailbox's runner, which
coalesces any number of rings into one running sync and one follow-up, so a
storm of notifications for one mailbox costs at most two syncs. A failed
verification spends the peer's failure budget (adapters/webhook_budgets.py),
as on the ESP hooks, so garbage from one peer costs only header parsing.

The route is a `WebhookRoutes` (adapters/webhook_routes.py): the daemon builds
it with the served table and a `RouteContext` (the pool it records into, the
metrics it counts refusals in) and adds it to its `Webhooks`
(daemon/supervisor.py); daemon/webhooks/gmail_config.py fills the table from the
tenants' `[gmail]` tables.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NoReturn

import structlog
from aiohttp import hdrs, web

from inboxd.adapters.gmail.push import (
    MAX_PUSH_BODY_BYTES,
    CertsUnavailable,
    MalformedPush,
    PushUnauthorized,
    PushVerifier,
    parse_push_body,
)
from inboxd.adapters.webhook_budgets import PushTable, peer_key
from inboxd.adapters.webhook_routes import RouteContext, answer_retry_later, json_error
from inboxd.pipeline.errors import DATABASE_ERRORS, describe
from inboxd.pipeline.mailbox import scheduling

__all__ = ["PUSH_PATH", "GmailPush", "GmailPushTable", "GmailPushTenant"]

log = structlog.get_logger(__name__)

PUSH_PATH = "/push/gmail/{tenant}"
# Pub/Sub push sends application/json (Pub/Sub push subscription docs).
PUSH_CONTENT_TYPES = frozenset({"application/json"})


@dataclass(slots=True)
class GmailPushTenant:
    """What the route needs of one tenant: its verifier and its Gmail mailboxes."""

    tenant_id: str
    verifier: PushVerifier
    # lower-cased address → mailbox id
    mailboxes: Mapping[str, str] = field(default_factory=dict)

    def mailbox_of(self, address: str) -> str | None:
        return self.mailboxes.get(address.strip().lower())


class GmailPushTable(PushTable[GmailPushTenant]):
    """tenant → GmailPushTenant; `replace` swaps it whole on SIGHUP."""


class GmailPush:
    """The Gmail push route with its checks: a `WebhookRoutes`
    (adapters/webhook_routes.py), recording into `context.pool`."""

    def __init__(self, table: GmailPushTable, context: RouteContext) -> None:
        self.table = table
        self.context = context

    def routes(self) -> list[web.RouteDef]:
        return [web.post(PUSH_PATH, self.handle)]

    def body_limit(self, request: web.Request) -> int | None:  # noqa: ARG002 - one limit
        return MAX_PUSH_BODY_BYTES

    def check_before_body(self, request: web.Request) -> None:
        tenant = self.table.get(request.match_info.get("tenant", ""))
        if tenant is None:
            json_error(404, "not_found")
        if request.content_type.lower() not in PUSH_CONTENT_TYPES:
            json_error(415, "unsupported_media_type")
        if not self.table.failures.allows(_failure_key(request, tenant)):
            answer_retry_later(429, "rate_limited")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        tenant = self.table.get(request.match_info["tenant"])
        if tenant is None:  # removed by a reload since check_before_body
            json_error(404, "not_found")
        if len(request.headers.getall(hdrs.AUTHORIZATION, [])) > 1:
            self._refuse(request, tenant, "authorization: more than one header")
        try:
            await tenant.verifier.verify(request.headers.get(hdrs.AUTHORIZATION))
        except PushUnauthorized as exc:
            self._refuse(request, tenant, str(exc))
        except CertsUnavailable as exc:
            log.warning("gmail_push_certs_unavailable", tenant=tenant.tenant_id, error=str(exc))
            answer_retry_later(503, "unavailable")
        body = await request.read()
        try:
            note = parse_push_body(body)
        except MalformedPush as exc:
            log.info("gmail_push_malformed", tenant=tenant.tenant_id, error=str(exc)[:200])
            json_error(400, "malformed_payload")
        mailbox = tenant.mailbox_of(note.email_address)
        if mailbox is None:
            log.info("gmail_push_unknown_address", tenant=tenant.tenant_id)
            return web.Response(status=204)
        try:
            async with self.context.pool.acquire() as conn:
                await scheduling.record_push(
                    conn, tenant.tenant_id, mailbox, hint=str(note.history_id)
                )
        except DATABASE_ERRORS as exc:
            log.warning("gmail_push_not_recorded", tenant=tenant.tenant_id, error=describe(exc))
            answer_retry_later(503, "unavailable")
        log.debug("gmail_push_recorded", tenant=tenant.tenant_id, mailbox=mailbox)
        return web.Response(status=204)

    def _refuse(self, request: web.Request, tenant: GmailPushTenant, check: str) -> NoReturn:
        """401 with a body that says nothing about which check failed."""
        self.table.failures.charge(_failure_key(request, tenant))
        self.context.metrics.webhook_verification_failed(f"{tenant.tenant_id}/gmail")
        log.info("gmail_push_rejected", tenant=tenant.tenant_id, check=check)
        json_error(401, "unauthorized")


def _failure_key(request: web.Request, tenant: GmailPushTenant) -> tuple[str, str, str]:
    return tenant.tenant_id, "gmail-push", peer_key(request.remote)
