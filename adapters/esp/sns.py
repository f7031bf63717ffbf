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
    → the certificate's RSA public key, from `CertificateCache` (fetched once
      per URL; fetch failure → SourceUnavailable, the route answers 503)
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
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import aiohttp
import anyio
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding
from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicKey

from inboxd.adapters.esp.base import SourceUnavailable, VerificationFailed
from inboxd.adapters.esp.fields import parse_iso_time, parse_json_object

__all__ = [
    "CERT_CACHE_MAX_ENTRIES",
    "CERT_CACHE_TTL_S",
    "CERT_FETCH_TIMEOUT_S",
    "CERT_MAX_BYTES",
    "NOTIFICATION",
    "SUBSCRIPTION_CONFIRMATION",
    "UNSUBSCRIBE_CONFIRMATION",
    "CertificateCache",
    "Fetch",
    "SnsMessage",
    "canonical_string",
    "fetch_certificate",
    "is_signing_cert_url",
    "is_subscribe_url",
    "load_public_key",
    "verify_sns_message",
]

NOTIFICATION = "Notification"
SUBSCRIPTION_CONFIRMATION = "SubscriptionConfirmation"
UNSUBSCRIBE_CONFIRMATION = "UnsubscribeConfirmation"

#: Signed keys per message Type, in the order the canonical string lists them
#: (AWS SNS developer guide, "Verifying the signatures of Amazon SNS messages").
_SIGNED_KEYS: Mapping[str, tuple[str, ...]] = {
    NOTIFICATION: ("Message", "MessageId", "Subject", "Timestamp", "TopicArn", "Type"),
    SUBSCRIPTION_CONFIRMATION: ("Message", "MessageId", "SubscribeURL", "Timestamp", "Token",
                                "TopicArn", "Type"),
    UNSUBSCRIBE_CONFIRMATION: ("Message", "MessageId", "SubscribeURL", "Timestamp", "Token",
                               "TopicArn", "Type"),
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
    r"https://" + _SNS_HOST + r"/SimpleNotificationService-[0-9a-f]{1,64}\.pem", re.ASCII)
#: SubscribeURL: the SNS endpoint with the ConfirmSubscription query; no fragment,
#: no whitespace, no backslash (which some parsers read as a path separator).
_SUBSCRIBE_URL = re.compile(r"https://" + _SNS_HOST + r"/[^\s#\\]*", re.ASCII)

#: Certificates kept (one per signing key SNS uses; a handful per region in use).
CERT_CACHE_MAX_ENTRIES = 64
#: How long a fetched certificate is reused, seconds. SNS rotates signing
#: certificates rarely and publishes them at new URLs, so a day only bounds how
#: long a withdrawn certificate stays trusted.
CERT_CACHE_TTL_S = 24 * 3600.0
#: Deadline for fetching one certificate, seconds. A PEM is ~2 KB from an AWS
#: regional endpoint; a fetch still running after this is failing, and answering
#: 503 promptly lets SNS retry instead of holding its connection open.
CERT_FETCH_TIMEOUT_S = 5.0
#: Certificate fetches running at once, over all URLs; one more is refused with
#: SourceUnavailable (503, SNS retries) instead of queueing: real traffic needs one
#: fetch per signing certificate per day, so more at once is someone making up
#: URLs.
MAX_CONCURRENT_CERT_FETCHES = 4
#: How long a URL whose fetch failed is not fetched again, seconds: the provider's
#: retries (and a forger's repeats) get 503 at once instead of new requests.
CERT_FAILURE_TTL_S = 60.0
#: Largest certificate response read, bytes (real SNS certificates are ~2 KB).
CERT_MAX_BYTES = 64 * 1024
#: Read size while streaming a certificate response, bytes.
_READ_CHUNK_BYTES = 8192

#: Fetches a certificate URL (already checked) and returns the response body;
#: raises SourceUnavailable when it cannot.
Fetch = Callable[[str], Awaitable[bytes]]

_PEM_BEGIN = b"-----BEGIN CERTIFICATE-----"
_PEM_END = b"-----END CERTIFICATE-----"


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


async def fetch_certificate(url: str) -> bytes:
    """Default `Fetch`: GET `url` with TLS verification, no redirects, a deadline
    and a size cap. Any failure (network, timeout, status other than 200, body
    over CERT_MAX_BYTES) raises SourceUnavailable; there is no retry here because
    SNS retries the whole delivery after our 503."""
    try:
        with anyio.fail_after(CERT_FETCH_TIMEOUT_S):
            timeout = aiohttp.ClientTimeout(total=CERT_FETCH_TIMEOUT_S)
            async with aiohttp.ClientSession(timeout=timeout) as session, session.get(
                url, allow_redirects=False
            ) as response:
                if response.status != 200:
                    raise SourceUnavailable(f"sns certificate: HTTP {response.status}")
                if (response.content_length or 0) > CERT_MAX_BYTES:
                    raise SourceUnavailable("sns certificate: response too large")
                body = bytearray()
                async for chunk in response.content.iter_chunked(_READ_CHUNK_BYTES):
                    body += chunk
                    if len(body) > CERT_MAX_BYTES:
                        raise SourceUnavailable("sns certificate: response too large")
                return bytes(body)
    except TimeoutError as exc:
        raise SourceUnavailable("sns certificate: fetch timed out") from exc
    except aiohttp.ClientError as exc:
        raise SourceUnavailable(f"sns certificate: {type(exc).__name__}") from exc


@dataclass(slots=True)
class _Flight:
    """One URL's fetch lock and how many callers hold or wait for it."""

    lock: anyio.Lock = field(default_factory=anyio.Lock)
    users: int = 0


class CertificateCache:
    """Signing-certificate public keys by URL: bounded (LRU), expiring, and
    single-flight — concurrent misses for one URL fetch it once.

    Only URLs that passed `is_signing_cert_url` reach it. A failed fetch is
    remembered for CERT_FAILURE_TTL_S (SourceUnavailable without a new request),
    at most MAX_CONCURRENT_CERT_FETCHES run at once; a response that is not one
    PEM X.509 certificate with an RSA key raises VerificationFailed.
    """

    def __init__(
        self,
        fetch: Fetch | None = None,
        *,
        max_entries: int = CERT_CACHE_MAX_ENTRIES,
        ttl_s: float = CERT_CACHE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fetch = fetch or fetch_certificate
        self._max_entries = max_entries
        self._ttl_s = ttl_s
        self._clock = clock
        self._keys: OrderedDict[str, tuple[RSAPublicKey, float]] = OrderedDict()
        self._flights: dict[str, _Flight] = {}
        self._failed: OrderedDict[str, float] = OrderedDict()  # url → retry not before
        self._fetching = 0

    async def public_key(self, url: str) -> RSAPublicKey:
        """The RSA public key of the certificate at `url`.

        Raises SourceUnavailable (fetch failed) or VerificationFailed (not a
        usable certificate).
        """
        cached = self._lookup(url)
        if cached is not None:
            return cached
        flight = self._flights.setdefault(url, _Flight())
        flight.users += 1
        try:
            async with flight.lock:
                # Another caller may have fetched it while this one waited.
                cached = self._lookup(url)
                if cached is not None:
                    return cached
                key = load_public_key(await self._fetch_once(url))
                self._store(url, key)
                return key
        finally:
            flight.users -= 1
            if flight.users == 0:
                del self._flights[url]

    async def _fetch_once(self, url: str) -> bytes:
        """Fetch `url` unless it failed lately or too many fetches run already."""
        retry_at = self._failed.get(url)
        if retry_at is not None and self._clock() < retry_at:
            raise SourceUnavailable("sns certificate: failed recently, not fetched again yet")
        if self._fetching >= MAX_CONCURRENT_CERT_FETCHES:
            raise SourceUnavailable("sns certificate: too many fetches at once")
        self._fetching += 1
        try:
            return await self._fetch(url)
        except SourceUnavailable:
            self._failed[url] = self._clock() + CERT_FAILURE_TTL_S
            self._failed.move_to_end(url)
            while len(self._failed) > self._max_entries:
                self._failed.popitem(last=False)
            raise
        finally:
            self._fetching -= 1

    def _lookup(self, url: str) -> RSAPublicKey | None:
        entry = self._keys.get(url)
        if entry is None:
            return None
        key, expires_at = entry
        if self._clock() >= expires_at:
            del self._keys[url]
            return None
        self._keys.move_to_end(url)
        return key

    def _store(self, url: str, key: RSAPublicKey) -> None:
        self._keys[url] = (key, self._clock() + self._ttl_s)
        self._keys.move_to_end(url)
        while len(self._keys) > self._max_entries:
            self._keys.popitem(last=False)


def load_public_key(pem: bytes) -> RSAPublicKey:
    """The RSA public key of a response that is exactly one PEM certificate.

    Surrounding text is refused rather than skipped (as the AWS Ruby SDK's
    verifier does): a certificate URL serves a bare PEM. Raises VerificationFailed.
    """
    text = pem.strip()
    if not (text.startswith(_PEM_BEGIN) and text.endswith(_PEM_END)):
        raise VerificationFailed("sns: certificate is not a PEM certificate")
    if text.count(_PEM_BEGIN) != 1:
        raise VerificationFailed("sns: certificate response holds several certificates")
    try:
        certificate = x509.load_pem_x509_certificate(text)
    except ValueError as exc:
        raise VerificationFailed("sns: certificate does not parse") from exc
    key = certificate.public_key()
    if not isinstance(key, RSAPublicKey):
        raise VerificationFailed("sns: certificate key is not RSA")
    return key


async def verify_sns_message(
    body: bytes, *, topic_arns: frozenset[str], certificates: CertificateCache
) -> SnsMessage:
    """Verify an SNS HTTP(S) request body and return its signed fields.

    `topic_arns` is the source's allowlist. Raises VerificationFailed (bad
    envelope, foreign topic, hostile URL, bad signature) or SourceUnavailable
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
    timestamp = parse_iso_time(fields["Timestamp"], what="sns: Timestamp",
                               error=VerificationFailed)

    key = await certificates.public_key(cert_url)
    try:
        key.verify(signature, canonical_string(fields, signed_keys), padding.PKCS1v15(),
                   digest())
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
