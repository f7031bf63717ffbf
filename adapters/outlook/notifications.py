"""`POST /push/outlook/{tenant}` and `…/lifecycle`: Microsoft Graph's change and
lifecycle notifications, doorbells and nothing more.

Graph ("Receive change notifications through webhooks") first validates each URL
when a subscription is created: a POST with `?validationToken=…`, answered 200
`text/plain` with the decoded token within 10 s, whatever its body. Then each POST
carries `{"value": [notification, …]}`, several subscriptions (and mailboxes) at
once, and wants a 2xx within 3 s; anything else is retried for up to 4 hours.
There is no signature: a notification proves itself by its `clientState`, the
secret we gave its subscription (adapters/outlook/tables.py).

Order of checks, cheapest and least trusting first:

    body over MAX_NOTIFICATION_BODY_BYTES  413 before reading (listener middleware;
                                           a validation POST has an empty body)
    tenant without an [outlook] table      404   ┐ before the body is read
    ?validationToken=…                     200 text/plain, the token; │ (`check_before_body`)
                                           400 when empty or longer   │
                                           than MAX_VALIDATION_TOKEN_CHARS
    content type not JSON                  415   │
    the peer's failure budget spent        429   ┘
    body not Graph's shape, or empty       400, the peer's failure budget spent
    subscriptions of the POST              one query, tenant-scoped: another tenant's
                                           subscription id is unknown here
    unknown id or clientState mismatch     that notification rejected; the request is
                                           counted (inboxd_webhook_verification_failures,
                                           source "<tenant>/outlook") and logged with
                                           tenant and subscription ids (never a
                                           clientState, received or stored)
    every notification rejected            401, the peer's failure budget spent
    the accepted ones, one transaction     lifecycle events stored (record_lifecycle),
                                           record_push once per distinct configured
                                           mailbox (last_push_at, doorbell NOTIFY) → 202
    database unavailable, or slower than   503 + Retry-After (Graph retries)
      RECORD_DEADLINE_S

Validation is answered for served tenants only: Graph validates when we create a
subscription, which only a tenant with an `[outlook]` table does, so another
tenant's URL is 404 even then.

Both routes take both kinds of item: an item with `lifecycleEvent` is a lifecycle
notification (Graph sends subscriptionRemoved and missed to the change URL when a
subscription has no lifecycle URL), one without is a change notification. A
lifecycle event is stored on its subscription's row (the strongest pending one is
kept, adapters/outlook/tables.py) and its mailbox rung: the Outlook source
renews, recreates or resyncs and clears it. An event Graph may add later is
acknowledged, logged and ignored. A change notification's content (resource,
changeType) is not used: the runner's delta sync reads what changed, and any
number of rings coalesce into one sync and one follow-up.

The routes are a `WebhookRoutes` (adapters/webhook_routes.py): the daemon builds
them with the served table and a `RouteContext` (the pool they record into, the
metrics they count refusals in) and adds them to its `Webhooks`
(daemon/supervisor.py); daemon/webhooks/outlook_config.py fills the table from the
tenants' `[outlook]` tables.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

import anyio
import asyncpg
import orjson
import structlog
from aiohttp import web

from inboxd.adapters.outlook import tables as graph_subscriptions
from inboxd.adapters.webhook_budgets import PushTable, peer_key
from inboxd.adapters.webhook_routes import RouteContext, answer_retry_later, json_error
from inboxd.pipeline.errors import DATABASE_ERRORS, describe
from inboxd.pipeline.mailbox import scheduling

__all__ = [
    "LIFECYCLE_PATH",
    "NOTIFICATION_PATH",
    "GraphNotification",
    "MalformedNotifications",
    "OutlookPush",
    "OutlookPushTable",
    "OutlookPushTenant",
    "parse_notifications",
]

log = structlog.get_logger(__name__)

NOTIFICATION_PATH = "/push/outlook/{tenant}"
LIFECYCLE_PATH = "/push/outlook/{tenant}/lifecycle"
# Graph posts application/json (changeNotificationCollection); a validation POST
# is answered before this check, whatever its content type.
NOTIFICATION_CONTENT_TYPES = frozenset({"application/json"})
#: A notification without resource data is under 1 KiB (the docs' examples are
#: ~600 bytes); Graph batches them but documents no maximum, so 512 KiB leaves room
#: for ~500 in one POST. We never ask for resource data (no encrypted content).
MAX_NOTIFICATION_BODY_BYTES = 512 * 1024
#: Graph's tokens are ~150 characters; this bounds what we echo.
MAX_VALIDATION_TOKEN_CHARS = 1024
#: Graph's subscription ids are GUIDs (36 characters).
MAX_SUBSCRIPTION_ID_CHARS = 128
#: Rejected subscription ids named in one log line.
LOGGED_REJECTED_IDS = 5
#: Graph wants a 2xx within 3 s (10 s marks the endpoint slow and delays or drops
#: its notifications: "Receive change notifications through webhooks"): a database
#: slower than this is answered 503, which Graph retries.
RECORD_DEADLINE_S = 2.0


@dataclass(frozen=True, slots=True)
class OutlookPushTenant:
    """What the routes need of one tenant: its id and its configured Outlook mailboxes
    (a notification of a mailbox removed by a reload is acknowledged, not rung)."""

    tenant_id: str
    mailboxes: frozenset[str] = frozenset()


class OutlookPushTable(PushTable[OutlookPushTenant]):
    """tenant → OutlookPushTenant; `replace` swaps it whole on SIGHUP."""


class MalformedNotifications(ValueError):
    """The body is not a changeNotificationCollection; the message names no value."""


@dataclass(frozen=True, slots=True)
class GraphNotification:
    """One item of `value`: whose (`subscription_id`), its secret, and for a lifecycle
    notification its `lifecycleEvent`."""

    subscription_id: str
    client_state: str | None = field(repr=False)
    lifecycle_event: str | None = None


def parse_notifications(body: bytes) -> list[GraphNotification]:
    """The items of a notification POST; MalformedNotifications when it is not
    `{"value": [{"subscriptionId": …, …}, …]}` with at least one item. A missing
    or non-string clientState is kept as None (the item is then rejected)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise MalformedNotifications("not JSON") from None
    items = data.get("value") if isinstance(data, dict) else None
    if not isinstance(items, list) or not items:
        raise MalformedNotifications("expected a non-empty value array")
    parsed: list[GraphNotification] = []
    for item in items:
        sub_id = item.get("subscriptionId") if isinstance(item, dict) else None
        if not isinstance(sub_id, str) or not 0 < len(sub_id) <= MAX_SUBSCRIPTION_ID_CHARS:
            raise MalformedNotifications("an item without a subscriptionId")
        event = item.get("lifecycleEvent")
        if event is not None and not isinstance(event, str):
            raise MalformedNotifications("a lifecycleEvent that is not a string")
        secret = item.get("clientState")
        parsed.append(GraphNotification(sub_id, secret if isinstance(secret, str) else None, event))
    return parsed


@dataclass(slots=True)
class _Verdict:
    """What one POST's notifications come to, once checked against their rows."""

    mailboxes: list[str] = field(default_factory=list)  # to ring, distinct, in order
    lifecycle: dict[str, str] = field(default_factory=dict)  # subscription id → event
    accepted: int = 0
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (subscription id, check)
    ignored: int = 0  # accepted, but of an unconfigured mailbox or an unknown event


def _verify(
    tenant: OutlookPushTenant,
    notes: Sequence[GraphNotification],
    known: Mapping[str, graph_subscriptions.GraphSubscription],
) -> _Verdict:
    verdict = _Verdict()
    for note in notes:
        row = known.get(note.subscription_id)
        if row is None:
            verdict.rejected.append((note.subscription_id, "unknown_subscription"))
            continue
        received = (note.client_state or "").encode("utf-8", "surrogatepass")
        if not hmac.compare_digest(received, row.client_state.encode("utf-8")):
            verdict.rejected.append((note.subscription_id, "client_state_mismatch"))
            continue
        verdict.accepted += 1
        event = note.lifecycle_event
        if row.mailbox_id not in tenant.mailboxes or (
            event is not None and event not in graph_subscriptions.LIFECYCLE_EVENTS
        ):
            verdict.ignored += 1
            continue
        if event is not None:
            pending = verdict.lifecycle.get(note.subscription_id)
            verdict.lifecycle[note.subscription_id] = (
                graph_subscriptions.stronger_event(pending, event) or event
            )
        if row.mailbox_id not in verdict.mailboxes:
            verdict.mailboxes.append(row.mailbox_id)
    return verdict


class OutlookPush:
    """The Graph notification routes with their checks: a `WebhookRoutes`
    (adapters/webhook_routes.py), recording into `context.pool`."""

    def __init__(self, table: OutlookPushTable, context: RouteContext) -> None:
        self.table = table
        self.context = context

    def routes(self) -> list[web.RouteDef]:
        return [web.post(NOTIFICATION_PATH, self.handle), web.post(LIFECYCLE_PATH, self.handle)]

    def body_limit(self, request: web.Request) -> int | None:  # noqa: ARG002 - one limit
        return MAX_NOTIFICATION_BODY_BYTES

    def check_before_body(self, request: web.Request) -> None:
        tenant = self.table.get(request.match_info.get("tenant", ""))
        if tenant is None:
            json_error(404, "not_found")
        token = request.query.get("validationToken")
        if token is not None:
            _answer_validation(tenant, token)
        if request.content_type.lower() not in NOTIFICATION_CONTENT_TYPES:
            json_error(415, "unsupported_media_type")
        if not self.table.failures.allows(_failure_key(request, tenant)):
            answer_retry_later(429, "rate_limited")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        tenant = self.table.get(request.match_info["tenant"])
        if tenant is None:  # removed by a reload since check_before_body
            json_error(404, "not_found")
        try:
            notes = parse_notifications(await request.read())
        except MalformedNotifications as exc:
            self.table.failures.charge(_failure_key(request, tenant))
            log.info("outlook_push_malformed", tenant=tenant.tenant_id, error=str(exc))
            json_error(400, "malformed_payload")
        try:
            with anyio.fail_after(RECORD_DEADLINE_S):
                verdict = await self._record(self.context.pool, tenant, notes)
        except DATABASE_ERRORS as exc:  # TimeoutError included: the deadline above
            log.warning("outlook_push_not_recorded", tenant=tenant.tenant_id, error=describe(exc))
            answer_retry_later(503, "unavailable")
        if verdict.rejected:
            self._reject(request, tenant, verdict)
        log.debug(
            "outlook_push_recorded",
            tenant=tenant.tenant_id,
            accepted=verdict.accepted,
            ignored=verdict.ignored,
            mailboxes=verdict.mailboxes,
            lifecycle=sorted(set(verdict.lifecycle.values())),
        )
        return web.Response(status=202)

    @staticmethod
    async def _record(
        pool: asyncpg.Pool, tenant: OutlookPushTenant, notes: Sequence[GraphNotification]
    ) -> _Verdict:
        """Look the POST's subscriptions up (one query), verify, and in one transaction
        store the lifecycle events and ring each mailbox once."""
        async with pool.acquire() as conn:
            known = await graph_subscriptions.subscriptions_by_id(
                conn, tenant.tenant_id, (n.subscription_id for n in notes)
            )
            verdict = _verify(tenant, notes, known)
            if verdict.mailboxes:
                async with conn.transaction():
                    await graph_subscriptions.record_lifecycle(
                        conn, tenant.tenant_id, verdict.lifecycle
                    )
                    for mailbox in verdict.mailboxes:
                        await scheduling.record_push(conn, tenant.tenant_id, mailbox)
        return verdict

    def _reject(self, request: web.Request, tenant: OutlookPushTenant, verdict: _Verdict) -> None:
        """Count and log the rejected notifications; 401 when nothing was accepted, with
        a body that says nothing about which check failed."""
        # one count per request that carried any (the metric counts requests, as for
        # every webhook); the log line says how many of its notifications
        self.context.metrics.webhook_verification_failed(f"{tenant.tenant_id}/outlook")
        refused = verdict.accepted == 0
        log.info(
            "outlook_push_rejected",
            tenant=tenant.tenant_id,
            rejected=len(verdict.rejected),
            accepted=verdict.accepted,
            subscriptions=list(dict.fromkeys(s[:64] for s, _ in verdict.rejected))[
                :LOGGED_REJECTED_IDS
            ],
            checks=sorted({check for _, check in verdict.rejected}),
        )
        if refused:
            self.table.failures.charge(_failure_key(request, tenant))
            json_error(401, "unauthorized")


def _answer_validation(tenant: OutlookPushTenant, token: str) -> NoReturn:
    """200 text/plain with the token, before the body is read. An HTTPException under
    400 passes the error middleware as an answer (daemon/http/server.py)."""
    if not 0 < len(token) <= MAX_VALIDATION_TOKEN_CHARS:
        json_error(400, "invalid_validation_token")
    log.info("outlook_push_validated", tenant=tenant.tenant_id)  # never the token
    raise web.HTTPOk(text=token, content_type="text/plain")


def _failure_key(request: web.Request, tenant: OutlookPushTenant) -> tuple[str, str, str]:
    return tenant.tenant_id, "outlook-push", peer_key(request.remote)
