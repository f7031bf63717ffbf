"""The contract of a delivery-event source: verify a webhook request, normalise its events.

One module per provider scheme implements `EspReceiver` (the class) and a
`from_config(source_id, table, reveal)` constructor; `adapters/esp/registry.py`
maps the `provider` key of a tenant's `[[delivery_sources]]` table to it. The
rules they share live in `config.py` (unknown keys, `tolerance_s`) and
`fields.py` (JSON bodies, typed fields, event times, signed timestamps). The
daemon's route (`POST /hooks/esp/{tenant}/{source}`) does, in this order:

    size limit (413) → content type (415) → rate limit (429)
    → await source.accept(request)
         VerificationFailed → 401, generic body, metric; nothing stored
         VerificationUnavailable  → 503 (e.g. certificate fetch failed); nothing stored
         MalformedPayload   → 400; nothing stored (only ever after verification
                              for schemes that sign the body)
    → persist Accepted.events (and the replay token) in one transaction
    → 2xx after commit; database unavailable → 503 so the provider retries
    → Accepted.confirm_url (SNS SubscriptionConfirmation): GET it, then 200

`accept` verifies on the raw bytes *before* parsing wherever the scheme signs
the body (Standard Webhooks, SendGrid): a re-serialised body fails. Schemes
that sign fields instead (SNS canonical string, Mailgun timestamp+token)
parse first and verify those fields; Postmark has no signature and is
verified by HTTP Basic credentials. Comparisons are constant-time. Secrets
come in revealed through `reveal` and never appear in reprs, logs or errors.
An event type the adapter does not know becomes `EventType.UNKNOWN` with its
raw type — never an error. In a batch of independent events (SendGrid), an
event object that cannot be normalised becomes UNKNOWN too (`malformed:<type>`)
instead of failing the request, which would lose the rest of the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from inboxd.pipeline.delivery.model import DeliveryEvent

__all__ = [
    "COMMON_KEYS",
    "DEFAULT_TOLERANCE_S",
    "MAX_TOLERANCE_S",
    "Accepted",
    "DeliveryConfigError",
    "EspReceiver",
    "MalformedPayload",
    "Reveal",
    "VerificationFailed",
    "VerificationUnavailable",
    "WebhookRequest",
]

#: Signed timestamps older or newer than this are refused (Standard Webhooks
#: spec and the Svix/SendGrid/Mailgun guides all recommend 5 minutes).
DEFAULT_TOLERANCE_S = 300.0
#: The widest tolerance a source may configure. Single-use tokens (Mailgun) are
#: remembered for 2 × this (pipeline/delivery/worker.py REPLAY_TOKEN_KEEP_S), so
#: a token can never be forgotten while its timestamp would still pass.
MAX_TOLERANCE_S = 1800.0

#: Keys of a `[[delivery_sources]]` table that the daemon reads for every
#: provider; a provider's `from_config` ignores these and refuses other keys it
#: does not know.
COMMON_KEYS = frozenset(
    {
        "id",
        "provider",
        "max_body_bytes",
        "rate_limit_per_s",
        "rate_limit_burst",
        "payload_fields",
        "recipients",
    }
)

#: `reveal(value)` turns a config value that may be a secret reference
#: (`env:NAME`, `file:/path`, already parsed by the daemon's config loader) into
#: its string; plain strings pass through.
Reveal = Callable[[Any], str]


class VerificationFailed(Exception):
    """The request is not provably from the provider. `str()` is for logs only:
    it names the check that failed, never a secret or a signature."""


class VerificationUnavailable(Exception):
    """Verification could not be completed for a transient reason (the SNS
    signing certificate could not be fetched): the route answers 503 so the
    provider retries, instead of refusing a request that may be genuine."""


class MalformedPayload(Exception):
    """Verified (or unsigned) content that is not the provider's documented shape."""


class DeliveryConfigError(ValueError):
    """A `[[delivery_sources]]` table the provider module cannot use. The message
    names the key, e.g. `secret: must start with whsec_`."""


@dataclass(frozen=True, slots=True)
class WebhookRequest:
    """What the route hands to a source: the raw body, headers, and when it arrived.

    `headers` is case-insensitive (aiohttp's CIMultiDictProxy; tests may pass
    any mapping with lower-case keys). `received_at` is a Unix time in seconds,
    the clock that timestamp tolerances are checked against.
    """

    body: bytes
    headers: Mapping[str, str]
    received_at: float


@dataclass(frozen=True, slots=True)
class Accepted:
    """The verified content of one request.

    `events` may be empty (an SNS SubscriptionConfirmation, a SendGrid test
    post with an empty batch). `replay_token` must not have been accepted
    before for this source (Mailgun's token); the route stores it in the same
    transaction as the events and refuses the request when it is known —
    within `replay_scope` when given (a fingerprint of the signing key, so a
    token is single-use across every source sharing that key), else the source.
    `confirm_url` is an SNS SubscribeURL, already checked to be an
    `https://sns.<region>.amazonaws.com(.cn)/` address, to GET after the
    request is verified.
    """

    events: list[DeliveryEvent] = field(default_factory=list)
    replay_token: str | None = None
    replay_scope: str | None = None
    confirm_url: str | None = None


class EspReceiver(Protocol):
    """One configured delivery-event source of a tenant."""

    # Read-only members: a source may provide them as class constants (ClassVar,
    # frozen dataclasses), which a plain attribute in a protocol would refuse.

    @property
    def provider(self) -> str:
        """Provider name as in config (`standard_webhooks`, `ses`, `sendgrid` …)."""
        ...

    @property
    def content_types(self) -> frozenset[str]:
        """Media types (lower-case, without parameters) the provider posts."""
        ...

    @property
    def default_payload_fields(self) -> tuple[str, ...]:
        """Dotted paths of the provider event object kept in `delivery_events.payload`
        unless the source's config names its own `payload_fields`. No bodies, no
        addresses."""
        ...

    async def accept(self, request: WebhookRequest) -> Accepted:
        """Verify `request` and normalise its events.

        Raises VerificationFailed or MalformedPayload; never anything else for
        bad input. May await network I/O only where the scheme requires it (SNS
        signing certificate, cached).
        """
        ...
