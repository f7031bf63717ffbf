"""SES events, normalised: what one verified SNS notification of SES says, as
DeliveryEvents (one per recipient), read strictly (adapters/esp/fields.py).

SES publishes mail events in two shapes (notifications with `notificationType`,
event publishing with `eventType`); both are read. Suppression-list bounces and
complaints are the provider's refusal, not the recipient's; a subscription
event's topic preferences become list unsubscribes. The receiver that verifies
the SNS message is adapters/esp/ses.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from inboxd.adapters.esp.base import (
    MalformedPayload,
)
from inboxd.adapters.esp.fields import (
    MAX_FIELD_CHARS,
    MAX_ID_CHARS,
    MAX_MESSAGE_ID_CHARS,
    check_text,
    optional_str,
    parse_iso_time,
)
from inboxd.adapters.esp.sns import (
    SnsMessage,
)
from inboxd.pipeline.delivery.model import BounceType, DeliveryEvent, EventType

_BOUNCE_TYPES: Mapping[str, BounceType] = {
    "Permanent": BounceType.PERMANENT,
    "Transient": BounceType.TRANSIENT,
    "Undetermined": BounceType.UNDETERMINED,
}
#: Bounce sub-types for mail SES never tried to deliver (its global or the
#: account's suppression list): the provider refused, the recipient did not bounce.
_SUPPRESSED_BOUNCE_SUBTYPES = frozenset({"Suppressed", "OnAccountSuppressionList"})
#: complaintSubType for mail SES accepted but did not send (account suppression list).
_SUPPRESSED_COMPLAINT_SUBTYPE = "OnAccountSuppressionList"
_OPT_OUT = "OptOut"


@dataclass(frozen=True, slots=True)
class _Draft:
    """What one SES event says about one recipient, before the common fields."""

    event_type: EventType
    recipient: str | None = None
    bounce_type: BounceType | None = None
    bounce_subtype: str | None = None
    list_id: str | None = None


def normalise(event: Mapping[str, Any], message: SnsMessage) -> list[DeliveryEvent]:
    """The delivery events of one verified SES event (see the module docstring).

    Never empty: an event whose recipient list is empty still yields one event
    without a recipient. Raises MalformedPayload.
    """
    raw_type = event.get("eventType", event.get("notificationType"))
    if not isinstance(raw_type, str) or not raw_type:
        raise MalformedPayload("ses: eventType/notificationType missing")
    check_text(raw_type, what="ses: eventType", max_chars=MAX_ID_CHARS)
    check_text(message.message_id, what="sns: MessageId", max_chars=MAX_ID_CHARS)
    mail = _object(event, "mail")
    detail, drafts = _drafts(raw_type, event, mail)
    occurred_at = (
        _timestamp(detail, "timestamp") or _timestamp(mail, "timestamp") or message.timestamp
    )
    common_headers = _object(mail, "commonHeaders")
    provider_message_id = _optional_str(mail, "messageId", max_chars=MAX_ID_CHARS)
    message_id_header = _optional_str(common_headers, "messageId", max_chars=MAX_MESSAGE_ID_CHARS)
    return [
        DeliveryEvent(
            provider_event_id=(
                message.message_id if len(drafts) == 1 else f"{message.message_id}:{index}"
            ),
            provider_type=raw_type,
            event_type=draft.event_type,
            occurred_at=occurred_at,
            provider_message_id=provider_message_id,
            message_id_header=message_id_header,
            recipient=draft.recipient,
            bounce_type=draft.bounce_type,
            bounce_subtype=draft.bounce_subtype,
            list_id=draft.list_id,
            payload=event,
        )
        for index, draft in enumerate(drafts)
    ]


def _drafts(
    raw_type: str, event: Mapping[str, Any], mail: Mapping[str, Any]
) -> tuple[Mapping[str, Any], list[_Draft]]:
    """The type's own object (for its timestamp) and one draft per event."""
    match raw_type:
        case "Send":
            return _object(event, "send"), _each(EventType.ACCEPTED, _destinations(mail))
        case "Delivery":
            detail = _object(event, "delivery", required=True)
            return detail, _each(EventType.DELIVERED, _strings(detail, "recipients"))
        case "DeliveryDelay":
            detail = _object(event, "deliveryDelay", required=True)
            return detail, _each(EventType.DEFERRED, _addresses(detail, "delayedRecipients"))
        case "Bounce":
            detail = _object(event, "bounce", required=True)
            return detail, bounce_drafts(detail)
        case "Complaint":
            detail = _object(event, "complaint", required=True)
            return detail, complaint_drafts(detail)
        case "Reject":
            return _object(event, "reject"), _each(EventType.REJECTED, _destinations(mail))
        case "Rendering Failure":
            return _object(event, "failure"), _each(EventType.REJECTED, _destinations(mail))
        case "Open":
            return _object(event, "open"), [_Draft(EventType.OPENED, _sole_destination(mail))]
        case "Click":
            return _object(event, "click"), [_Draft(EventType.CLICKED, _sole_destination(mail))]
        case "Subscription":
            detail = _object(event, "subscription", required=True)
            return detail, subscription_drafts(detail, _sole_destination(mail))
        case _:
            return {}, [_Draft(EventType.UNKNOWN)]


def _each(event_type: EventType, recipients: Sequence[str]) -> list[_Draft]:
    return [_Draft(event_type, r) for r in recipients] or [_Draft(event_type)]


def bounce_drafts(bounce: Mapping[str, Any]) -> list[_Draft]:
    """One draft per bounced recipient. An unrecognised bounceType is
    undetermined: only a bounce SES calls Permanent may suppress an address."""
    bounce_type = _BOUNCE_TYPES.get(
        _optional_str(bounce, "bounceType") or "", BounceType.UNDETERMINED
    )
    subtype = _optional_str(bounce, "bounceSubType")
    event_type = (
        EventType.SUPPRESSED if subtype in _SUPPRESSED_BOUNCE_SUBTYPES else EventType.BOUNCED
    )
    recipients = _addresses(bounce, "bouncedRecipients")
    return [_Draft(event_type, r, bounce_type, subtype) for r in recipients] or [
        _Draft(event_type, None, bounce_type, subtype)
    ]


def complaint_drafts(complaint: Mapping[str, Any]) -> list[_Draft]:
    """One draft per complained recipient (SES lists every recipient on the
    complaining domain, since most ISPs redact the complainant)."""
    event_type = (
        EventType.SUPPRESSED
        if _optional_str(complaint, "complaintSubType") == _SUPPRESSED_COMPLAINT_SUBTYPE
        else EventType.COMPLAINED
    )
    return _each(event_type, _addresses(complaint, "complainedRecipients"))


def subscription_drafts(subscription: Mapping[str, Any], recipient: str | None) -> list[_Draft]:
    """Unsubscribes in an SES list-management Subscription event.

    `unsubscribeAll` → one, scoped to the contact list; otherwise one per topic
    whose status became OptOut, scoped `<contactList>/<topic>`. A change with no
    opt-out (an opt-in) is recorded as unknown.
    """
    contact_list = _optional_str(subscription, "contactList", max_chars=MAX_ID_CHARS)
    new = _object(subscription, "newTopicPreferences")
    if new.get("unsubscribeAll") is True:
        return [_Draft(EventType.UNSUBSCRIBED, recipient, list_id=contact_list)]
    before = _topic_statuses(_object(subscription, "oldTopicPreferences"))
    drafts = [
        _Draft(
            EventType.UNSUBSCRIBED,
            recipient,
            list_id=f"{contact_list}/{topic}" if contact_list else topic,
        )
        for topic, status in _topic_statuses(new).items()
        if status == _OPT_OUT and before.get(topic) != _OPT_OUT
    ]
    return drafts or [_Draft(EventType.UNKNOWN, recipient, list_id=contact_list)]


def _topic_statuses(preferences: Mapping[str, Any]) -> dict[str, str]:
    entries = preferences.get("topicSubscriptionStatus", [])
    if not isinstance(entries, list):
        raise MalformedPayload("ses: topicSubscriptionStatus is not a list")
    statuses: dict[str, str] = {}
    for entry in entries:
        if not isinstance(entry, dict):
            raise MalformedPayload("ses: topicSubscriptionStatus entry is not an object")
        topic = _optional_str(entry, "topicName", max_chars=MAX_ID_CHARS)
        status = _optional_str(entry, "subscriptionStatus")
        if topic is None or status is None:
            raise MalformedPayload("ses: topicSubscriptionStatus entry lacks topicName/status")
        statuses[topic] = status
    return statuses


def _destinations(mail: Mapping[str, Any]) -> list[str]:
    return _strings(mail, "destination")


def _sole_destination(mail: Mapping[str, Any]) -> str | None:
    destinations = _destinations(mail)
    return destinations[0] if len(destinations) == 1 else None


def _object(parent: Mapping[str, Any], key: str, *, required: bool = False) -> Mapping[str, Any]:
    value = parent.get(key)
    if value is None and not required:
        return {}
    if not isinstance(value, dict):
        raise MalformedPayload(f"ses: {key} is not an object")
    return value


def _optional_str(
    parent: Mapping[str, Any], key: str, *, max_chars: int = MAX_FIELD_CHARS
) -> str | None:
    # An empty string is absent too: SES fields are never meaningfully empty.
    return optional_str(parent, key, where="ses: ", max_chars=max_chars) or None


def _strings(parent: Mapping[str, Any], key: str) -> list[str]:
    value = parent.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise MalformedPayload(f"ses: {key} is not a list of strings")
    for text in value:
        check_text(text, what=f"ses: {key}")
    return value


def _addresses(parent: Mapping[str, Any], key: str) -> list[str]:
    """The emailAddress of each object in a *Recipients list."""
    value = parent.get(key, [])
    if not isinstance(value, list):
        raise MalformedPayload(f"ses: {key} is not a list")
    addresses: list[str] = []
    for entry in value:
        address = entry.get("emailAddress") if isinstance(entry, dict) else None
        if not isinstance(address, str):
            raise MalformedPayload(f"ses: {key} entry has no emailAddress")
        addresses.append(check_text(address, what=f"ses: {key} emailAddress"))
    return addresses


def _timestamp(parent: Mapping[str, Any], key: str) -> datetime | None:
    text = _optional_str(parent, key)
    return None if text is None else parse_iso_time(text, what=f"ses: {key}")
