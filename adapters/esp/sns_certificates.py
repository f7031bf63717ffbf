"""SNS signing certificates: fetched from an already-checked URL, parsed, cached.

`verify_sns_message` (sns.py) checks the SigningCertURL against SNS's hosts and
naming before it asks `CertificateCache.public_key(url)` for the RSA key. The
cache is what bounds the outbound requests a sender who knows an allowlisted
TopicArn can cause:

    cached and fresh (CERT_CACHE_TTL_S)   → the key, no request
    failed within CERT_FAILURE_TTL_S      → VerificationUnavailable, no request
    MAX_CONCURRENT_CERT_FETCHES running   → VerificationUnavailable, no request
    otherwise                             → one fetch per URL however many ask
                                            (single flight), then cached

A fetch failure is VerificationUnavailable (the route answers 503 and SNS retries),
and so is a response that is not exactly one PEM X.509 certificate with an RSA key:
the URL was checked to be an SNS host over verified HTTPS, so what answered in its
place is something between us and AWS (a filtering proxy's page, a captive portal),
not the sender — treating it as a forgery turned genuine mail into `sns_unverified`
records for as long as the proxy stood there. Both are remembered for
CERT_FAILURE_TTL_S, so a broken path is not asked again for every message.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import anyio
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicKey

from inboxd.adapters.esp.base import VerificationUnavailable

__all__ = [
    "CERT_CACHE_MAX_ENTRIES",
    "CERT_CACHE_TTL_S",
    "CERT_FAILURE_TTL_S",
    "CERT_FETCH_TIMEOUT_S",
    "CERT_MAX_BYTES",
    "MAX_CONCURRENT_CERT_FETCHES",
    "CertificateCache",
    "Fetch",
    "fetch_certificate",
    "load_public_key",
]

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
#: VerificationUnavailable (503, SNS retries) instead of queueing: real traffic needs one
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
#: raises VerificationUnavailable when it cannot.
Fetch = Callable[[str], Awaitable[bytes]]

_PEM_BEGIN = b"-----BEGIN CERTIFICATE-----"
_PEM_END = b"-----END CERTIFICATE-----"


async def fetch_certificate(url: str) -> bytes:
    """Default `Fetch`: GET `url` with TLS verification, no redirects, a deadline
    and a size cap. Any failure (network, timeout, status other than 200, body
    over CERT_MAX_BYTES) raises VerificationUnavailable; there is no retry here because
    SNS retries the whole delivery after our 503."""
    try:
        with anyio.fail_after(CERT_FETCH_TIMEOUT_S):
            timeout = aiohttp.ClientTimeout(total=CERT_FETCH_TIMEOUT_S)
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.get(url, allow_redirects=False) as response,
            ):
                if response.status != 200:
                    raise VerificationUnavailable(f"sns certificate: HTTP {response.status}")
                if (response.content_length or 0) > CERT_MAX_BYTES:
                    raise VerificationUnavailable("sns certificate: response too large")
                body = bytearray()
                async for chunk in response.content.iter_chunked(_READ_CHUNK_BYTES):
                    body += chunk
                    if len(body) > CERT_MAX_BYTES:
                        raise VerificationUnavailable("sns certificate: response too large")
                return bytes(body)
    except TimeoutError as exc:
        raise VerificationUnavailable("sns certificate: fetch timed out") from exc
    except aiohttp.ClientError as exc:
        raise VerificationUnavailable(f"sns certificate: {type(exc).__name__}") from exc


@dataclass(slots=True)
class _Flight:
    """One URL's fetch lock and how many callers hold or wait for it."""

    lock: anyio.Lock = field(default_factory=anyio.Lock)
    users: int = 0


class CertificateCache:
    """Signing-certificate public keys by URL: bounded (LRU), expiring, and
    single-flight — concurrent misses for one URL fetch it once.

    Only URLs that passed `is_signing_cert_url` reach it. A failed fetch is
    remembered for CERT_FAILURE_TTL_S (VerificationUnavailable without a new request),
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

        Raises VerificationUnavailable (fetch failed) or VerificationFailed (not a
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
                served = await self._fetch_once(url)
                try:
                    key = load_public_key(served)
                except VerificationUnavailable:
                    self._remember_failure(url)
                    raise
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
            raise VerificationUnavailable("sns certificate: failed recently, not fetched again yet")
        if self._fetching >= MAX_CONCURRENT_CERT_FETCHES:
            raise VerificationUnavailable("sns certificate: too many fetches at once")
        self._fetching += 1
        try:
            return await self._fetch(url)
        except VerificationUnavailable:
            self._remember_failure(url)
            raise
        finally:
            self._fetching -= 1

    def _remember_failure(self, url: str) -> None:
        self._failed[url] = self._clock() + CERT_FAILURE_TTL_S
        self._failed.move_to_end(url)
        while len(self._failed) > self._max_entries:
            self._failed.popitem(last=False)

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
    verifier does): a certificate URL serves a bare PEM. Raises VerificationUnavailable
    (module docstring: what answers in the SNS host's place is not the sender).
    """
    text = pem.strip()
    if not (text.startswith(_PEM_BEGIN) and text.endswith(_PEM_END)):
        raise VerificationUnavailable("sns: certificate is not a PEM certificate")
    if text.count(_PEM_BEGIN) != 1:
        raise VerificationUnavailable("sns: certificate response holds several certificates")
    try:
        certificate = x509.load_pem_x509_certificate(text)
    except ValueError as exc:
        raise VerificationUnavailable("sns: certificate does not parse") from exc
    key = certificate.public_key()
    if not isinstance(key, RSAPublicKey):
        raise VerificationUnavailable("sns: certificate key is not RSA")
    return key
