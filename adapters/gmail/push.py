"""Verifying a Gmail push (a Cloud Pub/Sub push request) before anything trusts it.

Gmail announces mailbox changes by publishing to a Pub/Sub topic; a push
subscription POSTs each message to our route with `Authorization: Bearer <JWT>`,
an OpenID Connect ID token Google signs with RS256 ("Authentication for push
subscriptions", cloud.google.com/pubsub/docs/authenticate-push-subscriptions).
The route (adapters/gmail/push_route.py, docs/architecture.md "Tracing one Gmail push")
calls, in this order:

    PushVerifier.verify(Authorization)   PushUnauthorized → 401, nothing recorded
                                         CertsUnavailable → 503, Pub/Sub retries
    parse_push_body(raw body)            MalformedPush → 400 (verified, but not the
                                         documented shape; never a 5xx, §8)

`verify` refuses, in order and before any cryptography where it can: anything but
exactly one `Bearer` JWT; a header whose alg is not RS256 (so `none`, HS256 keyed
with the public certificate, and every other algorithm never reach a key) or
without a kid; a kid Google does not publish; a signature that does not verify;
then the claims: iss is Google, aud is our endpoint's audience, email is the
subscription's service account with email_verified true, iat and exp present and
within the clock skew. `str(exc)` names the failed check for logs; it never
holds the token or a claim's value.

Google's signing certificates (`GoogleCerts`, adapters/gmail/google_certs.py)
are cached by the response's max-age and refetched at most once a minute for an
unknown kid, single flight, never with a blocking call.
"""

from __future__ import annotations

import base64
import binascii
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import jwt
import orjson
import structlog

from inboxd.adapters.gmail.google_certs import (
    CERTS_DEFAULT_TTL_S,
    CERTS_FAILURE_RETRY_S,
    CERTS_FETCH_TIMEOUT_S,
    CERTS_MAX_BYTES,
    CERTS_MAX_KEYS,
    CERTS_MAX_TTL_S,
    CERTS_MIN_TTL_S,
    CERTS_REFETCH_INTERVAL_S,
    GOOGLE_CERTS_URL,
    MAX_KID_CHARS,
    CertsUnavailable,
    FetchedCerts,
    GoogleCerts,
    UnknownSigningKey,
    fetch_google_certs,
    freshness_s,
    parse_certs,
)

__all__ = [
    "CERTS_DEFAULT_TTL_S",
    "CERTS_FAILURE_RETRY_S",
    "CERTS_FETCH_TIMEOUT_S",
    "CERTS_MAX_BYTES",
    "CERTS_MAX_KEYS",
    "CERTS_MAX_TTL_S",
    "CERTS_MIN_TTL_S",
    "CERTS_REFETCH_INTERVAL_S",
    "DEFAULT_CLOCK_SKEW_S",
    "GOOGLE_CERTS_URL",
    "GOOGLE_ISSUERS",
    "MAX_AUTHORIZATION_CHARS",
    "MAX_CLOCK_SKEW_S",
    "MAX_EMAIL_CHARS",
    "MAX_HISTORY_ID",
    "MAX_KID_CHARS",
    "MAX_PUSH_BODY_BYTES",
    "CertsUnavailable",
    "FetchedCerts",
    "GmailNotification",
    "GoogleCerts",
    "MalformedPush",
    "PushClaims",
    "PushUnauthorized",
    "PushVerifier",
    "fetch_google_certs",
    "freshness_s",
    "parse_certs",
    "parse_push_body",
]

log = structlog.get_logger(__name__)

#: The two spellings of Google's issuer an ID token may carry ("Verify the Google
#: ID token on your server side", developers.google.com/identity/gsi/web/guides/
#: verify-google-id-token; the Pub/Sub page's example uses the https form).
GOOGLE_ISSUERS = frozenset({"accounts.google.com", "https://accounts.google.com"})


#: Longest Authorization header looked at. A Google ID token is ~1 KB (an RS256
#: signature is 342 base64url characters, header and claims a few hundred more).
MAX_AUTHORIZATION_CHARS = 4096
#: Default tolerance for iat/exp against our clock, seconds.
DEFAULT_CLOCK_SKEW_S = 60.0
#: Largest clock skew a verifier may be configured with, seconds: more than this
#: is not clock drift but a reason to fix NTP.
MAX_CLOCK_SKEW_S = 300.0

#: Largest push body parsed. A Gmail notification is ~300 bytes; the route's
#: body limit should be this or lower.
MAX_PUSH_BODY_BYTES = 64 * 1024
#: Longest base64 `message.data` (the notification JSON is under 100 bytes).
_MAX_DATA_CHARS = 4096
#: Longest email address: RFC 5321 §4.5.3.1.3 limits a path to 256 octets
#: including the angle brackets.
MAX_EMAIL_CHARS = 254
#: Longest Pub/Sub messageId kept (they are decimal strings of ~16 digits; 256 is
#: the bound inboxd uses for every provider id, adapters/esp/fields.py).
_MAX_MESSAGE_ID_CHARS = 256
#: Longest subscription name: projects/<≤30>/subscriptions/<≤255>.
_MAX_SUBSCRIPTION_CHARS = 512
#: Largest historyId accepted: Gmail's is an unsigned 64-bit number, but it is
#: stored as a PostgreSQL bigint, and a value the database refuses must be the
#: sender's 400, never our 5xx (docs/architecture.md §8). Real ones are ~10^7-10^10.
MAX_HISTORY_ID = 2**63 - 1
_MAX_HISTORY_ID_DIGITS = len(str(MAX_HISTORY_ID))

_BEARER = re.compile(r"bearer +([A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*)", re.IGNORECASE)
_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,9})?(Z|[+-]\d{2}:\d{2})")
_DIGITS = re.compile(r"[0-9]+")
_PUBLIC_ID = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no space


class PushUnauthorized(Exception):
    """The push is not provably from Pub/Sub for this endpoint (the route answers
    401). `str()` names the failed check, for logs only; never the token."""


class MalformedPush(Exception):
    """A verified push whose body is not a Gmail notification (the route answers
    400). `str()` names the field, never its value."""


# --- the push token --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PushClaims:
    """The verified claims of a push token."""

    email: str
    subject: str | None
    audience: str
    issuer: str
    issued_at: float
    expires_at: float
    kid: str


class PushVerifier:
    """Verifies the Authorization header of a Pub/Sub push for one subscription.

    `audience` is the audience configured on the push subscription (the endpoint
    URL when none was set); `service_account` the email the subscription signs
    as. `clock` is Unix seconds, injectable for tests.
    """

    def __init__(
        self,
        certs: GoogleCerts,
        audience: str,
        service_account: str,
        clock_skew_s: float = DEFAULT_CLOCK_SKEW_S,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not audience or not service_account:
            raise ValueError("audience and service_account must be non-empty")
        if not 0 <= clock_skew_s <= MAX_CLOCK_SKEW_S:
            raise ValueError(f"clock_skew_s must be within 0..{MAX_CLOCK_SKEW_S:g}")
        self._certs = certs
        self._audience = audience
        self._service_account = service_account
        self._skew_s = clock_skew_s
        self._clock = clock

    def __repr__(self) -> str:
        return f"PushVerifier(audience={self._audience!r})"

    async def verify(self, authorization_header: str | None) -> PushClaims:
        """The claims of a push whose token Google signed for this subscription.

        Raises PushUnauthorized naming the failed check, or CertsUnavailable when
        Google's certificates cannot be fetched (transient: answer 503).
        """
        token = _bearer_token(authorization_header)
        kid = _checked_header(token)
        try:
            key = await self._certs.public_key(kid)
        except UnknownSigningKey as exc:
            raise PushUnauthorized(str(exc)) from None
        try:
            decoded = jwt.PyJWS().decode_complete(token, key, algorithms=["RS256"])
        except jwt.InvalidSignatureError:
            raise PushUnauthorized("signature: does not verify") from None
        except jwt.PyJWTError:
            raise PushUnauthorized("token: does not decode") from None
        try:
            claims = orjson.loads(decoded["payload"])
        except orjson.JSONDecodeError:
            raise PushUnauthorized("claims: not JSON") from None
        if not isinstance(claims, dict):
            raise PushUnauthorized("claims: not a JSON object")
        return self._checked_claims(claims, kid)

    def _checked_claims(self, claims: dict[str, Any], kid: str) -> PushClaims:
        issuer = claims.get("iss")
        if not isinstance(issuer, str) or issuer not in GOOGLE_ISSUERS:
            raise PushUnauthorized("iss: not Google")
        # Pub/Sub sends one audience string, never an array (PushConfig.OidcToken).
        if claims.get("aud") != self._audience:
            raise PushUnauthorized("aud: not this endpoint's audience")
        if claims.get("email") != self._service_account:
            raise PushUnauthorized("email: not the subscription's service account")
        if claims.get("email_verified") is not True:
            raise PushUnauthorized("email_verified: not true")
        issued_at = _number(claims, "iat")
        expires_at = _number(claims, "exp")
        now = self._clock()
        if issued_at > now + self._skew_s:
            raise PushUnauthorized("iat: in the future")
        if expires_at <= now - self._skew_s:
            raise PushUnauthorized("exp: expired")
        if expires_at <= issued_at:
            raise PushUnauthorized("exp: not after iat")
        subject = claims.get("sub")
        return PushClaims(
            email=self._service_account,
            subject=subject if isinstance(subject, str) else None,
            audience=self._audience,
            issuer=issuer,
            issued_at=issued_at,
            expires_at=expires_at,
            kid=kid,
        )


def _bearer_token(header: str | None) -> str:
    """The one compact JWT of `Bearer <jwt>` (scheme case-insensitive, RFC 9110
    §11.1). Two tokens, another scheme or a list of credentials are refused."""
    if not header:
        raise PushUnauthorized("authorization: missing")
    if len(header) > MAX_AUTHORIZATION_CHARS:
        raise PushUnauthorized("authorization: too long")
    match = _BEARER.fullmatch(header)
    if match is None:
        raise PushUnauthorized("authorization: not exactly one Bearer JWT")
    return match.group(1)


def _checked_header(token: str) -> str:
    """The kid of a header that asks for RS256, refused before any key is fetched
    or any cryptography runs: alg none, HS256 keyed with the public certificate
    (the classic confusion) and every other algorithm stop here."""
    segment = token.partition(".")[0]
    try:
        header = orjson.loads(base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4)))
    except (binascii.Error, ValueError):  # orjson.JSONDecodeError is a ValueError
        raise PushUnauthorized("header: not a JWT header") from None
    if not isinstance(header, dict):
        raise PushUnauthorized("header: not a JWT header")
    if header.get("alg") != "RS256":
        raise PushUnauthorized("alg: not RS256")
    # Google's header is {alg, kid, typ}; crit and b64 (RFC 7515 §4.1.11, RFC 7797)
    # change how the token is read, which nothing here implements.
    if "crit" in header or "b64" in header:
        raise PushUnauthorized("header: crit/b64 not supported")
    kid = header.get("kid")
    if not isinstance(kid, str) or not kid or len(kid) > MAX_KID_CHARS:
        raise PushUnauthorized("kid: missing")
    if token.endswith("."):
        raise PushUnauthorized("signature: missing")
    return kid


def _number(claims: Mapping[str, Any], name: str) -> float:
    value = claims.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PushUnauthorized(f"{name}: missing or not a number")
    return float(value)


# --- the push body ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GmailNotification:
    """What one Gmail push says: this mailbox changed up to this history id."""

    email_address: str
    history_id: int
    message_id: str
    publish_time: datetime


def parse_push_body(body: bytes) -> GmailNotification:
    """The Gmail notification of a verified push body; MalformedPush otherwise.

    The body is Pub/Sub's push envelope (`{"message": {"data", "messageId",
    "publishTime", "attributes"?}, "subscription"}`, Pub/Sub "Push subscriptions"
    page); `data` is standard base64 of Gmail's JSON `{"emailAddress",
    "historyId"}` (Gmail API "Push notifications" guide), where historyId is a
    decimal string or a number. Unknown extra keys are ignored.
    """
    if len(body) > MAX_PUSH_BODY_BYTES:
        raise MalformedPush("body: too large")
    envelope = _json_object(body, "body")
    _text(envelope, "subscription", _MAX_SUBSCRIPTION_CHARS, "", _PUBLIC_ID)
    message = envelope.get("message")
    if not isinstance(message, dict):
        raise MalformedPush("message: missing or not an object")
    attributes = message.get("attributes")
    if attributes is not None and not isinstance(attributes, dict):
        raise MalformedPush("message.attributes: not an object")
    message_id = _text(message, "messageId", _MAX_MESSAGE_ID_CHARS, "message.", _PUBLIC_ID)
    publish_time = _rfc3339(_text(message, "publishTime", 64, "message."), "message.publishTime")
    data = _text(message, "data", _MAX_DATA_CHARS, "message.")
    try:
        decoded = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise MalformedPush("message.data: not base64") from None
    notification = _json_object(decoded, "message.data")
    email_address = _text(notification, "emailAddress", MAX_EMAIL_CHARS, "message.data.")
    if "@" not in email_address or not email_address.isprintable() or " " in email_address:
        raise MalformedPush("message.data.emailAddress: not an email address")
    return GmailNotification(
        email_address=email_address,
        history_id=_history_id(notification.get("historyId")),
        message_id=message_id,
        publish_time=publish_time,
    )


def _json_object(data: bytes, what: str) -> dict[str, Any]:
    try:
        parsed = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise MalformedPush(f"{what}: not JSON") from None
    if not isinstance(parsed, dict):
        raise MalformedPush(f"{what}: not a JSON object")
    return parsed


def _text(
    obj: Mapping[str, Any],
    key: str,
    max_chars: int,
    where: str = "",
    pattern: re.Pattern[str] | None = None,
) -> str:
    """`obj[key]`: a non-empty string of at most `max_chars` without NUL
    (PostgreSQL text cannot hold it), matching `pattern` when given; errors name
    `where` + `key`."""
    value = obj.get(key)
    if not isinstance(value, str) or not value:
        raise MalformedPush(f"{where}{key}: missing or not a non-empty string")
    if len(value) > max_chars:
        raise MalformedPush(f"{where}{key}: longer than {max_chars} characters")
    if "\x00" in value or (pattern is not None and not pattern.fullmatch(value)):
        raise MalformedPush(f"{where}{key}: not the documented form")
    return value


def _history_id(value: Any) -> int:
    """A positive historyId given as a JSON integer or a string of decimal digits,
    at most MAX_HISTORY_ID. Floats (1.0, or integers orjson could only read as
    floats) and booleans are refused."""
    if isinstance(value, str):
        # Length first: int() of an attacker-sized digit string is wasted work.
        if len(value) > _MAX_HISTORY_ID_DIGITS or not _DIGITS.fullmatch(value):
            raise MalformedPush("message.data.historyId: not a decimal integer")
        number = int(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        raise MalformedPush("message.data.historyId: missing or not an integer")
    if not 0 < number <= MAX_HISTORY_ID:
        raise MalformedPush("message.data.historyId: out of range")
    return number


def _rfc3339(value: str, what: str) -> datetime:
    """An RFC 3339 time (Pub/Sub writes nanoseconds; Python keeps microseconds), in UTC."""
    if not _RFC3339.fullmatch(value):
        raise MalformedPush(f"{what}: not an RFC 3339 time")
    try:
        return datetime.fromisoformat(value).astimezone(UTC)
    except (ValueError, OverflowError):
        raise MalformedPush(f"{what}: not a valid time") from None
