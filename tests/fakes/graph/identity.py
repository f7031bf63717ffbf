"""The Microsoft identity platform v2.0 endpoints the fake serves.

- POST {authority}/{tenant}/oauth2/v2.0/token, form-encoded:
  `client_credentials` ("OAuth 2.0 client credentials flow": client_id,
  client_secret, scope `https://graph.microsoft.com/.default`) → an app-only
  token; `refresh_token` ("OAuth 2.0 authorization code flow", refresh the
  access token) → a new access token and a new refresh token (Entra rotates
  them; the old one stays valid: "Refresh tokens aren't revoked when used to
  acquire new access tokens"); `urn:ietf:params:oauth:grant-type:device_code`
  ("OAuth 2.0 device authorization grant") → `authorization_pending` until the
  user signs in (fake.approve_device_code), then the tokens.
- POST {authority}/{tenant}/oauth2/v2.0/devicecode (client_id, scope) →
  {device_code, user_code, verification_uri, expires_in: 900, interval: 5,
  message}.
- Errors are Entra's body: {"error", "error_description": "AADSTS…: …",
  "error_codes": [n], "timestamp", "trace_id", "correlation_id", "error_uri"};
  400 for grant errors, 401 `invalid_client` for a wrong secret (AADSTS7000215).
  Codes used: 50173 (grant revoked), 700082 (refresh token expired), 70016
  (authorization pending), 70019 (device code expired), 70000 (declined / bad
  grant), 90002 (tenant not found), 1002012 (scope without /.default).
Access tokens are opaque here (Graph never asks a client to read them) and
live `access_token_ttl_s` (3599 s, what Entra answers in expires_in). Graph may
refuse one before its expiry (`revoke_access_tokens`: continuous access evaluation
after a critical event, an admin's session revocation): 401
InvalidAuthenticationToken on every request that carries it, inner requests of a
$batch included (their answers carry the 401: msgraph-sdk-dotnet#2660), while the
refresh token or the client credentials still get a new one.
With `single_use_refresh_tokens` on, a refresh token is refused once it was
redeemed (400 invalid_grant AADSTS70000), as Entra does for rotated tokens it
chooses to invalidate: a client must keep the newest one it was given.

Client credentials ("Microsoft identity platform application authentication
certificate credentials"): a `client_secret`, or `client_assertion_type`
urn:ietf:params:oauth:client-assertion-type:jwt-bearer with `client_assertion`, a
JWT signed RS256 by the key of a certificate registered on the app
(`certificates`: PEM), its header's `x5t#S256` the certificate's SHA-256
thumbprint (base64url), aud the token endpoint (`token_url`), iss = sub = the
client id, exp in the future: else 401 invalid_client AADSTS700027. With
`public_client_flows` off (a confidential client: Authentication → Allow public
client flows = No), refresh and device code grants without either are refused:
401 invalid_client AADSTS7000218 ("The request body must contain the following
parameter: 'client_assertion' or 'client_secret'").
"""

from __future__ import annotations

import base64
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jwt
from cryptography import x509
from cryptography.hazmat.primitives import hashes

from .errors import Answer, json_answer

ACCESS_TOKEN_TTL_S = 3599
DEVICE_CODE_TTL_S = 900  # device code guide: "the user has 15 minutes to sign in"
DEVICE_POLL_INTERVAL_S = 5
GRAPH_DEFAULT_SCOPE = "https://graph.microsoft.com/.default"
DELEGATED_SCOPE = "https://graph.microsoft.com/Mail.Read offline_access"
DEVICE_CODE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"
CLIENT_ASSERTION_TYPE = "urn:ietf:params:oauth:client-assertion-type:jwt-bearer"
VERIFICATION_URI = "https://microsoft.com/devicelogin"


@dataclass
class AccessGrant:
    user: str | None  # None: app-only (client credentials)
    expires_at: float
    refresh_token: str | None = None
    revoked: bool = False


@dataclass
class RefreshGrant:
    user: str
    client_id: str
    scope: str
    family: str = ""  # the sign-in it descends from (rotation keeps it)
    revoked: bool = False
    expired: bool = False
    redeemed: bool = False  # used once to get new tokens


@dataclass
class DeviceCode:
    device_code: str
    user_code: str
    client_id: str
    scope: str
    expires_at: float
    user: str | None = None  # set when approved
    declined: bool = False
    slow_down: int = 0  # polls still answered slow_down
    redeemed: bool = False


@dataclass
class Identity:
    """Tokens, grants and device codes of one tenant (fake.identity)."""

    directory_id: str
    client_id: str
    client_secret: str
    clock: Callable[[], float] = time.time
    access_token_ttl_s: int = ACCESS_TOKEN_TTL_S
    tenant_domain: str = "contoso.onmicrosoft.com"
    access_tokens: dict[str, AccessGrant] = field(default_factory=dict)
    refresh_tokens: dict[str, RefreshGrant] = field(default_factory=dict)
    device_codes: dict[str, DeviceCode] = field(default_factory=dict)  # by device_code
    single_use_refresh_tokens: bool = False
    refused_redeemed: int = 0  # refresh requests refused for a redeemed token
    token_url: str = ""  # a client assertion's audience (set by the server)
    certificates: list[bytes] = field(default_factory=list)  # PEM, registered on the app
    public_client_flows: bool = True
    assertions_accepted: int = 0

    def issue_access_token(self, user: str | None, refresh_token: str | None = None) -> str:
        token = "fake-at." + secrets.token_urlsafe(32)
        self.access_tokens[token] = AccessGrant(
            user, self.clock() + self.access_token_ttl_s, refresh_token
        )
        return token

    def issue_refresh_token(
        self, user: str, scope: str = DELEGATED_SCOPE, family: str | None = None
    ) -> str:
        token = "fake-rt." + secrets.token_urlsafe(40)
        self.refresh_tokens[token] = RefreshGrant(user, self.client_id, scope, family or token)
        return token

    def revoke(self, token: str) -> None:
        """Revoke the sign-in `token` descends from: it and every token rotated from it."""
        family = self.refresh_tokens[token].family
        for grant in self.refresh_tokens.values():
            if grant.family == family:
                grant.revoked = True

    def access_grant(self, token: str) -> AccessGrant | None:
        """The grant of a currently valid access token (None: missing, unknown, expired,
        or issued from a refresh token since revoked)."""
        grant = self.access_tokens.get(token)
        if grant is None or grant.revoked or grant.expires_at <= self.clock():
            return None
        if grant.refresh_token is not None:
            parent = self.refresh_tokens.get(grant.refresh_token)
            if parent is None or parent.revoked:
                return None
        return grant

    def revoke_access_tokens(self, user: str | None = None) -> int:
        """Every access token issued so far (of `user`, or all) is refused from now on,
        before its expiry; grants and refresh tokens stay valid. Answers how many."""
        revoked = 0
        for grant in self.access_tokens.values():
            if user is None or (grant.user or "").lower() == user.lower():
                grant.revoked = True
                revoked += 1
        return revoked

    # -- endpoints -------------------------------------------------------------
    def token(self, tenant: str, form: dict[str, str]) -> Answer:
        if (problem := self._tenant(tenant)) is not None:
            return problem
        grant_type = form.get("grant_type", "")
        if grant_type == "client_credentials":
            return self._client_credentials(form)
        if grant_type == "refresh_token":
            return self._refresh(form)
        if grant_type == DEVICE_CODE_GRANT:
            return self._device_code_grant(form)
        return entra_error(
            400,
            "unsupported_grant_type",
            70003,
            f"The app requested an unsupported grant type '{grant_type}'.",
        )

    def devicecode(self, tenant: str, form: dict[str, str]) -> Answer:
        if (problem := self._tenant(tenant)) is not None:
            return problem
        if form.get("client_id") != self.client_id:
            return entra_error(
                400, "unauthorized_client", 700016, "Application not found in the directory."
            )
        code = DeviceCode(
            device_code="fake-dc." + secrets.token_urlsafe(32),
            user_code=secrets.token_hex(4).upper(),
            client_id=self.client_id,
            scope=form.get("scope", DELEGATED_SCOPE),
            expires_at=self.clock() + DEVICE_CODE_TTL_S,
        )
        self.device_codes[code.device_code] = code
        return json_answer(
            {
                "user_code": code.user_code,
                "device_code": code.device_code,
                "verification_uri": VERIFICATION_URI,
                "expires_in": DEVICE_CODE_TTL_S,
                "interval": DEVICE_POLL_INTERVAL_S,
                "message": f"To sign in, use a web browser to open the page {VERIFICATION_URI} "
                f"and enter the code {code.user_code} to authenticate.",
            }
        )

    def device_code_by_user_code(self, user_code: str) -> DeviceCode:
        for code in self.device_codes.values():
            if code.user_code == user_code:
                return code
        raise KeyError(f"no device code with user_code {user_code!r}")

    # -- grants ------------------------------------------------------------------
    def _tenant(self, tenant: str) -> Answer | None:
        if tenant.lower() in (self.directory_id, self.tenant_domain, "organizations", "common"):
            return None
        return entra_error(400, "invalid_request", 90002, f"Tenant '{tenant}' not found.")

    def _client(self, form: dict[str, str], *, secret_required: bool) -> Answer | None:
        if form.get("client_id") != self.client_id:
            return entra_error(
                400,
                "unauthorized_client",
                700016,
                f"Application with identifier '{form.get('client_id')}' was not found "
                "in the directory.",
            )
        if form.get("client_assertion") is not None or form.get("client_assertion_type"):
            return self._assertion(form)
        secret = form.get("client_secret")
        if secret is None and secret_required:
            return entra_error(
                401,
                "invalid_client",
                7000218,
                "The request body must contain the following parameter: 'client_assertion' "
                "or 'client_secret'.",
            )
        if secret is not None and secret != self.client_secret:
            return entra_error(
                401,
                "invalid_client",
                7000215,
                "Invalid client secret provided. Ensure the secret being sent in the request "
                "is the client secret value, not the client secret ID.",
            )
        return None

    def _assertion(self, form: dict[str, str]) -> Answer | None:
        """A certificate's client assertion (module docstring); None when it holds."""
        refused = entra_error(
            401,
            "invalid_client",
            700027,
            "The certificate with identifier used to sign the client assertion is not "
            "registered on application, or the assertion is not valid.",
        )
        if form.get("client_assertion_type") != CLIENT_ASSERTION_TYPE:
            return refused
        assertion = form.get("client_assertion", "")
        try:
            header = jwt.get_unverified_header(assertion)
        except jwt.PyJWTError:
            return refused
        for pem in self.certificates:
            cert = x509.load_pem_x509_certificate(pem)
            digest = cert.fingerprint(hashes.SHA256())
            thumbprint = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
            if header.get("x5t#S256") != thumbprint:
                continue
            try:
                claims = jwt.decode(
                    assertion,
                    cert.public_key(),  # type: ignore[arg-type]
                    algorithms=["RS256"],
                    audience=self.token_url,
                    issuer=self.client_id,
                    options={"require": ["exp", "aud", "iss", "sub", "jti"]},
                )
            except jwt.PyJWTError:
                return refused
            if claims.get("sub") != self.client_id:
                return refused
            self.assertions_accepted += 1
            return None
        return refused

    def _client_credentials(self, form: dict[str, str]) -> Answer:
        if (problem := self._client(form, secret_required=True)) is not None:
            return problem
        if not form.get("scope", "").endswith("/.default"):
            return entra_error(
                400,
                "invalid_scope",
                1002012,
                "The provided value for scope is not valid. Client credential flows must have "
                "a scope value with /.default suffixed to the resource identifier.",
            )
        token = self.issue_access_token(None)
        return json_answer(
            {
                "token_type": "Bearer",
                "expires_in": self.access_token_ttl_s,
                "ext_expires_in": self.access_token_ttl_s,
                "access_token": token,
            }
        )

    def _refresh(self, form: dict[str, str]) -> Answer:
        confidential = not self.public_client_flows
        if (problem := self._client(form, secret_required=confidential)) is not None:
            return problem
        grant = self.refresh_tokens.get(form.get("refresh_token", ""))
        if grant is None or grant.revoked:
            return entra_error(
                400,
                "invalid_grant",
                50173,
                "The provided grant has expired due to it being revoked, a fresh auth token "
                "is needed. The user might have changed or reset their password.",
            )
        if grant.expired:
            return entra_error(
                400,
                "invalid_grant",
                700082,
                "The refresh token has expired due to inactivity.",
            )
        if grant.redeemed and self.single_use_refresh_tokens:
            self.refused_redeemed += 1
            return entra_error(
                400,
                "invalid_grant",
                70000,
                "The provided value for the input parameter 'refresh_token' or 'assertion' "
                "is not valid.",
            )
        grant.redeemed = True
        return self._user_tokens(grant.user, grant.scope, grant.family)

    def _device_code_grant(self, form: dict[str, str]) -> Answer:
        confidential = not self.public_client_flows
        if (problem := self._client(form, secret_required=confidential)) is not None:
            return problem
        code = self.device_codes.get(form.get("device_code", ""))
        if code is None or code.redeemed:
            return entra_error(400, "invalid_grant", 70000, "The provided device code is invalid.")
        if code.expires_at <= self.clock():
            return entra_error(400, "expired_token", 70019, "Verification code expired.")
        if code.declined:
            return entra_error(
                400,
                "authorization_declined",
                70000,
                "The end user denied the authorization request.",
            )
        if code.slow_down > 0:
            code.slow_down -= 1
            return entra_error(400, "slow_down", 70016, "The client is polling too quickly.")
        if code.user is None:
            return entra_error(
                400,
                "authorization_pending",
                70016,
                "OAuth 2.0 device flow error. Authorization is pending. Continue polling.",
            )
        code.redeemed = True
        return self._user_tokens(code.user, code.scope)

    def _user_tokens(self, user: str, scope: str, family: str | None = None) -> Answer:
        refresh = self.issue_refresh_token(user, scope, family)
        return json_answer(
            {
                "token_type": "Bearer",
                "scope": scope,
                "expires_in": self.access_token_ttl_s,
                "ext_expires_in": self.access_token_ttl_s,
                "access_token": self.issue_access_token(user, refresh),
                "refresh_token": refresh,
            }
        )


def entra_error(status: int, error: str, aadsts: int, description: str) -> Answer:
    """Entra's token-endpoint error body (the AADSTS code leads the description)."""
    trace, correlation = str(uuid.uuid4()), str(uuid.uuid4())
    stamp = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime())
    body: dict[str, Any] = {
        "error": error,
        "error_description": f"AADSTS{aadsts}: {description} Trace ID: {trace} "
        f"Correlation ID: {correlation} Timestamp: {stamp}",
        "error_codes": [aadsts],
        "timestamp": stamp,
        "trace_id": trace,
        "correlation_id": correlation,
        "error_uri": f"https://login.microsoftonline.com/error?code={aadsts}",
    }
    return json_answer(body, status)
