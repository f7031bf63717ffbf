"""`POST /hooks/esp/{tenant}/{source}`: delivery-event webhooks of sending providers.

Order of checks, cheapest and least trusting first (adapters/esp/base.py has
the provider half):

    body over the source's limit   413 (the listener's body-limit middleware,
                                   before reading, via `body_limit`)
    unknown tenant/source          404   ┐
    content type not the provider's 415  │ before the body is read (`check_before_body`)
    peer's failure budget spent    429 + Retry-After │ ("Budgets" below)
    source's budget spent          429 + Retry-After ┘
    verification failed            401 {"error": "unauthorized"}, counted; nothing stored
    verified, source budget spent  429 + Retry-After (raced with concurrent requests)
    certificate fetch failed       503 (SNS; the provider retries)
    malformed verified content     400
    replayed single-use token      401, counted
    store failed / timed out       503 + Retry-After (the provider retries; nothing half-stored)
    stored (or already stored)     200 {"stored": n, "duplicates": d} — only after COMMIT
    SNS SubscriptionConfirmation   GET SubscribeURL after verification, then 200

No event is processed inside the request: the handler verifies, persists and
answers; the event workers apply the rows afterwards (pipeline/delivery/worker.py).

Budgets. Whoever knows a hook URL can send to it, so unverified requests must
neither hold a tenant's events back nor cost unbounded CPU:

- Verified requests spend the source's bucket (`DeliveryHook.limiter`,
  `rate_limit_per_s` / `rate_limit_burst`): checked before the body (429 when
  empty, nothing read), spent once verification passed.
- Every request that does not end verified — verification failed, a replayed
  token, malformed content, verification unavailable — spends instead the
  failure bucket of its peer at that source (`HookTable.failures`, keyed
  (tenant, source, peer), `FAILED_VERIFICATION_RATE_PER_S` /
  `FAILED_VERIFICATION_BURST`). While that bucket is empty, the peer's requests
  to that source get 429 before their body is read: a flood costs header
  parsing, not body reads and HMACs, and its log lines and 401s are bounded by
  the bucket.
- Garbage spends nothing of the source's bucket nor of other peers' buckets,
  so a flood of unsigned requests from one peer leaves signed events from
  other peers flowing. Per-peer state is bounded (`MAX_TRACKED_PEERS`, least
  recently charged dropped first; a dropped bucket is a full one).

A peer is `request.remote`: the TCP peer (an IPv6 one is its /64,
adapters/webhook_budgets.py `peer_key`), or, when the TCP peer is one of
`[listener] trusted_proxies`, the client address the proxy forwarded
(daemon/http/forwarded.py). Behind a proxy that is not listed there every
request has the proxy's address, so all senders share ONE failure budget per
source: a flood through the proxy then holds signed events back as well (they
get 429 before their body is read and the provider retries later).
X-Forwarded-For from any other peer is ignored: any client can send one.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import NoReturn

import structlog
from aiohttp import hdrs, web

from inboxd.adapters.esp.base import (
    Accepted,
    EspReceiver,
    MalformedPayload,
    VerificationFailed,
    VerificationUnavailable,
    WebhookRequest,
)
from inboxd.adapters.webhook_budgets import PeerBudgets, RateLimiter, peer_key
from inboxd.adapters.webhook_routes import ApiError, json_error, json_response
from inboxd.daemon.http.state import HTTP_STATE
from inboxd.pipeline.delivery.intake import (
    DeliveryIntake,
    IntakeUnavailable,
    ReplayedToken,
    SourcePolicy,
)

__all__ = [
    "DEFAULT_HOOK_BODY_BYTES",
    "DEFAULT_RATE_BURST",
    "DEFAULT_RATE_PER_S",
    "FAILED_VERIFICATION_BURST",
    "FAILED_VERIFICATION_RATE_PER_S",
    "HOOK_PATH",
    "MAX_TRACKED_PEERS",
    "DeliveryHook",
    "EspHooks",
    "HookTable",
    "hook_routes",
]

log = structlog.get_logger(__name__)

HOOK_PATH = "/hooks/esp/{tenant}/{source}"
#: Per-source body limit: SNS messages are at most 256 KiB (SNS quotas), and
#: so are SendGrid's batches in practice; the issue's default.
DEFAULT_HOOK_BODY_BYTES = 256 * 1024
#: Requests per second a source may send before 429. Providers retry 429s
#: with backoff; 2,000/s is far above what one tenant's traffic needs and keeps a
#: runaway or hostile sender from filling the database.
DEFAULT_RATE_PER_S = 2000.0
DEFAULT_RATE_BURST = 4000.0
#: Requests per second one peer may send to one source that end unverified,
#: and their burst. An honest sender fails verification only when misconfigured
#: (a secret it rotated before we did, a clock off by more than the tolerance),
#: and then every request of it fails: 5/s keeps its 401s — the log lines and
#: `inboxd_webhook_verification_failures` an operator looks at — coming, while
#: the rest costs only header parsing. 20 leaves room for the requests an
#: honest sender has in flight when its secret changes.
FAILED_VERIFICATION_RATE_PER_S = 5.0
FAILED_VERIFICATION_BURST = 20.0
#: Failure buckets kept at most, over all sources: ~290 bytes each (measured with
#: tracemalloc, IPv4 keys), so ~3 MB at most.
MAX_TRACKED_PEERS = 10_000
#: Retry-After for 429 and 503 answers, seconds.
RETRY_AFTER_S = 5

Confirm = Callable[[str], Awaitable[None]]


@dataclass(slots=True, kw_only=True)
class DeliveryHook:
    """One configured delivery source of one tenant, ready to serve."""

    tenant_id: str
    source_id: str
    receiver: EspReceiver
    policy: SourcePolicy
    max_body_bytes: int = DEFAULT_HOOK_BODY_BYTES
    limiter: RateLimiter = field(
        default_factory=lambda: RateLimiter(DEFAULT_RATE_PER_S, DEFAULT_RATE_BURST)
    )

    @property
    def label(self) -> str:
        """Metric label: config ids only."""
        return f"{self.tenant_id}/{self.source_id}"


class HookTable:
    """(tenant, source) → DeliveryHook; `replace` swaps it whole on SIGHUP.

    `failures` holds the failed-verification budget of each peer at each
    source (module docstring, "Budgets"); it outlives reloads, so a reload does
    not hand a flooding peer a fresh burst either.
    """

    __slots__ = ("_sources", "failures")

    def __init__(
        self,
        sources: Mapping[tuple[str, str], DeliveryHook] | None = None,
        *,
        failures: PeerBudgets | None = None,
    ) -> None:
        self._sources: dict[tuple[str, str], DeliveryHook] = dict(sources or {})
        # `is None`, not `or`: an empty PeerBudgets is falsy (it has a length), so the
        # budgets a caller passed were replaced by the default ones
        self.failures = (
            failures
            if failures is not None
            else PeerBudgets(
                FAILED_VERIFICATION_RATE_PER_S, FAILED_VERIFICATION_BURST, MAX_TRACKED_PEERS
            )
        )

    def replace(self, sources: Mapping[tuple[str, str], DeliveryHook]) -> None:
        """Use `sources` from now on; a source whose rate settings did not change
        keeps its bucket (a reload must not hand a flooding sender a fresh burst)."""
        fresh = dict(sources)
        for key, hook in fresh.items():
            old = self._sources.get(key)
            if old is not None and old.limiter.settings == hook.limiter.settings:
                hook.limiter = old.limiter
        self._sources = fresh

    def get(self, tenant_id: str, source_id: str) -> DeliveryHook | None:
        return self._sources.get((tenant_id, source_id))

    def __len__(self) -> int:
        return len(self._sources)

    def check_before_body(self, request: web.Request) -> None:
        """404, 415 and 429 of hook requests, before the body is read (size
        first, then type, then the peer's failure budget, then the source's).
        Spends nothing: what a request spends depends on its verification
        (`spend_verified`, `spend_failed`)."""
        if "source" not in request.match_info or "tenant" not in request.match_info:
            return
        hook = self.get(request.match_info["tenant"], request.match_info["source"])
        if hook is None:
            json_error(404, "not_found")
        if request.content_type.lower() not in hook.receiver.content_types:
            json_error(415, "unsupported_media_type")
        if not self.failures.allows(_failure_key(request, hook)) or not hook.limiter.ready():
            _rate_limited()

    def spend_verified(self, hook: DeliveryHook) -> None:
        """Spend a token of the source's budget for a verified request; 429 when
        concurrent requests emptied it since `check_before_body`."""
        if not hook.limiter.take():
            _rate_limited()

    def spend_failed(self, request: web.Request, hook: DeliveryHook) -> None:
        """Spend a token of the peer's failure budget at `hook`'s source."""
        self.failures.charge(_failure_key(request, hook))

    def body_limit(self, request: web.Request) -> int | None:
        """The source's own body limit for hook requests."""
        info = request.match_info
        if "source" not in info or "tenant" not in info:
            return None
        hook = self.get(info["tenant"], info["source"])
        return hook.max_body_bytes if hook is not None else None


def _failure_key(request: web.Request, hook: DeliveryHook) -> tuple[str, str, str]:
    # The hook's own strings: one copy per source in the table, not one per key.
    return hook.tenant_id, hook.source_id, peer_key(request.remote)


def _rate_limited() -> NoReturn:
    json_error(429, "rate_limited", headers={hdrs.RETRY_AFTER: str(RETRY_AFTER_S)})


class EspHooks:
    """The ESP hook route with its per-source limits: a `WebhookRoutes`
    (adapters/webhook_routes.py)."""

    def __init__(self, table: HookTable, intake: DeliveryIntake, confirm: Confirm) -> None:
        self.table = table
        self.intake = intake
        self.confirm = confirm

    def routes(self) -> list[web.RouteDef]:
        return hook_routes(self.table, self.intake, self.confirm)

    def body_limit(self, request: web.Request) -> int | None:
        return self.table.body_limit(request)

    def check_before_body(self, request: web.Request) -> None:
        self.table.check_before_body(request)


def hook_routes(table: HookTable, intake: DeliveryIntake, confirm: Confirm) -> list[web.RouteDef]:
    """The webhook route; `EspHooks` gives the listener the table's limits with it."""

    async def handle(request: web.Request) -> web.Response:
        # 404/415/429 were answered before the body was read (check_before_body);
        # a reload between then and now can still have removed the source.
        hook = table.get(request.match_info["tenant"], request.match_info["source"])
        if hook is None:
            json_error(404, "not_found")
        body = await request.read()
        webhook = WebhookRequest(body=body, headers=request.headers, received_at=time.time())
        try:
            accepted = await _accept(request, hook, webhook)
        except ApiError as exc:
            # Only a failed verification is the peer's failure: a 400 came from a
            # verified sender (it spends the source's budget), and a 503 (SNS
            # certificates unreachable) is our outage, not the peer's fault.
            if exc.status == 401:
                table.spend_failed(request, hook)
            elif exc.status == 400:
                table.spend_verified(hook)
            raise
        table.spend_verified(hook)
        try:
            stored = await intake.submit(
                hook.tenant_id,
                hook.source_id,
                hook.receiver.provider,
                accepted.events,
                hook.policy,
                received_at=webhook.received_at,
                replay_token=accepted.replay_token,
                replay_scope=accepted.replay_scope,
            )
        except ReplayedToken:
            table.spend_failed(request, hook)
            _refuse(request, hook, "replayed token")
        except IntakeUnavailable as exc:
            log.warning(
                "webhook_not_stored", tenant=hook.tenant_id, source=hook.source_id, error=str(exc)
            )
            json_error(503, "unavailable", headers={hdrs.RETRY_AFTER: str(RETRY_AFTER_S)})
        request.app[HTTP_STATE].metrics.delivery_events_stored(
            hook.receiver.provider, stored.new, stored.duplicates
        )
        if accepted.confirm_url is not None:
            await _confirm(confirm, hook, accepted.confirm_url)
        return json_response({"stored": stored.new, "duplicates": stored.duplicates})

    return [web.post(HOOK_PATH, handle)]


async def _accept(request: web.Request, hook: DeliveryHook, webhook: WebhookRequest) -> Accepted:
    try:
        return await hook.receiver.accept(webhook)
    except VerificationFailed as exc:
        _refuse(request, hook, str(exc))
    except VerificationUnavailable as exc:
        log.warning(
            "webhook_verification_unavailable",
            tenant=hook.tenant_id,
            source=hook.source_id,
            error=str(exc),
        )
        json_error(503, "unavailable", headers={hdrs.RETRY_AFTER: str(RETRY_AFTER_S)})
    except MalformedPayload as exc:
        log.info(
            "webhook_malformed", tenant=hook.tenant_id, source=hook.source_id, error=str(exc)[:200]
        )
        json_error(400, "malformed_payload")


def _refuse(request: web.Request, hook: DeliveryHook, check: str) -> NoReturn:
    """401 with a body that says nothing about which check failed."""
    request.app[HTTP_STATE].metrics.webhook_verification_failed(hook.label)
    # `check` names the failed check; cut in case an adapter's message ever quotes input.
    log.info("webhook_rejected", tenant=hook.tenant_id, source=hook.source_id, check=check[:200])
    json_error(401, "unauthorized")


async def _confirm(confirm: Confirm, hook: DeliveryHook, url: str) -> None:
    try:
        await confirm(url)
    except Exception as exc:  # SNS re-sends the confirmation when we do not answer 2xx
        log.warning(
            "subscription_confirm_failed",
            tenant=hook.tenant_id,
            source=hook.source_id,
            error=type(exc).__name__,
        )
        json_error(503, "unavailable", headers={hdrs.RETRY_AFTER: str(RETRY_AFTER_S)})
    log.info("subscription_confirmed", tenant=hook.tenant_id, source=hook.source_id)
