"""Turning the tenants' `[[delivery_sources]]` tables into served webhook sources.

Keys every source understands (the provider module reads the rest):

    id                 unique within the tenant; the URL is /hooks/esp/<tenant>/<id>
    provider           standard_webhooks (resend, svix), ses, sendgrid, mailgun, postmark
    max_body_bytes     request size limit, default 262144 (256 KiB)
    rate_limit_per_s   requests per second before 429, default 2000
    rate_limit_burst   bucket size, default 4000
    payload_fields     dotted paths of the provider event kept in
                       delivery_events.payload (default: the provider's list,
                       which holds no addresses and no content)
    recipients         "hash" (default: only sha256 of addresses is stored) or
                       "keep" (addresses stored as well)

A source whose table is unusable is reported (check-config, logs) and not
served; the tenant's other sources and mailboxes are unaffected.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp

from inboxd.adapters.esp.base import DeliveryConfigError
from inboxd.adapters.esp.registry import build_esp_receiver
from inboxd.adapters.webhook_budgets import RateLimiter
from inboxd.daemon.config.reader import ConfigProblem
from inboxd.daemon.config.secrets import Secret, SecretError
from inboxd.daemon.config.tenant import TenantConfig
from inboxd.daemon.webhooks.esp import (
    DEFAULT_HOOK_BODY_BYTES,
    DEFAULT_RATE_BURST,
    DEFAULT_RATE_PER_S,
    DeliveryHook,
)
from inboxd.pipeline.delivery.intake import SourcePolicy

__all__ = ["build_delivery_hooks", "confirm_subscription"]

#: The largest per-source body limit: the listener's own default limit.
MAX_HOOK_BODY_BYTES = 1024 * 1024
#: SNS expects the SubscribeURL GET to finish promptly; it re-sends otherwise.
CONFIRM_TIMEOUT_S = 10.0

Fetch = Callable[[str], Awaitable[bytes]]


def reveal(value: Any) -> str:
    """Config value → string; secret references are read now."""
    return value.reveal() if isinstance(value, Secret) else str(value)


def build_delivery_hooks(
    tenants: Mapping[str, TenantConfig],
    *,
    fetch: Fetch | None = None,
) -> tuple[dict[tuple[str, str], DeliveryHook], list[ConfigProblem]]:
    """The served sources of all tenants, and a problem per unusable source."""
    sources: dict[tuple[str, str], DeliveryHook] = {}
    problems: list[ConfigProblem] = []
    for tenant in sorted(tenants.values(), key=lambda t: t.tenant_id):
        for index, table in enumerate(tenant.delivery_sources):
            source_id = str(table.get("id"))
            try:
                sources[(tenant.tenant_id, source_id)] = _build(
                    tenant.tenant_id, source_id, table, fetch
                )
            except (DeliveryConfigError, SecretError) as exc:
                key, sep, message = str(exc).partition(": ")
                where = f"delivery_sources[{index}]"
                problems.append(
                    ConfigProblem(
                        tenant.source_file,
                        f"{where}.{key}" if sep else where,
                        message if sep else str(exc),
                    )
                )
    return sources, problems


def _build(
    tenant_id: str, source_id: str, table: Mapping[str, Any], fetch: Fetch | None
) -> DeliveryHook:
    adapter = build_esp_receiver(source_id, table, reveal, fetch=fetch)
    fields = table.get("payload_fields", adapter.default_payload_fields)
    if not isinstance(fields, list | tuple) or not all(isinstance(f, str) for f in fields):
        raise DeliveryConfigError("payload_fields: expected a list of dotted paths")
    recipients = table.get("recipients", "hash")
    if recipients not in ("hash", "keep"):
        raise DeliveryConfigError(f'recipients: expected "hash" or "keep", got {recipients!r}')
    max_body = _number(table, "max_body_bytes", DEFAULT_HOOK_BODY_BYTES, 1, MAX_HOOK_BODY_BYTES)
    rate = _number(table, "rate_limit_per_s", DEFAULT_RATE_PER_S, 0.001, 1e9)
    burst = _number(table, "rate_limit_burst", max(DEFAULT_RATE_BURST, rate), 1, 1e9)
    return DeliveryHook(
        tenant_id=tenant_id,
        source_id=source_id,
        receiver=adapter,
        policy=SourcePolicy(payload_fields=tuple(fields), keep_recipients=recipients == "keep"),
        max_body_bytes=int(max_body),
        limiter=RateLimiter(rate, burst),
    )


def _number(table: Mapping[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise DeliveryConfigError(
            f"{key}: expected a number from {low:g} to {high:g}, got {value!r}"
        )
    return float(value)


async def confirm_subscription(url: str) -> None:
    """GET an SNS SubscribeURL (already checked to be an SNS host by the adapter)."""
    timeout = aiohttp.ClientTimeout(total=CONFIRM_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as response:
        if response.status != 200:
            raise RuntimeError(f"SubscribeURL answered {response.status}")
