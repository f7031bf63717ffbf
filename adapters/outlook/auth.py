"""Access tokens for Microsoft Graph from the identity platform's v2.0 token endpoint.

    app-only     grant_type=client_credentials, scope {graph}/.default, the app's
                 client_secret or a certificate's signed client assertion
    delegated    grant_type=refresh_token with the mailbox's refresh token; Entra
                 answers a new refresh token each time ("refresh tokens ... are
                 replaced with a fresh token upon every use") and may refuse the
                 old one, so the newest is written to the RefreshTokenStore (the
                 database: token_store.py) before it is used, and read back before
                 the first refresh: it wins over the configured one as long as the
                 configuration names the same token it was stored for (a new
                 `inboxd connect outlook` wins over the store). A refresh token
                 refused (invalid_grant) makes the store be read again: another
                 replica may have redeemed ours and stored its successor, which
                 is then presented once before the mailbox needs attention

`GraphTokens.token()` answers the cached token until TOKEN_REFRESH_MARGIN_S before
its expiry, then fetches one (single-flight: concurrent callers wait for the same
fetch). All HTTP is aiohttp on the event loop: nothing blocks (msal/azure-identity's
synchronous credentials would). It is also the SDK's `AccessTokenProvider`, so the
request adapter asks it for every request, and it refuses to hand a token to any
host but the configured Graph host, or over plain http beyond this machine.

Failures: the endpoint's permanent answers (invalid_grant: revoked, expired or
consent withdrawn; invalid_client: wrong secret or certificate; unauthorized_client;
invalid_scope...) are `OutlookAuthError` (the mailbox needs attention, with
Entra's error and AADSTS code, never the token); a 5xx, 429 or dropped connection
is retried TOKEN_ATTEMPTS times, then `OutlookUnavailable`.
"""

from __future__ import annotations

import base64
import hashlib
import math
import time
import uuid
from typing import Any, Protocol
from urllib.parse import urlsplit

import aiohttp
import anyio
import jwt
import orjson
import structlog
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from kiota_abstractions.authentication import AccessTokenProvider, AllowedHostsValidator
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
    wait_random,
)

from inboxd.adapters.outlook.config import OutlookMailbox, OutlookSettings
from inboxd.adapters.outlook.errors import OutlookAuthError, OutlookUnavailable

__all__ = ["GraphTokens", "RefreshTokenStore", "client_authentication"]

log = structlog.get_logger(__name__)

#: Refresh this long before the token's expiry (Entra access tokens live 60-90 min).
TOKEN_REFRESH_MARGIN_S = 300.0
#: Attempts of one token request before a transient failure is the runner's business.
TOKEN_ATTEMPTS = 4
TOKEN_BACKOFF_S = 1.0
TOKEN_TIMEOUT_S = 30.0
CLIENT_ASSERTION_TYPE = "urn:ietf:params:oauth:client-assertion-type:jwt-bearer"
#: Lifetime of a certificate's client assertion (Entra accepts up to 10 minutes).
ASSERTION_LIFETIME_S = 600
#: Entra errors that no retry fixes (OAuth 2.0 RFC 6749 §5.2 and Entra's additions).
PERMANENT_ERRORS = frozenset(
    {
        "invalid_grant",
        "invalid_client",
        "unauthorized_client",
        "invalid_scope",
        "unsupported_grant_type",
        "consent_required",
        "interaction_required",
        "invalid_request",
    }
)
_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


class _RefreshTokenRefused(OutlookAuthError):
    """invalid_grant to a refresh token: the store may hold a newer one."""


class RefreshTokenStore(Protocol):
    """Where a delegated mailbox's newest refresh token outlives the process. Both
    raise OutlookUnavailable when the store cannot answer (a retriable failure)."""

    async def load(self, configured_sha256: str) -> str | None:
        """The stored token, if it was stored while the configuration named the
        token whose sha256 is `configured_sha256`."""
        ...

    async def save(self, configured_sha256: str, refresh_token: str) -> None:
        """Keep `refresh_token` durably before returning."""
        ...


class GraphTokens(AccessTokenProvider):
    """One mailbox's access tokens (module docstring)."""

    def __init__(
        self,
        settings: OutlookSettings,
        mailbox: OutlookMailbox,
        session: aiohttp.ClientSession,
        store: RefreshTokenStore | None = None,
    ) -> None:
        self._settings = settings
        self._mailbox = mailbox
        self._session = session
        self._store = store
        self._token: str | None = None
        self._expires_at = 0.0  # monotonic
        self._refresh_token: str | None = None  # the newest one Entra gave us
        self._configured_sha256: str | None = None  # set once the store was read
        self._lock = anyio.Lock()
        graph = urlsplit(settings.graph_url)
        self._graph_host = graph.hostname or ""
        self._scope = settings.graph_scope
        self._hosts = AllowedHostsValidator([self._graph_host])

    async def token(self) -> str:
        """A valid access token (cached, refreshed shortly before it expires)."""
        if self._token is not None and time.monotonic() < self._expires_at:
            return self._token
        async with self._lock:
            if self._token is None or time.monotonic() >= self._expires_at:
                self._token, lifetime = await self._fetch()
                self._expires_at = time.monotonic() + max(0.0, lifetime - TOKEN_REFRESH_MARGIN_S)
            return self._token

    def invalidate(self, token: str) -> None:
        """Graph refused `token` (401): the next `token()` fetches a new one."""
        if self._token == token:
            self._token = None

    def forget(self) -> None:
        """Graph refused the current token where the request does not say which one
        was sent (inside a $batch): the next `token()` fetches a new one."""
        self._token = None

    # --- kiota AccessTokenProvider ----------------------------------------------------------

    async def get_authorization_token(
        self,
        uri: str,
        additional_authentication_context: dict[str, Any] | None = None,  # noqa: ARG002 - kiota's
    ) -> str:
        parts = urlsplit(uri)
        if parts.hostname != self._graph_host:
            return ""  # no Authorization header for any other host
        if parts.scheme != "https" and parts.hostname not in _LOOPBACK:
            raise OutlookAuthError("refusing to send a Graph token over plain http")
        return await self.token()

    def get_allowed_hosts_validator(self) -> AllowedHostsValidator:
        return self._hosts

    # --- the token endpoint ------------------------------------------------------------------

    async def _restore(self) -> None:
        """Before the first refresh: the stored newest refresh token, if it was
        stored for the token the configuration names now."""
        if self._mailbox.refresh_token is None or self._configured_sha256 is not None:
            return
        configured = self._mailbox.refresh_token.reveal().strip()
        digest = hashlib.sha256(configured.encode()).hexdigest()
        if self._store is not None:
            stored = await self._store.load(digest)
            if stored:
                self._refresh_token = stored
        self._configured_sha256 = digest

    async def _fetch(self) -> tuple[str, float]:
        await self._restore()
        retrying = AsyncRetrying(
            stop=stop_after_attempt(TOKEN_ATTEMPTS),
            wait=wait_exponential(multiplier=TOKEN_BACKOFF_S, max=30.0)
            + wait_random(0, TOKEN_BACKOFF_S),
            retry=retry_if_exception_type(OutlookUnavailable),
            reraise=True,
        )
        try:
            result: tuple[str, float] = await retrying(self._request_once)
        except _RefreshTokenRefused:
            if not await self._reread_store():
                raise
            # another replica (or a run this process lost track of) redeemed the
            # token we held and stored its successor: present that one instead
            result = await retrying(self._request_once)
        return result

    async def _reread_store(self) -> bool:
        """After invalid_grant to the refresh token we presented: True when the store
        holds another one (a replica refreshing the same mailbox redeemed ours and
        stored the token Entra rotated it into; single-use refresh tokens make the
        loser's refused), now the one to present."""
        if self._store is None or self._configured_sha256 is None:
            return False
        assert self._mailbox.refresh_token is not None
        presented = self._refresh_token or self._mailbox.refresh_token.reveal().strip()
        stored = await self._store.load(self._configured_sha256)
        if not stored or stored == presented:
            return False
        self._refresh_token = stored
        log.info("graph_refresh_token_reread")
        return True

    async def _request_once(self) -> tuple[str, float]:
        form = self._form()
        url = self._settings.token_url
        try:
            async with self._session.post(
                url, data=form, timeout=aiohttp.ClientTimeout(total=TOKEN_TIMEOUT_S)
            ) as response:
                body = await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise OutlookUnavailable(f"token endpoint: {type(exc).__name__}") from exc
        answer = _json(body)
        if status == 200 and isinstance(answer.get("access_token"), str):
            await self._keep(answer.get("refresh_token"), form.get("refresh_token"))
            lifetime = answer.get("expires_in", 3600)
            try:
                seconds = float(lifetime)
            except (TypeError, ValueError):
                seconds = 3600.0
            return answer["access_token"], seconds if math.isfinite(seconds) else 3600.0
        error = str(answer.get("error") or f"http_{status}")
        codes = answer.get("error_codes")
        code = f" (AADSTS{codes[0]})" if isinstance(codes, list) and codes else ""
        if status in (400, 401, 403) and error in PERMANENT_ERRORS:
            if error == "invalid_grant" and form["grant_type"] == "refresh_token":
                raise _RefreshTokenRefused(f"token endpoint refused the credentials: {error}{code}")
            raise OutlookAuthError(f"token endpoint refused the credentials: {error}{code}")
        raise OutlookUnavailable(f"token endpoint answered {status}: {error}{code}")

    async def _keep(self, issued: object, presented: str | None) -> None:
        """A refresh token Entra issued: the newest one from now on, in memory at once
        (the one presented may be refused already) and in the store before this
        answer's access token is used. A store that fails raises OutlookUnavailable:
        the request is made again with the in-memory token, and its answer stored."""
        if not isinstance(issued, str) or not issued.strip() or issued == presented:
            return
        self._refresh_token = issued.strip()
        if self._store is not None and self._configured_sha256 is not None:
            await self._store.save(self._configured_sha256, self._refresh_token)

    def _form(self) -> dict[str, str]:
        form = {"client_id": self._settings.client_id, "scope": self._scope}
        if self._mailbox.refresh_token is not None:
            refresh = self._refresh_token or self._mailbox.refresh_token.reveal().strip()
            form |= {
                "grant_type": "refresh_token",
                "refresh_token": refresh,
                "scope": f"{self._scope} offline_access",
            }
        else:
            form["grant_type"] = "client_credentials"
        return form | client_authentication(self._settings)


def client_authentication(settings: OutlookSettings) -> dict[str, str]:
    """The form fields that authenticate the app at the token endpoint, for every
    grant (client credentials, refresh token, device code): its client_secret, or
    a client assertion signed with its certificate (a new one each call: it lives
    ASSERTION_LIFETIME_S); none for a public client. OutlookAuthError when the
    certificate cannot be read."""
    if settings.client_secret is not None:
        return {"client_secret": settings.client_secret.reveal().strip()}
    if settings.certificate is not None:
        return {
            "client_assertion_type": CLIENT_ASSERTION_TYPE,
            "client_assertion": _assertion(settings),
        }
    return {}


def _assertion(settings: OutlookSettings) -> str:
    """A client assertion signed with the certificate's key (Entra "certificate
    credentials": RS256, x5t#S256 header, aud = the token endpoint)."""
    assert settings.certificate is not None
    pem = settings.certificate.reveal().encode()
    try:
        key = serialization.load_pem_private_key(pem, password=None)
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise OutlookAuthError(
            "certificate: expected a PEM with the private key and the certificate"
        ) from exc
    thumbprint = base64.urlsafe_b64encode(cert.fingerprint(hashes.SHA256())).rstrip(b"=")
    now = int(time.time())
    claims = {
        "aud": settings.token_url,
        "iss": settings.client_id,
        "sub": settings.client_id,
        "jti": str(uuid.uuid4()),
        "nbf": now,
        "iat": now,
        "exp": now + ASSERTION_LIFETIME_S,
    }
    headers = {"x5t#S256": thumbprint.decode()}
    return jwt.encode(claims, key, algorithm="RS256", headers=headers)  # type: ignore[arg-type]


def _json(body: bytes) -> dict[str, Any]:
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
