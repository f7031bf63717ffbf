"""Standard Webhooks (and its Svix form): HMAC-signed delivery events, as Resend sends them.

Protocol (https://www.standardwebhooks.com, spec "Verifying webhook authenticity"):
the sender posts a JSON body with three headers,

    webhook-id:         msg_p5jXN8AQM9LWM0D4loKWxJek   unique per event, same on retries
    webhook-timestamp:  1614265330                     integer Unix seconds
    webhook-signature:  v1,<base64> [v1,<base64> …]    space-separated, any may match

Svix (which Resend uses) sends the same values as `svix-id`, `svix-timestamp`,
`svix-signature`; either set is accepted, `webhook-*` when both are present. The
signature is base64(HMAC-SHA256(key, f"{id}.{timestamp}.".encode() + raw body)),
where the key is the base64-decoded part of the `whsec_…` secret. `accept` checks,
in order: the three headers are present, the timestamp is an integer within
`tolerance_s` of the receive time, one `v1` signature matches under one of the
configured keys (constant-time) — and only then parses the body. Each of the
three headers must come once: two `webhook-signature` (or `-id`, `-timestamp`)
headers are refused like a bad signature (401), because the spec defines one
header carrying a space-delimited list and a second one leaves open which the
sender signed.

Bounds (adapters/esp/fields.py): after verification, a webhook id longer than
MAX_ID_CHARS or holding NUL, an event time outside the event-time range, a body
nested deeper than MAX_JSON_DEPTH, or an id field over its limit is
MalformedPayload (400): one request is one event, so nothing of it is stored.

Rotation: `secret` and the optional `next_secret` are both accepted, so the new
secret can be configured before the provider switches to it; retiring a secret
is removing it from the config. Other signature versions (`v1a,` is the
spec's Ed25519 form) are ignored, not failed.

The body is normalised as Resend's `email.*` events
(https://resend.com/docs/webhooks/event-types): `{"type", "created_at", "data":
{"email_id", "to": [...], "bounce": {"type", "subType"}, …}}`, one DeliveryEvent per
address in `data.to`. A type not in `EVENT_TYPES` becomes `EventType.UNKNOWN`,
which also covers other Standard Webhooks senders' events.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import math
from collections.abc import Mapping
from email.utils import parseaddr
from typing import Any

from inboxd.pipeline.delivery.model import BounceType, DeliveryEvent, EventType

from .base import (
    DEFAULT_TOLERANCE_S,
    Accepted,
    DeliveryConfigError,
    MalformedPayload,
    Reveal,
    VerificationFailed,
    WebhookRequest,
)
from .config import read_tolerance, refuse_unknown_keys
from .fields import (
    MAX_ID_CHARS,
    MAX_MESSAGE_ID_CHARS,
    check_depth,
    check_text,
    check_timestamp,
    optional_str,
    parse_json_object,
    read_iso_time,
    single_header,
)

__all__ = ["EVENT_TYPES", "StandardWebhooksReceiver"]

#: Prefix of a Standard Webhooks symmetric secret; the rest is the base64 key
#: (spec "Signature scheme", symmetric).
SECRET_PREFIX = "whsec_"  # noqa: S105 (a format prefix)

#: Header sets, in order of preference (spec names first, then Svix's).
HEADER_SETS: tuple[tuple[str, str, str], ...] = (
    ("webhook-id", "webhook-timestamp", "webhook-signature"),
    ("svix-id", "svix-timestamp", "svix-signature"),
)

#: The signature version this module verifies (HMAC-SHA256). `v1a` (Ed25519) and
#: any future version are skipped.
SIGNATURE_VERSION = "v1"

#: Resend event type → our event type (https://resend.com/docs/webhooks/event-types).
#: `email.scheduled`, `email.received` (inbound mail) and `contact.*`/`domain.*`
#: are not delivery outcomes and stay UNKNOWN.
EVENT_TYPES: Mapping[str, EventType] = {
    "email.sent": EventType.ACCEPTED,
    "email.delivered": EventType.DELIVERED,
    "email.delivery_delayed": EventType.DEFERRED,
    "email.bounced": EventType.BOUNCED,
    "email.complained": EventType.COMPLAINED,
    "email.opened": EventType.OPENED,
    "email.clicked": EventType.CLICKED,
    "email.failed": EventType.REJECTED,
    "email.suppressed": EventType.SUPPRESSED,
}

#: Resend `data.bounce.type` → bounce classification. Resend's bounce page lists
#: Permanent, Transient and Undetermined (the field docs also say "Temporary");
#: anything else, or no type at all, is UNDETERMINED, which never suppresses.
BOUNCE_TYPES: Mapping[str, BounceType] = {
    "permanent": BounceType.PERMANENT,
    "transient": BounceType.TRANSIENT,
    "temporary": BounceType.TRANSIENT,
    "undetermined": BounceType.UNDETERMINED,
}

#: Paths kept in `delivery_events.payload` by default: ids, types and reasons.
#: No addresses (`to`, `from`), no subject, no click URL or IP (links can carry
#: personal tokens), no bounce message (SMTP diagnostics quote addresses).
#: `data.tags` are the sender's own labels, set at send time.
DEFAULT_PAYLOAD_FIELDS: tuple[str, ...] = (
    "type",
    "created_at",
    "timestamp",
    "data.email_id",
    "data.broadcast_id",
    "data.template_id",
    "data.created_at",
    "data.bounce.type",
    "data.bounce.subType",
    "data.suppressed.type",
    "data.failed.reason",
    "data.tags",
)

_CONFIG_KEYS = frozenset({"secret", "next_secret", "tolerance_s"})


class StandardWebhooksReceiver:
    """A Standard Webhooks / Svix sender (Resend) configured with one or two secrets."""

    provider = "standard_webhooks"
    content_types = frozenset({"application/json"})
    default_payload_fields = DEFAULT_PAYLOAD_FIELDS

    __slots__ = ("_keys", "source_id", "tolerance_s")

    def __init__(
        self,
        source_id: str,
        keys: tuple[bytes, ...],
        tolerance_s: float = DEFAULT_TOLERANCE_S,
    ) -> None:
        if not keys:
            raise DeliveryConfigError("secret: required")
        # not (x > 0) also refuses NaN, which would make every skew comparison false.
        if not (0 < tolerance_s < math.inf):
            raise DeliveryConfigError("tolerance_s: must be a finite number > 0")
        self.source_id = source_id
        self.tolerance_s = tolerance_s
        self._keys = keys

    @classmethod
    def from_config(
        cls,
        source_id: str,
        table: Mapping[str, Any],
        reveal: Reveal,
    ) -> StandardWebhooksReceiver:
        """Build a source from its `[[delivery_sources]]` table.

        Keys: `secret` (required) and `next_secret` (optional), each `whsec_` +
        base64 and passed through `reveal`; `tolerance_s` (seconds, > 0, default
        `DEFAULT_TOLERANCE_S`). `COMMON_KEYS` are ignored. Raises DeliveryConfigError
        naming the key; a secret's value is never part of the message.
        """
        refuse_unknown_keys(table, _CONFIG_KEYS, cls.provider)
        if table.get("secret") is None:
            raise DeliveryConfigError("secret: required")
        keys = [decode_secret("secret", reveal(table["secret"]))]
        if table.get("next_secret") is not None:
            keys.append(decode_secret("next_secret", reveal(table["next_secret"])))
        return cls(source_id, tuple(keys), read_tolerance(table))

    def __repr__(self) -> str:
        return (
            f"StandardWebhooksReceiver(source_id={self.source_id!r}, "
            f"keys={len(self._keys)}, tolerance_s={self.tolerance_s})"
        )

    async def accept(self, request: WebhookRequest) -> Accepted:
        """Verify the signature on the raw body, then parse and normalise it.

        Raises VerificationFailed (headers, timestamp or signature) or
        MalformedPayload (verified but not a JSON object of Resend's shape).
        """
        webhook_id = verify_request(request, self._keys, self.tolerance_s)
        check_text(webhook_id, what="webhook-id", max_chars=MAX_ID_CHARS)
        payload = parse_json_object(request.body)
        check_depth(payload)
        return Accepted(events=normalise(webhook_id, payload))


def decode_secret(key: str, value: str) -> bytes:
    """The HMAC key of a `whsec_…` secret; DeliveryConfigError names `key`, not the value."""
    value = value.strip()
    if not value.startswith(SECRET_PREFIX):
        raise DeliveryConfigError(f"{key}: must start with {SECRET_PREFIX}")
    try:
        secret = base64.b64decode(value[len(SECRET_PREFIX) :], validate=True)
    except (binascii.Error, ValueError):
        raise DeliveryConfigError(f"{key}: the part after {SECRET_PREFIX} is not base64") from None
    if not secret:
        raise DeliveryConfigError(f"{key}: the key after {SECRET_PREFIX} is empty")
    return secret


def verify_request(request: WebhookRequest, keys: tuple[bytes, ...], tolerance_s: float) -> str:
    """Check headers, timestamp and signature of `request`; return the webhook id.

    Raises VerificationFailed naming the check that failed.
    """
    msg_id, timestamp, signatures = read_headers(request.headers)
    check_timestamp(timestamp, request.received_at, tolerance_s)
    # surrogateescape: aiohttp decodes header bytes that are not UTF-8 that way,
    # and the signature is over the bytes the sender sent.
    signed = f"{msg_id}.{timestamp}.".encode("utf-8", "surrogateescape") + request.body
    expected = [hmac.digest(key, signed, hashlib.sha256) for key in keys]
    if not any(
        hmac.compare_digest(candidate, digest)
        for candidate in signature_candidates(signatures)
        for digest in expected
    ):
        raise VerificationFailed("no matching v1 signature")
    return msg_id


def read_headers(headers: Mapping[str, str]) -> tuple[str, str, str]:
    """(id, timestamp, signature) from the `webhook-*` set, else the `svix-*` set.

    The first set with any header present is used whole: mixing sets would let one
    sender's id pair with another's signature. A header of the set that comes
    twice is VerificationFailed (module docstring).
    """
    names = next(
        (names for names in HEADER_SETS if any(headers.get(n) is not None for n in names)),
        HEADER_SETS[0],
    )
    values = []
    for name in names:
        value = (single_header(headers, name) or "").strip()
        if not value:
            raise VerificationFailed(f"missing {name} header")
        values.append(value)
    return values[0], values[1], values[2]


def signature_candidates(header: str) -> list[bytes]:
    """The decoded `v1` signatures of a signature header; undecodable entries are skipped."""
    candidates = []
    for entry in header.split():
        version, _, encoded = entry.partition(",")
        if version != SIGNATURE_VERSION:
            continue
        try:
            candidates.append(base64.b64decode(encoded, validate=True))
        except (binascii.Error, ValueError):
            continue
    return candidates


def normalise(webhook_id: str, payload: dict[str, Any]) -> list[DeliveryEvent]:
    """One DeliveryEvent per recipient of a Resend-shaped event.

    Several recipients get ids `{webhook_id}:{index}` so each is its own event;
    no recipient at all still gives one event (recipient None).
    """
    provider_type = optional_str(payload, "type", max_chars=MAX_ID_CHARS)
    if not provider_type:
        raise MalformedPayload("type is missing or not a string")
    data = payload.get("data", {})
    if not isinstance(data, dict):
        raise MalformedPayload("data is not an object")
    event_type = EVENT_TYPES.get(provider_type, EventType.UNKNOWN)
    bounce_type, bounce_subtype = None, None
    if event_type is EventType.BOUNCED:
        bounce_type, bounce_subtype = classify_bounce(data.get("bounce"))
    occurred_at = read_iso_time(payload.get("created_at", payload.get("timestamp")))
    message_id = data.get("email_id")
    if isinstance(message_id, str):
        check_text(message_id, what="data.email_id", max_chars=MAX_ID_CHARS)
    common: dict[str, Any] = {
        "provider_type": provider_type,
        "event_type": event_type,
        "occurred_at": occurred_at,
        "provider_message_id": message_id if isinstance(message_id, str) else None,
        "message_id_header": find_message_id_header(data),
        "bounce_type": bounce_type,
        "bounce_subtype": bounce_subtype,
        "payload": payload,
    }
    recipients = read_recipients(data.get("to"))
    if len(recipients) <= 1:
        recipient = recipients[0] if recipients else None
        return [DeliveryEvent(provider_event_id=webhook_id, recipient=recipient, **common)]
    return [
        DeliveryEvent(provider_event_id=f"{webhook_id}:{index}", recipient=recipient, **common)
        for index, recipient in enumerate(recipients)
    ]


def classify_bounce(bounce: Any) -> tuple[BounceType, str | None]:
    """(classification, subType) of Resend's `data.bounce` object."""
    if not isinstance(bounce, dict):
        return BounceType.UNDETERMINED, None
    raw_type = bounce.get("type")
    bounce_type = BounceType.UNDETERMINED
    if isinstance(raw_type, str):
        bounce_type = BOUNCE_TYPES.get(raw_type.lower(), BounceType.UNDETERMINED)
    subtype = bounce.get("subType")
    if isinstance(subtype, str):
        check_text(subtype, what="data.bounce.subType")
    return bounce_type, subtype if isinstance(subtype, str) and subtype else None


def read_recipients(to: Any) -> list[str]:
    """Bare addresses of `data.to`: a list (or, tolerated, one string) of
    addresses that may carry a display name (`Name <a@example.org>`)."""
    if isinstance(to, str):
        to = [to]
    if not isinstance(to, list):
        return []
    recipients = []
    for entry in to:
        if not isinstance(entry, str) or not entry.strip():
            continue
        check_text(entry, what="data.to")
        if "<" not in entry and '"' not in entry and "(" not in entry:
            # A bare address, the common case: parseaddr costs ~6 µs and finds nothing more.
            recipients.append(entry.strip())
            continue
        try:
            address = parseaddr(entry)[1]
        except (RecursionError, ValueError):  # deeply nested comments: keep it as given
            address = ""
        recipients.append(address or entry.strip())
    return recipients


def find_message_id_header(data: Mapping[str, Any]) -> str | None:
    """The RFC 5322 Message-ID: `data.message_id`, else a `Message-ID` in `data.headers`
    (a list of `{name, value}` or a name → value object)."""
    direct = data.get("message_id")
    if isinstance(direct, str) and direct:
        return check_text(direct, what="data.message_id", max_chars=MAX_MESSAGE_ID_CHARS)
    headers = data.get("headers")
    pairs: list[tuple[Any, Any]] = []
    if isinstance(headers, dict):
        pairs = list(headers.items())
    elif isinstance(headers, list):
        pairs = [(h.get("name"), h.get("value")) for h in headers if isinstance(h, dict)]
    for name, value in pairs:
        if isinstance(name, str) and name.lower() == "message-id" and isinstance(value, str):
            check_text(value, what="data.headers Message-ID", max_chars=MAX_MESSAGE_ID_CHARS)
            return value.strip() or None
    return None
