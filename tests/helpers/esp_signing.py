"""Signed webhook requests for every ESP scheme, made by each scheme's published
algorithm independently of adapters/esp (a mistake there is not mirrored here).

Each `Signer` holds a key and builds (body, headers) pairs; `config` is the
`[[delivery_sources]]` table that verifies them (without `id`).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from helpers.keys import make_certificate, rsa_key, sign_sns

SW_KEY = b"inboxd-test-standard-webhooks-key"
MAILGUN_KEY = "key-inboxd-test-mailgun"
POSTMARK_USER, POSTMARK_PASSWORD = "hooks", "correct horse battery staple"
SNS_TOPIC = "arn:aws:sns:eu-west-1:123456789012:ses-events"
SNS_CERT_URL = "https://sns.eu-west-1.amazonaws.com/SimpleNotificationService-0123abcd.pem"
JSON = {"content-type": "application/json"}
Headers = list[tuple[str, str]]


def sign_standard(body: bytes, msg_id: str, ts: int | None = None) -> Headers:
    """Standard Webhooks headers: v1 = base64(HMAC-SHA256(key, id.ts.body))."""
    ts = int(time.time()) if ts is None else ts
    signed = f"{msg_id}.{ts}.".encode("utf-8", "surrogateescape") + body
    mac = base64.b64encode(hmac.new(SW_KEY, signed, hashlib.sha256).digest()).decode()
    return [
        ("webhook-id", msg_id),
        ("webhook-timestamp", str(ts)),
        ("webhook-signature", f"v1,{mac}"),
        *JSON.items(),
    ]


def standard_config() -> dict[str, Any]:
    return {"provider": "standard_webhooks", "secret": "whsec_" + base64.b64encode(SW_KEY).decode()}


def mailgun_body(event_data: Any, token: str = "t" * 50, ts: int | None = None) -> bytes:
    """A Mailgun JSON webhook body: HMAC-SHA256(key, timestamp + token) in `signature`."""
    stamp = str(int(time.time()) if ts is None else ts)
    mac = hmac.new(MAILGUN_KEY.encode(), (stamp + token).encode(), hashlib.sha256).hexdigest()
    signature = {"timestamp": stamp, "token": token, "signature": mac}
    # json, not orjson: tests post bodies nested deeper than orjson serialises (254)
    return json.dumps({"signature": signature, "event-data": event_data}).encode()


def mailgun_config() -> dict[str, Any]:
    return {"provider": "mailgun", "signing_key": MAILGUN_KEY}


def postmark_headers() -> Headers:
    token = base64.b64encode(f"{POSTMARK_USER}:{POSTMARK_PASSWORD}".encode()).decode()
    return [("authorization", f"Basic {token}"), *JSON.items()]


def postmark_config() -> dict[str, Any]:
    return {"provider": "postmark", "username": POSTMARK_USER, "password": POSTMARK_PASSWORD}


@dataclass
class SendGridSigner:
    """ECDSA P-256 over timestamp + body (SendGrid Event Webhook security)."""

    key: ec.EllipticCurvePrivateKey = field(
        default_factory=lambda: ec.generate_private_key(ec.SECP256R1())
    )

    def config(self) -> dict[str, Any]:
        der = self.key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        return {"provider": "sendgrid", "public_key": base64.b64encode(der).decode()}

    def headers(self, body: bytes, ts: int | None = None) -> Headers:
        stamp = str(int(time.time()) if ts is None else ts)
        signature = self.key.sign(stamp.encode() + body, ec.ECDSA(hashes.SHA256()))
        return [
            ("x-twilio-email-event-webhook-signature", base64.b64encode(signature).decode()),
            ("x-twilio-email-event-webhook-timestamp", stamp),
            *JSON.items(),
        ]


@dataclass
class SnsSigner:
    """SNS notifications (SignatureVersion 2) under a self-signed certificate;
    `fetch` serves that certificate to the SES receiver."""

    key: rsa.RSAPrivateKey = field(default_factory=rsa_key)

    def fetch(self) -> Callable[[str], Any]:
        pem = make_certificate(self.key)

        async def fetch(url: str) -> bytes:
            return pem

        return fetch

    def notification(self, ses_event: Any, message_id: str = "n-1") -> bytes:
        fields = {
            "Type": "Notification",
            "MessageId": message_id,
            "TopicArn": SNS_TOPIC,
            "Message": json.dumps(ses_event),
            "Timestamp": "2026-11-30T09:00:06.000Z",
            "SignatureVersion": "2",
            "SigningCertURL": SNS_CERT_URL,
        }
        return orjson.dumps(sign_sns(fields, self.key))


def ses_config() -> dict[str, Any]:
    return {"provider": "ses", "topic_arns": [SNS_TOPIC]}
