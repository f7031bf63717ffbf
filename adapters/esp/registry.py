"""Which module serves which `provider` of a `[[delivery_sources]]` table.

Adding a provider = one module implementing adapters/esp/base.py's contract
plus one line here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from inboxd.adapters.esp import mailgun, postmark, sendgrid, ses, standard_webhooks
from inboxd.adapters.esp.base import DeliveryConfigError, EspReceiver, Reveal

__all__ = ["PROVIDERS", "build_esp_receiver"]

Fetch = Callable[[str], Awaitable[bytes]]

_BUILDERS: dict[str, Callable[..., EspReceiver]] = {
    # Resend and Svix senders sign with Standard Webhooks.
    "standard_webhooks": standard_webhooks.StandardWebhooksReceiver.from_config,
    "resend": standard_webhooks.StandardWebhooksReceiver.from_config,
    "svix": standard_webhooks.StandardWebhooksReceiver.from_config,
    "ses": ses.SesReceiver.from_config,
    "sendgrid": sendgrid.from_config,
    "mailgun": mailgun.from_config,
    "postmark": postmark.PostmarkReceiver.from_config,
}

PROVIDERS = frozenset(_BUILDERS)


def build_esp_receiver(
    source_id: str, table: Mapping[str, Any], reveal: Reveal, *, fetch: Fetch | None = None
) -> EspReceiver:
    """The configured source; DeliveryConfigError naming the key when unusable.

    `fetch` (HTTPS GET returning bytes) is how the SES source loads SNS signing
    certificates; None uses its default client.
    """
    provider = table.get("provider")
    builder = _BUILDERS.get(provider) if isinstance(provider, str) else None
    if builder is None:
        raise DeliveryConfigError(
            f"provider: expected one of {', '.join(sorted(PROVIDERS))}, got {provider!r}"
        )
    if provider == "ses" and fetch is not None:
        return builder(source_id, table, reveal, fetch=fetch)
    return builder(source_id, table, reveal)
