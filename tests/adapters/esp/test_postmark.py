"""Postmark: HTTP Basic verification and normalisation of each RecordType.

Samples are the example payloads of Postmark's webhook pages
(https://postmarkapp.com/developer/webhooks/{delivery,bounce,spam-complaint,
open-tracking,click,subscription-change}-webhook), as also recorded in
`anymail/django-anymail:tests/test_postmark_webhooks.py` (the ManualSuppression
and resubscribe SubscriptionChange samples come from there).
"""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import orjson
import pytest

from inboxd.adapters.esp.base import (
    DeliveryConfigError,
    MalformedPayload,
    VerificationFailed,
    WebhookRequest,
)
from inboxd.adapters.esp.postmark import PostmarkReceiver
from inboxd.pipeline.delivery.model import BounceType, EventType, minimise_payload

USERNAME = "postmark-hooks"
PASSWORD = "correct horse battery staple"
NOW = 1700000000.0

DELIVERY = {
    "MessageID": "883953f4-6105-42a2-a16a-77a8eac79483",
    "Recipient": "john@example.com",
    "DeliveredAt": "2019-11-05T16:33:54.9070259Z",
    "Details": "Test delivery webhook details",
    "Tag": "welcome-email",
    "ServerID": 23,
    "Metadata": {"a_key": "a_value", "b_key": "b_value"},
    "RecordType": "Delivery",
    "MessageStream": "outbound",
}

BOUNCE = {
    "RecordType": "Bounce",
    "MessageStream": "outbound",
    "ID": 4323372036854775807,
    "Type": "HardBounce",
    "TypeCode": 1,
    "Name": "Hard bounce",
    "Tag": "Test",
    "MessageID": "883953f4-6105-42a2-a16a-77a8eac79483",
    "Metadata": {"a_key": "a_value", "b_key": "b_value"},
    "ServerID": 23,
    "Description": "The server was unable to deliver your message (ex: unknown user, "
    "mailbox not found).",
    "Details": "Test bounce details",
    "Email": "john@example.com",
    "From": "sender@example.com",
    "BouncedAt": "2019-11-05T16:33:54.9070259Z",
    "DumpAvailable": True,
    "Inactive": True,
    "CanActivate": True,
    "Subject": "Test subject",
    "Content": "<Full dump of bounce>",
}

SPAM_COMPLAINT = {
    "RecordType": "SpamComplaint",
    "MessageStream": "outbound",
    "ID": 42,
    "Type": "SpamComplaint",
    "TypeCode": 512,
    "Name": "Spam complaint",
    "Tag": "Test",
    "MessageID": "00000000-0000-0000-0000-000000000000",
    "Metadata": {"a_key": "a_value", "b_key": "b_value"},
    "ServerID": 1234,
    "Description": "",
    "Details": "Test spam complaint details",
    "Email": "john@example.com",
    "From": "sender@example.com",
    "BouncedAt": "2019-11-05T16:33:54.9070259Z",
    "DumpAvailable": True,
    "Inactive": True,
    "CanActivate": False,
    "Subject": "Test subject",
    "Content": "<Abuse report dump>",
}

_CLIENT = {"Name": "Chrome 35.0.1916.153", "Company": "Google", "Family": "Chrome"}
_OS = {"Name": "OS X 10.7 Lion", "Company": "Apple Computer, Inc.", "Family": "OS X 10"}
_GEO = {
    "CountryISOCode": "RS",
    "Country": "Serbia",
    "RegionISOCode": "VO",
    "Region": "Autonomna Pokrajina Vojvodina",
    "City": "Novi Sad",
    "Zip": "21000",
    "Coords": "45.2517,19.8369",
    "IP": "188.2.95.4",
}
_UA = (
    "Mozilla/5.0 (Macintosh; Intel Mac OS X 10_7_5) AppleWebKit/537.36 (KHTML, like Gecko) "
    "Chrome/35.0.1916.153 Safari/537.36"
)

OPEN = {
    "RecordType": "Open",
    "MessageStream": "outbound",
    "FirstOpen": True,
    "Client": _CLIENT,
    "OS": _OS,
    "Platform": "WebMail",
    "UserAgent": _UA,
    "Geo": _GEO,
    "MessageID": "883953f4-6105-42a2-a16a-77a8eac79483",
    "Metadata": {"a_key": "a_value", "b_key": "b_value"},
    "ReceivedAt": "2019-11-05T16:33:54.9070259Z",
    "Tag": "welcome-email",
    "Recipient": "john@example.com",
}

CLICK = {
    "RecordType": "Click",
    "MessageStream": "outbound",
    "ClickLocation": "HTML",
    "Client": _CLIENT,
    "OS": _OS,
    "Platform": "Desktop",
    "UserAgent": _UA,
    "OriginalLink": "https://example.com",
    "Geo": _GEO | {"IP": "8.8.8.8"},
    "MessageID": "00000000-0000-0000-0000-000000000000",
    "Metadata": {"a_key": "a_value", "b_key": "b_value"},
    "ReceivedAt": "2017-10-25T15:21:11.9065619Z",
    "Tag": "welcome-email",
    "Recipient": "john@example.com",
}

SUBSCRIPTION_CHANGE_HARD_BOUNCE = {
    "RecordType": "SubscriptionChange",
    "MessageID": "883953f4-6105-42a2-a16a-77a8eac79483",
    "ServerID": 123456,
    "MessageStream": "outbound",
    "ChangedAt": "2020-02-01T10:53:34.416071Z",
    "Recipient": "bounced-address@wildbit.com",
    "Origin": "Recipient",
    "SuppressSending": True,
    "SuppressionReason": "HardBounce",
    "Tag": "my-tag",
    "Metadata": {"example": "value", "example_2": "value"},
}

UNSUBSCRIBE = {
    "RecordType": "SubscriptionChange",
    "MessageID": "a4909a96-73d7-4c49-b148-a54522d3f7ac",
    "ServerID": 23,
    "MessageStream": "outbound",
    "ChangedAt": "2022-06-05T17:17:32Z",
    "Recipient": "john@example.com",
    "Origin": "Recipient",
    "SuppressSending": True,
    "SuppressionReason": "ManualSuppression",
    "Tag": "welcome-email",
    "Metadata": {"example": "value", "example_2": "value"},
}

RESUBSCRIBE = UNSUBSCRIBE | {"SuppressSending": False, "SuppressionReason": None}


def basic(username: str = USERNAME, password: str = PASSWORD, scheme: str = "Basic") -> str:
    return f"{scheme} " + base64.b64encode(f"{username}:{password}".encode()).decode()


def request(body: dict[str, Any] | bytes, authorization: str | None = None) -> WebhookRequest:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    headers = {"authorization": basic() if authorization is None else authorization}
    return WebhookRequest(body=raw, headers=headers, received_at=NOW)


def source(**table: Any) -> PostmarkReceiver:
    table.setdefault("username", USERNAME)
    table.setdefault("password", PASSWORD)
    return PostmarkReceiver.from_config("postmark", table, reveal=str)


# -- credentials -----------------------------------------------------------------------


async def test_right_credentials_pass() -> None:
    accepted = await source().accept(request(DELIVERY))
    assert len(accepted.events) == 1


async def test_scheme_name_is_case_insensitive() -> None:
    accepted = await source().accept(request(DELIVERY, basic(scheme="basic")))
    assert len(accepted.events) == 1


async def test_password_may_contain_colons() -> None:
    # RFC 7617: only the first colon separates user-id and password.
    accepted = await source(password="a:b:c").accept(request(DELIVERY, basic(password="a:b:c")))
    assert len(accepted.events) == 1


@pytest.mark.parametrize(
    ("authorization", "reason"),
    [
        (basic(username="someone-else"), "wrong"),
        (basic(password="correct horse battery stapler"), "wrong"),
        (basic(password=""), "wrong"),
        (basic(username="", password=""), "wrong"),
        (basic(username="someone-else", password="nope"), "wrong"),
        (basic(username=USERNAME.upper()), "wrong"),
        ("", "missing"),
        ("Bearer " + base64.b64encode(f"{USERNAME}:{PASSWORD}".encode()).decode(), "not Basic"),
        ('Digest username="postmark-hooks"', "not Basic"),
        (base64.b64encode(f"{USERNAME}:{PASSWORD}".encode()).decode(), "not Basic"),
        ("Basic !!!not-base64!!!", "not base64"),
        ("Basic cG9zdG1hcms", "not base64"),  # truncated, bad padding
        ("Basic", "empty"),
        ("Basic   ", "empty"),
        ("Basic " + base64.b64encode(USERNAME.encode()).decode(), "no ':'"),
    ],
)
async def test_bad_credentials_fail(authorization: str, reason: str) -> None:
    with pytest.raises(VerificationFailed, match=reason) as failed:
        await source().accept(request(DELIVERY, authorization))
    assert PASSWORD not in str(failed.value)


async def test_missing_header_fails() -> None:
    no_header = WebhookRequest(body=orjson.dumps(DELIVERY), headers={}, received_at=NOW)
    with pytest.raises(VerificationFailed, match="missing"):
        await source().accept(no_header)


async def test_credentials_are_checked_before_the_body() -> None:
    with pytest.raises(VerificationFailed):
        await source().accept(request(b"not json", basic(password="wrong")))


# -- body ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"",
        b"[1, 2]",
        b'"Delivery"',
        b"null",
        b'{"MessageID": "x"}',
        b'{"RecordType": 5}',
        b'{"RecordType": "Delivery", "DeliveredAt": "yesterday"}',
        b'{"RecordType": "Delivery", "DeliveredAt": 1573000000}',
    ],
)
async def test_malformed_body_fails(body: bytes) -> None:
    with pytest.raises(MalformedPayload):
        await source().accept(request(body))


# -- normalisation ---------------------------------------------------------------------


async def normalise_one(sample: dict[str, Any]) -> Any:
    accepted = await source().accept(request(sample))
    assert accepted.replay_token is None and accepted.confirm_url is None
    [event] = accepted.events
    assert event.payload == sample
    return event


async def test_delivery() -> None:
    event = await normalise_one(DELIVERY)
    assert event.event_type is EventType.DELIVERED
    assert event.provider_type == "Delivery"
    assert event.provider_event_id is None
    assert event.provider_message_id == "883953f4-6105-42a2-a16a-77a8eac79483"
    assert event.recipient == "john@example.com"
    assert event.occurred_at == datetime(2019, 11, 5, 16, 33, 54, 907025, tzinfo=UTC)
    assert event.bounce_type is None and event.list_id is None


async def test_hard_bounce() -> None:
    event = await normalise_one(BOUNCE)
    assert event.event_type is EventType.BOUNCED
    assert event.provider_type == "Bounce"
    assert event.provider_event_id == "bounce:4323372036854775807"
    assert event.provider_message_id == "883953f4-6105-42a2-a16a-77a8eac79483"
    assert event.recipient == "john@example.com"
    assert event.bounce_type is BounceType.PERMANENT
    assert event.bounce_subtype == "HardBounce"
    assert event.occurred_at == datetime(2019, 11, 5, 16, 33, 54, 907025, tzinfo=UTC)
    assert event.list_id is None


async def test_bounce_time_keeps_its_offset() -> None:
    # anymail's recorded bounce: BouncedAt with a -04:00 offset.
    event = await normalise_one(BOUNCE | {"BouncedAt": "2016-04-27T16:28:50.3963933-04:00"})
    assert event.occurred_at == datetime(
        2016, 4, 27, 16, 28, 50, 396393, tzinfo=timezone(timedelta(hours=-4))
    )


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("HardBounce", BounceType.PERMANENT),
        ("BadEmailAddress", BounceType.PERMANENT),
        ("ManuallyDeactivated", BounceType.PERMANENT),
        ("Transient", BounceType.TRANSIENT),
        ("SoftBounce", BounceType.TRANSIENT),
        ("DnsError", BounceType.TRANSIENT),
        ("Blocked", BounceType.TRANSIENT),
        ("DMARCPolicy", BounceType.TRANSIENT),
        ("SpamNotification", BounceType.UNDETERMINED),
        ("VirusNotification", BounceType.UNDETERMINED),
        ("Unknown", BounceType.UNDETERMINED),
        ("Unconfirmed", BounceType.UNDETERMINED),
        ("SMTPApiError", BounceType.UNDETERMINED),
        ("TemplateRenderingFailed", BounceType.UNDETERMINED),
        ("SomethingNew", BounceType.UNDETERMINED),
    ],
)
async def test_bounce_types(kind: str, expected: BounceType) -> None:
    event = await normalise_one(BOUNCE | {"Type": kind})
    assert event.event_type is EventType.BOUNCED
    assert event.bounce_type is expected
    assert event.bounce_subtype == kind


async def test_bounce_without_type_is_undetermined() -> None:
    sample = {k: v for k, v in BOUNCE.items() if k not in ("Type", "TypeCode")}
    event = await normalise_one(sample)
    assert event.bounce_type is BounceType.UNDETERMINED
    assert event.bounce_subtype is None


@pytest.mark.parametrize(
    "kind",
    [
        "AutoResponder",
        "AddressChange",
        "ChallengeVerification",
        "Subscribe",
        "Unsubscribe",
        "OpenRelayTest",
    ],
)
async def test_replies_reported_as_bounces_are_not_bounces(kind: str) -> None:
    event = await normalise_one(BOUNCE | {"Type": kind})
    assert event.event_type is EventType.UNKNOWN
    assert event.provider_type == f"Bounce:{kind}"
    assert event.provider_event_id == "bounce:4323372036854775807"
    assert event.bounce_type is None


async def test_bounce_without_id_has_no_event_id() -> None:
    sample = {k: v for k, v in BOUNCE.items() if k != "ID"}
    assert (await normalise_one(sample)).provider_event_id is None
    assert (await normalise_one(BOUNCE | {"ID": True})).provider_event_id is None
    assert (await normalise_one(BOUNCE | {"ID": "77"})).provider_event_id == "bounce:77"


async def test_spam_complaint() -> None:
    event = await normalise_one(SPAM_COMPLAINT)
    assert event.event_type is EventType.COMPLAINED
    assert event.provider_type == "SpamComplaint"
    assert event.provider_event_id == "bounce:42"
    assert event.recipient == "john@example.com"
    assert event.occurred_at == datetime(2019, 11, 5, 16, 33, 54, 907025, tzinfo=UTC)
    assert event.bounce_type is None


async def test_open() -> None:
    event = await normalise_one(OPEN)
    assert event.event_type is EventType.OPENED
    assert event.provider_event_id is None
    assert event.recipient == "john@example.com"
    assert event.occurred_at == datetime(2019, 11, 5, 16, 33, 54, 907025, tzinfo=UTC)


async def test_click() -> None:
    event = await normalise_one(CLICK)
    assert event.event_type is EventType.CLICKED
    assert event.provider_event_id is None
    assert event.provider_message_id == "00000000-0000-0000-0000-000000000000"
    assert event.recipient == "john@example.com"
    assert event.occurred_at == datetime(2017, 10, 25, 15, 21, 11, 906561, tzinfo=UTC)


async def test_subscription_change_unsubscribe() -> None:
    event = await normalise_one(UNSUBSCRIBE)
    assert event.event_type is EventType.UNSUBSCRIBED
    assert event.provider_type == "SubscriptionChange"
    assert event.list_id == "outbound"
    assert event.recipient == "john@example.com"
    assert event.provider_message_id == "a4909a96-73d7-4c49-b148-a54522d3f7ac"
    assert event.occurred_at == datetime(2022, 6, 5, 17, 17, 32, tzinfo=UTC)
    assert event.provider_event_id is None


async def test_subscription_change_hard_bounce() -> None:
    event = await normalise_one(SUBSCRIPTION_CHANGE_HARD_BOUNCE)
    assert event.event_type is EventType.BOUNCED
    assert event.bounce_type is BounceType.PERMANENT
    assert event.bounce_subtype == "HardBounce"
    assert event.recipient == "bounced-address@wildbit.com"
    assert event.list_id is None
    assert event.occurred_at == datetime(2020, 2, 1, 10, 53, 34, 416071, tzinfo=UTC)


async def test_subscription_change_spam_complaint() -> None:
    event = await normalise_one(UNSUBSCRIBE | {"SuppressionReason": "SpamComplaint"})
    assert event.event_type is EventType.COMPLAINED
    assert event.list_id is None


async def test_subscription_change_resubscribe() -> None:
    event = await normalise_one(RESUBSCRIBE)
    assert event.event_type is EventType.UNKNOWN
    assert event.provider_type == "SubscriptionChange:resubscribe"
    assert event.recipient == "john@example.com"


@pytest.mark.parametrize(
    "change",
    [{"SuppressionReason": "SomethingNew"}, {"SuppressSending": "true"}, {"SuppressSending": None}],
)
async def test_subscription_change_not_understood(change: dict[str, Any]) -> None:
    event = await normalise_one(UNSUBSCRIBE | change)
    assert event.event_type is EventType.UNKNOWN
    assert event.provider_type == "SubscriptionChange"
    assert event.list_id is None


async def test_unknown_record_type() -> None:
    sample = {
        "RecordType": "SMTPApiError",
        "MessageID": "m",
        "Recipient": "a@example.org",
        "FailedAt": "2024-01-01T00:00:00Z",
    }
    event = await normalise_one(sample)
    assert event.event_type is EventType.UNKNOWN
    assert event.provider_type == "SMTPApiError"
    assert event.occurred_at is None
    assert event.recipient == "a@example.org"


# -- config ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ({"username": USERNAME}, "password"),
        ({"password": PASSWORD}, "username"),
        ({"username": USERNAME, "password": ""}, "password"),
        ({"username": "", "password": PASSWORD}, "username"),
        ({"username": "a:b", "password": PASSWORD}, "username"),
        ({"username": USERNAME, "password": PASSWORD, "secret": PASSWORD}, "secret"),
    ],
)
def test_bad_config_is_refused_naming_the_key(table: dict[str, Any], key: str) -> None:
    with pytest.raises(DeliveryConfigError) as refused:
        PostmarkReceiver.from_config("postmark", table, reveal=str)
    assert str(refused.value).startswith(f"{key}:")
    assert PASSWORD not in str(refused.value)


def test_config_reveals_both_and_ignores_common_keys() -> None:
    revealed: list[Any] = []

    def reveal(value: Any) -> str:
        revealed.append(value)
        return {"ref:user": USERNAME, "ref:pass": PASSWORD}[value]

    table = {
        "id": "postmark",
        "provider": "postmark",
        "max_body_bytes": 65536,
        "rate_limit_per_s": 5,
        "rate_limit_burst": 10,
        "payload_fields": ["RecordType"],
        "recipients": "hash",
        "username": "ref:user",
        "password": "ref:pass",
    }
    built = PostmarkReceiver.from_config("postmark", table, reveal=reveal)
    assert revealed == ["ref:user", "ref:pass"]
    assert built.provider == "postmark"
    assert built.content_types == frozenset({"application/json"})
    assert PASSWORD not in repr(built) and USERNAME not in repr(built)


def test_default_payload_fields_keep_no_personal_data() -> None:
    for sample in (DELIVERY, BOUNCE, SPAM_COMPLAINT, OPEN, CLICK, UNSUBSCRIBE):
        kept = minimise_payload(sample, PostmarkReceiver.default_payload_fields)
        dumped = orjson.dumps(kept).decode()
        for personal in (
            "@",
            "Test subject",
            "dump",
            "188.2.95.4",
            "8.8.8.8",
            "Mozilla",
            "https://",
            "a_value",
            "details",
        ):
            assert personal not in dumped, (sample["RecordType"], personal)
        assert kept["RecordType"] == sample["RecordType"]
