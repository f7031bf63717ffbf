"""Keys, certificates and SNS signatures made here, independently of the adapters.

The canonical string of "Verifying the signatures of Amazon SNS messages" (AWS
SNS developer guide) is written out here rather than imported, so a mistake in
the module's table is not mirrored by the tests.
"""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import NameOID

from inboxd.adapters.esp.base import VerificationUnavailable

# Canonical keys per SNS message type.
SNS_CANONICAL_KEYS = {
    "Notification": ("Message", "MessageId", "Subject", "Timestamp", "TopicArn", "Type"),
    "SubscriptionConfirmation": (
        "Message",
        "MessageId",
        "SubscribeURL",
        "Timestamp",
        "Token",
        "TopicArn",
        "Type",
    ),
    "UnsubscribeConfirmation": (
        "Message",
        "MessageId",
        "SubscribeURL",
        "Timestamp",
        "Token",
        "TopicArn",
        "Type",
    ),
}
# SignatureVersion -> digest.
SNS_DIGESTS = {"1": hashes.SHA1, "2": hashes.SHA256}


def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def make_certificate(key: Any, common_name: str = "sns.amazonaws.com") -> bytes:
    """A self-signed PEM certificate for `key`, valid from yesterday for a year."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.now(UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(days=1))
        .not_valid_after(now + timedelta(days=365))
        .sign(key, hashes.SHA256())
    )
    return certificate.public_bytes(serialization.Encoding.PEM)


def sign_sns(fields: dict[str, Any], key: rsa.RSAPrivateKey) -> dict[str, Any]:
    """`fields` with Signature set over the canonical string of its Type.

    The digest follows fields["SignatureVersion"]; keys whose value is None are
    not part of the canonical string.
    """
    canonical = "".join(
        f"{name}\n{fields[name]}\n"
        for name in SNS_CANONICAL_KEYS[fields["Type"]]
        if fields.get(name) is not None
    ).encode("utf-8")
    digest = SNS_DIGESTS[fields["SignatureVersion"]]()
    signature = key.sign(canonical, padding.PKCS1v15(), digest)
    return {**fields, "Signature": base64.b64encode(signature).decode("ascii")}


class FakeFetch:
    """Serves PEMs by URL and records every call; VerificationUnavailable otherwise.

    With `fail` set every fetch fails (HTTP 503), as an unreachable SNS would.
    """

    def __init__(self, pems: dict[str, bytes]) -> None:
        self.pems = pems
        self.calls: list[str] = []
        self.fail = False

    async def __call__(self, url: str) -> bytes:
        self.calls.append(url)
        if self.fail:
            raise VerificationUnavailable("sns certificate: HTTP 503")
        if url not in self.pems:
            raise VerificationUnavailable("sns certificate: HTTP 404")
        return self.pems[url]
