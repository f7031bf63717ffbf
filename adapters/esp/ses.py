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
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from inboxd.adapters.esp.base import (
    Accepted,
    DeliveryConfigError,
    Reveal,
    WebhookRequest,
)
from inboxd.adapters.esp.config import refuse_unknown_keys
from inboxd.adapters.esp.fields import (
    check_depth,
    parse_json_object,
)
from inboxd.adapters.esp.ses_events import normalise
from inboxd.adapters.esp.sns import (
    SUBSCRIPTION_CONFIRMATION,
    UNSUBSCRIBE_CONFIRMATION,
    verify_sns_message,
)
from inboxd.adapters.esp.sns_certificates import CertificateCache

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
        reveal: Reveal,  # noqa: ARG003 - every scheme's; SNS signs with certificates, no secret
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
