"""Amazon SNS HTTP(S) message verification: envelope, signing certificate, signature.

SNS posts a JSON envelope (with `Content-Type: text/plain`, which is why the body
is parsed whatever the media type) of one of three `Type`s: `Notification`,
`SubscriptionConfirmation`, `UnsubscribeConfirmation`. `verify_sns_message`
checks it in this order, so that a hostile or foreign message never causes an
outbound request:

    parse the envelope (a JSON object with the string fields its Type needs)
    → TopicArn in the source's allowlist
    → SignatureVersion "1" (RSA PKCS#1 v1.5 / SHA-1) or "2" (… / SHA-256)
    → SigningCertURL is https://sns.<region>.amazonaws.com(.cn)/<name>.pem
      (and a confirmation's SubscribeURL is on the same kind of host)
    → Signature is base64
    → the certificate's RSA public key, from `CertificateCache`
      (sns_certificates.py: fetched once per URL; fetch failure →
      VerificationUnavailable, the route answers 503)
    → the signature over the canonical string ("Key\\nValue\\n" for Message,
      MessageId, Subject if present, [SubscribeURL,] Timestamp, [Token,]
      TopicArn, Type — in that byte order), else VerificationFailed.

AWS: "Verifying the signatures of Amazon SNS messages",
https://docs.aws.amazon.com/sns/latest/dg/sns-verify-signature-of-message.html

Everything that is wrong with the envelope is `VerificationFailed` (401), never
`MalformedPayload`: nothing in it can be trusted until the signature checks, and
the route's contract keeps 400 for verified content.

There is deliberately no timestamp tolerance: SNS retries an HTTP(S) delivery
with the original Timestamp and signature, under a delivery policy the topic
owner sets (up to 3,600 s of retries — "Amazon SNS message delivery retries"),
and throttled deliveries wait in SNS's queue, so a 5-minute window would refuse
genuine retries. Replays are harmless: the SNS MessageId is the events' dedup key.

Trust rests on the certificate URL: only an AWS-operated SNS host can serve it,
and the default fetch verifies that host's TLS certificate. The certificate's
own validity dates are not checked — SNS keeps signing retried messages with
the key it signed them with, and an old certificate served by that host is
still AWS's. Raw message delivery (no envelope, no signature) cannot be
verified and is refused.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding

from inboxd.adapters.esp.base import VerificationFailed
from inboxd.adapters.esp.fields import parse_iso_time, parse_json_object
from inboxd.adapters.esp.sns_certificates import CertificateCache

__all__ = [
    "NOTIFICATION",
    "SUBSCRIPTION_CONFIRMATION",
    "UNSUBSCRIBE_CONFIRMATION",
    "SnsMessage",
    "canonical_string",
    "is_signing_cert_url",
    "is_subscribe_url",
    "verify_sns_message",
]

NOTIFICATION = "Notification"
SUBSCRIPTION_CONFIRMATION = "SubscriptionConfirmation"
UNSUBSCRIBE_CONFIRMATION = "UnsubscribeConfirmation"

#: Signed keys per message Type, in the order the canonical string lists them
#: (AWS SNS developer guide, "Verifying the signatures of Amazon SNS messages").
_SIGNED_KEYS: Mapping[str, tuple[str, ...]] = {
    NOTIFICATION: ("Message", "MessageId", "Subject", "Timestamp", "TopicArn", "Type"),
    SUBSCRIPTION_CONFIRMATION: (
        "Message",
        "MessageId",
        "SubscribeURL",
        "Timestamp",
        "Token",
        "TopicArn",
        "Type",
    ),
    UNSUBSCRIBE_CONFIRMATION: (
        "Message",
        "MessageId",
        "SubscribeURL",
        "Timestamp",
        "Token",
        "TopicArn",
        "Type",
    ),
}
#: The only signed key that may be absent (a Notification published without one).
_OPTIONAL_KEYS = frozenset({"Subject"})

#: SignatureVersion → digest of the RSA PKCS#1 v1.5 signature (same AWS page).
_DIGESTS: Mapping[str, Callable[[], hashes.HashAlgorithm]] = {
    "1": hashes.SHA1,
    "2": hashes.SHA256,
}

# Whole-URL patterns, anchored at both ends, instead of a URL parser: the fetch
# (yarl) and a checker (urllib) must not disagree on which host a URL names, so
# anything that is not exactly scheme, SNS host, optional :443 and path fails —
# userinfo, other ports, IP addresses, `sns.<region>.amazonaws.com.evil.com`.
# Regions: us-east-1, ap-southeast-2, us-gov-west-1, cn-north-1 (.com.cn) …
_SNS_HOST = r"sns\.[a-z]+(?:-[a-z]+)+-[0-9]+\.amazonaws\.com(?:\.cn)?(?::443)?"
#: SigningCertURL: exactly SNS's own naming, /SimpleNotificationService-<hex>.pem,
#: no query, no fragment — the narrower the pattern, the fewer URLs a sender who
#: knows an allowlisted TopicArn can make us fetch.
_SIGNING_CERT_URL = re.compile(
    r"https://" + _SNS_HOST + r"/SimpleNotificationService-[0-9a-f]{1,64}\.pem", re.ASCII
)
#: SubscribeURL: the SNS endpoint with the ConfirmSubscription query; no fragment,
#: no whitespace, no backslash (which some parsers read as a path separator).
_SUBSCRIBE_URL = re.compile(r"https://" + _SNS_HOST + r"/[^\s#\\]*", re.ASCII)


@dataclass(frozen=True, slots=True)
class SnsMessage:
    """A verified SNS message. `message` is the published Message string
    (for SES, a JSON document); `subscribe_url` and `token` are set for the two
    confirmation types only, `subject` only when the publisher gave one."""

    type: str
    message_id: str
    topic_arn: str
    message: str
    timestamp: datetime
    subscribe_url: str | None = None
    token: str | None = None
    subject: str | None = None


def is_signing_cert_url(url: str) -> bool:
    """True when `url` is an https SNS certificate URL (see the module docstring)."""
    return _SIGNING_CERT_URL.fullmatch(url) is not None


def is_subscribe_url(url: str) -> bool:
    """True when `url` is an https address on an SNS regional host."""
    return _SUBSCRIBE_URL.fullmatch(url) is not None


async def verify_sns_message(
    body: bytes, *, topic_arns: frozenset[str], certificates: CertificateCache
) -> SnsMessage:
    """Verify an SNS HTTP(S) request body and return its signed fields.

    `topic_arns` is the source's allowlist. Raises VerificationFailed (bad
    envelope, foreign topic, hostile URL, bad signature) or VerificationUnavailable
    (the certificate could not be fetched). All checks that need no network run
    before the certificate is fetched.
    """
    envelope = parse_json_object(body, what="sns: body", error=VerificationFailed)
    message_type = _required(envelope, "Type")
    signed_keys = _SIGNED_KEYS.get(message_type)
    if signed_keys is None:
        raise VerificationFailed("sns: unknown message Type")
    fields = _signed_fields(envelope, signed_keys)
    if fields["TopicArn"] not in topic_arns:
        raise VerificationFailed("sns: TopicArn not allowed for this source")
    digest = _DIGESTS.get(_required(envelope, "SignatureVersion"))
    if digest is None:
        raise VerificationFailed("sns: unsupported SignatureVersion")
    cert_url = _required(envelope, "SigningCertURL")
    if not is_signing_cert_url(cert_url):
        raise VerificationFailed("sns: SigningCertURL is not an SNS certificate URL")
    subscribe_url = fields.get("SubscribeURL")
    if subscribe_url is not None and not is_subscribe_url(subscribe_url):
        raise VerificationFailed("sns: SubscribeURL is not an SNS address")
    signature = _decode_signature(_required(envelope, "Signature"))
    timestamp = parse_iso_time(fields["Timestamp"], what="sns: Timestamp", error=VerificationFailed)

    key = await certificates.public_key(cert_url)
    try:
        key.verify(signature, canonical_string(fields, signed_keys), padding.PKCS1v15(), digest())
    except InvalidSignature as exc:
        raise VerificationFailed("sns: signature does not match") from exc

    return SnsMessage(
        type=message_type,
        message_id=fields["MessageId"],
        topic_arn=fields["TopicArn"],
        message=fields["Message"],
        timestamp=timestamp,
        subscribe_url=subscribe_url,
        token=fields.get("Token"),
        subject=fields.get("Subject"),
    )


def canonical_string(fields: Mapping[str, str], signed_keys: tuple[str, ...]) -> bytes:
    """The bytes SNS signs: "Key\\nValue\\n" for each signed key present, in order."""
    parts: list[str] = []
    for key in signed_keys:
        if key in fields:
            parts.append(f"{key}\n{fields[key]}\n")
    return "".join(parts).encode("utf-8")


def _required(envelope: Mapping[str, Any], key: str) -> str:
    value = envelope.get(key)
    if not isinstance(value, str) or not value:
        raise VerificationFailed(f"sns: {key} missing or not a string")
    return value


def _signed_fields(envelope: Mapping[str, Any], signed_keys: tuple[str, ...]) -> dict[str, str]:
    fields: dict[str, str] = {}
    for key in signed_keys:
        value = envelope.get(key)
        # A null Subject is how some SNS consumers spell "no subject"; AWS's own
        # validators leave a null key out of the canonical string too.
        if key in _OPTIONAL_KEYS and value is None:
            continue
        if not isinstance(value, str):
            raise VerificationFailed(f"sns: {key} missing or not a string")
        fields[key] = value
    return fields


def _decode_signature(text: str) -> bytes:
    try:
        signature = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise VerificationFailed("sns: Signature is not base64") from exc
    if not signature:
        raise VerificationFailed("sns: Signature is empty")
    return signature
