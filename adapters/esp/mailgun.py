"""Mailgun webhooks (JSON form): verify the HMAC of timestamp+token, normalise event-data.

Protocol (Mailgun "Securing Webhooks",
https://documentation.mailgun.com/docs/mailgun/user-manual/webhooks/securing-webhooks):

    POST, Content-Type: application/json
    {"signature": {"timestamp": "<Unix seconds>", "token": "<50 random chars>",
                   "signature": hex(HMAC-SHA256(signing_key, timestamp + token)),
                   "parent-signature": …only for a subaccount's domain},
     "event-data": {…one event…}}

Only the legacy multipart/form-data webhooks sign form fields instead; they
are not supported (content type application/json only).

The scheme signs two fields, not the body, so the body is parsed first. Until
the signature is checked nothing in the body is trusted, and every way the
body can fail to carry a usable signature — not JSON, not an object, no
`signature` object, a field missing or of the wrong type — is
VerificationFailed (401), exactly like a wrong signature: the answer never
depends on whether the key is right, and a request that cannot be proven to
come from Mailgun is not stored. After verification, an `event-data` that is
not the documented shape is MalformedPayload (400).

Bounds (adapters/esp/fields.py): after verification, an event-data nested
deeper than MAX_JSON_DEPTH, an id over MAX_ID_CHARS, a time outside the
event-time range or NUL in a field read is MalformedPayload (400). A token
longer than MAX_TOKEN_CHARS or holding NUL is VerificationFailed: Mailgun's
are 50 characters, and the token is stored (hashed) as the replay key.

`accept` checks: timestamp within the tolerance of the receive time → HMAC
(constant-time). For a subaccount's domain Mailgun adds `parent-signature`,
the same HMAC under the primary account's key; either one matching the
configured key verifies. The token is handed up as `Accepted.replay_token`:
the route refuses a token it has accepted before, which is what makes a
captured request useless within the tolerance window.

Normalisation (Mailgun "Event Types",
https://documentation.mailgun.com/docs/mailgun/user-manual/events/event-types):

    accepted → ACCEPTED        delivered → DELIVERED       rejected → REJECTED
    opened   → OPENED          clicked   → CLICKED         complained → COMPLAINED
    unsubscribed → UNSUBSCRIBED, list_id = event-data.mailing-list.address when
                   present (a mailing-list unsubscribe), else None (the source)
    failed, severity temporary → DEFERRED (Mailgun retries)
    failed, severity permanent:
        reason suppress-bounce / suppress-unsubscribe / suppress-complaint
            → SUPPRESSED (Mailgun did not try: the address is on its list)
        reason old (retry limit reached after temporary failures) or espblock
            (the receiving ESP refused the sender/content) → BOUNCED, TRANSIENT:
            the address is not shown to be bad, and Mailgun itself does not add
            these to its bounce list (Suppressions API: only permanent recipient
            mailbox errors are)
        any other reason (bounce, delayed-bounce, generic, …) → BOUNCED, PERMANENT
    failed, other or no severity → BOUNCED, UNDETERMINED
    anything else (stored, list_member_uploaded, …) → UNKNOWN with the raw type

`bounce_subtype` is delivery-status.code (the SMTP code, e.g. "550"), else
the reason. Ids: the event id is `{event-data.id}:{timestamp}`. Mailgun's
event id is unique only within about a day (Mailgun "Event Structure";
django-anymail's Mailgun notes), so the id alone would deduplicate two
different events that happen to share it on different days. `timestamp` is
`repr(float(event-data.timestamp))`, e.g. "1403645210.123": the shortest
round-trip form depends only on the number, so a redelivery of the same event
gets the same id even if it is serialised differently (`1521472262.5` vs
`1.5214722625e9`, or an integer). The text as sent is not kept by orjson, and
a second parse just to recover it would cost more than it buys. An event
without an id or a timestamp has no event id and is fingerprinted. The
Message-ID header
(event-data.message.headers.message-id, without angle brackets) is both
`message_id_header` and `provider_message_id`, because Mailgun's message id
is that header. `payload` is `{"event-data": …}` — the signature is left out,
so a redelivery (new token) of an event without an id fingerprints the same.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

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
    read_unix_time,
    required_str,
)

__all__ = ["MailgunReceiver", "from_config"]

_CONFIG_KEYS = frozenset({"signing_key", "tolerance_s"})

#: Prefix of MalformedPayload messages about the event object.
_WHERE = "event-data."
_TIMESTAMP = "event-data.timestamp"
#: Longest signature token accepted: Mailgun's are 50 characters ("Securing
#: Webhooks"); the bound keeps the replay key (hashed, but first read and hashed
#: per request) small.
MAX_TOKEN_CHARS = 256

_SIMPLE_TYPES: dict[str, EventType] = {
    "accepted": EventType.ACCEPTED,
    "delivered": EventType.DELIVERED,
    "rejected": EventType.REJECTED,
    "opened": EventType.OPENED,
    "clicked": EventType.CLICKED,
    "complained": EventType.COMPLAINED,
    "unsubscribed": EventType.UNSUBSCRIBED,
}

#: Permanent-failure reasons for addresses already on a Mailgun suppression list.
_SUPPRESSION_REASONS = frozenset(
    {
        "suppress-bounce",
        "suppress-unsubscribe",
        "suppress-complaint",
    }
)

#: Permanent-failure reasons that do not show the address is bad (module docstring).
_NOT_ADDRESS_REASONS = frozenset({"old", "espblock"})


@dataclass(frozen=True, slots=True)
class MailgunReceiver:
    """One Mailgun webhook of a tenant, verified with its webhook signing key."""

    provider: ClassVar[str] = "mailgun"
    content_types: ClassVar[frozenset[str]] = frozenset({"application/json"})
    #: No addresses (recipient, envelope, message headers, mailing list), no
    #: delivery-status message/description (they quote addresses), no
    #: user-variables (application data of unknown content).
    default_payload_fields: ClassVar[tuple[str, ...]] = (
        "event-data.event",
        "event-data.timestamp",
        "event-data.id",
        "event-data.severity",
        "event-data.reason",
        "event-data.log-level",
        "event-data.delivery-status.code",
        "event-data.delivery-status.attempt-no",
        "event-data.delivery-status.retry-seconds",
        "event-data.tags",
        "event-data.campaigns",
    )

    source_id: str
    signing_key: bytes = field(repr=False)
    tolerance_s: float = DEFAULT_TOLERANCE_S

    async def accept(self, request: WebhookRequest) -> Accepted:
        """Verify `request` and normalise its one event.

        Raises VerificationFailed when the body carries no usable signature
        object, the timestamp is out of tolerance or the HMAC does not match;
        MalformedPayload when the verified event-data is not the documented shape.
        Returns the event with the token as `replay_token`.
        """
        # Parsed before verification (the scheme signs fields, not the body):
        # an unparsable body is VerificationFailed (module docstring).
        body = parse_json_object(request.body, error=VerificationFailed)
        token = self._verify(body.get("signature"), request.received_at)
        data = body.get("event-data")
        check_depth(data, what="event-data")
        event = normalise_event(data)
        return Accepted(events=[event], replay_token=token, replay_scope=self.replay_scope)

    @property
    def replay_scope(self) -> str:
        """Where a token is single-use: every source verified by this signing key
        (Mailgun signs the token, not the event, so a token seen by one source
        must not pass at another). A fingerprint, never the key: 64 bits of the
        sha256 of a high-entropy key say nothing about it."""
        return (
            "key:" + hashlib.sha256(b"inboxd replay scope\x00" + self.signing_key).hexdigest()[:16]
        )

    def _verify(self, signature: Any, received_at: float) -> str:
        """The token of a valid `signature` object; VerificationFailed otherwise."""
        if not isinstance(signature, dict):
            raise VerificationFailed("no signature object")
        timestamp = _signed_timestamp(signature.get("timestamp"))
        token = signature.get("token")
        if not isinstance(token, str) or not token:
            raise VerificationFailed("signature.token missing")
        check_text(
            token, what="signature.token", max_chars=MAX_TOKEN_CHARS, error=VerificationFailed
        )
        candidates = [signature.get("signature"), signature.get("parent-signature")]
        offered = [value for value in candidates if isinstance(value, str) and value]
        if not offered:
            raise VerificationFailed("signature.signature missing")
        check_timestamp(timestamp, received_at, self.tolerance_s)
        expected = (
            hmac.new(
                self.signing_key,
                (timestamp + token).encode("utf-8"),
                hashlib.sha256,
            )
            .hexdigest()
            .encode("ascii")
        )
        # Compare with every offered signature (no early exit) so the time taken
        # does not tell which one, if any, matched.
        matches = [
            hmac.compare_digest(expected, value.lower().encode("utf-8")) for value in offered
        ]
        if not any(matches):
            raise VerificationFailed("signature does not verify")
        return token


def _signed_timestamp(value: Any) -> str:
    """The timestamp exactly as signed: Mailgun sends a string of digits (its
    docs also call it an int, so an integer is taken as its decimal string).
    That it is digits only is checked with the tolerance (check_timestamp)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise VerificationFailed("signature.timestamp is not Unix seconds")
    return value


def normalise_event(data: Any) -> DeliveryEvent:
    """A verified `event-data` object as a DeliveryEvent (the module docstring has the rules)."""
    if not isinstance(data, dict):
        raise MalformedPayload("event-data is missing or not an object")
    raw_type = required_str(data, "event", where=_WHERE, max_chars=MAX_ID_CHARS)
    event_type = _SIMPLE_TYPES.get(raw_type, EventType.UNKNOWN)
    bounce_type: BounceType | None = None
    bounce_subtype: str | None = None
    list_id: str | None = None
    if raw_type == "failed":
        event_type, bounce_type = classify_failure(
            optional_str(data, "severity", where=_WHERE), optional_str(data, "reason", where=_WHERE)
        )
        if event_type is EventType.BOUNCED:
            bounce_subtype = _status_code(data) or optional_str(data, "reason", where=_WHERE)
    elif raw_type == "unsubscribed":
        list_id = _mailing_list(data)
    message_id = _message_id(data)
    return DeliveryEvent(
        provider_event_id=event_id(data),
        provider_type=raw_type,
        event_type=event_type,
        occurred_at=read_unix_time(data.get("timestamp"), what=_TIMESTAMP),
        provider_message_id=message_id,
        message_id_header=message_id,
        recipient=optional_str(data, "recipient", where=_WHERE),
        bounce_type=bounce_type,
        bounce_subtype=bounce_subtype,
        list_id=list_id,
        payload={"event-data": data},
    )


def event_id(data: Mapping[str, Any]) -> str | None:
    """`{id}:{repr(float(timestamp))}` of an event-data object; None without an
    id or a timestamp (module docstring: why the timestamp, why this form of
    it). MalformedPayload when either is of the wrong type."""
    mailgun_id = optional_str(data, "id", where=_WHERE, max_chars=MAX_ID_CHARS)
    timestamp = data.get("timestamp")
    # read_unix_time refuses what is not a number in datetime's range, so
    # float() below cannot overflow.
    if not mailgun_id or read_unix_time(timestamp, what=_TIMESTAMP) is None:
        return None
    # What read_unix_time turned into a time is a number (it refuses anything else).
    assert isinstance(timestamp, int | float)
    return f"{mailgun_id}:{float(timestamp)!r}"


def classify_failure(
    severity: str | None, reason: str | None
) -> tuple[EventType, BounceType | None]:
    """EventType and BounceType of a `failed` event from its severity and reason."""
    if severity == "temporary":
        return EventType.DEFERRED, None
    if severity != "permanent":
        return EventType.BOUNCED, BounceType.UNDETERMINED
    if reason in _SUPPRESSION_REASONS:
        return EventType.SUPPRESSED, None
    if reason in _NOT_ADDRESS_REASONS:
        return EventType.BOUNCED, BounceType.TRANSIENT
    return EventType.BOUNCED, BounceType.PERMANENT


def _status_code(data: Mapping[str, Any]) -> str | None:
    status = data.get("delivery-status")
    if not isinstance(status, dict):
        return None
    code = status.get("code")
    if isinstance(code, int) and not isinstance(code, bool):
        return str(code)
    if isinstance(code, str) and code:
        return check_text(code, what="event-data.delivery-status.code")
    return None


def _mailing_list(data: Mapping[str, Any]) -> str | None:
    mailing_list = data.get("mailing-list")
    if not isinstance(mailing_list, dict):
        return None
    address = mailing_list.get("address")
    if isinstance(address, str):
        check_text(address, what="event-data.mailing-list.address", max_chars=MAX_ID_CHARS)
    return address if isinstance(address, str) and address else None


def _message_id(data: Mapping[str, Any]) -> str | None:
    message = data.get("message")
    headers = message.get("headers") if isinstance(message, dict) else None
    value = headers.get("message-id") if isinstance(headers, dict) else None
    if value is None:
        return None
    if not isinstance(value, str):
        raise MalformedPayload("message.headers.message-id is not a string")
    # Also provider_message_id (module docstring), a key of the evidence index.
    check_text(value, what="message.headers.message-id", max_chars=MAX_MESSAGE_ID_CHARS)
    return value or None


def from_config(source_id: str, table: Mapping[str, Any], reveal: Reveal) -> MailgunReceiver:
    """Build the source from its `[[delivery_sources]]` table.

    Keys: `signing_key` (required, the HTTP webhook signing key; a secret, so
    normally a reference revealed through `reveal`) and `tolerance_s`
    (optional, seconds, default DEFAULT_TOLERANCE_S). COMMON_KEYS are ignored.
    Raises DeliveryConfigError naming the key; the key's value never appears.
    """
    refuse_unknown_keys(table, _CONFIG_KEYS, MailgunReceiver.provider)
    if "signing_key" not in table:
        raise DeliveryConfigError("signing_key: required")
    signing_key = reveal(table["signing_key"])
    if not isinstance(signing_key, str) or not signing_key.strip():
        raise DeliveryConfigError("signing_key: must be a non-empty string")
    return MailgunReceiver(
        source_id=source_id,
        signing_key=signing_key.strip().encode("utf-8"),
        tolerance_s=read_tolerance(table),
    )
