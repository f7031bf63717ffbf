"""adapters.esp.ses: SES events through SNS — config, confirmations, normalisation.

SES samples are the AWS SES developer guide's examples ("Examples of event data
that Amazon SES publishes to Amazon SNS", awsdocs/amazon-ses-developer-guide
doc-source/event-publishing-retrieving-sns-examples.md, and "Amazon SNS
notification examples for Amazon SES", doc-source/notification-examples.md),
with the long `headers` lists left out. Each is wrapped in an SNS Notification
signed here with a self-signed certificate (the signature scheme itself is
covered with published vectors in test_sns.py).
"""

from __future__ import annotations

import copy
from datetime import datetime
from typing import Any

import orjson
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from helpers.keys import FakeFetch, sign_sns

from inboxd.adapters.esp.base import (
    Accepted,
    DeliveryConfigError,
    MalformedPayload,
    VerificationFailed,
    VerificationUnavailable,
    WebhookRequest,
)
from inboxd.adapters.esp.ses import SesReceiver, from_config
from inboxd.pipeline.delivery.model import BounceType, EventType, dedup_key, minimise_payload

TOPIC = "arn:aws:sns:us-east-1:123456789012:ses-events"
CERT_URL = "https://sns.us-east-1.amazonaws.com/SimpleNotificationService-0123456789abcdef.pem"
SNS_MESSAGE_ID = "22b80b92-fdea-4c2c-8f9d-bdfb0c7bf324"
SNS_TIMESTAMP = "2024-05-02T00:54:06.655Z"
SUBSCRIBE_URL = (
    "https://sns.us-east-1.amazonaws.com/?Action=ConfirmSubscription"
    f"&TopicArn={TOPIC}&Token=2336412f37fb687f5d51e6e2425c464de12884"
)
SES_MESSAGE_ID = "EXAMPLE7c191be45-e9aedb9a-02f9-4d12-a87d-dd0099a07f8a-000000"


def _mail(timestamp: str, destination: list[str], **extra: Any) -> dict[str, Any]:
    return {
        "timestamp": timestamp,
        "source": "sender@example.com",
        "sourceArn": "arn:aws:ses:us-east-1:123456789012:identity/sender@example.com",
        "sendingAccountId": "123456789012",
        "messageId": SES_MESSAGE_ID,
        "destination": destination,
        "headersTruncated": False,
        "commonHeaders": {
            "from": ["sender@example.com"],
            "to": destination,
            "messageId": SES_MESSAGE_ID,
            "subject": "Message sent from Amazon SES",
        },
        "tags": {"ses:configuration-set": ["ConfigSet"], "ses:source-ip": ["192.0.2.0"]},
        **extra,
    }


# Event publishing examples (eventType), AWS SES developer guide.
BOUNCE = {
    "eventType": "Bounce",
    "bounce": {
        "bounceType": "Permanent",
        "bounceSubType": "General",
        "bouncedRecipients": [
            {
                "emailAddress": "recipient@example.com",
                "action": "failed",
                "status": "5.1.1",
                "diagnosticCode": "smtp; 550 5.1.1 user unknown",
            }
        ],
        "timestamp": "2017-08-05T00:41:02.669Z",
        "feedbackId": "01000157c44f053b-61b59c11-9236-11e6-8f96-7be8aexample-000000",
        "reportingMTA": "dsn; mta.example.com",
    },
    "mail": _mail("2017-08-05T00:40:02.012Z", ["recipient@example.com"]),
}
COMPLAINT = {
    "eventType": "Complaint",
    "complaint": {
        "complainedRecipients": [{"emailAddress": "recipient@example.com"}],
        "timestamp": "2017-08-05T00:41:02.669Z",
        "feedbackId": "01000157c44f053b-61b59c11-9236-11e6-8f96-7be8aexample-000000",
        "userAgent": "Mozilla/5.0 (Windows NT 10.0; Win64; x64) AppleWebKit/537.36",
        "complaintFeedbackType": "abuse",
        "arrivalDate": "2017-08-05T00:41:02.669Z",
    },
    "mail": _mail("2017-08-05T00:40:01.123Z", ["recipient@example.com"]),
}
DELIVERY = {
    "eventType": "Delivery",
    "mail": _mail("2016-10-19T23:20:52.240Z", ["recipient@example.com"]),
    "delivery": {
        "timestamp": "2016-10-19T23:21:04.133Z",
        "processingTimeMillis": 11893,
        "recipients": ["recipient@example.com"],
        "smtpResponse": "250 2.6.0 Message received",
        "reportingMTA": "mta.example.com",
    },
}
SEND = {
    "eventType": "Send",
    "mail": _mail("2016-10-14T05:02:16.645Z", ["recipient@example.com"]),
    "send": {},
}
REJECT = {
    "eventType": "Reject",
    "mail": _mail("2016-10-14T17:38:15.211Z", ["sender@example.com"]),
    "reject": {"reason": "Bad content"},
}
OPEN = {
    "eventType": "Open",
    "mail": _mail("2017-08-09T21:59:49.927Z", ["recipient@example.com"]),
    "open": {
        "ipAddress": "192.0.2.1",
        "timestamp": "2017-08-09T22:00:19.652Z",
        "userAgent": "Mozilla/5.0 (iPhone; CPU iPhone OS 10_3_3 like Mac OS X)",
    },
}
CLICK = {
    "eventType": "Click",
    "click": {
        "ipAddress": "192.0.2.1",
        "link": "http://docs.aws.amazon.com/ses/latest/DeveloperGuide/send-email-smtp.html",
        "linkTags": {"samplekey0": ["samplevalue0"], "samplekey1": ["samplevalue1"]},
        "timestamp": "2017-08-09T23:51:25.570Z",
        "userAgent": "Mozilla/5.0 (Windows NT 10.0; Win64; x64)",
    },
    "mail": _mail("2017-08-09T23:50:05.795Z", ["recipient@example.com"]),
}
RENDERING_FAILURE = {
    "eventType": "Rendering Failure",
    "mail": _mail("2018-01-22T18:43:06.197Z", ["recipient@example.com"]),
    "failure": {
        "errorMessage": "Attribute 'attributeName' is not present in the rendering data.",
        "templateName": "MyTemplate",
    },
}
DELIVERY_DELAY = {
    "eventType": "DeliveryDelay",
    "mail": _mail("2020-06-16T00:15:40.641Z", ["recipient@example.com"]),
    "deliveryDelay": {
        "timestamp": "2020-06-16T00:25:40.095Z",
        "delayType": "TransientCommunicationFailure",
        "expirationTime": "2020-06-16T00:25:40.914Z",
        "delayedRecipients": [
            {
                "emailAddress": "recipient@example.com",
                "status": "4.4.1",
                "diagnosticCode": "smtp; 421 4.4.1 Unable to connect to remote host",
            }
        ],
    },
}
SUBSCRIPTION = {
    "eventType": "Subscription",
    "mail": _mail("2022-01-12T01:00:14.340Z", ["recipient@example.com"]),
    "subscription": {
        "contactList": "ContactListName",
        "timestamp": "2022-01-12T01:00:17.910Z",
        "source": "UnsubscribeHeader",
        "newTopicPreferences": {
            "unsubscribeAll": True,
            "topicSubscriptionStatus": [
                {"topicName": "ExampleTopicName", "subscriptionStatus": "OptOut"},
            ],
        },
        "oldTopicPreferences": {
            "unsubscribeAll": False,
            "topicSubscriptionStatus": [
                {"topicName": "ExampleTopicName", "subscriptionStatus": "OptOut"},
            ],
        },
    },
}
# Identity notification example (notificationType): "Bounce notification without a
# DSN" — two of three recipients bounced, and commonHeaders carry the sender's own
# Message-ID rather than SES's.
IDENTITY_BOUNCE = {
    "notificationType": "Bounce",
    "bounce": {
        "bounceType": "Permanent",
        "bounceSubType": "General",
        "bouncedRecipients": [
            {"emailAddress": "jane@example.com"},
            {"emailAddress": "richard@example.com"},
        ],
        "timestamp": "2016-01-27T14:59:38.237Z",
        "feedbackId": "00000137860315fd-869464a4-8680-4114-98d3-716fe35851f9-000000",
        "remoteMtaIp": "127.0.2.0",
    },
    "mail": {
        "timestamp": "2016-01-27T14:59:38.237Z",
        "messageId": "00000137860315fd-34208509-5b74-41f3-95c5-22c1edc3c924-000000",
        "source": "john@example.com",
        "sourceArn": "arn:aws:ses:us-east-1:888888888888:identity/example.com",
        "sourceIp": "127.0.3.0",
        "sendingAccountId": "123456789012",
        "destination": ["jane@example.com", "mary@example.com", "richard@example.com"],
        "headersTruncated": False,
        "commonHeaders": {
            "from": ["John Doe <john@example.com>"],
            "date": "Wed, 27 Jan 2016 14:05:45 +0000",
            "to": [
                "Jane Doe <jane@example.com>, Mary Doe <mary@example.com>, "
                "Richard Doe <richard@example.com>"
            ],
            "messageId": "custom-message-ID",
            "subject": "Hello",
        },
    },
}
# Identity notification example: "Complaint notification with a feedback report".
IDENTITY_COMPLAINT = {
    "notificationType": "Complaint",
    "complaint": {
        "userAgent": "AnyCompany Feedback Loop (V0.01)",
        "complainedRecipients": [{"emailAddress": "richard@example.com"}],
        "complaintFeedbackType": "abuse",
        "arrivalDate": "2016-01-27T14:59:38.237Z",
        "timestamp": "2016-01-27T14:59:38.237Z",
        "feedbackId": "000001378603177f-18c07c78-fa81-4a58-9dd1-fedc3cb8f49a-000000",
    },
    "mail": {
        "timestamp": "2016-01-27T14:59:38.237Z",
        "messageId": "000001378603177f-7a5433e7-8edb-42ae-af10-f0181f34d6ee-000000",
        "source": "john@example.com",
        "sendingAccountId": "123456789012",
        "destination": ["jane@example.com", "mary@example.com", "richard@example.com"],
    },
}
# Identity notification example: "Amazon SNS delivery notification example".
IDENTITY_DELIVERY = {
    "notificationType": "Delivery",
    "mail": {
        "timestamp": "2016-01-27T14:59:38.237Z",
        "messageId": "0000014644fe5ef6-9a483358-9170-4cb4-a269-f5dcdf415321-000000",
        "source": "john@example.com",
        "sendingAccountId": "123456789012",
        "destination": ["jane@example.com"],
    },
    "delivery": {
        "timestamp": "2016-01-27T14:59:38.237Z",
        "recipients": ["jane@example.com"],
        "processingTimeMillis": 546,
        "reportingMTA": "a8-70.smtp-out.amazonses.com",
        "smtpResponse": "250 ok:  Message 64111812 accepted",
        "remoteMtaIp": "127.0.2.0",
    },
}
ALL_SAMPLES = [
    BOUNCE,
    COMPLAINT,
    DELIVERY,
    SEND,
    REJECT,
    OPEN,
    CLICK,
    RENDERING_FAILURE,
    DELIVERY_DELAY,
    SUBSCRIPTION,
    IDENTITY_BOUNCE,
    IDENTITY_COMPLAINT,
    IDENTITY_DELIVERY,
]


def ts(text: str) -> datetime:
    return datetime.fromisoformat(text)


@pytest.fixture
def fetch(certificate: bytes) -> FakeFetch:
    return FakeFetch({CERT_URL: certificate})


@pytest.fixture
def source(fetch: FakeFetch) -> SesReceiver:
    table = {
        "id": "ses-prod",
        "provider": "ses",
        "topic_arns": [TOPIC],
        "max_body_bytes": 262144,
        "payload_fields": ["eventType"],
        "recipients": "hash",
    }
    return SesReceiver.from_config("ses-prod", table, str, fetch=fetch)


def signed(fields: dict[str, Any], key: rsa.RSAPrivateKey) -> bytes:
    """The SNS envelope `fields`, signed (SignatureVersion 2), as a request body."""
    return orjson.dumps(
        sign_sns({"SignatureVersion": "2", "SigningCertURL": CERT_URL, **fields}, key)
    )


def notification_body(
    ses_event: Any, key: rsa.RSAPrivateKey, *, message_id: str = SNS_MESSAGE_ID, topic: str = TOPIC
) -> bytes:
    message = ses_event if isinstance(ses_event, str) else orjson.dumps(ses_event).decode()
    return signed(
        {
            "Type": "Notification",
            "MessageId": message_id,
            "TopicArn": topic,
            "Message": message,
            "Timestamp": SNS_TIMESTAMP,
            "UnsubscribeURL": "https://sns.us-east-1.amazonaws.com/?Action=Unsubscribe",
        },
        key,
    )


def request(raw: bytes) -> WebhookRequest:
    # What SNS sends: a JSON body labelled text/plain.
    return WebhookRequest(
        body=raw,
        headers={
            "content-type": "text/plain; charset=UTF-8",
            "x-amz-sns-message-type": "Notification",
            "x-amz-sns-topic-arn": TOPIC,
        },
        received_at=1714611247.0,
    )


async def accept(
    source: SesReceiver, ses_event: Any, key: rsa.RSAPrivateKey, **kwargs: Any
) -> Accepted:
    return await source.accept(request(notification_body(ses_event, key, **kwargs)))


# --- config ---------------------------------------------------------------------------


def test_from_config_reads_topics_and_ignores_common_keys(source: SesReceiver) -> None:
    assert source.topic_arns == frozenset({TOPIC})
    assert source.provider == "ses"
    assert source.content_types == frozenset({"application/json", "text/plain"})
    assert "ses-prod" in repr(source)


def test_module_level_from_config() -> None:
    built = from_config(
        "s", {"topic_arns": [TOPIC, "arn:aws-cn:sns:cn-north-1:123456789012:x"]}, str
    )
    assert len(built.topic_arns) == 2


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ({}, "topic_arns"),
        ({"topic_arns": []}, "topic_arns"),
        ({"topic_arns": TOPIC}, "topic_arns"),
        ({"topic_arns": [TOPIC, 7]}, "topic_arns"),
        ({"topic_arns": [""]}, "topic_arns"),
        ({"topic_arns": ["arn:aws:sqs:us-east-1:123456789012:queue"]}, "topic_arns"),
        ({"topic_arns": [TOPIC + ":3f1c2d4e-subscription-id"]}, "topic_arns"),
        ({"topic_arns": [TOPIC], "secret": "whsec_x"}, "secret"),
        ({"topic_arns": [TOPIC], "topic_arn": TOPIC}, "topic_arn"),
    ],
)
def test_from_config_refuses(table: dict[str, Any], key: str) -> None:
    with pytest.raises(DeliveryConfigError, match=f"^{key}:"):
        SesReceiver.from_config("ses", table, str)


# --- SNS message types ----------------------------------------------------------------


async def test_subscription_confirmation_yields_confirm_url(
    source: SesReceiver, signing_key: rsa.RSAPrivateKey
) -> None:
    raw = signed(
        {
            "Type": "SubscriptionConfirmation",
            "MessageId": "165545c9-2a5c-472c-8df2-7ff2be2b3b1b",
            "Token": "2336412f37fb687f5d51e6e2425c464de12884",
            "TopicArn": TOPIC,
            "Message": f"You have chosen to subscribe to the topic {TOPIC}.",
            "SubscribeURL": SUBSCRIBE_URL,
            "Timestamp": "2012-04-26T20:45:04.751Z",
        },
        signing_key,
    )
    accepted = await source.accept(request(raw))
    assert accepted == Accepted(events=[], confirm_url=SUBSCRIBE_URL)


async def test_unverified_subscription_confirmation_yields_nothing(
    source: SesReceiver, signing_key: rsa.RSAPrivateKey
) -> None:
    fields = orjson.loads(
        signed(
            {
                "Type": "SubscriptionConfirmation",
                "MessageId": "m",
                "Token": "t",
                "TopicArn": TOPIC,
                "Message": "m",
                "SubscribeURL": SUBSCRIBE_URL,
                "Timestamp": "2012-04-26T20:45:04.751Z",
            },
            signing_key,
        )
    )
    fields["SubscribeURL"] = SUBSCRIBE_URL + "&extra=1"
    with pytest.raises(VerificationFailed):
        await source.accept(request(orjson.dumps(fields)))


@pytest.mark.parametrize(
    "url",
    [
        "https://evil.com/?Action=ConfirmSubscription",
        "https://sns.us-east-1.amazonaws.com.evil.com/?Action=ConfirmSubscription",
        "http://sns.us-east-1.amazonaws.com/?Action=ConfirmSubscription",
    ],
)
async def test_hostile_subscribe_url_is_refused(
    url: str, source: SesReceiver, fetch: FakeFetch, signing_key: rsa.RSAPrivateKey
) -> None:
    raw = signed(
        {
            "Type": "SubscriptionConfirmation",
            "MessageId": "m",
            "Token": "t",
            "TopicArn": TOPIC,
            "Message": "m",
            "SubscribeURL": url,
            "Timestamp": "2012-04-26T20:45:04.751Z",
        },
        signing_key,
    )
    with pytest.raises(VerificationFailed):
        await source.accept(request(raw))
    assert fetch.calls == []


async def test_unsubscribe_confirmation_yields_nothing(
    source: SesReceiver, signing_key: rsa.RSAPrivateKey
) -> None:
    raw = signed(
        {
            "Type": "UnsubscribeConfirmation",
            "MessageId": "m",
            "Token": "t",
            "TopicArn": TOPIC,
            "Message": "You have unsubscribed",
            "SubscribeURL": SUBSCRIBE_URL,
            "Timestamp": "2012-04-26T20:45:04.751Z",
        },
        signing_key,
    )
    assert await source.accept(request(raw)) == Accepted()


async def test_foreign_topic_is_refused_without_fetch(
    source: SesReceiver, fetch: FakeFetch, signing_key: rsa.RSAPrivateKey
) -> None:
    with pytest.raises(VerificationFailed):
        await accept(
            source, SEND, signing_key, topic="arn:aws:sns:us-east-1:999999999999:ses-events"
        )
    assert fetch.calls == []


async def test_certificate_fetch_failure_is_source_unavailable(
    source: SesReceiver, fetch: FakeFetch, signing_key: rsa.RSAPrivateKey
) -> None:
    fetch.fail = True
    with pytest.raises(VerificationUnavailable):
        await accept(source, SEND, signing_key)


async def test_certificate_fetched_once_across_notifications(
    source: SesReceiver, fetch: FakeFetch, signing_key: rsa.RSAPrivateKey
) -> None:
    await accept(source, SEND, signing_key, message_id="a")
    await accept(source, DELIVERY, signing_key, message_id="b")
    assert fetch.calls == [CERT_URL]


@pytest.mark.parametrize("raw", [b"not json", b"[]", b'{"Type":"Notification"}'])
async def test_unparsable_envelope_is_verification_failure(
    raw: bytes, source: SesReceiver, fetch: FakeFetch
) -> None:
    with pytest.raises(VerificationFailed):
        await source.accept(request(raw))
    assert fetch.calls == []


async def test_json_content_type_works_too(
    source: SesReceiver, signing_key: rsa.RSAPrivateKey
) -> None:
    raw = notification_body(SEND, signing_key)
    accepted = await source.accept(
        WebhookRequest(body=raw, headers={"content-type": "application/json"}, received_at=0.0)
    )
    assert [e.event_type for e in accepted.events] == [EventType.ACCEPTED]


# --- normalisation --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sample", "event_type", "recipient", "occurred_at"),
    [
        (SEND, EventType.ACCEPTED, "recipient@example.com", "2016-10-14T05:02:16.645Z"),
        (DELIVERY, EventType.DELIVERED, "recipient@example.com", "2016-10-19T23:21:04.133Z"),
        (DELIVERY_DELAY, EventType.DEFERRED, "recipient@example.com", "2020-06-16T00:25:40.095Z"),
        (BOUNCE, EventType.BOUNCED, "recipient@example.com", "2017-08-05T00:41:02.669Z"),
        (COMPLAINT, EventType.COMPLAINED, "recipient@example.com", "2017-08-05T00:41:02.669Z"),
        (REJECT, EventType.REJECTED, "sender@example.com", "2016-10-14T17:38:15.211Z"),
        (
            RENDERING_FAILURE,
            EventType.REJECTED,
            "recipient@example.com",
            "2018-01-22T18:43:06.197Z",
        ),
        (OPEN, EventType.OPENED, "recipient@example.com", "2017-08-09T22:00:19.652Z"),
        (CLICK, EventType.CLICKED, "recipient@example.com", "2017-08-09T23:51:25.570Z"),
        (SUBSCRIPTION, EventType.UNSUBSCRIBED, "recipient@example.com", "2022-01-12T01:00:17.910Z"),
        (IDENTITY_DELIVERY, EventType.DELIVERED, "jane@example.com", "2016-01-27T14:59:38.237Z"),
        (
            IDENTITY_COMPLAINT,
            EventType.COMPLAINED,
            "richard@example.com",
            "2016-01-27T14:59:38.237Z",
        ),
    ],
    ids=lambda v: v["eventType"] if isinstance(v, dict) and "eventType" in v else None,
)
async def test_documented_samples_normalise(
    sample: dict,
    event_type: EventType,
    recipient: str,
    occurred_at: str,
    source: SesReceiver,
    signing_key: rsa.RSAPrivateKey,
) -> None:
    (event,) = (await accept(source, sample, signing_key)).events
    raw_type = sample.get("eventType", sample.get("notificationType"))
    assert event.provider_type == raw_type
    assert event.event_type == event_type
    assert event.recipient == recipient
    assert event.occurred_at == ts(occurred_at)
    assert event.occurred_at.tzinfo is not None
    assert event.provider_event_id == SNS_MESSAGE_ID
    assert event.provider_message_id == sample["mail"]["messageId"]
    assert event.payload == sample  # the parsed SES event, not the SNS string


async def test_bounce_fields(source: SesReceiver, signing_key: rsa.RSAPrivateKey) -> None:
    (event,) = (await accept(source, BOUNCE, signing_key)).events
    assert (event.bounce_type, event.bounce_subtype) == (BounceType.PERMANENT, "General")
    assert event.message_id_header == SES_MESSAGE_ID
    assert event.provider_message_id == SES_MESSAGE_ID


async def test_multi_recipient_bounce_yields_one_event_each(
    source: SesReceiver, signing_key: rsa.RSAPrivateKey
) -> None:
    events = (await accept(source, IDENTITY_BOUNCE, signing_key)).events
    assert [e.recipient for e in events] == ["jane@example.com", "richard@example.com"]
    assert [e.provider_event_id for e in events] == [f"{SNS_MESSAGE_ID}:0", f"{SNS_MESSAGE_ID}:1"]
    assert len({dedup_key(e) for e in events}) == 2
    assert {e.event_type for e in events} == {EventType.BOUNCED}
    assert {e.message_id_header for e in events} == {"custom-message-ID"}
    assert {e.occurred_at for e in events} == {ts("2016-01-27T14:59:38.237Z")}


async def test_send_to_several_destinations_yields_one_event_each(
    source: SesReceiver, signing_key: rsa.RSAPrivateKey
) -> None:
    sample = copy.deepcopy(SEND)
    sample["mail"]["destination"] = ["a@example.com", "b@example.com", "c@example.com"]
    events = (await accept(source, sample, signing_key)).events
    assert [e.recipient for e in events] == ["a@example.com", "b@example.com", "c@example.com"]
    assert len({e.provider_event_id for e in events}) == 3


@pytest.mark.parametrize("sample", [OPEN, CLICK])
async def test_open_and_click_name_a_recipient_only_when_unambiguous(
    sample: dict, source: SesReceiver, signing_key: rsa.RSAPrivateKey
) -> None:
    several = copy.deepcopy(sample)
    several["mail"]["destination"] = ["a@example.com", "b@example.com"]
    (event,) = (await accept(source, several, signing_key)).events
    assert event.recipient is None
    assert event.provider_event_id == SNS_MESSAGE_ID


@pytest.mark.parametrize(
    ("bounce_type", "expected"),
    [
        ("Permanent", BounceType.PERMANENT),
        ("Transient", BounceType.TRANSIENT),
        ("Undetermined", BounceType.UNDETERMINED),
        ("SomethingNew", BounceType.UNDETERMINED),
    ],
)
async def test_bounce_types(
    bounce_type: str, expected: BounceType, source: SesReceiver, signing_key: rsa.RSAPrivateKey
) -> None:
    sample = copy.deepcopy(BOUNCE)
    sample["bounce"]["bounceType"] = bounce_type
    (event,) = (await accept(source, sample, signing_key)).events
    assert event.bounce_type == expected


@pytest.mark.parametrize("subtype", ["Suppressed", "OnAccountSuppressionList"])
async def test_bounce_on_a_suppression_list_is_suppressed(
    subtype: str, source: SesReceiver, signing_key: rsa.RSAPrivateKey
) -> None:
    sample = copy.deepcopy(BOUNCE)
    sample["bounce"]["bounceSubType"] = subtype
    (event,) = (await accept(source, sample, signing_key)).events
    assert event.event_type == EventType.SUPPRESSED
    assert event.bounce_subtype == subtype


async def test_complaint_on_account_suppression_list_is_suppressed(
    source: SesReceiver, signing_key: rsa.RSAPrivateKey
) -> None:
    sample = copy.deepcopy(COMPLAINT)
    sample["complaint"]["complaintSubType"] = "OnAccountSuppressionList"
    (event,) = (await accept(source, sample, signing_key)).events
    assert event.event_type == EventType.SUPPRESSED


async def test_bounce_without_recipients_still_yields_an_event(
    source: SesReceiver, signing_key: rsa.RSAPrivateKey
) -> None:
    sample = copy.deepcopy(BOUNCE)
    sample["bounce"]["bouncedRecipients"] = []
    (event,) = (await accept(source, sample, signing_key)).events
    assert (event.event_type, event.recipient) == (EventType.BOUNCED, None)


async def test_unsubscribe_all_scopes_the_contact_list(
    source: SesReceiver, signing_key: rsa.RSAPrivateKey
) -> None:
    (event,) = (await accept(source, SUBSCRIPTION, signing_key)).events
    assert (event.event_type, event.list_id) == (EventType.UNSUBSCRIBED, "ContactListName")


async def test_topic_opt_outs_scope_each_topic(
    source: SesReceiver, signing_key: rsa.RSAPrivateKey
) -> None:
    sample = copy.deepcopy(SUBSCRIPTION)
    sample["subscription"]["newTopicPreferences"] = {
        "unsubscribeAll": False,
        "topicSubscriptionStatus": [
            {"topicName": "ExampleTopicName", "subscriptionStatus": "OptOut"},  # already
            {"topicName": "News", "subscriptionStatus": "OptOut"},
            {"topicName": "Offers", "subscriptionStatus": "OptOut"},
            {"topicName": "Billing", "subscriptionStatus": "OptIn"},
        ],
    }
    events = (await accept(source, sample, signing_key)).events
    assert [(e.event_type, e.list_id) for e in events] == [
        (EventType.UNSUBSCRIBED, "ContactListName/News"),
        (EventType.UNSUBSCRIBED, "ContactListName/Offers"),
    ]
    assert [e.provider_event_id for e in events] == [f"{SNS_MESSAGE_ID}:0", f"{SNS_MESSAGE_ID}:1"]


async def test_subscription_opt_in_is_unknown(
    source: SesReceiver, signing_key: rsa.RSAPrivateKey
) -> None:
    sample = copy.deepcopy(SUBSCRIPTION)
    sample["subscription"]["newTopicPreferences"] = {
        "unsubscribeAll": False,
        "topicSubscriptionStatus": [
            {"topicName": "ExampleTopicName", "subscriptionStatus": "OptIn"}
        ],
    }
    (event,) = (await accept(source, sample, signing_key)).events
    assert (event.event_type, event.provider_type) == (EventType.UNKNOWN, "Subscription")


async def test_unknown_event_type_is_unknown(
    source: SesReceiver, signing_key: rsa.RSAPrivateKey
) -> None:
    sample = {**copy.deepcopy(SEND), "eventType": "BrandNewThing"}
    (event,) = (await accept(source, sample, signing_key)).events
    assert (event.event_type, event.provider_type) == (EventType.UNKNOWN, "BrandNewThing")
    assert event.occurred_at == ts(SEND["mail"]["timestamp"])
    assert event.provider_message_id == SES_MESSAGE_ID


async def test_notification_without_mail_uses_the_sns_timestamp(
    source: SesReceiver, signing_key: rsa.RSAPrivateKey
) -> None:
    # Sent once when an identity's notification topic is set.
    sample = {
        "notificationType": "AmazonSnsSubscriptionSucceeded",
        "message": "You have successfully subscribed your Amazon SNS topic.",
    }
    (event,) = (await accept(source, sample, signing_key)).events
    assert event.event_type == EventType.UNKNOWN
    assert event.occurred_at == ts(SNS_TIMESTAMP)
    assert event.provider_message_id is None


@pytest.mark.parametrize(
    "message",
    [
        "not json",
        '{"eventType": "Bounce"',
        "[]",
        '"Bounce"',
        "{}",
        '{"eventType": 5}',
        orjson.dumps({"eventType": "Bounce", "mail": SEND["mail"]}).decode(),
        orjson.dumps(
            {**BOUNCE, "bounce": {**BOUNCE["bounce"], "bouncedRecipients": [{}]}}
        ).decode(),
        orjson.dumps({**BOUNCE, "bounce": {**BOUNCE["bounce"], "timestamp": "yesterday"}}).decode(),
        orjson.dumps(
            {**DELIVERY, "delivery": {**DELIVERY["delivery"], "recipients": "x"}}
        ).decode(),
        orjson.dumps({**SEND, "mail": ["not", "an", "object"]}).decode(),
        orjson.dumps({**SEND, "mail": {**SEND["mail"], "destination": [1]}}).decode(),
    ],
    ids=[
        "text",
        "truncated",
        "array",
        "string",
        "no-type",
        "numeric-type",
        "no-bounce",
        "recipient-without-address",
        "bad-timestamp",
        "recipients-not-list",
        "mail-not-object",
        "destination-not-strings",
    ],
)
async def test_verified_but_malformed_ses_event(
    message: str, source: SesReceiver, signing_key: rsa.RSAPrivateKey
) -> None:
    with pytest.raises(MalformedPayload):
        await accept(source, message, signing_key)


@pytest.mark.parametrize("sample", ALL_SAMPLES)
async def test_default_payload_fields_keep_no_addresses(
    sample: dict, source: SesReceiver, signing_key: rsa.RSAPrivateKey
) -> None:
    for event in (await accept(source, sample, signing_key)).events:
        kept = minimise_payload(event.payload, source.default_payload_fields)
        text = orjson.dumps(kept).decode()
        assert "@" not in text
        assert "192.0.2" not in text and "127.0." not in text
        assert kept.get("eventType", kept.get("notificationType")) == event.provider_type


async def test_default_payload_fields_keep_the_bounce_classification(
    source: SesReceiver, signing_key: rsa.RSAPrivateKey
) -> None:
    (event,) = (await accept(source, BOUNCE, signing_key)).events
    kept = minimise_payload(event.payload, source.default_payload_fields)
    assert kept["bounce"] == {
        "bounceType": "Permanent",
        "bounceSubType": "General",
        "feedbackId": BOUNCE["bounce"]["feedbackId"],
        "reportingMTA": "dsn; mta.example.com",
        "timestamp": "2017-08-05T00:41:02.669Z",
    }
    assert kept["mail"]["tags"] == {"ses:configuration-set": ["ConfigSet"]}
