"""Google's signing certificates, fetched and cached without blocking the loop.

The Pub/Sub push token is a Google ID token; its signing keys come from the v1
certs endpoint, a JSON object {kid: PEM X.509 certificate}, which Google rotates
and says to cache for the response's Cache-Control max-age ("Verify the Google
ID token on your server side", developers.google.com/identity/gsi/web/guides/
verify-google-id-token). The cache is what bounds the requests a sender can
make us send to Google:

    set fresh, kid known              → the key, no request
    set fresh, kid unknown            → one refetch, but at most one per
                                        CERTS_REFETCH_INTERVAL_S; else "kid: unknown"
    set stale or never fetched        → fetch, unless the last fetch failed less than
                                        CERTS_FAILURE_RETRY_S ago (CertsUnavailable)
    any fetch                         → single flight: concurrent callers wait for it

The fetch is aiohttp with a deadline and a size cap, never a blocking call:
google-auth's `verify_oauth2_token` fetches the certificates synchronously and
would stall the event loop, so it is not used here.
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import orjson
import structlog
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicKey

from inboxd.adapters.http_fetch import SingleFlightCache, get_capped
from inboxd.pipeline.errors import RetriableError

log = structlog.get_logger(__name__)

#: Longest kid taken (Google's are 40 hex digits).
MAX_KID_CHARS = 128
_DIGITS = re.compile(r"[0-9]+")

#: Google's signing certificates in the v1 format, {kid: PEM certificate}. The
#: Pub/Sub push token is a Google ID token, signed by these keys.
GOOGLE_CERTS_URL = "https://www.googleapis.com/oauth2/v1/certs"

#: Deadline for one certificate fetch, seconds. The document is a few KB from
#: Google's front end; a fetch still running after this is failing, and a prompt
#: 503 lets Pub/Sub redeliver rather than hold its connection open.
CERTS_FETCH_TIMEOUT_S = 5.0
#: Largest certificate document read, bytes. Google publishes two or three
#: certificates of ~1.2 KB PEM each (~4 KB); anything near this cap is not it.
CERTS_MAX_BYTES = 64 * 1024
#: Most certificates taken from one document (Google publishes 2-3 at a time:
#: the current key and the ones rotating in and out).
CERTS_MAX_KEYS = 16
#: At most one refetch per this many seconds because of a kid the fresh set does
#: not hold. Google publishes a key before it signs with it, so an unknown kid is
#: rare for real pushes; a flood of made-up kids must not make us hammer Google.
CERTS_REFETCH_INTERVAL_S = 60.0
#: After a failed fetch, this many seconds of CertsUnavailable (503) without a
#: request: Pub/Sub's redeliveries (and a forger's repeats) do not turn into a
#: request each while Google's endpoint or our network is down.
CERTS_FAILURE_RETRY_S = 10.0
#: Shortest life given to a fetched set, seconds, whatever its max-age says
#: (max-age=0 would otherwise mean one fetch per push). Equal to the refetch
#: interval, so every path fetches at most once per interval once the set is fresh.
CERTS_MIN_TTL_S = CERTS_REFETCH_INTERVAL_S
#: Longest life given to a fetched set, seconds: bounds how long a certificate
#: Google has withdrawn can still be trusted should the header ever promise days.
#: Google's own max-age is a few hours, so this rarely binds.
CERTS_MAX_TTL_S = 6 * 3600.0
#: Life of a set whose response has no Cache-Control max-age, seconds.
CERTS_DEFAULT_TTL_S = 300.0


class UnknownSigningKey(Exception):
    """A kid Google does not publish (after the one refetch the cache allows)."""


class CertsUnavailable(RetriableError):
    """Google's certificates could not be fetched, so the push could not be
    verified either way: the route answers 503 and Pub/Sub redelivers."""


# --- Google's certificates ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FetchedCerts:
    """One certificate response: its body and how long it may be used, seconds
    (None when the response said nothing)."""

    body: bytes
    max_age_s: float | None


#: Fetches the certificate URL; raises CertsUnavailable when it cannot.
Fetch = Callable[[str], Awaitable[FetchedCerts]]


async def fetch_google_certs(url: str) -> FetchedCerts:
    """Default `Fetch`: GET `url` with no redirects, a deadline and a size cap.
    Any failure (network, timeout, status other than 200, body over
    CERTS_MAX_BYTES) is CertsUnavailable; no retry here, Pub/Sub redelivers."""
    fetched = await get_capped(
        url,
        timeout_s=CERTS_FETCH_TIMEOUT_S,
        max_bytes=CERTS_MAX_BYTES,
        what="google certs",
        failure=CertsUnavailable,
    )
    return FetchedCerts(fetched.body, freshness_s(fetched.headers))


def freshness_s(headers: Mapping[str, str]) -> float | None:
    """Seconds a response stays fresh: Cache-Control max-age minus Age (RFC 9111
    §4.2.1, §4.2.3); 0 for no-store/no-cache; None without max-age."""
    max_age: int | None = None
    for directive in headers.get("Cache-Control", "").split(","):
        name, _, value = directive.strip().partition("=")
        name = name.lower()
        if name in ("no-store", "no-cache"):
            return 0.0
        value = value.strip('"')
        if name == "max-age" and _DIGITS.fullmatch(value) and len(value) <= 10:
            max_age = int(value)
    if max_age is None:
        return None
    age = headers.get("Age", "")
    if _DIGITS.fullmatch(age) and len(age) <= 10:
        return float(max(0, max_age - int(age)))
    return float(max_age)


def parse_certs(body: bytes) -> dict[str, RSAPublicKey]:
    """The RSA public keys of a v1 certs document, by kid. A document that is not
    a JSON object of PEM certificates is CertsUnavailable (Google's answer is
    wrong, not the push); a certificate whose key is not RSA is skipped, since
    only RS256 tokens are accepted."""
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise CertsUnavailable("google certs: not JSON") from None
    if not isinstance(document, dict) or not document:
        raise CertsUnavailable("google certs: not a non-empty JSON object")
    if len(document) > CERTS_MAX_KEYS:
        raise CertsUnavailable("google certs: too many certificates")
    keys: dict[str, RSAPublicKey] = {}
    for kid, pem in document.items():
        if not kid or len(kid) > MAX_KID_CHARS or not isinstance(pem, str):
            raise CertsUnavailable("google certs: not {kid: PEM certificate}")
        try:
            certificate = x509.load_pem_x509_certificate(pem.encode("utf-8"))
        except ValueError:
            raise CertsUnavailable("google certs: a certificate does not parse") from None
        key = certificate.public_key()
        if isinstance(key, RSAPublicKey):
            keys[kid] = key
    if not keys:
        raise CertsUnavailable("google certs: no RSA certificate")
    return keys


@dataclass(frozen=True, slots=True)
class _KeySet:
    """One fetched set of keys by kid and how long it may be used, seconds."""

    keys: dict[str, RSAPublicKey]
    ttl_s: float


class GoogleCerts:
    """Google's signing keys by kid: cached for the response's max-age (clamped
    to CERTS_MIN_TTL_S..CERTS_MAX_TTL_S), refetched at most once per
    CERTS_REFETCH_INTERVAL_S for an unknown kid, single flight (module
    docstring). `clock` is monotonic seconds, injectable for tests."""

    def __init__(
        self,
        certs_url: str = GOOGLE_CERTS_URL,
        fetch: Fetch | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._url = certs_url
        self._fetch = fetch or fetch_google_certs
        self._failing = False  # the last fetch failed: logged once, not every attempt
        self._sets: SingleFlightCache[str, _KeySet] = SingleFlightCache(
            self._fetch_keys,
            ttl_s=lambda fetched: fetched.ttl_s,
            failure_ttl_s=CERTS_FAILURE_RETRY_S,
            max_entries=1,  # the one certificate URL
            failure=CertsUnavailable,
            what="google certs",
            clock=clock,
        )

    async def public_key(self, kid: str) -> RSAPublicKey:
        """The RSA key Google signs with under `kid`.

        Raises UnknownSigningKey when Google does not publish it
        (after the one refetch the rate limit allows) and CertsUnavailable when
        the certificates cannot be fetched.
        """
        key = (await self._sets.get(self._url)).keys.get(kid)
        if key is None:
            # A fresh set without this kid: a rotation we have not seen yet, or a
            # made-up kid. Only one refetch per interval either way.
            refetched = await self._sets.get(self._url, refetch_after_s=CERTS_REFETCH_INTERVAL_S)
            key = refetched.keys.get(kid)
        if key is None:
            raise UnknownSigningKey("kid: unknown")
        return key

    async def _fetch_keys(self, url: str) -> _KeySet:
        """Fetch the whole set (Google drops retired keys from it) and its life."""
        try:
            fetched = await self._fetch(url)
            keys = parse_certs(fetched.body)
        except CertsUnavailable as exc:
            if not self._failing:  # CONTRIBUTING.md rule 8: once, not every attempt
                log.warning("google_certs_unavailable", reason=str(exc))
            self._failing = True
            raise
        if self._failing:
            log.info("google_certs_recovered", keys=len(keys))
        self._failing = False
        ttl_s = CERTS_DEFAULT_TTL_S if fetched.max_age_s is None else fetched.max_age_s
        return _KeySet(keys, min(max(ttl_s, CERTS_MIN_TTL_S), CERTS_MAX_TTL_S))
