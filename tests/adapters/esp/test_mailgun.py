"""adapters.esp.mailgun: JSON webhooks, checked against Mailgun's own vector.

The published vector is a fact copied from Mailgun's PHP library,
mailgun/mailgun-php:tests/Api/WebhookTest.php (testVerifyWebhookGood /
testVerifyWebhookBad): signing key, timestamp 1403645220, token and signature,
and a second token that the same signature does not match. The vector is old,
so requests pass a received_at next to its timestamp. Other requests are
signed in the test with the same key, the way the "Securing Webhooks" page
describes (hex HMAC-SHA256 over timestamp + token).
"""

from __future__ import annotations

import hashlib
import hmac
from datetime import UTC, datetime
from typing import Any

import orjson
import pytest

from inboxd.adapters.esp import base
from inboxd.adapters.esp.base import (
    Accepted,
    DeliveryConfigError,
    MalformedPayload,
    VerificationFailed,
    WebhookRequest,
)
from inboxd.adapters.esp.mailgun import MailgunReceiver, from_config
from inboxd.pipeline.delivery.model import BounceType, EventType

# --- mailgun-php tests/Api/WebhookTest.php ------------------------------------------
MG_SIGNING_KEY = "key-3ax6xnjp29jd6fds4gc373sgvjxteol0"
MG_TIMESTAMP = 1403645220
MG_TOKEN = "5egbgr1vjgqxtrnp65xfznchgdccwh5d6i09vijqi3whgowmn6"
MG_SIGNATURE = "9cfc5c41582e51246e73c88d34db3af0a3a2692a76fbab81492842f000256d33"
MG_OTHER_TOKEN = "owyldpe6nxhmrn78epljl6bj0orrki1u3d2v5e6cnlmmuox8jr"

MESSAGE_ID = "20130503182626.18666.16540@sandbox.mailgun.org"
EVENT_TS = 1403645210.123


def plain(value: Any) -> str:
    return value


def source(key: str = MG_SIGNING_KEY, **extra: Any) -> MailgunReceiver:
    return from_config("mg-main", {"signing_key": key, **extra}, plain)


def event_data(event: str = "delivered", **fields: Any) -> dict[str, Any]:
    return {
        "id": "CPgfbmQMTCKtHW6uIWtuVe",
        "timestamp": EVENT_TS,
        "log-level": "info",
        "event": event,
        "recipient": "alice@example.com",
        "message": {
            "headers": {
                "to": "Alice <alice@example.com>",
                "message-id": MESSAGE_ID,
                "from": "Bob <bob@sandbox.mailgun.org>",
                "subject": "Test",
            }
        },
        "tags": ["my_tag_1"],
        "user-variables": {"my_var_1": "Mailgun Variable #1"},
        **fields,
    }


def sign(timestamp: str, token: str, key: str = MG_SIGNING_KEY) -> str:
    return hmac.new(key.encode(), (timestamp + token).encode(), hashlib.sha256).hexdigest()


def body(data: Any = None, *, envelope: Any = "published", **changes: Any) -> bytes:
    """A webhook body: the published signature object with `changes` applied to
    its fields (None removes one), or `envelope` as the whole signature value."""
    if envelope == "published":
        envelope = {
            "timestamp": str(MG_TIMESTAMP),
            "token": MG_TOKEN,
            "signature": MG_SIGNATURE,
            **changes,
        }
        envelope = {k: v for k, v in envelope.items() if v is not None}
    document: dict[str, Any] = {"signature": envelope}
    document["event-data"] = event_data() if data is None else data
    return orjson.dumps(document)


def request(raw: bytes, received_at: float = MG_TIMESTAMP + 1) -> WebhookRequest:
    return WebhookRequest(
        body=raw, headers={"content-type": "application/json"}, received_at=received_at
    )


def signed(data: Any, token: str = "t" * 50, timestamp: int = MG_TIMESTAMP) -> WebhookRequest:
    signature = {
        "timestamp": str(timestamp),
        "token": token,
        "signature": sign(str(timestamp), token),
    }
    return request(body(data, envelope=signature), received_at=timestamp)


async def one(data: dict[str, Any]) -> Any:
    [event] = (await source().accept(signed(data))).events
    return event


# --- the published vector -----------------------------------------------------------


async def test_published_vector_verifies_and_returns_token() -> None:
    accepted = await source().accept(request(body()))

    assert isinstance(accepted, Accepted)
    assert accepted.replay_token == MG_TOKEN
    [event] = accepted.events
    # Mailgun's id is unique only within about a day: the event time makes it ours.
    assert event.provider_event_id == "CPgfbmQMTCKtHW6uIWtuVe:1403645210.123"
    assert event.provider_type == "delivered"
    assert event.event_type is EventType.DELIVERED
    assert event.occurred_at == datetime.fromtimestamp(EVENT_TS, tz=UTC)
    assert event.message_id_header == MESSAGE_ID
    assert event.provider_message_id == MESSAGE_ID
    assert event.recipient == "alice@example.com"
    assert event.payload == {"event-data": event_data()}


async def test_published_other_token_fails() -> None:
    with pytest.raises(VerificationFailed, match="signature does not verify"):
        await source().accept(request(body(token=MG_OTHER_TOKEN)))


async def test_wrong_key_fails() -> None:
    with pytest.raises(VerificationFailed, match="signature does not verify"):
        await source("key-0000000000000000000000000000000").accept(request(body()))


async def test_tampered_timestamp_fails() -> None:
    # Still inside the tolerance window, but not the signed value.
    with pytest.raises(VerificationFailed, match="signature does not verify"):
        await source().accept(request(body(timestamp=str(MG_TIMESTAMP + 1))))


async def test_tampered_token_fails() -> None:
    with pytest.raises(VerificationFailed, match="signature does not verify"):
        await source().accept(request(body(token=MG_TOKEN[:-1] + "7")))


@pytest.mark.parametrize(
    "signature",
    [
        MG_SIGNATURE[:-2],  # truncated
        MG_SIGNATURE + "00",
        MG_SIGNATURE.replace("9c", "9d", 1),
        "zz" * 32,  # not hex
        "é" * 64,
    ],
)
async def test_bad_signature_value_fails(signature: str) -> None:
    with pytest.raises(VerificationFailed):
        await source().accept(request(body(signature=signature)))


async def test_uppercase_hex_signature_verifies() -> None:
    accepted = await source().accept(request(body(signature=MG_SIGNATURE.upper())))
    assert accepted.replay_token == MG_TOKEN


async def test_integer_timestamp_is_signed_as_its_digits() -> None:
    accepted = await source().accept(request(body(timestamp=MG_TIMESTAMP)))
    assert len(accepted.events) == 1


async def test_parent_signature_verifies_with_primary_key() -> None:
    # A subaccount's domain: `signature` is under the subaccount's key, which we
    # do not have; `parent-signature` is under ours.
    raw = body(signature="0" * 64, **{"parent-signature": MG_SIGNATURE})
    assert (await source().accept(request(raw))).replay_token == MG_TOKEN


@pytest.mark.parametrize(
    ("offset_s", "passes"),
    [
        (0, True),
        (base.DEFAULT_TOLERANCE_S, True),
        (base.DEFAULT_TOLERANCE_S + 1, False),
        (-base.DEFAULT_TOLERANCE_S, True),
        (-base.DEFAULT_TOLERANCE_S - 1, False),
    ],
)
async def test_timestamp_tolerance(offset_s: float, passes: bool) -> None:
    req = request(body(), received_at=MG_TIMESTAMP + offset_s)
    if passes:
        assert (await source().accept(req)).replay_token == MG_TOKEN
    else:
        with pytest.raises(VerificationFailed, match="tolerance"):
            await source().accept(req)


async def test_configured_tolerance_is_used() -> None:
    narrow = source(tolerance_s=2.5)
    assert (await narrow.accept(request(body(), received_at=MG_TIMESTAMP + 2.5))).events
    with pytest.raises(VerificationFailed, match="tolerance"):
        await narrow.accept(request(body(), received_at=MG_TIMESTAMP + 2.6))


# --- no usable signature: VerificationFailed, whatever the key ----------------------


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{",
        b"not json",
        b"\xff",
        b"[]",
        b'"x"',
        b"null",
        orjson.dumps({"event-data": event_data()}),
        body(envelope=None),
        body(envelope=[MG_SIGNATURE]),
        body(envelope=MG_SIGNATURE),
        body(timestamp=None),
        body(timestamp="1403645220.0"),
        body(timestamp="-1"),
        body(timestamp="١٤٠٣٦٤٥٢٢٠"),
        body(timestamp=True),
        body(timestamp=1403645220.0),
        body(token=None),
        body(token=""),
        body(token=7),
        body(signature=None),
        body(signature=""),
        body(signature=1),
        body(signature=None, **{"parent-signature": 5}),
    ],
)
async def test_unusable_signature_is_verification_failure(raw: bytes) -> None:
    with pytest.raises(VerificationFailed):
        await source().accept(request(raw))


async def test_answer_does_not_depend_on_the_key_for_unsigned_garbage() -> None:
    for key in (MG_SIGNING_KEY, "key-other"):
        with pytest.raises(VerificationFailed):
            await source(key).accept(request(b"{not json"))


# --- verified but malformed ---------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        None,
        [],
        "delivered",
        {"id": "x"},  # no event
        {"event": 5},
        {"event": "delivered", "timestamp": "now"},
        {"event": "delivered", "timestamp": False},
        {"event": "delivered", "timestamp": 1e300},
        {"event": "delivered", "recipient": ["a@example.com"]},
        {"event": "failed", "severity": 2},
        {"event": "delivered", "message": {"headers": {"message-id": 42}}},
    ],
)
async def test_malformed_event_data_after_valid_signature(data: Any) -> None:
    document = {
        "signature": {"timestamp": str(MG_TIMESTAMP), "token": MG_TOKEN, "signature": MG_SIGNATURE}
    }
    if data is not None:
        document["event-data"] = data
    with pytest.raises(MalformedPayload):
        await source().accept(request(orjson.dumps(document)))


# --- normalisation ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw_type", "fields", "expected"),
    [
        ("accepted", {}, (EventType.ACCEPTED, None, None)),
        ("delivered", {"delivery-status": {"code": 250}}, (EventType.DELIVERED, None, None)),
        ("rejected", {"reject": {"reason": "virus"}}, (EventType.REJECTED, None, None)),
        ("opened", {"ip": "192.0.2.1"}, (EventType.OPENED, None, None)),
        ("clicked", {"url": "https://example.com"}, (EventType.CLICKED, None, None)),
        ("complained", {}, (EventType.COMPLAINED, None, None)),
        (
            "failed",
            {"severity": "temporary", "reason": "generic", "delivery-status": {"code": 452}},
            (EventType.DEFERRED, None, None),
        ),
        (
            "failed",
            {"severity": "temporary", "reason": "espblock"},
            (EventType.DEFERRED, None, None),
        ),
        (
            "failed",
            {
                "severity": "permanent",
                "reason": "bounce",
                "delivery-status": {"code": 550, "message": "5.1.1 alice@example.com?"},
            },
            (EventType.BOUNCED, BounceType.PERMANENT, "550"),
        ),
        (
            "failed",
            {"severity": "permanent", "reason": "generic"},
            (EventType.BOUNCED, BounceType.PERMANENT, "generic"),
        ),
        (
            "failed",
            {
                "severity": "permanent",
                "reason": "delayed-bounce",
                "delivery-status": {"code": "5.1.1"},
            },
            (EventType.BOUNCED, BounceType.PERMANENT, "5.1.1"),
        ),
        ("failed", {"severity": "permanent"}, (EventType.BOUNCED, BounceType.PERMANENT, None)),
        (
            "failed",
            {"severity": "permanent", "reason": "old", "delivery-status": {"code": 421}},
            (EventType.BOUNCED, BounceType.TRANSIENT, "421"),
        ),
        (
            "failed",
            {"severity": "permanent", "reason": "espblock"},
            (EventType.BOUNCED, BounceType.TRANSIENT, "espblock"),
        ),
        (
            "failed",
            {
                "severity": "permanent",
                "reason": "suppress-bounce",
                "delivery-status": {"code": 605},
            },
            (EventType.SUPPRESSED, None, None),
        ),
        (
            "failed",
            {"severity": "permanent", "reason": "suppress-unsubscribe"},
            (EventType.SUPPRESSED, None, None),
        ),
        (
            "failed",
            {"severity": "permanent", "reason": "suppress-complaint"},
            (EventType.SUPPRESSED, None, None),
        ),
        ("failed", {}, (EventType.BOUNCED, BounceType.UNDETERMINED, None)),
        ("stored", {"storage": {"key": "k"}}, (EventType.UNKNOWN, None, None)),
        ("list_member_uploaded", {}, (EventType.UNKNOWN, None, None)),
    ],
)
async def test_each_event_kind(
    raw_type: str, fields: dict[str, Any], expected: tuple[Any, ...]
) -> None:
    event = await one(event_data(raw_type, **fields))
    assert event.provider_type == raw_type
    assert (event.event_type, event.bounce_type, event.bounce_subtype) == expected
    assert event.list_id is None


async def test_unsubscribe_from_a_mailing_list_is_scoped() -> None:
    event = await one(
        event_data(
            "unsubscribed",
            **{"mailing-list": {"address": "news@lists.example.com", "list-id": "l1"}},
        )
    )
    assert event.event_type is EventType.UNSUBSCRIBED
    assert event.list_id == "news@lists.example.com"


async def test_unsubscribe_without_a_mailing_list_is_source_wide() -> None:
    event = await one(event_data("unsubscribed"))
    assert event.event_type is EventType.UNSUBSCRIBED
    assert event.list_id is None


async def test_unknown_event_keeps_raw_type() -> None:
    event = await one({"event": "something_new", "id": "e1"})
    assert event.event_type is EventType.UNKNOWN
    assert event.provider_type == "something_new"
    assert event.occurred_at is None and event.message_id_header is None
    assert event.provider_message_id is None and event.recipient is None


async def test_same_id_on_another_day_is_another_event() -> None:
    today = await one(event_data(id="dup-id", timestamp=EVENT_TS))
    next_day = await one(event_data(id="dup-id", timestamp=EVENT_TS + 86_400))
    assert today.provider_event_id == "dup-id:1403645210.123"
    assert next_day.provider_event_id == "dup-id:1403731610.123"


async def test_redelivery_keeps_the_event_id() -> None:
    # A redelivery has a new token and signature but the same event-data; the
    # number, not its spelling, makes the id (1403645210 == 1403645210.0).
    first = await source().accept(signed(event_data(timestamp=1403645210), token="a" * 50))
    again = await source().accept(signed(event_data(timestamp=1403645210.0), token="b" * 50))
    [first_event], [again_event] = first.events, again.events
    assert first_event.provider_event_id == again_event.provider_event_id
    assert first_event.provider_event_id == "CPgfbmQMTCKtHW6uIWtuVe:1403645210.0"


@pytest.mark.parametrize("missing", ["id", "timestamp"])
async def test_no_event_id_without_id_and_timestamp(missing: str) -> None:
    data = event_data()
    del data[missing]
    assert (await one(data)).provider_event_id is None


async def test_each_token_is_handed_up() -> None:
    first = await source().accept(signed(event_data(), token="a" * 50))
    second = await source().accept(signed(event_data(), token="b" * 50))
    assert (first.replay_token, second.replay_token) == ("a" * 50, "b" * 50)


async def test_payload_leaves_the_signature_out() -> None:
    event = await one(event_data("opened"))
    assert set(event.payload) == {"event-data"}


def test_default_payload_fields_are_not_personal() -> None:
    fields = MailgunReceiver.default_payload_fields
    assert {"event-data.event", "event-data.id", "event-data.timestamp"} <= set(fields)
    personal = (
        "recipient",
        "envelope",
        "message",
        "mailing-list",
        "user-variables",
        "delivery-status.message",
        "delivery-status.description",
        "ip",
        "url",
    )
    assert not [
        f
        for f in fields
        for p in personal
        if f == f"event-data.{p}" or f.startswith(f"event-data.{p}.")
    ]
    assert MailgunReceiver.provider == "mailgun"
    assert MailgunReceiver.content_types == frozenset({"application/json"})


# --- configuration ------------------------------------------------------------------


def test_from_config_reveals_the_key_and_hides_it() -> None:
    def reveal(value: Any) -> str:
        return MG_SIGNING_KEY if value == "env:MAILGUN_SIGNING_KEY" else "wrong"

    table = {
        "id": "mg-main",
        "provider": "mailgun",
        "max_body_bytes": 65536,
        "rate_limit_per_s": 5,
        "rate_limit_burst": 10,
        "payload_fields": [],
        "recipients": "hash",
        "signing_key": "env:MAILGUN_SIGNING_KEY",
        "tolerance_s": 120,
    }
    src = from_config("mg-main", table, reveal)
    assert src.source_id == "mg-main" and src.tolerance_s == 120.0
    assert MG_SIGNING_KEY not in repr(src)
    assert source().tolerance_s == base.DEFAULT_TOLERANCE_S


async def test_revealed_key_is_the_one_used() -> None:
    src = from_config("mg", {"signing_key": "env:K"}, lambda _: MG_SIGNING_KEY)
    assert (await src.accept(request(body()))).replay_token == MG_TOKEN


def test_from_config_refuses_unknown_keys() -> None:
    with pytest.raises(DeliveryConfigError, match="api_key"):
        from_config("s", {"signing_key": MG_SIGNING_KEY, "api_key": "x"}, plain)


@pytest.mark.parametrize("table", [{}, {"signing_key": ""}, {"signing_key": "   "}])
def test_from_config_requires_a_signing_key(table: dict[str, Any]) -> None:
    with pytest.raises(DeliveryConfigError, match=r"^signing_key"):
        from_config("s", table, plain)


@pytest.mark.parametrize("tolerance", [0, -1, "300", None, False, float("inf")])
def test_from_config_refuses_bad_tolerance(tolerance: Any) -> None:
    with pytest.raises(DeliveryConfigError, match=r"^tolerance_s"):
        source(tolerance_s=tolerance)
