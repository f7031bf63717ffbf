"""A delivery event as the pipeline sees it, whatever provider reported it.

Adapters (adapters/esp/) verify a webhook request and turn each provider event
into one `DeliveryEvent`: the provider's own event id (the dedup key) when it
has one, the provider's type and our normalised `EventType`, the signed event
time, the ids that correlate it with an outbound message, the recipient, the
bounce classification, the unsubscribe scope, and the provider's event object
as parsed (`payload`). The pipeline minimises the payload before it is stored
(`minimise_payload`), hashes recipients (`address_hash`), and derives the
dedup key for providers without event ids (`dedup_key`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

import orjson

__all__ = [
    "BounceType",
    "DeliveryEvent",
    "EventType",
    "address_hash",
    "dedup_key",
    "minimise_payload",
]


class EventType(StrEnum):
    """Normalised event types. `UNKNOWN` keeps the provider's type in `provider_type`."""

    ACCEPTED = "accepted"  # the provider took the message for delivery
    DELIVERED = "delivered"  # the receiving server accepted it
    DEFERRED = "deferred"  # temporary failure, the provider retries
    BOUNCED = "bounced"  # delivery failed (see BounceType)
    COMPLAINED = "complained"  # the recipient marked it as spam (feedback loop)
    OPENED = "opened"
    CLICKED = "clicked"
    UNSUBSCRIBED = "unsubscribed"  # from a list/purpose (`DeliveryEvent.list_id`)
    SUPPRESSED = "suppressed"  # the provider refused to send (address on its own list)
    REJECTED = "rejected"  # the provider refused the message itself (policy, virus)
    UNKNOWN = "unknown"


class BounceType(StrEnum):
    """Bounce classification. Only PERMANENT suppresses an address."""

    PERMANENT = "permanent"
    TRANSIENT = "transient"
    UNDETERMINED = "undetermined"


@dataclass(frozen=True, slots=True, kw_only=True)
class DeliveryEvent:
    """One provider event, verified and normalised.

    `provider_event_id` is the provider's unique id of this event (webhook-id /
    svix-id, SNS MessageId, sg_event_id, Mailgun event-data.id); None when the
    provider has none (Postmark), and then `dedup_key` fingerprints the event.
    `occurred_at` is the event time from the signed content (tz-aware); None only
    when the provider gives none, and then the receive time is used.
    `provider_message_id` is the provider's id of the sent message (SES
    mail.messageId, sg_message_id, Postmark MessageID, Resend email_id);
    `message_id_header` the RFC 5322 Message-ID of the sent message when the
    event carries it. `list_id` scopes an unsubscribe (SendGrid asm_group_id,
    Postmark MessageStream, SES topic …); None scopes it to the whole source.
    `payload` is the provider's event object as parsed: fingerprinted whole,
    stored only through the source's field allowlist.
    """

    provider_event_id: str | None
    provider_type: str
    event_type: EventType
    occurred_at: datetime | None
    provider_message_id: str | None = None
    message_id_header: str | None = None
    recipient: str | None = None
    bounce_type: BounceType | None = None
    bounce_subtype: str | None = None
    list_id: str | None = None
    payload: Mapping[str, Any] = field(default_factory=dict)


def address_hash(address: str) -> str:
    """sha256 hex of the UTF-8 of the space-trimmed, lower-cased address: how
    recipients are keyed.

    An application checks a suppression with the same function, or in SQL
    `encode(sha256(convert_to(lower(btrim(addr)), 'UTF8')), 'hex')` (btrim and
    strip(" ") remove the same spaces; lower() agrees for ASCII addresses and in
    UTF-8 locales).
    """
    return hashlib.sha256(address.strip(" ").lower().encode("utf-8")).hexdigest()


def dedup_key(event: DeliveryEvent) -> str:
    """The event's dedup key within its source.

    The provider's event id when there is one (`id:` prefix). Otherwise a
    conservative fingerprint (`fp:` prefix): sha256 over the provider type and
    the whole provider event object, keys sorted. A retried delivery of the same
    event has identical content and so the same key; any difference at all
    gives another key, so two distinct events are never taken for one — at
    worst a re-sent event whose provider changed a field is stored twice, which
    the evidence rules (first/last times) absorb.
    """
    if event.provider_event_id:
        return "id:" + event.provider_event_id
    canonical = orjson.dumps(
        {"type": event.provider_type, "event": event.payload},
        option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS,
        default=str,
    )
    return "fp:" + hashlib.sha256(canonical).hexdigest()


def minimise_payload(payload: Mapping[str, Any], fields: Iterable[str]) -> dict[str, Any]:
    """Only the allowlisted fields of `payload`, as dotted paths (`bounce.bounceType`).

    A path that is absent is skipped; a path to an object keeps the whole object,
    so allowlists name leaves.
    """
    kept: dict[str, Any] = {}
    for path in fields:
        parts = path.split(".")
        value: Any = payload
        for part in parts:
            if not isinstance(value, Mapping) or part not in value:
                break
            value = value[part]
        else:
            target = kept
            for part in parts[:-1]:
                target = target.setdefault(part, {})
            target[parts[-1]] = value
    return kept
