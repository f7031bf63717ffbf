"""Amazon SES delivery events, delivered by SNS to an HTTPS subscription.

`SesReceiver.accept` verifies the SNS envelope with `sns.verify_sns_message`
(signature, certificate URL, the source's `topic_arns` allowlist), then:

    SubscriptionConfirmation → Accepted(confirm_url=SubscribeURL), no events;
                               the route GETs the URL after answering
    UnsubscribeConfirmation  → Accepted(), nothing to do
    Notification             → the Message is an SES event as a JSON string:
                               event publishing (configuration set, `eventType`)
                               or identity notifications (`notificationType`)

Normalisation (AWS SES developer guide, "Contents of event data that Amazon SES
publishes to Amazon SNS" and "Amazon SNS notification contents for Amazon SES"):

    Send               → accepted     one event per mail.destination
    Delivery           → delivered    one per delivery.recipients
    DeliveryDelay      → deferred     one per deliveryDelay.delayedRecipients
    Bounce             → bounced      one per bounce.bouncedRecipients, with
                                      bounceType/bounceSubType; sub-types
                                      Suppressed and OnAccountSuppressionList
                                      (SES did not try) → suppressed
    Complaint          → complained   one per complaint.complainedRecipients;
                                      complaintSubType OnAccountSuppressionList
                                      (SES did not send) → suppressed
    Reject             → rejected     one per mail.destination (virus: not sent)
    Rendering Failure  → rejected     one per mail.destination (template error:
                                      not sent, to anybody)
    Open, Click        → opened, clicked; the recipient only when the mail had
                                      exactly one destination (SES does not say who)
    Subscription       → unsubscribed per opt-out: unsubscribeAll scopes the
                                      contact list, a topic newly OptOut scopes
                                      `<contactList>/<topic>`; a change without
                                      an opt-out → unknown
    anything else      → unknown with the raw type

`occurred_at` is the type's own timestamp (bounce.timestamp …), else
mail.timestamp, else the signed SNS Timestamp. The dedup id is the SNS MessageId,
suffixed `:<index>` when one notification yields several events. The verified
SES event is the payload of each of its events; anything in it that is not the
documented shape is MalformedPayload (400). So is anything out of the bounds of
adapters/esp/fields.py: a Message nested deeper than MAX_JSON_DEPTH, an SNS
MessageId, messageId or topic over MAX_ID_CHARS, a time outside the event-time
range, NUL in a field read.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from inboxd.adapters.esp.base import (
    Accepted,
    DeliveryConfigError,
    MalformedPayload,
    Reveal,
    WebhookRequest,
)
from inboxd.adapters.esp.config import refuse_unknown_keys
from inboxd.adapters.esp.fields import (
    MAX_FIELD_CHARS,
    MAX_ID_CHARS,
    MAX_MESSAGE_ID_CHARS,
    check_depth,
    check_text,
    optional_str,
    parse_iso_time,
    parse_json_object,
)
from inboxd.adapters.esp.sns import (
    SUBSCRIPTION_CONFIRMATION,
    UNSUBSCRIBE_CONFIRMATION,
    SnsMessage,
    verify_sns_message,
)
from inboxd.adapters.esp.sns_certificates import CertificateCache
from inboxd.pipeline.delivery.model import BounceType, DeliveryEvent, EventType

__all__ = ["DEFAULT_PAYLOAD_FIELDS", "SesReceiver", "from_config", "normalise"]

#: Keys of a `provider = "ses"` source table besides base.COMMON_KEYS.
CONFIG_KEYS = frozenset({"topic_arns"})

#: An SNS topic ARN (aws, aws-cn, aws-us-gov partitions); catches a pasted
#: subscription ARN or queue ARN at config time instead of 401s at run time.
_TOPIC_ARN = re.compile(
    r"arn:aws(?:-[a-z]+)*:sns:[a-z0-9-]+:[0-9]{12}:[A-Za-z0-9_.-]{1,256}", re.ASCII
)

#: Fields kept in delivery_events.payload by default: types, ids, times and
#: classifications. Not kept: addresses (destination, *Recipients, source),
#: headers, smtpResponse/diagnosticCode (quote addresses), IPs, user agents,
#: click links (may carry personal tokens), rendering error messages.
DEFAULT_PAYLOAD_FIELDS: tuple[str, ...] = (
    "eventType",
    "notificationType",
    "mail.messageId",
    "mail.timestamp",
    "mail.tags.ses:configuration-set",
    "bounce.bounceType",
    "bounce.bounceSubType",
    "bounce.feedbackId",
    "bounce.reportingMTA",
    "bounce.timestamp",
    "complaint.complaintFeedbackType",
    "complaint.complaintSubType",
    "complaint.feedbackId",
    "complaint.arrivalDate",
    "complaint.timestamp",
    "delivery.processingTimeMillis",
    "delivery.reportingMTA",
    "delivery.timestamp",
    "deliveryDelay.delayType",
    "deliveryDelay.expirationTime",
    "deliveryDelay.timestamp",
    "reject.reason",
    "failure.templateName",
    "open.timestamp",
    "click.timestamp",
    "subscription.contactList",
    "subscription.source",
    "subscription.timestamp",
    "subscription.newTopicPreferences",
    "subscription.oldTopicPreferences",
)

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


class SesReceiver:
    """An SES configuration set or identity publishing to allowlisted SNS topics."""

    provider = "ses"
    # SNS posts its JSON envelope as text/plain; accept both.
    content_types = frozenset({"application/json", "text/plain"})
    default_payload_fields = DEFAULT_PAYLOAD_FIELDS

    def __init__(
        self, source_id: str, *, topic_arns: frozenset[str], certificates: CertificateCache
    ) -> None:
        self.source_id = source_id
        self.topic_arns = topic_arns
        self._certificates = certificates

    def __repr__(self) -> str:
        return f"SesReceiver(source_id={self.source_id!r}, topic_arns={sorted(self.topic_arns)!r})"

    @classmethod
    def from_config(
        cls,
        source_id: str,
        table: Mapping[str, Any],
        reveal: Reveal,
        *,
        fetch: Callable[[str], Awaitable[bytes]] | None = None,
    ) -> SesReceiver:
        """Build the source from its `[[delivery_sources]]` table.

        `topic_arns` (required): the SNS topic ARNs SES publishes to for this
        source; messages from any other topic are refused before any network
        request. SES has no secret to reveal (`reveal` is unused). `fetch`
        replaces the certificate download (tests). Raises DeliveryConfigError.
        """
        refuse_unknown_keys(table, CONFIG_KEYS, cls.provider)
        return cls(
            source_id,
            topic_arns=_topic_arns(table.get("topic_arns")),
            certificates=CertificateCache(fetch),
        )

    async def accept(self, request: WebhookRequest) -> Accepted:
        """Verify the SNS message and normalise the SES event it carries.

        Raises VerificationFailed, VerificationUnavailable (certificate fetch) or
        MalformedPayload (verified, but not an SES event).
        """
        message = await verify_sns_message(
            request.body, topic_arns=self.topic_arns, certificates=self._certificates
        )
        if message.type == SUBSCRIPTION_CONFIRMATION:
            return Accepted(confirm_url=message.subscribe_url)
        if message.type == UNSUBSCRIBE_CONFIRMATION:
            return Accepted()
        event = parse_json_object(message.message, what="ses: Message")
        check_depth(event, what="ses: Message")
        return Accepted(events=normalise(event, message))


from_config = SesReceiver.from_config


def _topic_arns(value: Any) -> frozenset[str]:
    if not isinstance(value, list | tuple) or not value:
        raise DeliveryConfigError("topic_arns: required, a non-empty list of SNS topic ARNs")
    for arn in value:
        if not isinstance(arn, str) or not _TOPIC_ARN.fullmatch(arn):
            raise DeliveryConfigError(f"topic_arns: {arn!r} is not an SNS topic ARN")
    return frozenset(value)


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
