"""adapters.esp.sendgrid: the signed Event Webhook, checked against SendGrid's own vectors.

The published vectors are facts copied from SendGrid's reference libraries:
- sendgrid/sendgrid-python, test/unit/test_eventwebhook.py (a "dropped" batch,
  timestamp 1600112502, its key and signature, a second "bad" key and a bad
  signature);
- sendgrid/sendgrid-nodejs, packages/eventwebhook/src/eventwebhook.spec.js
  (a signed JSON *object* body, timestamp 1588788367).
Both vectors are years old, so each request passes a received_at next to the
vector's timestamp. Everything else is signed in the test with a fresh P-256 key.
"""

from __future__ import annotations

import base64
import textwrap
from datetime import UTC, datetime
from typing import Any

import orjson
import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from multidict import CIMultiDict

from inboxd.adapters.esp import base
from inboxd.adapters.esp.base import (
    Accepted,
    DeliveryConfigError,
    MalformedPayload,
    VerificationFailed,
    WebhookRequest,
)
from inboxd.adapters.esp.sendgrid import SendGridReceiver, from_config
from inboxd.pipeline.delivery.model import BounceType, EventType, dedup_key

# --- sendgrid-python test/unit/test_eventwebhook.py ---------------------------------
PY_PUBLIC_KEY = (
    "MFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAE83T4O/n84iotIvIW4mdBgQ/7dAfSmpqIM8kF9mN1flpVKS3G"
    "Rqe62gw+2fNNRaINXvVpiglSI8eNEc6wEA3F+g=="
)
PY_SIGNATURE = (
    "MEUCIGHQVtGj+Y3LkG9fLcxf3qfI10QysgDWmMOVmxG0u6ZUAiEAyBiXDWzM+uOe5W0JuG+luQAbPIqHh89M"
    "15TluLtEZtM="
)
PY_TIMESTAMP = "1600112502"
# json.dumps(..., sort_keys=True, separators=(",", ":")) + "\r\n", as the library builds it.
PY_PAYLOAD = (
    b'[{"email":"hello@world.com","event":"dropped","reason":"Bounced Address",'
    b'"sg_event_id":"ZHJvcC0xMDk5NDkxOS1MUnpYbF9OSFN0T0doUTRrb2ZTbV9BLTA",'
    b'"sg_message_id":"LRzXl_NHStOGhQ4kofSm_A.filterdrecv-p3mdw1-756b745b58-kmzbl-18-'
    b'5F5FC76C-9.0","smtp-id":"<LRzXl_NHStOGhQ4kofSm_A@ismtpd0039p1iad1.sendgrid.net>",'
    b'"timestamp":1600112492}]\r\n'
)
# The same test's "bad key" (a valid P-256 key that did not sign the payload) and
# "bad signature" (a valid DER signature of something else).
PY_OTHER_KEY = (
    "MFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAEqTxd43gyp8IOEto2LdIfjRQrIbsd4SXZkLW6jDutdhXSJCWH"
    "w8REntlo7aNDthvj+y7GjUuFDb/R1NGe1OPzpA=="
)
PY_BAD_SIGNATURE = (
    "MEUCIQCtIHJeH93Y+qpYeWrySphQgpNGNr/U+UyUlBkU6n7RAwIgJTz2C+8a8xonZGi6BpSzoQsbVRamr2nl"
    "xFDWYNH3j/0="
)

# --- sendgrid-nodejs packages/eventwebhook/src/eventwebhook.spec.js -----------------
NODE_PUBLIC_KEY = (
    "MFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAEEDr2LjtURuePQzplybdC+u4CwrqDqBaWjcMMsTbhdbcwHBce"
    "pxo7yAQGhHPTnlvFYPAZFceEu/1FwCM/QmGUhA=="
)
NODE_SIGNATURE = (
    "MEUCIQCtIHJeH93Y+qpYeWrySphQgpNGNr/U+UyUlBkU6n7RAwIgJTz2C+8a8xonZGi6BpSzoQsbVRamr2nl"
    "xFDWYNH2j/0="
)
NODE_TIMESTAMP = "1588788367"
NODE_PAYLOAD = b'{"category":"example_payload","event":"test_event","message_id":"message_id"}'

SIG = "x-twilio-email-event-webhook-signature"
TS = "x-twilio-email-event-webhook-timestamp"
NOW = 1_700_000_000


def plain(value: Any) -> str:
    return value


def source(public_key: str = PY_PUBLIC_KEY, **extra: Any) -> SendGridReceiver:
    return from_config("sg-main", {"public_key": public_key, **extra}, plain)


def request(
    body: bytes, signature: str | None, timestamp: str | None, received_at: float
) -> WebhookRequest:
    headers = {}
    if signature is not None:
        headers[SIG] = signature
    if timestamp is not None:
        headers[TS] = timestamp
    return WebhookRequest(body=body, headers=headers, received_at=received_at)


def published(received_at: float = int(PY_TIMESTAMP) + 1, **changes: Any) -> WebhookRequest:
    values = {"body": PY_PAYLOAD, "signature": PY_SIGNATURE, "timestamp": PY_TIMESTAMP}
    values.update(changes)
    return request(values["body"], values["signature"], values["timestamp"], received_at)


class Signer:
    """A fresh P-256 key pair: the source that trusts it, and signed requests."""

    def __init__(self) -> None:
        self.private = ec.generate_private_key(ec.SECP256R1())
        der = self.private.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        self.public_b64 = base64.b64encode(der).decode("ascii")

    def source(self) -> SendGridReceiver:
        return source(self.public_b64)

    def request(self, body: bytes, timestamp: int = NOW) -> WebhookRequest:
        signed = str(timestamp).encode("ascii") + body
        signature = self.private.sign(signed, ec.ECDSA(hashes.SHA256()))
        return request(
            body, base64.b64encode(signature).decode("ascii"), str(timestamp), float(timestamp)
        )

    def batch(self, *events: dict[str, Any]) -> WebhookRequest:
        return self.request(orjson.dumps(list(events)))


@pytest.fixture
def signer() -> Signer:
    return Signer()


# --- the published vectors ----------------------------------------------------------


async def test_published_vector_verifies_and_normalises() -> None:
    accepted = await source().accept(published())

    assert isinstance(accepted, Accepted)
    assert accepted.replay_token is None and accepted.confirm_url is None
    [event] = accepted.events
    assert event.provider_event_id == "ZHJvcC0xMDk5NDkxOS1MUnpYbF9OSFN0T0doUTRrb2ZTbV9BLTA"
    assert event.provider_type == "dropped"
    # "Bounced Address" names SendGrid's bounce list: the address is suppressed.
    assert event.event_type is EventType.SUPPRESSED
    assert event.occurred_at == datetime(2020, 9, 14, 19, 41, 32, tzinfo=UTC)
    assert event.occurred_at.timestamp() == 1600112492
    assert event.provider_message_id == "LRzXl_NHStOGhQ4kofSm_A"
    assert event.message_id_header == "<LRzXl_NHStOGhQ4kofSm_A@ismtpd0039p1iad1.sendgrid.net>"
    assert event.recipient == "hello@world.com"
    assert event.bounce_type is None and event.list_id is None
    assert event.payload["reason"] == "Bounced Address"


async def test_published_key_as_pem_verifies() -> None:
    pem = (
        "-----BEGIN PUBLIC KEY-----\n"
        + "\n".join(textwrap.wrap(PY_PUBLIC_KEY, 64))
        + "\n-----END PUBLIC KEY-----\n"
    )
    accepted = await source(pem).accept(published())
    assert len(accepted.events) == 1


async def test_published_other_key_fails() -> None:
    with pytest.raises(VerificationFailed, match="signature"):
        await source(PY_OTHER_KEY).accept(published())


async def test_published_bad_signature_fails() -> None:
    with pytest.raises(VerificationFailed, match="signature"):
        await source().accept(published(signature=PY_BAD_SIGNATURE))


async def test_published_non_numeric_timestamp_fails() -> None:
    with pytest.raises(VerificationFailed, match="timestamp"):
        await source().accept(published(timestamp="timestamp"))


async def test_published_payload_replaced_fails() -> None:
    with pytest.raises(VerificationFailed):
        await source().accept(published(body=b"payload"))


async def test_reserialised_body_fails() -> None:
    # Same events, different bytes (json default separators, no trailing CRLF).
    reserialised = orjson.dumps(orjson.loads(PY_PAYLOAD))
    assert orjson.loads(reserialised) == orjson.loads(PY_PAYLOAD)
    with pytest.raises(VerificationFailed):
        await source().accept(published(body=reserialised))


async def test_trailing_bytes_are_signed_too() -> None:
    with pytest.raises(VerificationFailed):
        await source().accept(published(body=PY_PAYLOAD.rstrip(b"\r\n")))


async def test_other_timestamp_in_window_fails() -> None:
    # Within tolerance, but not the timestamp that was signed.
    with pytest.raises(VerificationFailed, match="signature"):
        await source().accept(published(timestamp=str(int(PY_TIMESTAMP) + 1)))


async def test_nodejs_vector_verifies_but_an_object_body_is_malformed() -> None:
    nodejs = source(NODE_PUBLIC_KEY)
    signed = request(NODE_PAYLOAD, NODE_SIGNATURE, NODE_TIMESTAMP, int(NODE_TIMESTAMP))
    with pytest.raises(MalformedPayload, match="array"):
        await nodejs.accept(signed)
    # The same request with one bit of the signature changed is not verified,
    # so it never gets as far as the body.
    tampered = NODE_SIGNATURE.replace("H2j", "H3j")
    with pytest.raises(VerificationFailed):
        await nodejs.accept(request(NODE_PAYLOAD, tampered, NODE_TIMESTAMP, int(NODE_TIMESTAMP)))


async def test_headers_are_case_insensitive_as_aiohttp_gives_them() -> None:
    headers = CIMultiDict(
        {
            "X-Twilio-Email-Event-Webhook-Signature": PY_SIGNATURE,
            "X-Twilio-Email-Event-Webhook-Timestamp": PY_TIMESTAMP,
        }
    )
    req = WebhookRequest(body=PY_PAYLOAD, headers=headers, received_at=int(PY_TIMESTAMP))
    assert len((await source().accept(req)).events) == 1


# --- header and signature failures --------------------------------------------------


@pytest.mark.parametrize("missing", ["signature", "timestamp"])
async def test_missing_header_fails(missing: str) -> None:
    with pytest.raises(VerificationFailed, match="missing header"):
        await source().accept(published(**{missing: None}))


@pytest.mark.parametrize("empty", ["signature", "timestamp"])
async def test_empty_header_fails(empty: str) -> None:
    with pytest.raises(VerificationFailed, match="missing header"):
        await source().accept(published(**{empty: ""}))


async def test_truncated_signature_fails() -> None:
    der = base64.b64decode(PY_SIGNATURE)
    truncated = base64.b64encode(der[:-4]).decode("ascii")
    with pytest.raises(VerificationFailed, match="signature does not verify"):
        await source().accept(published(signature=truncated))
    with pytest.raises(VerificationFailed):
        await source().accept(published(signature=PY_SIGNATURE[:-6]))


@pytest.mark.parametrize("garbage", ["not base64!", "MEUC*IGHQ", "é" * 8, "===="])
async def test_garbage_base64_fails(garbage: str) -> None:
    with pytest.raises(VerificationFailed):
        await source().accept(published(signature=garbage))


async def test_valid_base64_that_is_not_der_fails() -> None:
    with pytest.raises(VerificationFailed, match="signature does not verify"):
        await source().accept(published(signature=base64.b64encode(b"garbage").decode()))


@pytest.mark.parametrize(
    "timestamp", ["-1600112502", "1600112502.0", " 1600112502", "١٦٠٠١١٢٥٠٢", "1_600_112_502"]
)
async def test_non_digit_timestamp_fails(timestamp: str) -> None:
    with pytest.raises(VerificationFailed, match="timestamp"):
        await source().accept(published(timestamp=timestamp))


@pytest.mark.parametrize(
    ("offset_s", "passes"),
    [
        (0, True),
        (base.DEFAULT_TOLERANCE_S, True),  # received 5 min after signing: inside
        (base.DEFAULT_TOLERANCE_S + 1, False),  # stale
        (-base.DEFAULT_TOLERANCE_S, True),  # signed 5 min "in the future": inside
        (-base.DEFAULT_TOLERANCE_S - 1, False),  # from the future
    ],
)
async def test_timestamp_tolerance(offset_s: float, passes: bool) -> None:
    req = published(received_at=int(PY_TIMESTAMP) + offset_s)
    if passes:
        assert len((await source().accept(req)).events) == 1
    else:
        with pytest.raises(VerificationFailed, match="tolerance"):
            await source().accept(req)


async def test_configured_tolerance_is_used() -> None:
    narrow = source(tolerance_s=10)
    assert len((await narrow.accept(published(received_at=int(PY_TIMESTAMP) + 10))).events) == 1
    with pytest.raises(VerificationFailed, match="tolerance"):
        await narrow.accept(published(received_at=int(PY_TIMESTAMP) + 11))


async def test_huge_timestamp_fails_cleanly() -> None:
    with pytest.raises(VerificationFailed, match="tolerance"):
        await source().accept(published(timestamp="9" * 400))


# --- verified but malformed ---------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        b"[{",
        b"",
        b"\xff\xfe",
        b'{"event":"open"}',
        b'"x"',
        b"[1]",
        b'[{"event":"open"}, []]',
        b"[null]",
    ],
)
async def test_malformed_body_after_valid_signature(signer: Signer, body: bytes) -> None:
    with pytest.raises(MalformedPayload):
        await signer.source().accept(signer.request(body))


@pytest.mark.parametrize(
    ("event", "provider_type"),
    [
        ({"timestamp": NOW}, "malformed:?"),  # no event type
        ({"event": 7}, "malformed:?"),
        ({"event": "open", "timestamp": "yesterday"}, "malformed:open"),
        ({"event": "open", "timestamp": True}, "malformed:open"),
        ({"event": "open", "timestamp": 1e300}, "malformed:open"),
        ({"event": "open", "email": ["a@example.com"]}, "malformed:open"),
        ({"event": "bounce", "type": 5}, "malformed:bounce"),
        (
            {"event": "group_unsubscribe", "email": "a@example.com"},  # no asm_group_id
            "malformed:group_unsubscribe",
        ),
    ],
)
async def test_malformed_event_is_kept_as_unknown(
    signer: Signer, event: dict[str, Any], provider_type: str
) -> None:
    [kept] = (await signer.source().accept(signer.batch(event))).events
    assert (kept.event_type, kept.provider_type) == (EventType.UNKNOWN, provider_type)
    assert kept.occurred_at is None and kept.recipient is None and kept.list_id is None
    assert kept.provider_message_id is None and kept.message_id_header is None
    assert kept.bounce_type is None and kept.payload == event


async def test_one_malformed_event_does_not_cost_the_batch(signer: Signer) -> None:
    # SendGrid retries a refused batch for 24 hours and then drops it: refusing
    # it for one bad event would lose the good ones.
    bad = sg_event("group_unsubscribe", 2)  # no asm_group_id
    batch = [sg_event("delivered", 1), bad, sg_event("bounce", 3, type="bounce")]
    events = (await signer.source().accept(signer.batch(*batch))).events

    assert [(e.provider_event_id, e.provider_type, e.event_type) for e in events] == [
        ("evt-1", "delivered", EventType.DELIVERED),
        ("evt-2", "malformed:group_unsubscribe", EventType.UNKNOWN),
        ("evt-3", "bounce", EventType.BOUNCED),
    ]
    assert events[1].payload == bad and events[1].recipient is None
    assert events[2].recipient == "user3@example.com"


@pytest.mark.parametrize("sg_event_id", [None, 42, "", ["evt-1"]])
async def test_malformed_event_without_a_string_id_is_fingerprinted(
    signer: Signer, sg_event_id: Any
) -> None:
    event = {"event": "open", "timestamp": "yesterday", "sg_event_id": sg_event_id}
    [kept] = (await signer.source().accept(signer.batch(event))).events
    assert kept.provider_event_id is None
    assert dedup_key(kept).startswith("fp:")


async def test_empty_batch_is_accepted(signer: Signer) -> None:
    assert (await signer.source().accept(signer.request(b"[]"))).events == []


async def test_malformed_body_without_signature_is_verification_failure(signer: Signer) -> None:
    # Garbage is never parsed before the signature is checked.
    with pytest.raises(VerificationFailed):
        await signer.source().accept(request(b"[{", PY_SIGNATURE, str(NOW), NOW))


# --- normalisation ------------------------------------------------------------------


def sg_event(event: str, n: int, **fields: Any) -> dict[str, Any]:
    return {
        "email": f"user{n}@example.com",
        "timestamp": NOW - n,
        "event": event,
        "smtp-id": f"<msg{n}@ismtpd-555>",
        "sg_event_id": f"evt-{n}",
        "sg_message_id": f"xmsg{n}.filterdrecv-p3mdw1-{n}.0",
        **fields,
    }


async def test_batch_of_every_kind_is_normalised(signer: Signer) -> None:
    batch = [
        sg_event("processed", 1),
        sg_event("delivered", 2, response="250 OK"),
        sg_event("deferred", 3, response="400 try again later", attempt="5"),
        sg_event(
            "bounce", 4, type="bounce", status="5.1.1", bounce_classification="Invalid Address"
        ),
        sg_event("bounce", 5, type="blocked", status="4.0.0", bounce_classification="Reputation"),
        sg_event("dropped", 6, reason="Unsubscribed Address"),
        sg_event("dropped", 7, reason="Spam Content (if Spam Checker app is enabled)"),
        sg_event("open", 8, sg_machine_open=False, useragent="Mozilla/4.0", ip="192.0.2.1"),
        sg_event("click", 9, url="https://example.com/x"),
        sg_event("spamreport", 10),
        sg_event("unsubscribe", 11),
        sg_event("group_unsubscribe", 12, asm_group_id=10),
        sg_event("group_resubscribe", 13, asm_group_id=10),
        sg_event("account_status_change", 14),
    ]
    events = (await signer.source().accept(signer.batch(*batch))).events

    got = [
        (e.provider_type, e.event_type, e.bounce_type, e.bounce_subtype, e.list_id) for e in events
    ]
    assert got == [
        ("processed", EventType.ACCEPTED, None, None, None),
        ("delivered", EventType.DELIVERED, None, None, None),
        ("deferred", EventType.DEFERRED, None, None, None),
        ("bounce", EventType.BOUNCED, BounceType.PERMANENT, "Invalid Address", None),
        ("bounce", EventType.BOUNCED, BounceType.TRANSIENT, "Reputation", None),
        ("dropped", EventType.SUPPRESSED, None, None, None),
        ("dropped", EventType.REJECTED, None, None, None),
        ("open", EventType.OPENED, None, None, None),
        ("click", EventType.CLICKED, None, None, None),
        ("spamreport", EventType.COMPLAINED, None, None, None),
        ("unsubscribe", EventType.UNSUBSCRIBED, None, None, None),
        ("group_unsubscribe", EventType.UNSUBSCRIBED, None, None, "asm:10"),
        ("group_resubscribe", EventType.UNKNOWN, None, None, None),
        ("account_status_change", EventType.UNKNOWN, None, None, None),
    ]
    for n, event in enumerate(events, start=1):
        assert event.provider_event_id == f"evt-{n}"
        assert event.provider_message_id == f"xmsg{n}"
        assert event.message_id_header == f"<msg{n}@ismtpd-555>"
        assert event.recipient == f"user{n}@example.com"
        assert event.occurred_at == datetime.fromtimestamp(NOW - n, tz=UTC)
        assert event.payload == batch[n - 1]


@pytest.mark.parametrize(
    ("kind", "classification", "expected"),
    [
        ("bounce", None, BounceType.PERMANENT),
        ("bounce", "Invalid Address", BounceType.PERMANENT),
        ("bounce", "Mailbox Unavailable", BounceType.PERMANENT),
        ("bounce", "Unclassified", BounceType.PERMANENT),
        ("bounce", "Content", BounceType.TRANSIENT),
        ("bounce", "Reputation", BounceType.TRANSIENT),
        ("bounce", "Frequency or Volume Too High", BounceType.TRANSIENT),
        ("bounce", "Technical Failure", BounceType.TRANSIENT),
        ("blocked", None, BounceType.TRANSIENT),
        ("blocked", "Invalid Address", BounceType.TRANSIENT),
        (None, None, BounceType.UNDETERMINED),
        ("soft", None, BounceType.UNDETERMINED),
    ],
)
async def test_bounce_classification_rule(
    signer: Signer, kind: str | None, classification: str | None, expected: BounceType
) -> None:
    fields: dict[str, Any] = {}
    if kind is not None:
        fields["type"] = kind
    if classification is not None:
        fields["bounce_classification"] = classification
    [event] = (await signer.source().accept(signer.batch(sg_event("bounce", 1, **fields)))).events
    assert event.event_type is EventType.BOUNCED
    assert event.bounce_type is expected


async def test_bounce_subtype_falls_back_to_status(signer: Signer) -> None:
    [event] = (
        await signer.source().accept(
            signer.batch(sg_event("bounce", 1, type="bounce", status="5.1.1"))
        )
    ).events
    assert event.bounce_subtype == "5.1.1"


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        ("Bounced Address", EventType.SUPPRESSED),
        ("Unsubscribed Address", EventType.SUPPRESSED),
        ("Spam Reporting Address", EventType.SUPPRESSED),
        ("Invalid", EventType.SUPPRESSED),
        ("Invalid SMTPAPI header", EventType.REJECTED),
        ("Spam Content (if spam checker app enabled)", EventType.REJECTED),
        ("Recipient List over Package Quota", EventType.REJECTED),
        (None, EventType.REJECTED),
    ],
)
async def test_drop_rule(signer: Signer, reason: str | None, expected: EventType) -> None:
    fields = {} if reason is None else {"reason": reason}
    [event] = (await signer.source().accept(signer.batch(sg_event("dropped", 1, **fields)))).events
    assert event.event_type is expected


async def test_unknown_event_type_is_kept(signer: Signer) -> None:
    [event] = (
        await signer.source().accept(
            signer.batch({"event": "machine_opened_twice", "timestamp": NOW})
        )
    ).events
    assert event.event_type is EventType.UNKNOWN
    assert event.provider_type == "machine_opened_twice"
    assert event.provider_event_id is None and event.provider_message_id is None


async def test_group_id_as_string(signer: Signer) -> None:
    [event] = (
        await signer.source().accept(
            signer.batch(sg_event("group_unsubscribe", 1, asm_group_id="42"))
        )
    ).events
    assert event.list_id == "asm:42"


async def test_missing_optional_fields_are_none(signer: Signer) -> None:
    [event] = (await signer.source().accept(signer.batch({"event": "open"}))).events
    assert event.occurred_at is None
    assert (event.recipient, event.message_id_header, event.provider_message_id) == (
        None,
        None,
        None,
    )


def test_default_payload_fields_are_not_personal() -> None:
    fields = set(SendGridReceiver.default_payload_fields)
    assert {"event", "timestamp", "sg_event_id", "sg_message_id"} <= fields
    assert not fields & {"email", "reason", "response", "url", "ip", "useragent", "smtp-id"}
    assert SendGridReceiver.provider == "sendgrid"
    assert SendGridReceiver.content_types == frozenset({"application/json"})


# --- configuration ------------------------------------------------------------------


def test_from_config_reveals_the_key_and_ignores_common_keys() -> None:
    revealed: list[Any] = []

    def reveal(value: Any) -> str:
        revealed.append(value)
        return PY_PUBLIC_KEY if value == "env:SG_KEY" else value

    table = {
        "id": "sg-main",
        "provider": "sendgrid",
        "max_body_bytes": 1_000_000,
        "rate_limit_per_s": 10,
        "rate_limit_burst": 20,
        "payload_fields": ["event"],
        "recipients": "hash",
        "public_key": "env:SG_KEY",
        "tolerance_s": 60,
    }
    src = from_config("sg-main", table, reveal)
    assert revealed == ["env:SG_KEY"]
    assert src.source_id == "sg-main" and src.tolerance_s == 60.0
    assert src.tolerance_s == 60.0
    assert source().tolerance_s == base.DEFAULT_TOLERANCE_S


def test_from_config_refuses_unknown_keys() -> None:
    with pytest.raises(DeliveryConfigError, match="secret"):
        from_config("s", {"public_key": PY_PUBLIC_KEY, "secret": "x"}, plain)


def test_from_config_requires_public_key() -> None:
    with pytest.raises(DeliveryConfigError, match=r"^public_key"):
        from_config("s", {"provider": "sendgrid"}, plain)


def _b64_spki(key: Any) -> str:
    der = key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return base64.b64encode(der).decode("ascii")


@pytest.mark.parametrize(
    "bad_key",
    [
        pytest.param(
            lambda: _b64_spki(ec.generate_private_key(ec.SECP384R1()).public_key()), id="p384"
        ),
        pytest.param(
            lambda: _b64_spki(ed25519.Ed25519PrivateKey.generate().public_key()), id="ed25519"
        ),
        pytest.param(lambda: "not a key", id="garbage"),
        pytest.param(lambda: base64.b64encode(b"\x30\x03\x02\x01\x01").decode(), id="not-spki"),
        pytest.param(lambda: PY_SIGNATURE, id="a-signature"),
        pytest.param(lambda: "", id="empty"),
        pytest.param(
            lambda: "-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----", id="bad-pem"
        ),
    ],
)
def test_from_config_refuses_what_is_not_a_p256_public_key(bad_key: Any) -> None:
    with pytest.raises(DeliveryConfigError, match=r"^public_key"):
        source(bad_key())


@pytest.mark.parametrize("tolerance", [0, -5, "300", True, float("inf"), float("nan")])
def test_from_config_refuses_bad_tolerance(tolerance: Any) -> None:
    with pytest.raises(DeliveryConfigError, match=r"^tolerance_s"):
        source(tolerance_s=tolerance)
