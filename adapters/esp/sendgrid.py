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

One bad event does not cost the batch. A body that is not a JSON array, or an
element that is not an object, is MalformedPayload (400): the request is not
an Event Webhook post at all. But an event object that cannot be normalised
(a field of the wrong type, a group_unsubscribe without asm_group_id) becomes
an UNKNOWN event with `provider_type` "malformed:<event or ?>", the
`sg_event_id` when it is a string (else None, so the pipeline fingerprints
it), no time, and the raw object as payload; the rest of the batch is
normalised as usual. Refusing the batch instead would lose its good events:
SendGrid retries any non-2xx answer for up to 24 hours ("Troubleshooting the
Event Webhook"), every retry fails the same way, and then the batch is dropped.
The field bounds of adapters/esp/fields.py are checked the same way, event by
event: an `sg_event_id` longer than MAX_ID_CHARS, a `timestamp` outside the
event-time range, an event nested deeper than MAX_JSON_DEPTH (`category`,
`unique_args`), NUL in a field — each makes that one event a malformed UNKNOWN
(its id dropped, so it is fingerprinted; its raw type trimmed to
MAX_ID_CHARS and cleaned) while the batch's good events are stored as usual.

Each of the two headers must come once; a repeated one is refused before the
signature is checked (401, like a bad signature): SendGrid sends one of each,
and with two the signed pair is ambiguous.

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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import (
    load_der_public_key,
    load_pem_public_key,
)

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
    load_json,
    optional_str,
    read_unix_time,
    required_str,
    single_header,
)

__all__ = ["SendGridReceiver", "from_config"]

SIGNATURE_HEADER = "x-twilio-email-event-webhook-signature"
TIMESTAMP_HEADER = "x-twilio-email-event-webhook-timestamp"

_CONFIG_KEYS = frozenset({"public_key", "tolerance_s"})

#: `provider_type` prefix of an event object that could not be normalised.
MALFORMED_PREFIX = "malformed:"
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
_SENDER_SIDE_CLASSIFICATIONS = frozenset(
    {
        "Content",
        "Reputation",
        "Frequency or Volume Too High",
        "Technical Failure",
    }
)

#: `reason`s of a dropped event that name one of SendGrid's suppression lists
#: (SendGrid "Drops" docs: unsubscribe, spam report, invalid emails, bounces).
_SUPPRESSION_DROP_REASONS = frozenset(
    {
        "Bounced Address",
        "Unsubscribed Address",
        "Spam Reporting Address",
        "Invalid",
    }
)


@dataclass(frozen=True, slots=True)
class SendGridReceiver:
    """One SendGrid Event Webhook of a tenant, verified with its public key."""

    provider: ClassVar[str] = "sendgrid"
    content_types: ClassVar[frozenset[str]] = frozenset({"application/json"})
    #: Ids, types, times and classifications only: `email`, `ip`, `useragent`,
    #: `url`, `reason` and `response` can quote addresses or identify a person.
    default_payload_fields: ClassVar[tuple[str, ...]] = (
        "event",
        "timestamp",
        "sg_event_id",
        "sg_message_id",
        "type",
        "bounce_classification",
        "status",
        "asm_group_id",
        "category",
        "attempt",
        "tls",
        "sg_machine_open",
    )

    source_id: str
    public_key: ec.EllipticCurvePublicKey = field(repr=False)
    tolerance_s: float = DEFAULT_TOLERANCE_S

    async def accept(self, request: WebhookRequest) -> Accepted:
        """Verify `request` and normalise its batch.

        Raises VerificationFailed (missing or malformed headers, timestamp out of
        tolerance, bad signature) before looking at the body, then
        MalformedPayload when the verified body is not an array of event objects.
        An event object that cannot be normalised does not fail the batch
        (module docstring).
        """
        self._verify(request)
        return Accepted(events=normalise_batch(parse_batch(request.body)))

    def _verify(self, request: WebhookRequest) -> None:
        signature_b64 = single_header(request.headers, SIGNATURE_HEADER)
        timestamp = single_header(request.headers, TIMESTAMP_HEADER)
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
                signature,
                timestamp.encode("ascii") + request.body,
                _SIGNATURE_ALGORITHM,
            )
        except InvalidSignature:
            raise VerificationFailed("signature does not verify") from None


def parse_batch(body: bytes) -> list[Mapping[str, Any]]:
    """The events of a verified body; MalformedPayload unless a JSON array of objects."""
    parsed = load_json(body)
    if not isinstance(parsed, list):
        raise MalformedPayload("body is not a JSON array")
    for index, item in enumerate(parsed):
        if not isinstance(item, dict):
            raise MalformedPayload(f"event {index} is not an object")
    return parsed


def normalise_batch(items: list[Mapping[str, Any]]) -> list[DeliveryEvent]:
    """The events of a parsed batch, in order; one that cannot be normalised is
    kept as a malformed UNKNOWN event (module docstring) instead of failing all."""
    events = []
    for item in items:
        try:
            events.append(normalise_event(item))
        except MalformedPayload:
            events.append(malformed_event(item))
    return events


def malformed_event(item: Mapping[str, Any]) -> DeliveryEvent:
    """The UNKNOWN stand-in for an event object `normalise_event` refused.

    Only what cannot be wrong is read: the raw `event` and `sg_event_id`, each
    when it is a non-empty string. Recipient and message ids stay None, so it
    can neither suppress an address nor change a message's delivery evidence.
    An `sg_event_id` that fields.check_text refuses (too long, NUL) is dropped,
    so the event is fingerprinted — a trimmed id could collide with another
    event's real one; the raw type is kept trimmed and cleaned, so it says
    what the provider sent. The pipeline stores the payload depth-bounded.
    """
    raw_type = item.get("event")
    sg_event_id = item.get("sg_event_id")
    return DeliveryEvent(
        provider_event_id=sg_event_id if _usable_id(sg_event_id) else None,
        provider_type=MALFORMED_PREFIX + _safe_type(raw_type),
        event_type=EventType.UNKNOWN,
        occurred_at=None,
        payload=item,
    )


def _usable_id(value: Any) -> bool:
    if not isinstance(value, str) or not value:
        return False
    try:
        check_text(value, what="sg_event_id", max_chars=MAX_ID_CHARS)
    except MalformedPayload:
        return False
    return True


def _safe_type(raw_type: Any) -> str:
    """The raw `event` as text PostgreSQL stores: trimmed to MAX_ID_CHARS, NUL and
    lone surrogates replaced; "?" when it is not a non-empty string."""
    if not isinstance(raw_type, str) or not raw_type:
        return "?"
    trimmed = raw_type[:MAX_ID_CHARS].replace("\x00", "\ufffd")
    return trimmed.encode("utf-8", "replace").decode("utf-8")


def normalise_event(item: Mapping[str, Any]) -> DeliveryEvent:
    """One SendGrid event object as a DeliveryEvent (the module docstring has the
    rules); MalformedPayload when a field has the wrong type or is out of bounds,
    or a group event has no group."""
    check_depth(item, what="event")
    raw_type = required_str(item, "event", max_chars=MAX_ID_CHARS)
    event_type = _SIMPLE_TYPES.get(raw_type, EventType.UNKNOWN)
    bounce_type: BounceType | None = None
    bounce_subtype: str | None = None
    list_id: str | None = None
    if raw_type == "bounce":
        event_type = EventType.BOUNCED
        bounce_type = classify_bounce(
            optional_str(item, "type"), optional_str(item, "bounce_classification")
        )
        bounce_subtype = optional_str(item, "bounce_classification") or optional_str(item, "status")
    elif raw_type == "dropped":
        event_type = classify_drop(optional_str(item, "reason"))
    elif raw_type == "group_unsubscribe":
        event_type = EventType.UNSUBSCRIBED
        list_id = f"asm:{_asm_group_id(item)}"
    return DeliveryEvent(
        provider_event_id=optional_str(item, "sg_event_id", max_chars=MAX_ID_CHARS),
        provider_type=raw_type,
        event_type=event_type,
        occurred_at=read_unix_time(item.get("timestamp")),
        provider_message_id=x_message_id(
            optional_str(item, "sg_message_id", max_chars=MAX_ID_CHARS)
        ),
        message_id_header=optional_str(item, "smtp-id", max_chars=MAX_MESSAGE_ID_CHARS),
        recipient=optional_str(item, "email"),
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
        return check_text(value, what="asm_group_id", max_chars=MAX_ID_CHARS)
    # A group event without its group cannot be scoped; widening it to the
    # whole source would over-suppress, so the event is refused instead (and
    # kept as a malformed UNKNOWN event, module docstring).
    raise MalformedPayload("group_unsubscribe without asm_group_id")


def from_config(source_id: str, table: Mapping[str, Any], reveal: Reveal) -> SendGridReceiver:
    """Build the source from its `[[delivery_sources]]` table.

    Keys: `public_key` (required; base64 DER SubjectPublicKeyInfo as SendGrid
    shows it, or a PEM; may be a secret reference) and `tolerance_s` (optional,
    seconds, default DEFAULT_TOLERANCE_S). COMMON_KEYS are ignored. Raises
    DeliveryConfigError naming the key for an unknown key, a missing key, or a
    key that is not an EC P-256 public key.
    """
    refuse_unknown_keys(table, _CONFIG_KEYS, SendGridReceiver.provider)
    if "public_key" not in table:
        raise DeliveryConfigError("public_key: required")
    return SendGridReceiver(
        source_id=source_id,
        public_key=load_public_key(reveal(table["public_key"])),
        tolerance_s=read_tolerance(table),
    )


def load_public_key(text: str) -> ec.EllipticCurvePublicKey:
    """An EC P-256 public key from base64 DER SubjectPublicKeyInfo or PEM text."""
    if not isinstance(text, str) or not text.strip():
        raise DeliveryConfigError("public_key: must be a non-empty string")
    try:
        if "-----BEGIN" in text:
            key = load_pem_public_key(text.strip().encode("ascii"))
        else:
            key = load_der_public_key(base64.b64decode("".join(text.split()), validate=True))
    except (ValueError, UnsupportedAlgorithm):
        raise DeliveryConfigError("public_key: not a base64 DER or PEM public key") from None
    if not (isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, ec.SECP256R1)):
        raise DeliveryConfigError("public_key: must be an EC P-256 (prime256v1) public key")
    return key
