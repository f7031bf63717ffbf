"""Postmark: unsigned delivery webhooks, protected by HTTP Basic credentials.

Protocol (https://postmarkapp.com/developer/webhooks/webhooks-overview): Postmark
signs nothing. The webhook URL carries credentials (`https://user:pass@host/…`),
which Postmark sends as `Authorization: Basic base64(user:pass)` (RFC 7617).
`accept` decodes that header and compares user name and password with the
configured ones, both always, in constant time (over SHA-256 digests, so the
lengths do not leak either), then parses the body: one JSON object, one event,
told apart by `RecordType`:

    Delivery            DeliveredAt   Recipient            → DELIVERED
    Bounce              BouncedAt     Email, Type, ID      → BOUNCED (BOUNCE_TYPES)
    SpamComplaint       BouncedAt     Email, ID            → COMPLAINED
    Open / Click        ReceivedAt    Recipient            → OPENED / CLICKED
    SubscriptionChange  ChangedAt     Recipient, SuppressSending, SuppressionReason
                                                           → see SUBSCRIPTION_CHANGES

Postmark gives events no id; only bounces and spam complaints carry the bounce
`ID`, which becomes `bounce:{ID}`. Every other event has `provider_event_id`
None and the pipeline fingerprints it. A RecordType not listed is
`EventType.UNKNOWN`; so are the parts of a known RecordType that are not a
delivery outcome, with `provider_type` `"{RecordType}:{detail}"` saying which.

Bounds (adapters/esp/fields.py): a body nested deeper than MAX_JSON_DEPTH
(`Metadata` is the sender's own), an event time outside the event-time range,
an id or type over MAX_ID_CHARS, NUL in a field read: MalformedPayload (400),
nothing stored. A repeated Authorization header is VerificationFailed (401):
RFC 9110 §11.6.2 gives it one value, and two leave open which one to check.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Mapping
from typing import Any

from inboxd.pipeline.delivery.model import BounceType, DeliveryEvent, EventType

from .base import (
    Accepted,
    DeliveryConfigError,
    MalformedPayload,
    Reveal,
    VerificationFailed,
    WebhookRequest,
)
from .config import refuse_unknown_keys
from .fields import (
    MAX_FIELD_CHARS,
    MAX_ID_CHARS,
    check_depth,
    check_text,
    parse_json_object,
    read_iso_time,
    single_header,
)

__all__ = ["BOUNCE_TYPES", "PostmarkReceiver"]

#: Authorization scheme Postmark uses for URL credentials (RFC 7617 §2; the scheme
#: name is case-insensitive, RFC 9110 §11.1).
BASIC_SCHEME = "basic"

#: RecordType → event type, for the record types whose type needs no further look.
RECORD_TYPES: Mapping[str, EventType] = {
    "Delivery": EventType.DELIVERED,
    "SpamComplaint": EventType.COMPLAINED,
    "Open": EventType.OPENED,
    "Click": EventType.CLICKED,
}

#: The field holding each RecordType's event time (Postmark webhook docs: "The
#: datetime for the … field will be in ISO 8601 format").
TIME_FIELDS: Mapping[str, str] = {
    "Delivery": "DeliveredAt",
    "Bounce": "BouncedAt",
    "SpamComplaint": "BouncedAt",
    "Open": "ReceivedAt",
    "Click": "ReceivedAt",
    "SubscriptionChange": "ChangedAt",
}

#: Postmark bounce `Type` → classification, from the bounce-type table of
#: https://postmarkapp.com/developer/api/bounce-api#bounce-types. PERMANENT (the
#: only class that suppresses) is kept to types that condemn the address itself:
#: HardBounce (1, "unknown user, mailbox not found"), BadEmailAddress (100000,
#: "not a valid email address"), ManuallyDeactivated (100002, Postmark will not
#: send to it). TRANSIENT: failures that clear without the address changing —
#: Transient (2, "message delayed"), DnsError (256, "a temporary DNS error"),
#: SoftBounce (4096, "mailbox full, account disabled, exceeds quota"), and the
#: sender-side refusals Blocked (100006, ISP block for content or blacklisting)
#: and DMARCPolicy (100009), which say nothing against the address. Every other
#: type (Unknown, SpamNotification, VirusNotification, Unconfirmed,
#: SMTPApiError, TemplateRenderingFailed, any new one) is UNDETERMINED.
BOUNCE_TYPES: Mapping[str, BounceType] = {
    "HardBounce": BounceType.PERMANENT,
    "BadEmailAddress": BounceType.PERMANENT,
    "ManuallyDeactivated": BounceType.PERMANENT,
    "Transient": BounceType.TRANSIENT,
    "DnsError": BounceType.TRANSIENT,
    "SoftBounce": BounceType.TRANSIENT,
    "Blocked": BounceType.TRANSIENT,
    "DMARCPolicy": BounceType.TRANSIENT,
}

#: Bounce `Type`s that are replies, not failed deliveries (same table: automatic
#: responders, address-change notices, challenge-response mails, subscribe and
#: unsubscribe requests mailed back, open-relay probes). They become UNKNOWN
#: (`Bounce:{Type}`) rather than bounces: an out-of-office reply is not evidence
#: against a delivery.
NOT_FAILURES = frozenset(
    {
        "AutoResponder",
        "AddressChange",
        "ChallengeVerification",
        "Subscribe",
        "Unsubscribe",
        "OpenRelayTest",
    }
)

#: SubscriptionChange with `SuppressSending: true`, by `SuppressionReason`
#: (https://postmarkapp.com/developer/webhooks/subscription-change-webhook).
#: ManualSuppression is an unsubscribe (link, List-Unsubscribe, or the customer
#: suppressing the address) scoped to the message stream. HardBounce and
#: SpamComplaint suppressions are reported again here — for broadcast streams,
#: which have no Bounce webhook, only here. `SuppressSending: false` (the address
#: was reactivated) has no event type of its own: UNKNOWN,
#: `SubscriptionChange:resubscribe`.
SUBSCRIPTION_CHANGES: Mapping[str, tuple[EventType, BounceType | None]] = {
    "ManualSuppression": (EventType.UNSUBSCRIBED, None),
    "HardBounce": (EventType.BOUNCED, BounceType.PERMANENT),
    "SpamComplaint": (EventType.COMPLAINED, None),
}

#: Paths kept in `delivery_events.payload` by default: types, ids, flags, times.
#: No addresses (Email, Recipient, From), subject, bounce dump (Content), SMTP
#: Details, Metadata, click link, user agent or Geo/IP.
DEFAULT_PAYLOAD_FIELDS: tuple[str, ...] = (
    "RecordType",
    "MessageStream",
    "ServerID",
    "ID",
    "Type",
    "TypeCode",
    "Inactive",
    "CanActivate",
    "SuppressSending",
    "SuppressionReason",
    "Origin",
    "FirstOpen",
    "Tag",
    "DeliveredAt",
    "BouncedAt",
    "ReceivedAt",
    "ChangedAt",
)

_CONFIG_KEYS = frozenset({"username", "password"})


class PostmarkReceiver:
    """A Postmark server's webhooks, checked against one user name and password."""

    provider = "postmark"
    content_types = frozenset({"application/json"})
    default_payload_fields = DEFAULT_PAYLOAD_FIELDS

    __slots__ = ("_password_digest", "_username_digest", "source_id")

    def __init__(self, source_id: str, username: str, password: str) -> None:
        if not username:
            raise DeliveryConfigError("username: required")
        if ":" in username:
            # RFC 7617 §2: the user-id cannot contain a colon.
            raise DeliveryConfigError("username: must not contain ':'")
        if not password:
            raise DeliveryConfigError("password: required")
        self.source_id = source_id
        # Only digests are kept: they are what is compared, and they are not the secret.
        self._username_digest = _digest(username.encode())
        self._password_digest = _digest(password.encode())

    @classmethod
    def from_config(
        cls,
        source_id: str,
        table: Mapping[str, Any],
        reveal: Reveal,
    ) -> PostmarkReceiver:
        """Build a source from its `[[delivery_sources]]` table.

        Keys: `username` (plain or secret reference) and `password` (secret
        reference), both required and passed through `reveal`. `COMMON_KEYS` are
        ignored. Raises DeliveryConfigError naming the key, never a value.
        """
        refuse_unknown_keys(table, _CONFIG_KEYS, cls.provider)
        for key in ("username", "password"):
            if table.get(key) is None:
                raise DeliveryConfigError(f"{key}: required")
        return cls(source_id, reveal(table["username"]), reveal(table["password"]))

    def __repr__(self) -> str:
        return f"PostmarkReceiver(source_id={self.source_id!r})"

    async def accept(self, request: WebhookRequest) -> Accepted:
        """Check the Basic credentials, then parse and normalise the one event.

        Raises VerificationFailed (header missing or malformed, wrong
        credentials) or MalformedPayload (not a JSON object with a RecordType).
        """
        check_credentials(
            single_header(request.headers, "authorization"),
            self._username_digest,
            self._password_digest,
        )
        payload = parse_json_object(request.body)
        check_depth(payload)
        return Accepted(events=[normalise(payload)])


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def check_credentials(header: str | None, username_digest: bytes, password_digest: bytes) -> None:
    """Refuse unless `header` is `Basic` credentials matching both digests.

    Both comparisons always run and are combined without short-circuit, so the
    time taken does not say which one failed. Raises VerificationFailed.
    """
    if not header:
        raise VerificationFailed("missing Authorization header")
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != BASIC_SCHEME:
        raise VerificationFailed("Authorization scheme is not Basic")
    token = token.strip()
    if not token:
        raise VerificationFailed("empty Basic credentials")
    try:
        decoded = base64.b64decode(token, validate=True)
    except (binascii.Error, ValueError):
        raise VerificationFailed("Basic credentials are not base64") from None
    username, colon, password = decoded.partition(b":")
    if not colon:
        raise VerificationFailed("Basic credentials have no ':'")
    username_ok = hmac.compare_digest(_digest(username), username_digest)
    password_ok = hmac.compare_digest(_digest(password), password_digest)
    if not (username_ok & password_ok):
        raise VerificationFailed("wrong Basic credentials")


def normalise(payload: dict[str, Any]) -> DeliveryEvent:
    """The DeliveryEvent of one Postmark webhook object."""
    record_type = payload.get("RecordType")
    if not isinstance(record_type, str) or not record_type:
        raise MalformedPayload("RecordType is missing or not a string")
    check_text(record_type, what="RecordType", max_chars=MAX_ID_CHARS)
    provider_type, event_type, bounce_type, bounce_subtype, list_id = classify(record_type, payload)
    time_field = TIME_FIELDS.get(record_type)
    return DeliveryEvent(
        provider_event_id=bounce_event_id(record_type, payload),
        provider_type=provider_type,
        event_type=event_type,
        occurred_at=read_iso_time(payload.get(time_field)) if time_field else None,
        provider_message_id=_text(payload.get("MessageID"), "MessageID", MAX_ID_CHARS),
        recipient=_text(payload.get("Recipient"), "Recipient")
        or _text(payload.get("Email"), "Email"),
        bounce_type=bounce_type,
        bounce_subtype=bounce_subtype,
        list_id=list_id,
        payload=payload,
    )


def classify(
    record_type: str,
    payload: Mapping[str, Any],
) -> tuple[str, EventType, BounceType | None, str | None, str | None]:
    """(provider_type, event_type, bounce_type, bounce_subtype, list_id) of one event."""
    if record_type == "Bounce":
        kind = _text(payload.get("Type"), "Type", MAX_ID_CHARS)
        if kind in NOT_FAILURES:
            return f"Bounce:{kind}", EventType.UNKNOWN, None, None, None
        bounce_type = BOUNCE_TYPES.get(kind or "", BounceType.UNDETERMINED)
        return record_type, EventType.BOUNCED, bounce_type, kind, None
    if record_type == "SubscriptionChange":
        return classify_subscription_change(payload)
    return record_type, RECORD_TYPES.get(record_type, EventType.UNKNOWN), None, None, None


def classify_subscription_change(
    payload: Mapping[str, Any],
) -> tuple[str, EventType, BounceType | None, str | None, str | None]:
    """SubscriptionChange by SuppressSending and SuppressionReason (SUBSCRIPTION_CHANGES)."""
    suppress = payload.get("SuppressSending")
    if suppress is False:
        return "SubscriptionChange:resubscribe", EventType.UNKNOWN, None, None, None
    reason = _text(payload.get("SuppressionReason"), "SuppressionReason")
    if suppress is not True or reason is None or reason not in SUBSCRIPTION_CHANGES:
        return "SubscriptionChange", EventType.UNKNOWN, None, None, None
    event_type, bounce_type = SUBSCRIPTION_CHANGES[reason]
    if event_type is EventType.UNSUBSCRIBED:
        stream = _text(payload.get("MessageStream"), "MessageStream", MAX_ID_CHARS)
        return "SubscriptionChange", event_type, None, None, stream
    bounce_subtype = reason if event_type is EventType.BOUNCED else None
    return "SubscriptionChange", event_type, bounce_type, bounce_subtype, None


def bounce_event_id(record_type: str, payload: Mapping[str, Any]) -> str | None:
    """`bounce:{ID}` for a Bounce or SpamComplaint that has an ID; else None."""
    if record_type not in ("Bounce", "SpamComplaint"):
        return None
    bounce_id = payload.get("ID")
    if isinstance(bounce_id, bool) or not isinstance(bounce_id, int | str):
        return None
    text = check_text(str(bounce_id).strip(), what="ID", max_chars=MAX_ID_CHARS)
    return f"bounce:{text}" if text else None


def _text(value: Any, what: str = "field", max_chars: int = MAX_FIELD_CHARS) -> str | None:
    """A non-empty string field, stripped; None for anything else. MalformedPayload
    when fields.check_text refuses it (`what` names the field)."""
    if isinstance(value, str) and value.strip():
        return check_text(value.strip(), what=what, max_chars=max_chars)
    return None
