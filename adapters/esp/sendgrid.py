"""SendGrid's signed Event Webhook: verify the ECDSA signature, normalise the batch.

Protocol (Twilio SendGrid "Getting Started with the Event Webhook Security
Features", and the reference verifiers in sendgrid-python
`sendgrid/helpers/eventwebhook` and sendgrid-nodejs `packages/eventwebhook`):

    POST, Content-Type: application/json, body = a JSON array of events
    X-Twilio-Email-Event-Webhook-Timestamp: <Unix seconds>
    X-Twilio-Email-Event-Webhook-Signature: base64(DER(ECDSA-P256-SHA256(
                                             timestamp bytes || raw body bytes)))

The verification key is the account's public key as SendGrid shows it: base64
DER SubjectPublicKeyInfo (a PEM is accepted too). `accept` checks, in order:
both headers present → timestamp within the tolerance of the receive time
(cheap, so a stale request costs no ECDSA work) → signature over the raw bytes.
Only then is the body parsed, so a body re-serialised by anything in between
fails verification, and MalformedPayload is never raised for unverified input.

Normalisation (Event Webhook Reference,
https://www.twilio.com/docs/sendgrid/for-developers/tracking-events/event):

    processed → ACCEPTED            delivered → DELIVERED     deferred → DEFERRED
    bounce    → BOUNCED (below)     dropped   → SUPPRESSED or REJECTED (below)
    open      → OPENED              click     → CLICKED       spamreport → COMPLAINED
    unsubscribe       → UNSUBSCRIBED, list_id None (the whole source)
    group_unsubscribe → UNSUBSCRIBED, list_id "asm:<asm_group_id>"
    group_resubscribe → UNKNOWN: lifting an unsubscribe is an application
                        decision the pipeline does not model; the event is kept
                        with its raw type so it stays visible
    anything else     → UNKNOWN with the raw type

Bounce rule. `type` "blocked" is a block: the receiver refused this message
(IP, content, policy), not the address, and SendGrid does not suppress blocked
addresses — TRANSIENT. `type` "bounce" is SendGrid's hard bounce — PERMANENT,
unless `bounce_classification` names a sender-side cause (Content, Reputation,
Frequency or Volume Too High, Technical Failure; SendGrid's "Bounce and Block
Classifications" page): then the address is not at fault and it is TRANSIENT,
so our own reputation problem does not suppress good addresses. Invalid
Address, Mailbox Unavailable, Unclassified or no classification keep
PERMANENT. Any other `type` is UNDETERMINED. `bounce_subtype` is the
classification, else the enhanced status code (`status`).

Drop rule. SendGrid drops a message without trying it. The reasons "Bounced
Address", "Unsubscribed Address", "Spam Reporting Address" and "Invalid" name
SendGrid's own suppression lists (bounces, unsubscribes, spam reports, invalid
emails) → SUPPRESSED. Every other reason ("Spam Content", "Invalid SMTPAPI
header", "Recipient List over Package Quota", …) is about the message or the
account → REJECTED.

Ids. `sg_event_id` is the event id (dedup key). `sg_message_id` is
"<X-Message-Id>.<filter suffix>"; the part before the first "." is the
X-Message-Id the v3 Mail Send API returns in its 202 response
(https://www.twilio.com/docs/sendgrid/glossary/x-message-id; SendGrid support
matches it with `msg_id LIKE '<X-Message-ID>%'`), so that prefix is
`provider_message_id`. `smtp-id` is the message's Message-ID header (kept as
SendGrid sends it, with angle brackets); `email` the recipient.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, ClassVar

import orjson
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import (
    load_der_public_key,
    load_pem_public_key,
)

from inboxd.pipeline.delivery.model import BounceType, DeliveryEvent, EventType

from .base import (
    COMMON_KEYS,
    DEFAULT_TOLERANCE_S,
    Accepted,
    MalformedPayload,
    Reveal,
    SourceConfigError,
    VerificationFailed,
    WebhookRequest,
)

__all__ = ["SendGridSource", "from_config"]

SIGNATURE_HEADER = "x-twilio-email-event-webhook-signature"
TIMESTAMP_HEADER = "x-twilio-email-event-webhook-timestamp"

_CONFIG_KEYS = frozenset({"public_key", "tolerance_s"})
_SIGNATURE_ALGORITHM = ec.ECDSA(hashes.SHA256())

_SIMPLE_TYPES: dict[str, EventType] = {
    "processed": EventType.ACCEPTED,
    "delivered": EventType.DELIVERED,
    "deferred": EventType.DEFERRED,
    "open": EventType.OPENED,
    "click": EventType.CLICKED,
    "spamreport": EventType.COMPLAINED,
    "unsubscribe": EventType.UNSUBSCRIBED,
    "group_resubscribe": EventType.UNKNOWN,
}

#: `bounce_classification` values that blame the sender, not the address
#: (SendGrid "Bounce and Block Classifications",
#: https://docs.sendgrid.com/ui/analytics-and-reporting/bounce-and-block-classifications).
_SENDER_SIDE_CLASSIFICATIONS = frozenset({
    "Content", "Reputation", "Frequency or Volume Too High", "Technical Failure",
})

#: `reason`s of a dropped event that name one of SendGrid's suppression lists
#: (SendGrid "Drops" docs: unsubscribe, spam report, invalid emails, bounces).
_SUPPRESSION_DROP_REASONS = frozenset({
    "Bounced Address", "Unsubscribed Address", "Spam Reporting Address", "Invalid",
})


@dataclass(frozen=True, slots=True)
class SendGridSource:
    """One SendGrid Event Webhook of a tenant, verified with its public key."""

    provider: ClassVar[str] = "sendgrid"
    content_types: ClassVar[frozenset[str]] = frozenset({"application/json"})
    #: Ids, types, times and classifications only: `email`, `ip`, `useragent`,
    #: `url`, `reason` and `response` can quote addresses or identify a person.
    default_payload_fields: ClassVar[tuple[str, ...]] = (
        "event", "timestamp", "sg_event_id", "sg_message_id", "type",
        "bounce_classification", "status", "asm_group_id", "category", "attempt",
        "tls", "sg_machine_open",
    )

    source_id: str
    public_key: ec.EllipticCurvePublicKey = field(repr=False)
    tolerance_s: float = DEFAULT_TOLERANCE_S

    async def accept(self, request: WebhookRequest) -> Accepted:
        """Verify `request` and normalise its batch.

        Raises VerificationFailed (missing or malformed headers, timestamp out of
        tolerance, bad signature) before looking at the body, then
        MalformedPayload when the verified body is not an array of event objects.
        """
        self._verify(request)
        return Accepted(events=[normalise_event(item) for item in parse_batch(request.body)])

    def _verify(self, request: WebhookRequest) -> None:
        signature_b64 = request.headers.get(SIGNATURE_HEADER)
        timestamp = request.headers.get(TIMESTAMP_HEADER)
        if not signature_b64:
            raise VerificationFailed(f"missing header {SIGNATURE_HEADER}")
        if not timestamp:
            raise VerificationFailed(f"missing header {TIMESTAMP_HEADER}")
        check_timestamp(timestamp, request.received_at, self.tolerance_s)
        try:
            signature = base64.b64decode(signature_b64, validate=True)
        except ValueError:
            raise VerificationFailed("signature header is not base64") from None
        try:
            self.public_key.verify(
                signature, timestamp.encode("ascii") + request.body, _SIGNATURE_ALGORITHM,
            )
        except InvalidSignature:
            raise VerificationFailed("signature does not verify") from None


def check_timestamp(timestamp: str, received_at: float, tolerance_s: float) -> None:
    """Refuse a timestamp header that is not Unix seconds within `tolerance_s` of
    `received_at`, in either direction (the boundary itself passes)."""
    # isascii: str.isdigit and int() also accept other scripts' digits.
    if not (timestamp.isascii() and timestamp.isdigit()):
        raise VerificationFailed("timestamp header is not Unix seconds")
    # Compared, not subtracted: int/float comparison is exact for any size of int.
    signed_at = int(timestamp)
    if not received_at - tolerance_s <= signed_at <= received_at + tolerance_s:
        raise VerificationFailed("timestamp outside tolerance")


def parse_batch(body: bytes) -> list[Mapping[str, Any]]:
    """The events of a verified body; MalformedPayload unless a JSON array of objects."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise MalformedPayload("body is not JSON") from None
    if not isinstance(parsed, list):
        raise MalformedPayload("body is not a JSON array")
    for index, item in enumerate(parsed):
        if not isinstance(item, dict):
            raise MalformedPayload(f"event {index} is not an object")
    return parsed


def normalise_event(item: Mapping[str, Any]) -> DeliveryEvent:
    """One SendGrid event object as a DeliveryEvent (the module docstring has the rules)."""
    raw_type = _required_str(item, "event")
    event_type = _SIMPLE_TYPES.get(raw_type, EventType.UNKNOWN)
    bounce_type: BounceType | None = None
    bounce_subtype: str | None = None
    list_id: str | None = None
    if raw_type == "bounce":
        event_type = EventType.BOUNCED
        bounce_type = classify_bounce(_optional_str(item, "type"),
                                      _optional_str(item, "bounce_classification"))
        bounce_subtype = (_optional_str(item, "bounce_classification")
                          or _optional_str(item, "status"))
    elif raw_type == "dropped":
        event_type = classify_drop(_optional_str(item, "reason"))
    elif raw_type == "group_unsubscribe":
        event_type = EventType.UNSUBSCRIBED
        list_id = f"asm:{_asm_group_id(item)}"
    return DeliveryEvent(
        provider_event_id=_optional_str(item, "sg_event_id"),
        provider_type=raw_type,
        event_type=event_type,
        occurred_at=_occurred_at(item),
        provider_message_id=x_message_id(_optional_str(item, "sg_message_id")),
        message_id_header=_optional_str(item, "smtp-id"),
        recipient=_optional_str(item, "email"),
        bounce_type=bounce_type,
        bounce_subtype=bounce_subtype,
        list_id=list_id,
        payload=item,
    )


def classify_bounce(bounce_kind: str | None, classification: str | None) -> BounceType:
    """BounceType of a bounce event from its `type` and `bounce_classification`."""
    if bounce_kind == "blocked":
        return BounceType.TRANSIENT
    if bounce_kind == "bounce":
        if classification in _SENDER_SIDE_CLASSIFICATIONS:
            return BounceType.TRANSIENT
        return BounceType.PERMANENT
    return BounceType.UNDETERMINED


def classify_drop(reason: str | None) -> EventType:
    """SUPPRESSED when a drop's reason names a SendGrid suppression list, else REJECTED."""
    if reason is not None and reason.strip() in _SUPPRESSION_DROP_REASONS:
        return EventType.SUPPRESSED
    return EventType.REJECTED


def x_message_id(sg_message_id: str | None) -> str | None:
    """The X-Message-Id part of an `sg_message_id` (before the first ".")."""
    if not sg_message_id:
        return None
    return sg_message_id.split(".", 1)[0] or None


def _asm_group_id(item: Mapping[str, Any]) -> str:
    value = item.get("asm_group_id")
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, str) and value:
        return value
    # A group event without its group cannot be scoped; widening it to the
    # whole source would over-suppress, so the shape is refused instead.
    raise MalformedPayload("group_unsubscribe without asm_group_id")


def _occurred_at(item: Mapping[str, Any]) -> datetime | None:
    value = item.get("timestamp")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MalformedPayload("timestamp is not a number")
    try:
        return datetime.fromtimestamp(value, tz=UTC)
    except (OverflowError, OSError, ValueError):
        raise MalformedPayload("timestamp out of range") from None


def _required_str(item: Mapping[str, Any], key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise MalformedPayload(f"{key} is missing or not a string")
    return value


def _optional_str(item: Mapping[str, Any], key: str) -> str | None:
    value = item.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise MalformedPayload(f"{key} is not a string")
    return value


def from_config(source_id: str, table: Mapping[str, Any], reveal: Reveal) -> SendGridSource:
    """Build the source from its `[[delivery_sources]]` table.

    Keys: `public_key` (required; base64 DER SubjectPublicKeyInfo as SendGrid
    shows it, or a PEM; may be a secret reference) and `tolerance_s` (optional,
    seconds, default DEFAULT_TOLERANCE_S). COMMON_KEYS are ignored. Raises
    SourceConfigError naming the key for an unknown key, a missing key, or a
    key that is not an EC P-256 public key.
    """
    unknown = sorted(set(table) - COMMON_KEYS - _CONFIG_KEYS)
    if unknown:
        raise SourceConfigError(f"{', '.join(unknown)}: unknown key(s) for provider sendgrid")
    if "public_key" not in table:
        raise SourceConfigError("public_key: required")
    return SendGridSource(
        source_id=source_id,
        public_key=load_public_key(reveal(table["public_key"])),
        tolerance_s=parse_tolerance(table.get("tolerance_s", DEFAULT_TOLERANCE_S)),
    )


def load_public_key(text: str) -> ec.EllipticCurvePublicKey:
    """An EC P-256 public key from base64 DER SubjectPublicKeyInfo or PEM text."""
    if not isinstance(text, str) or not text.strip():
        raise SourceConfigError("public_key: must be a non-empty string")
    try:
        if "-----BEGIN" in text:
            key = load_pem_public_key(text.strip().encode("ascii"))
        else:
            key = load_der_public_key(base64.b64decode("".join(text.split()), validate=True))
    except (ValueError, UnsupportedAlgorithm):
        raise SourceConfigError(
            "public_key: not a base64 DER or PEM public key") from None
    if not (isinstance(key, ec.EllipticCurvePublicKey)
            and isinstance(key.curve, ec.SECP256R1)):
        raise SourceConfigError("public_key: must be an EC P-256 (prime256v1) public key")
    return key


def parse_tolerance(value: Any) -> float:
    """`tolerance_s` as a positive, finite number of seconds."""
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not math.isfinite(value) or value <= 0):
        raise SourceConfigError("tolerance_s: must be a positive number of seconds")
    return float(value)
