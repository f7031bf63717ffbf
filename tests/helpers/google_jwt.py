"""Google-style ID tokens and certificates for tests, made without the code under test.

A `GoogleSigner` holds one RSA key and self-signed X.509 certificate per kid and
plays Google's part of a Pub/Sub push ("Authentication for push subscriptions",
cloud.google.com/pubsub/docs/authenticate-push-subscriptions):

    signer = GoogleSigner()                       # one key, kid signer.kid
    signer.certs_json()                           # the v1 certs document, bytes:
                                                  #   {kid: PEM certificate, ...}
    claims = signer.claims(audience=A, email=E, now=T)   # what Pub/Sub signs
    token = signer.sign(claims)                   # RS256 compact JWT with that kid
    signer.add_key("k2"); signer.remove_key(signer.kid)  # key rotation

`sign` also makes the tokens a verifier must refuse: `key=GoogleSigner.new_key()`
(a signature by a key Google never published), `kid=None` (no kid header),
`alg="none"` (no signature), `alg="HS256"` (HMAC keyed with the kid's public PEM
certificate: the algorithm-confusion attack), any other `alg` (the header says
it, the bytes are an RS256 signature), and `headers={...}` to add or override
header fields. Tokens are assembled here with `cryptography` and `hmac`, not
pyjwt, so a mistake in how the adapter uses pyjwt is not mirrored by the tests.

The Gmail fake (tests/fakes/gmail) serves these certificates at its certs
endpoint: `certs()` is a copy, {kid: PEM}, so after `add_key`/`remove_key` hand
the fake the new `certs()` (or serve `certs_json()` on each request).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import NameOID

__all__ = ["DEFAULT_KID", "GOOGLE_ISSUER", "TOKEN_LIFETIME_S", "GoogleSigner", "b64url"]

#: kid of the key a new signer starts with (Google's are 40 hex digits).
DEFAULT_KID = "0123456789abcdef0123456789abcdef01234567"
#: The issuer Pub/Sub's example token carries.
GOOGLE_ISSUER = "https://accounts.google.com"
#: Lifetime of the tokens `claims` describes: Google ID tokens last one hour.
TOKEN_LIFETIME_S = 3600

_DEFAULT = object()  # "the signer's current kid", distinct from kid=None (no kid header)


def b64url(data: bytes) -> str:
    """Base64url without padding (RFC 7515 §2)."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _segment(obj: Mapping[str, Any]) -> str:
    return b64url(json.dumps(obj, separators=(",", ":")).encode("utf-8"))


class GoogleSigner:
    """RSA keys and certificates by kid, the v1 certs document, and token signing."""

    def __init__(self, kid: str = DEFAULT_KID) -> None:
        self._keys: dict[str, rsa.RSAPrivateKey] = {}
        self._pems: dict[str, str] = {}
        self.kid = kid  # the kid `sign` uses by default: the last one added
        self.add_key(kid)

    @staticmethod
    def new_key() -> rsa.RSAPrivateKey:
        """A fresh 2048-bit RSA key (for signatures by a key Google never published)."""
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)

    def add_key(self, kid: str, key: rsa.RSAPrivateKey | None = None) -> None:
        """Publish a new key under `kid` and make it the default for `sign`."""
        key = key or self.new_key()
        self._keys[kid] = key
        self._pems[kid] = _certificate_pem(key)
        self.kid = kid

    def remove_key(self, kid: str) -> None:
        """Stop publishing `kid` (its tokens can still be signed with `key=`)."""
        del self._pems[kid]
        if self.kid == kid and self._pems:
            self.kid = next(reversed(self._pems))

    def key(self, kid: str) -> rsa.RSAPrivateKey:
        return self._keys[kid]

    def certificate_pem(self, kid: str) -> str:
        return self._pems[kid]

    def certs(self) -> dict[str, str]:
        """The published certificates, {kid: PEM}."""
        return dict(self._pems)

    def certs_json(self) -> bytes:
        """The body of https://www.googleapis.com/oauth2/v1/certs for these keys."""
        return json.dumps(self._pems).encode("utf-8")

    @staticmethod
    def claims(
        *, audience: str, email: str, now: float, lifetime_s: float = TOKEN_LIFETIME_S, **extra: Any
    ) -> dict[str, Any]:
        """The claims of a Pub/Sub push token issued at `now` (Unix seconds);
        `extra` adds or overrides claims (a value of None removes the claim)."""
        claims: dict[str, Any] = {
            "aud": audience,
            "azp": "113774264463038321964",
            "email": email,
            "email_verified": True,
            "exp": int(now + lifetime_s),
            "iat": int(now),
            "iss": GOOGLE_ISSUER,
            "sub": "113774264463038321964",
        }
        claims.update(extra)
        return {name: value for name, value in claims.items() if value is not None}

    def sign(
        self,
        claims: Mapping[str, Any],
        *,
        kid: Any = _DEFAULT,
        alg: str = "RS256",
        headers: Mapping[str, Any] | None = None,
        key: rsa.RSAPrivateKey | None = None,
    ) -> str:
        """A compact JWT of `claims` (module docstring for the forgeries).

        kid: the header's kid (default: the signer's current one; None: no kid).
        key: the RSA key that signs (default: the kid's own key).
        """
        kid_value = self.kid if kid is _DEFAULT else kid
        header: dict[str, Any] = {"alg": alg, "typ": "JWT"}
        if kid_value is not None:
            header["kid"] = kid_value
        header.update(headers or {})
        signing_input = f"{_segment(header)}.{_segment(claims)}".encode("ascii")
        if alg == "none":
            signature = b""
        elif alg == "HS256":
            secret = self._pems[kid_value if kid_value in self._pems else self.kid]
            signature = hmac.new(secret.encode("ascii"), signing_input, hashlib.sha256).digest()
        else:
            signer = key or self._keys[kid_value if kid_value in self._keys else self.kid]
            signature = signer.sign(signing_input, padding.PKCS1v15(), hashes.SHA256())
        return f"{signing_input.decode('ascii')}.{b64url(signature)}"


def _certificate_pem(key: rsa.RSAPrivateKey) -> str:
    """A self-signed certificate for `key`, valid from yesterday for two weeks
    (Google's certificates are short-lived self-signed ones too)."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "inboxd test signer")])
    now = datetime.now(UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(days=1))
        .not_valid_after(now + timedelta(days=14))
        .sign(key, hashes.SHA256())
    )
    return certificate.public_bytes(serialization.Encoding.PEM).decode("ascii")
