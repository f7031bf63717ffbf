"""Google's OAuth 2.0 endpoints as the fake serves them: /token, /authorize, /certs.

- POST /token (https://developers.google.com/identity/protocols/oauth2/web-server,
  .../oauth2/native-app, .../oauth2/service-account): form-encoded;
  grant_type=refresh_token → {access_token, expires_in, scope, token_type};
  grant_type=authorization_code with PKCE (RFC 7636: S256 = BASE64URL(SHA256(
  code_verifier)) without padding, or plain) → the same plus refresh_token when
  the authorisation asked access_type=offline; grant_type=
  urn:ietf:params:oauth:grant-type:jwt-bearer with an RS256 assertion signed by
  a service account key (iss = client_email, aud = the token URL, exp ≤ iat + 1 h,
  sub = the impersonated user). Errors are {"error", "error_description"}:
  invalid_grant (revoked/expired refresh token, bad code or verifier, bad JWT),
  invalid_client (401), unauthorized_client (401: sub not delegated),
  invalid_request, unsupported_grant_type.
- GET /authorize: consents at once (the fake has no browser) and redirects to
  redirect_uri with code and state.
- GET /certs: the v1 certs format of https://www.googleapis.com/oauth2/v1/certs,
  {kid: PEM X.509 certificate}, with Cache-Control max-age.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

import jwt
from aiohttp import web
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

ACCESS_TOKEN_TTL_S = 3599  # what Google's token endpoint answers in expires_in
CERTS_MAX_AGE_S = 21_600  # Google serves its certs with max-age of hours (~6 h)
JWT_MAX_LIFETIME_S = 3600  # service-account guide: exp at most 1 hour after iat
JWT_BEARER = "urn:ietf:params:oauth:grant-type:jwt-bearer"
GOOGLE_TOKEN_URLS = (
    "https://oauth2.googleapis.com/token",
    "https://accounts.google.com/o/oauth2/token",
)
GMAIL_SCOPE = "https://www.googleapis.com/auth/gmail.readonly"


@dataclass
class AccessGrant:
    user: str | None  # None: a service account acting as itself
    expires_at: float
    refresh_token: str | None = None


@dataclass
class RefreshGrant:
    user: str
    client_id: str
    scope: str
    revoked: bool = False


@dataclass
class CodeGrant:
    user: str
    client_id: str
    redirect_uri: str
    scope: str
    offline: bool
    challenge: str | None
    challenge_method: str


@dataclass
class ServiceAccountKey:
    """What add_service_account hands back: Google's JSON key file, built for the fake."""

    client_email: str
    private_key_pem: str
    private_key_id: str
    token_uri: str

    def info(self) -> dict[str, str]:
        """The service-account JSON key (google.oauth2.service_account accepts it)."""
        return {
            "type": "service_account",
            "project_id": "fake-project",
            "private_key_id": self.private_key_id,
            "private_key": self.private_key_pem,
            "client_email": self.client_email,
            "client_id": "1"
            + str(int(hashlib.sha256(self.client_email.encode()).hexdigest()[:12], 16)),
            "token_uri": self.token_uri,
        }


@dataclass
class OAuthState:
    clock: Callable[[], float] = time.monotonic
    access_token_ttl_s: int = ACCESS_TOKEN_TTL_S
    token_url: str = ""
    clients: dict[str, str | None] = field(default_factory=dict)  # id -> secret (None: public)
    refresh_tokens: dict[str, RefreshGrant] = field(default_factory=dict)
    access_tokens: dict[str, AccessGrant] = field(default_factory=dict)
    codes: dict[str, CodeGrant] = field(default_factory=dict)
    service_accounts: dict[str, tuple[Any, frozenset[str] | None]] = field(default_factory=dict)
    consent_user: str | None = None
    certs: dict[str, str] = field(default_factory=dict)
    certs_max_age_s: int = CERTS_MAX_AGE_S

    def issue_access_token(self, user: str | None, refresh_token: str | None = None) -> str:
        token = "ya29.fake-" + secrets.token_urlsafe(24)
        self.access_tokens[token] = AccessGrant(
            user, self.clock() + self.access_token_ttl_s, refresh_token
        )
        return token

    def access_grant(self, token: str) -> AccessGrant | None:
        grant = self.access_tokens.get(token)
        if grant is None or grant.expires_at <= self.clock():
            return None
        if grant.refresh_token and self.refresh_tokens[grant.refresh_token].revoked:
            return None  # revoking a refresh token revokes its access tokens too
        return grant

    def issue_refresh_token(self, user: str, client_id: str, scope: str = GMAIL_SCOPE) -> str:
        token = "1//fake-" + secrets.token_urlsafe(32)
        self.refresh_tokens[token] = RefreshGrant(user, client_id, scope)
        return token


def _oauth_error(status: int, error: str, description: str) -> web.Response:
    return web.json_response({"error": error, "error_description": description}, status=status)


def _token_answer(state: OAuthState, access: str, scope: str, refresh: str | None) -> web.Response:
    body: dict[str, object] = {
        "access_token": access,
        "expires_in": state.access_token_ttl_s,
        "scope": scope,
        "token_type": "Bearer",
    }
    if refresh is not None:
        body["refresh_token"] = refresh
    return web.json_response(body, headers={"Cache-Control": "no-store"})


def pkce_s256(verifier: str) -> str:
    digest = hashlib.sha256(verifier.encode("ascii")).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


class OAuthRoutes:
    """aiohttp handlers over an OAuthState; `on_token` counts grant types."""

    def __init__(
        self, state: OAuthState, on_token: Callable[[str], None], on_certs: Callable[[], None]
    ):
        self.state = state
        self.on_token = on_token
        self.on_certs = on_certs

    async def token(self, request: web.Request) -> web.Response:
        form = await request.post()
        grant_type = str(form.get("grant_type", ""))
        self.on_token(grant_type)
        if grant_type == JWT_BEARER:
            return self._jwt_bearer(str(form.get("assertion", "")))
        client_id, client_secret = self._client_credentials(request, form)
        if client_id not in self.state.clients:
            return _oauth_error(401, "invalid_client", "The OAuth client was not found.")
        expected = self.state.clients[client_id]
        if expected is not None and not hmac.compare_digest(expected, client_secret or ""):
            return _oauth_error(401, "invalid_client", "Unauthorized")
        if grant_type == "refresh_token":
            return self._refresh(client_id, str(form.get("refresh_token", "")))
        if grant_type == "authorization_code":
            return self._code(client_id, form)
        return _oauth_error(400, "unsupported_grant_type", f"Invalid grant_type: {grant_type}")

    @staticmethod
    def _client_credentials(request: web.Request, form: Any) -> tuple[str, str | None]:
        auth = request.headers.get("Authorization", "")
        if auth.lower().startswith("basic "):  # RFC 6749 §2.3.1, also accepted by Google
            decoded = base64.b64decode(auth[6:]).decode()
            client_id, _, secret = decoded.partition(":")
            return client_id, secret
        secret = form.get("client_secret")
        return str(form.get("client_id", "")), None if secret is None else str(secret)

    def _refresh(self, client_id: str, refresh_token: str) -> web.Response:
        grant = self.state.refresh_tokens.get(refresh_token)
        if not refresh_token:
            return _oauth_error(400, "invalid_request", "Missing required parameter: refresh_token")
        if grant is None or grant.revoked or grant.client_id != client_id:
            return _oauth_error(400, "invalid_grant", "Token has been expired or revoked.")
        access = self.state.issue_access_token(grant.user, refresh_token)
        return _token_answer(self.state, access, grant.scope, None)

    def _code(self, client_id: str, form: Any) -> web.Response:
        code = self.state.codes.pop(str(form.get("code", "")), None)
        if code is None or code.client_id != client_id:
            return _oauth_error(400, "invalid_grant", "Malformed auth code.")
        if str(form.get("redirect_uri", "")) != code.redirect_uri:
            return _oauth_error(400, "redirect_uri_mismatch", "Bad Request")
        verifier = str(form.get("code_verifier", ""))
        if code.challenge is not None:
            derived = pkce_s256(verifier) if code.challenge_method == "S256" else verifier
            if not verifier or not hmac.compare_digest(derived, code.challenge):
                return _oauth_error(400, "invalid_grant", "Invalid code verifier.")
        refresh = (
            self.state.issue_refresh_token(code.user, client_id, code.scope)
            if code.offline
            else None
        )
        access = self.state.issue_access_token(code.user, refresh)
        return _token_answer(self.state, access, code.scope, refresh)

    def _jwt_bearer(self, assertion: str) -> web.Response:
        try:
            claims = jwt.decode(assertion, options={"verify_signature": False})
            issuer = str(claims.get("iss", ""))
            key, subjects = self.state.service_accounts[issuer]
        except (jwt.PyJWTError, KeyError):
            return _oauth_error(400, "invalid_grant", "Invalid grant: account not found")
        audiences = [self.state.token_url, *GOOGLE_TOKEN_URLS]
        try:
            claims = jwt.decode(
                assertion,
                key,
                algorithms=["RS256"],
                audience=audiences,
                options={"require": ["iss", "aud", "iat", "exp"]},
            )
        except jwt.InvalidSignatureError:
            return _oauth_error(400, "invalid_grant", "Invalid JWT Signature.")
        except jwt.PyJWTError as exc:
            return _oauth_error(400, "invalid_grant", f"Invalid JWT: {exc}")
        if int(claims["exp"]) - int(claims["iat"]) > JWT_MAX_LIFETIME_S:
            return _oauth_error(
                400, "invalid_grant", "Invalid JWT: Token must be a short-lived token"
            )
        scope = str(claims.get("scope", ""))
        if not scope:
            return _oauth_error(400, "invalid_scope", "Empty or missing scope not allowed.")
        sub = claims.get("sub")
        if sub is not None and subjects is not None and sub not in subjects:
            return _oauth_error(
                401,
                "unauthorized_client",
                "Client is unauthorized to retrieve access tokens using this method, "
                "or client not authorized for any of the scopes requested.",
            )
        access = self.state.issue_access_token(None if sub is None else str(sub))
        return _token_answer(self.state, access, scope, None)

    async def authorize(self, request: web.Request) -> web.Response:
        q = request.query
        client_id, redirect_uri = q.get("client_id", ""), q.get("redirect_uri", "")
        if client_id not in self.state.clients or not redirect_uri:
            # Google shows an error page, never redirecting to an unverified URI.
            return web.Response(status=400, text="Error 400: invalid_request")
        if q.get("response_type") != "code":
            return web.Response(status=400, text="Error 400: unsupported_response_type")
        user = q.get("login_hint") or self.state.consent_user
        if user is None:
            return web.Response(status=400, text="Error 400: no user to consent")
        method = q.get("code_challenge_method", "plain" if "code_challenge" in q else "S256")
        code = "4/fake-" + secrets.token_urlsafe(24)
        self.state.codes[code] = CodeGrant(
            user=user,
            client_id=client_id,
            redirect_uri=redirect_uri,
            scope=q.get("scope", GMAIL_SCOPE),
            offline=q.get("access_type") == "offline",
            challenge=q.get("code_challenge"),
            challenge_method=method,
        )
        params = {"code": code, "scope": q.get("scope", GMAIL_SCOPE)}
        if "state" in q:
            params["state"] = q["state"]
        separator = "&" if "?" in redirect_uri else "?"
        raise web.HTTPFound(redirect_uri + separator + urlencode(params))

    async def certs(self, request: web.Request) -> web.Response:
        self.on_certs()
        return web.Response(
            body=json.dumps(self.state.certs).encode(),
            content_type="application/json",
            charset="UTF-8",
            headers={
                "Cache-Control": f"public, max-age={self.state.certs_max_age_s}, "
                "must-revalidate, no-transform"
            },
        )


def new_service_account_key() -> tuple[str, Any, str]:
    """(private key PEM, public key, key id) for a fake service account."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    return pem, key.public_key(), secrets.token_hex(20)


def load_public_key(value: Any) -> Any:
    """A public key from a PEM (public key or certificate), a public or a private key."""
    if isinstance(value, str | bytes):
        data = value.encode() if isinstance(value, str) else value
        if b"CERTIFICATE" in data:
            from cryptography import x509

            return x509.load_pem_x509_certificate(data).public_key()
        return serialization.load_pem_public_key(data)
    return value.public_key() if hasattr(value, "private_bytes") else value
