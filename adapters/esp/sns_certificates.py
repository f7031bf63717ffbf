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
from collections.abc import Awaitable, Callable

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicKey

from inboxd.adapters.esp.base import VerificationUnavailable
from inboxd.adapters.http_fetch import SingleFlightCache, get_capped

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
    fetched = await get_capped(
        url,
        timeout_s=CERT_FETCH_TIMEOUT_S,
        max_bytes=CERT_MAX_BYTES,
        what="sns certificate",
        failure=VerificationUnavailable,
    )
    return fetched.body


class CertificateCache(SingleFlightCache[str, RSAPublicKey]):
    """Signing-certificate public keys by URL: bounded (LRU), expiring, and
    single-flight — concurrent misses for one URL fetch it once.

    Only URLs that passed `is_signing_cert_url` reach it. A failed fetch, or a
    response that is not one PEM X.509 certificate with an RSA key, is
    VerificationUnavailable and remembered for CERT_FAILURE_TTL_S (no new request
    meanwhile); at most MAX_CONCURRENT_CERT_FETCHES run at once.
    """

    def __init__(
        self,
        fetch: Fetch | None = None,
        *,
        max_entries: int = CERT_CACHE_MAX_ENTRIES,
        ttl_s: float = CERT_CACHE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        fetch_pem = fetch or fetch_certificate

        async def fetch_key(url: str) -> RSAPublicKey:
            return load_public_key(await fetch_pem(url))

        super().__init__(
            fetch_key,
            ttl_s=ttl_s,
            failure_ttl_s=CERT_FAILURE_TTL_S,
            max_entries=max_entries,
            failure=VerificationUnavailable,
            what="sns certificate",
            max_concurrent_fetches=MAX_CONCURRENT_CERT_FETCHES,
            clock=clock,
        )

    async def public_key(self, url: str) -> RSAPublicKey:
        """The RSA public key of the certificate at `url`; VerificationUnavailable
        when it cannot be had (module docstring)."""
        return await self.get(url)


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
