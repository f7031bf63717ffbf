"""Standard Webhooks / Svix verification and Resend normalisation.

The signature vector is the one published with the reference libraries:
standard-webhooks/standard-webhooks `libraries/python/tests/test_webhooks.py`
(`test_sign_function`, `test_invalid_signature_raises_error`,
`test_multi_sig_payload_is_valid`) and svix/svix-webhooks
`python/tests/test_webhooks.py` (same values, `svix-*` headers). Resend samples
are the example payloads of https://resend.com/docs/webhooks/emails/*.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from datetime import UTC, datetime
from typing import Any

import orjson
import pytest

from inboxd.adapters.esp.base import (
    DEFAULT_TOLERANCE_S,
    DeliveryConfigError,
    MalformedPayload,
    VerificationFailed,
    WebhookRequest,
)
from inboxd.adapters.esp.standard_webhooks import StandardWebhooksReceiver, verify_request
from inboxd.pipeline.delivery.model import BounceType, EventType, minimise_payload

# -- the published vector ------------------------------------------------------------
VECTOR_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
VECTOR_KEY = base64.b64decode("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
VECTOR_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
VECTOR_TIMESTAMP = 1614265330
VECTOR_BODY = b'{"test": 2432232314}'
VECTOR_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
# test_invalid_signature_raises_error: the vector with its last base64 digit changed.
VECTOR_WRONG_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OA="
# test_multi_sig_payload_is_valid: decoys around the valid signature.
VECTOR_DECOY_V1 = "v1,Ceo5qEr07ixe2NLpvHk3FH9bwy/WavXrAFQ/9tdO6mc="
VECTOR_DECOY_V2 = "v2,Ceo5qEr07ixe2NLpvHk3FH9bwy/WavXrAFQ/9tdO6mc="

# Two more secrets for rotation tests (whsec_ + base64 of 24 random-looking bytes).
OLD_SECRET = "whsec_" + base64.b64encode(b"old-secret-24-bytes-long").decode()
NEW_SECRET = "whsec_" + base64.b64encode(b"new-secret-24-bytes-long").decode()

NOW = 1732318872  # 2024-11-22T23:41:12Z, about when the Resend samples were created


def vector_headers(prefix: str = "webhook") -> dict[str, str]:
    return {
        f"{prefix}-id": VECTOR_ID,
        f"{prefix}-timestamp": str(VECTOR_TIMESTAMP),
        f"{prefix}-signature": VECTOR_SIGNATURE,
    }


def sign(secret: str, msg_id: str, timestamp: int | str, body: bytes) -> str:
    key = base64.b64decode(secret.removeprefix("whsec_"))
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def signed_request(
    body: bytes,
    *,
    secret: str = VECTOR_SECRET,
    msg_id: str = "msg_2W2D3qXLS5fOaPja1GDg7rF2CwB",
    timestamp: int = NOW,
    received_at: float = NOW,
    prefix: str = "webhook",
) -> WebhookRequest:
    headers = {
        f"{prefix}-id": msg_id,
        f"{prefix}-timestamp": str(timestamp),
        f"{prefix}-signature": sign(secret, msg_id, timestamp, body),
    }
    return WebhookRequest(body=body, headers=headers, received_at=received_at)


def source(**table: Any) -> StandardWebhooksReceiver:
    table.setdefault("secret", VECTOR_SECRET)
    return StandardWebhooksReceiver.from_config("resend", table, reveal=str)


def keys(*secrets: str) -> tuple[bytes, ...]:
    return tuple(base64.b64decode(s.removeprefix("whsec_")) for s in secrets)


# -- signature: the reference vector ---------------------------------------------------


def test_reference_vector_reproduces() -> None:
    assert sign(VECTOR_SECRET, VECTOR_ID, VECTOR_TIMESTAMP, VECTOR_BODY) == VECTOR_SIGNATURE


@pytest.mark.parametrize("prefix", ["webhook", "svix"])
def test_reference_vector_verifies(prefix: str) -> None:
    request = WebhookRequest(VECTOR_BODY, vector_headers(prefix), float(VECTOR_TIMESTAMP))
    assert verify_request(request, (VECTOR_KEY,), DEFAULT_TOLERANCE_S) == VECTOR_ID


async def test_reference_vector_is_verified_before_its_shape_is_refused() -> None:
    # The vector's body is valid JSON but no Resend event (no "type"): past verification,
    # so MalformedPayload and not VerificationFailed.
    request = WebhookRequest(VECTOR_BODY, vector_headers(), float(VECTOR_TIMESTAMP))
    with pytest.raises(MalformedPayload):
        await source().accept(request)


async def test_wrong_signature_fails() -> None:
    headers = vector_headers() | {"webhook-signature": VECTOR_WRONG_SIGNATURE}
    with pytest.raises(VerificationFailed) as failed:
        await source().accept(WebhookRequest(VECTOR_BODY, headers, float(VECTOR_TIMESTAMP)))
    assert "g0hM9SsE" not in str(failed.value)
    assert "MfKQ9r8G" not in str(failed.value)


async def test_wrong_secret_fails() -> None:
    request = WebhookRequest(VECTOR_BODY, vector_headers(), float(VECTOR_TIMESTAMP))
    with pytest.raises(VerificationFailed):
        await source(secret=OLD_SECRET).accept(request)


@pytest.mark.parametrize("missing", ["webhook-id", "webhook-timestamp", "webhook-signature"])
async def test_missing_header_fails(missing: str) -> None:
    headers = vector_headers()
    del headers[missing]
    with pytest.raises(VerificationFailed, match=missing):
        await source().accept(WebhookRequest(VECTOR_BODY, headers, float(VECTOR_TIMESTAMP)))


@pytest.mark.parametrize("missing", ["svix-id", "svix-timestamp", "svix-signature"])
async def test_missing_svix_header_fails(missing: str) -> None:
    headers = vector_headers("svix")
    del headers[missing]
    with pytest.raises(VerificationFailed, match=missing):
        await source().accept(WebhookRequest(VECTOR_BODY, headers, float(VECTOR_TIMESTAMP)))


async def test_no_headers_at_all_fails() -> None:
    with pytest.raises(VerificationFailed, match="webhook-id"):
        await source().accept(WebhookRequest(VECTOR_BODY, {}, float(VECTOR_TIMESTAMP)))


@pytest.mark.parametrize(
    "signature",
    [
        VECTOR_SIGNATURE[:-8],  # truncated
        VECTOR_SIGNATURE[:-1],  # last padding character cut
        "v1,",  # nothing after the version
        VECTOR_SIGNATURE.removeprefix("v1,"),  # no version
        "v1a," + VECTOR_SIGNATURE[3:],  # another version with the right bytes
        "v1 " + VECTOR_SIGNATURE[3:],  # malformed separator
    ],
)
def test_truncated_or_malformed_signature_fails(signature: str) -> None:
    headers = vector_headers() | {"webhook-signature": signature}
    request = WebhookRequest(VECTOR_BODY, headers, float(VECTOR_TIMESTAMP))
    with pytest.raises(VerificationFailed, match="signature"):
        verify_request(request, (VECTOR_KEY,), DEFAULT_TOLERANCE_S)


def test_one_matching_signature_among_several_passes() -> None:
    header = " ".join([VECTOR_DECOY_V1, VECTOR_DECOY_V2, VECTOR_SIGNATURE, VECTOR_DECOY_V1])
    request = WebhookRequest(
        VECTOR_BODY, vector_headers() | {"webhook-signature": header}, float(VECTOR_TIMESTAMP)
    )
    assert verify_request(request, (VECTOR_KEY,), DEFAULT_TOLERANCE_S) == VECTOR_ID


def test_several_signatures_none_matching_fails() -> None:
    header = " ".join([VECTOR_DECOY_V1, VECTOR_DECOY_V2, VECTOR_WRONG_SIGNATURE])
    request = WebhookRequest(
        VECTOR_BODY, vector_headers() | {"webhook-signature": header}, float(VECTOR_TIMESTAMP)
    )
    with pytest.raises(VerificationFailed):
        verify_request(request, (VECTOR_KEY,), DEFAULT_TOLERANCE_S)


# -- timestamp -------------------------------------------------------------------------


@pytest.mark.parametrize("skew_s", [0, 300, -300, 299.9, -299.9])
def test_timestamp_inside_tolerance_passes(skew_s: float) -> None:
    request = WebhookRequest(VECTOR_BODY, vector_headers(), VECTOR_TIMESTAMP + skew_s)
    assert verify_request(request, (VECTOR_KEY,), DEFAULT_TOLERANCE_S) == VECTOR_ID


@pytest.mark.parametrize(
    ("skew_s", "reason"),
    [
        (301, "too old"),
        (300.5, "too old"),
        (-301, "too new"),
        (-300.5, "too new"),
    ],
)
def test_timestamp_outside_tolerance_fails(skew_s: float, reason: str) -> None:
    # received_at - timestamp = skew: a stale request arrives later than signed, a
    # "future" one earlier.
    request = WebhookRequest(VECTOR_BODY, vector_headers(), VECTOR_TIMESTAMP + skew_s)
    with pytest.raises(VerificationFailed, match=reason):
        verify_request(request, (VECTOR_KEY,), DEFAULT_TOLERANCE_S)


@pytest.mark.parametrize(
    "timestamp",
    [
        "hello",
        "1614265330.0",
        "-1614265330",
        "1614265330 ",
        "+1614265330",
        "1e9",
        "٣",
        "1" * 40,
    ],
)
def test_non_integer_timestamp_fails(timestamp: str) -> None:
    # Signed over the odd timestamp, so only the timestamp check can refuse it.
    headers = {
        "webhook-id": VECTOR_ID,
        "webhook-timestamp": timestamp,
        "webhook-signature": sign(VECTOR_SECRET, VECTOR_ID, timestamp, VECTOR_BODY),
    }
    request = WebhookRequest(VECTOR_BODY, headers, float(VECTOR_TIMESTAMP))
    with pytest.raises(VerificationFailed):
        verify_request(request, (VECTOR_KEY,), DEFAULT_TOLERANCE_S)


async def test_configured_tolerance_is_used() -> None:
    narrow = source(tolerance_s=10)
    request = WebhookRequest(VECTOR_BODY, vector_headers(), VECTOR_TIMESTAMP + 11.0)
    with pytest.raises(VerificationFailed, match="too old"):
        await narrow.accept(request)


# -- body ------------------------------------------------------------------------------


def test_reserialised_body_fails() -> None:
    # A proxy or framework that parses and re-dumps the JSON changes the bytes.
    reserialised = json.dumps(json.loads(VECTOR_BODY), separators=(",", ":")).encode()
    assert reserialised != VECTOR_BODY
    request = WebhookRequest(reserialised, vector_headers(), float(VECTOR_TIMESTAMP))
    with pytest.raises(VerificationFailed):
        verify_request(request, (VECTOR_KEY,), DEFAULT_TOLERANCE_S)


@pytest.mark.parametrize(
    "body", [b'{"type": "email.sent",', b"", b"\xff\xfe", b"[1, 2]", b'"email.sent"', b"null"]
)
async def test_malformed_body_after_valid_signature(body: bytes) -> None:
    with pytest.raises(MalformedPayload):
        await source().accept(signed_request(body))


@pytest.mark.parametrize(
    "body",
    [
        {"data": {}},
        {"type": 7, "data": {}},
        {"type": "email.sent", "data": []},
        {"type": "email.sent", "created_at": "yesterday", "data": {}},
    ],
)
async def test_wrong_shape_after_valid_signature(body: dict[str, Any]) -> None:
    with pytest.raises(MalformedPayload):
        await source().accept(signed_request(orjson.dumps(body)))


# -- header sets -----------------------------------------------------------------------


async def test_svix_headers_are_accepted() -> None:
    accepted = await source().accept(signed_request(orjson.dumps(SENT), prefix="svix"))
    assert accepted.events[0].provider_event_id == "msg_2W2D3qXLS5fOaPja1GDg7rF2CwB"


async def test_webhook_headers_are_preferred_over_svix() -> None:
    body = orjson.dumps(SENT)
    good = signed_request(body, msg_id="msg_good")
    bad_svix = {"svix-id": "msg_other", "svix-timestamp": "1", "svix-signature": "v1,AAAA"}
    accepted = await source().accept(WebhookRequest(body, dict(good.headers) | bad_svix, NOW))
    assert accepted.events[0].provider_event_id == "msg_good"

    good_svix = signed_request(body, prefix="svix").headers
    bad_webhook = {
        "webhook-id": "msg_x",
        "webhook-timestamp": str(NOW),
        "webhook-signature": VECTOR_WRONG_SIGNATURE,
    }
    with pytest.raises(VerificationFailed):
        await source().accept(WebhookRequest(body, dict(good_svix) | bad_webhook, NOW))


# -- rotation --------------------------------------------------------------------------


async def test_rotation_accepts_both_secrets_while_both_configured() -> None:
    both = source(secret=OLD_SECRET, next_secret=NEW_SECRET)
    body = orjson.dumps(SENT)
    for secret in (OLD_SECRET, NEW_SECRET):
        accepted = await both.accept(signed_request(body, secret=secret))
        assert accepted.events[0].event_type is EventType.ACCEPTED


async def test_rotation_accepts_a_header_signed_with_both() -> None:
    body = orjson.dumps(SENT)
    old = sign(OLD_SECRET, "msg_1", NOW, body)
    new = sign(NEW_SECRET, "msg_1", NOW, body)
    headers = {
        "webhook-id": "msg_1",
        "webhook-timestamp": str(NOW),
        "webhook-signature": f"{old} {new}",
    }
    accepted = await source(secret=NEW_SECRET).accept(WebhookRequest(body, headers, NOW))
    assert accepted.events[0].provider_event_id == "msg_1"


async def test_retired_secret_fails() -> None:
    after_retirement = source(secret=NEW_SECRET)
    body = orjson.dumps(SENT)
    with pytest.raises(VerificationFailed):
        await after_retirement.accept(signed_request(body, secret=OLD_SECRET))
    accepted = await after_retirement.accept(signed_request(body, secret=NEW_SECRET))
    assert len(accepted.events) == 1


def test_rotation_through_verify_request() -> None:
    body = b"{}"
    request = signed_request(body, secret=NEW_SECRET)
    assert verify_request(request, keys(OLD_SECRET, NEW_SECRET), DEFAULT_TOLERANCE_S)
    with pytest.raises(VerificationFailed):
        verify_request(request, keys(OLD_SECRET), DEFAULT_TOLERANCE_S)


# -- config ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ({"secret": "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"}, "secret"),  # no whsec_ prefix
        ({"secret": "whsec_not base64!!"}, "secret"),
        ({"secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaS"}, "secret"),  # bad padding
        ({"secret": "whsec_"}, "secret"),
        ({"secret": VECTOR_SECRET, "next_secret": "hunter2hunter2"}, "next_secret"),
        ({}, "secret"),
        ({"secret": VECTOR_SECRET, "tolerance_s": 0}, "tolerance_s"),
        ({"secret": VECTOR_SECRET, "tolerance_s": -5}, "tolerance_s"),
        ({"secret": VECTOR_SECRET, "tolerance_s": "300"}, "tolerance_s"),
        ({"secret": VECTOR_SECRET, "tolerance_s": True}, "tolerance_s"),
        ({"secret": VECTOR_SECRET, "tolerance_s": float("nan")}, "tolerance_s"),
        ({"secret": VECTOR_SECRET, "tolerance_s": float("inf")}, "tolerance_s"),
        ({"secret": VECTOR_SECRET, "signing_secret": VECTOR_SECRET}, "signing_secret"),
    ],
)
def test_bad_config_is_refused_naming_the_key(table: dict[str, Any], key: str) -> None:
    with pytest.raises(DeliveryConfigError) as refused:
        StandardWebhooksReceiver.from_config("resend", table, reveal=str)
    message = str(refused.value)
    assert message.startswith(f"{key}:")
    for value in table.values():
        if isinstance(value, str) and len(value) > 8:
            assert value.removeprefix("whsec_") not in message


def test_config_ignores_common_keys_and_reveals_secrets() -> None:
    class FakeSecret:
        def __init__(self, value: str) -> None:
            self.value = value

        def __repr__(self) -> str:
            return "FakeSecret('env:RESEND_SECRET')"

    revealed: list[str] = []

    def reveal(value: Any) -> str:
        result = value.value if isinstance(value, FakeSecret) else str(value)
        revealed.append(result)
        return result

    table = {
        "id": "resend",
        "provider": "standard_webhooks",
        "max_body_bytes": 65536,
        "rate_limit_per_s": 10,
        "rate_limit_burst": 20,
        "payload_fields": ["type"],
        "recipients": "hash",
        "secret": FakeSecret(VECTOR_SECRET),
        "next_secret": FakeSecret(NEW_SECRET),
        "tolerance_s": 120,
    }
    built = StandardWebhooksReceiver.from_config("resend", table, reveal=reveal)
    assert revealed == [VECTOR_SECRET, NEW_SECRET]
    assert built.tolerance_s == 120.0
    assert built.provider == "standard_webhooks"
    assert built.content_types == frozenset({"application/json"})
    text = repr(built)
    assert "resend" in text
    for secret in (VECTOR_SECRET, NEW_SECRET):
        assert secret.removeprefix("whsec_") not in text
    assert VECTOR_KEY.hex() not in text


# -- normalisation: Resend's documented samples ----------------------------------------

_COMMON = {
    "broadcast_id": "8b146471-e88e-4322-86af-016cd36fd216",
    "created_at": "2024-11-22T23:41:11.894719+00:00",
    "email_id": "56761188-7520-42d8-8898-ff6fc54ce618",
    "from": "Acme <onboarding@resend.dev>",
    "to": ["delivered@resend.dev"],
    "subject": "Sending this example",
    "template_id": "43f68331-0622-4e15-8202-246a0388854b",
    "tags": {"category": "confirm_email"},
}


def resend_event(event_type: str, **data: Any) -> dict[str, Any]:
    return {"type": event_type, "created_at": "2024-11-22T23:41:12.126Z", "data": _COMMON | data}


SENT = resend_event("email.sent")

SAMPLES: list[tuple[dict[str, Any], EventType]] = [
    (resend_event("email.sent"), EventType.ACCEPTED),
    (resend_event("email.delivered"), EventType.DELIVERED),
    (resend_event("email.delivery_delayed"), EventType.DEFERRED),
    (resend_event("email.complained"), EventType.COMPLAINED),
    (resend_event("email.opened"), EventType.OPENED),
    (
        resend_event(
            "email.clicked",
            click={
                "ipAddress": "122.115.53.11",
                "link": "https://resend.com",
                "timestamp": "2024-11-24T05:00:57.163Z",
                "userAgent": "Mozilla/5.0 (Macintosh; Intel Mac OS X 10_15_7)",
            },
        ),
        EventType.CLICKED,
    ),
    (resend_event("email.failed", failed={"reason": "reached_daily_quota"}), EventType.REJECTED),
    (
        resend_event(
            "email.suppressed",
            suppressed={
                "message": "Resend has suppressed sending to this address because it is on the "
                "account-level suppression list.",
                "type": "OnAccountSuppressionList",
            },
        ),
        EventType.SUPPRESSED,
    ),
    (resend_event("email.scheduled"), EventType.UNKNOWN),
    (resend_event("email.received", message_id="<example+123>", cc=[], bcc=[]), EventType.UNKNOWN),
    (
        resend_event(
            "email.bounced",
            bounce={
                "message": "The recipient's email address is on the suppression list because it "
                "has a recent history of producing hard bounces.",
                "subType": "Suppressed",
                "type": "Permanent",
            },
        ),
        EventType.BOUNCED,
    ),
]


@pytest.mark.parametrize(("sample", "expected"), SAMPLES, ids=[s["type"] for s, _ in SAMPLES])
async def test_resend_samples_normalise(sample: dict[str, Any], expected: EventType) -> None:
    accepted = await source().accept(signed_request(orjson.dumps(sample), msg_id="msg_1"))
    assert accepted.replay_token is None and accepted.confirm_url is None
    [event] = accepted.events
    assert event.event_type is expected
    assert event.provider_type == sample["type"]
    assert event.provider_event_id == "msg_1"
    assert event.provider_message_id == "56761188-7520-42d8-8898-ff6fc54ce618"
    assert event.recipient == "delivered@resend.dev"
    assert event.occurred_at == datetime(2024, 11, 22, 23, 41, 12, 126000, tzinfo=UTC)
    assert event.payload == sample
    assert event.list_id is None
    if expected is EventType.BOUNCED:
        assert event.bounce_type is BounceType.PERMANENT
        assert event.bounce_subtype == "Suppressed"
    else:
        assert event.bounce_type is None and event.bounce_subtype is None


@pytest.mark.parametrize(
    ("bounce", "bounce_type", "subtype"),
    [
        ({"type": "Permanent", "subType": "General"}, BounceType.PERMANENT, "General"),
        ({"type": "Transient", "subType": "MailboxFull"}, BounceType.TRANSIENT, "MailboxFull"),
        ({"type": "Temporary"}, BounceType.TRANSIENT, None),
        (
            {"type": "Undetermined", "subType": "Undetermined"},
            BounceType.UNDETERMINED,
            "Undetermined",
        ),
        ({"type": "Sideways"}, BounceType.UNDETERMINED, None),
        # Older payloads (django-anymail's recorded Resend bounce) carry only a message.
        (
            {"message": "The recipient's email provider sent a hard bounce message"},
            BounceType.UNDETERMINED,
            None,
        ),
        (None, BounceType.UNDETERMINED, None),
    ],
)
async def test_bounce_types(
    bounce: dict[str, Any] | None,
    bounce_type: BounceType,
    subtype: str | None,
) -> None:
    sample = resend_event("email.bounced", bounce=bounce)
    [event] = (await source().accept(signed_request(orjson.dumps(sample)))).events
    assert event.event_type is EventType.BOUNCED
    assert event.bounce_type is bounce_type
    assert event.bounce_subtype == subtype


async def test_unknown_type_is_kept_raw() -> None:
    sample = {
        "type": "contact.created",
        "created_at": "2024-11-22T23:41:12.126Z",
        "data": {"id": "e169aa45-1ecf-4183-9955-b1499d5701d3"},
    }
    [event] = (await source().accept(signed_request(orjson.dumps(sample), msg_id="m"))).events
    assert event.event_type is EventType.UNKNOWN
    assert event.provider_type == "contact.created"
    assert event.provider_event_id == "m"
    assert event.recipient is None
    assert event.provider_message_id is None


async def test_several_recipients_give_one_event_each() -> None:
    # data.to as in django-anymail's recorded Resend sent event: display names allowed.
    sample = resend_event("email.delivered", to=["Recipient <to@example.org>", "to2@example.org"])
    events = (await source().accept(signed_request(orjson.dumps(sample), msg_id="msg_9"))).events
    assert [e.recipient for e in events] == ["to@example.org", "to2@example.org"]
    assert [e.provider_event_id for e in events] == ["msg_9:0", "msg_9:1"]
    assert {e.event_type for e in events} == {EventType.DELIVERED}


async def test_no_recipient_still_gives_one_event() -> None:
    sample = resend_event("email.failed", to=[])
    [event] = (await source().accept(signed_request(orjson.dumps(sample), msg_id="m"))).events
    assert event.recipient is None
    assert event.provider_event_id == "m"


async def test_missing_created_at_leaves_occurred_at_unset() -> None:
    sample = {"type": "email.sent", "data": {"email_id": "e", "to": ["a@example.org"]}}
    [event] = (await source().accept(signed_request(orjson.dumps(sample)))).events
    assert event.occurred_at is None


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"message_id": "<111-222-333@email.example.com>"}, "<111-222-333@email.example.com>"),
        (
            {
                "headers": [
                    {"name": "Reply-To", "value": "reply@example.com"},
                    {"name": "Message-ID", "value": "<abc@example.org>"},
                ]
            },
            "<abc@example.org>",
        ),
        ({"headers": {"message-id": "<def@example.org>"}}, "<def@example.org>"),
        ({"headers": [{"name": "Reply-To", "value": "reply@example.com"}, "junk"]}, None),
        ({"headers": "Message-ID: <x@y>"}, None),
    ],
)
async def test_message_id_header(data: dict[str, Any], expected: str | None) -> None:
    sample = resend_event("email.delivered", **data)
    [event] = (await source().accept(signed_request(orjson.dumps(sample)))).events
    assert event.message_id_header == expected


def test_default_payload_fields_keep_no_personal_data() -> None:
    sample = resend_event(
        "email.bounced",
        bounce={
            "message": "550 5.1.1 <delivered@resend.dev>: user unknown",
            "subType": "General",
            "type": "Permanent",
        },
        click={"link": "https://example.com/reset?token=s3cr3t", "ipAddress": "192.0.2.1"},
    )
    kept = minimise_payload(sample, StandardWebhooksReceiver.default_payload_fields)
    dumped = orjson.dumps(kept).decode()
    for personal in ("@", "Sending this example", "token=", "192.0.2.1"):
        assert personal not in dumped
    assert kept["data"]["bounce"] == {"type": "Permanent", "subType": "General"}
    assert kept["type"] == "email.bounced"


# -- hostile input that once escaped as a 500 (security review) --------------------------


async def test_an_id_that_is_not_utf8_is_refused_not_a_crash() -> None:
    body = b'{"type": "email.delivered", "data": {"to": ["a@x.example"]}}'
    request = signed_request(body)
    headers = {**request.headers, "webhook-id": "\udcff"}  # aiohttp's surrogateescape
    with pytest.raises(VerificationFailed):
        await source().accept(WebhookRequest(body=body, headers=headers, received_at=NOW))


async def test_a_timestamp_padded_with_thousands_of_zeros_is_checked_not_a_crash() -> None:
    body = b'{"type": "email.delivered", "data": {"to": ["a@x.example"]}}'
    padded = "0" * 4400 + str(NOW)
    request = signed_request(body)
    headers = {
        **request.headers,
        "webhook-timestamp": padded,
        "webhook-signature": sign(VECTOR_SECRET, "msg_2W2D3qXLS5fOaPja1GDg7rF2CwB", padded, body),
    }
    accepted = await source().accept(WebhookRequest(body=body, headers=headers, received_at=NOW))
    assert len(accepted.events) == 1  # the same second, however it is written


async def test_deeply_nested_comments_in_a_recipient_do_not_crash() -> None:
    body = b'{"type": "email.delivered", "data": {"to": ["' + b"(" * 500 + b'"]}}'
    accepted = await source().accept(signed_request(body))
    assert [e.recipient for e in accepted.events] == ["(" * 500]
