"""Access tokens for one Gmail mailbox: OAuth 2.0 refresh-token grant or service-account JWT.

Two ways to act for a mailbox (config.GmailMailbox):

    refresh_token     POST token_url  grant_type=refresh_token, client_id,
                      client_secret, refresh_token   ("Using OAuth 2.0 for Web
                      Server Applications", refreshing an access token)
    service_account   POST token_url  grant_type=urn:ietf:params:oauth:grant-type:
                      jwt-bearer, assertion=<RS256 JWT: iss = the key's client_email,
                      sub = the mailbox address (domain-wide delegation), scope, aud =
                      token_url, iat, exp ≤ iat + 1 h>  ("Using OAuth 2.0 for Server
                      to Server Applications"; RFC 7523)

Both answer {"access_token", "expires_in", "token_type", "scope"?}. The scope is
gmail.readonly: messages.get format=raw, history.list and users.watch all accept
it (each method's "Authorization scopes"); gmail.metadata would not do (no raw).

`AccessTokens` caches the token until TOKEN_REFRESH_MARGIN_S before it expires
and refreshes single-flight (one lock; waiters re-check the cache, so N
concurrent callers cause one request). What the token endpoint says maps onto
errors.py:

    200 with a Gmail scope (or no scope field)    the token
    200 whose scope lacks every Gmail read scope  GmailAuthError (consent too narrow)
    400/401/403 {"error": "invalid_grant" | …}    GmailAuthError naming the error code
                                                  (revoked, expired, DWD not granted)
    429, 5xx, connection error, deadline          retried with tenacity (TOKEN_ATTEMPTS,
                                                  exponential backoff with jitter),
                                                  then GmailUnavailable

No blocking call runs on the event loop: the request is aiohttp (google-auth's
transports are synchronous), and signing one RS256 assertion takes about a
millisecond. Secrets are revealed per request and never logged; errors name
the error code Google returned, never a token or key.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import anyio
import jwt
import structlog
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
    wait_random,
)

from inboxd.adapters.gmail.config import GmailMailbox, GmailSettings
from inboxd.adapters.gmail.errors import GmailAuthError, GmailConfigError, GmailUnavailable
from inboxd.adapters.http_fetch import read_capped

__all__ = [
    "GMAIL_READ_SCOPES",
    "GMAIL_SCOPE",
    "JWT_BEARER_GRANT",
    "TOKEN_ATTEMPTS",
    "TOKEN_REFRESH_MARGIN_S",
    "TOKEN_REQUEST_TIMEOUT_S",
    "AccessTokens",
    "TokenSource",
]

log = structlog.get_logger(__name__)

#: The scope we ask a service account's delegation for (OAuth 2.0 scopes for Gmail).
GMAIL_SCOPE = "https://www.googleapis.com/auth/gmail.readonly"
#: Scopes that can read raw messages and history; a granted scope set must contain one.
GMAIL_READ_SCOPES = frozenset(
    {
        "https://mail.google.com/",
        "https://www.googleapis.com/auth/gmail.modify",
        GMAIL_SCOPE,
    }
)
JWT_BEARER_GRANT = "urn:ietf:params:oauth:grant-type:jwt-bearer"  # RFC 7523 §2.1
#: Lifetime of a service-account assertion: Google accepts at most one hour.
ASSERTION_LIFETIME_S = 3600
#: Refresh this long before expiry: longer than any Gmail call's deadline plus clock
#: skew, so a token handed out is still valid when the call it authorises arrives.
TOKEN_REFRESH_MARGIN_S = 300.0
#: Deadline of one token request (rule 7); the endpoint answers in well under a second.
TOKEN_REQUEST_TIMEOUT_S = 20.0
#: Attempts at the token endpoint before a transient failure becomes GmailUnavailable.
TOKEN_ATTEMPTS = 4
TOKEN_BACKOFF_INITIAL_S = 0.5
TOKEN_BACKOFF_MAX_S = 8.0
#: Largest token-endpoint answer read (a token answer is a few hundred bytes).
TOKEN_ANSWER_MAX_BYTES = 64 * 1024
#: Longest error_description kept in an error message.
DESCRIPTION_MAX_CHARS = 200


class TokenSource(Protocol):
    """What the client needs: a valid access token, and a way to drop one Gmail refused."""

    async def token(self) -> str: ...

    def invalidate(self, token: str) -> None: ...


class _TransientTokenFailure(Exception):
    """One failed attempt at the token endpoint that a later attempt may fix."""


@dataclass(frozen=True, slots=True)
class _ServiceAccountKey:
    client_email: str
    private_key: str
    private_key_id: str | None


class AccessTokens:
    """Access tokens for one mailbox, cached and refreshed single-flight (module docstring).

    `clock` is a monotonic clock in seconds (tests advance it to expire tokens);
    `session` is the daemon's shared aiohttp session.
    """

    def __init__(
        self,
        settings: GmailSettings,
        mailbox: GmailMailbox,
        session: aiohttp.ClientSession,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        attempts: int = TOKEN_ATTEMPTS,
        backoff_initial_s: float = TOKEN_BACKOFF_INITIAL_S,
        backoff_max_s: float = TOKEN_BACKOFF_MAX_S,
    ) -> None:
        mailbox.check_against(settings)
        self._settings = settings
        self._mailbox = mailbox
        self._session = session
        self._clock = clock
        self._wall_clock = wall_clock
        self._attempts = attempts
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._lock = anyio.Lock()
        self._token: str | None = None
        self._valid_until = -math.inf
        #: Token requests sent (tests: single flight, caching).
        self.requests = 0

    async def token(self) -> str:
        """A valid access token, from the cache or a refresh. GmailAuthError when
        Google refuses the credentials; GmailUnavailable when the endpoint stays
        unreachable through TOKEN_ATTEMPTS."""
        cached = self._cached()
        if cached is not None:
            return cached
        async with self._lock:
            cached = self._cached()  # another caller refreshed while we waited
            if cached is not None:
                return cached
            token, lifetime_s = await self._fetch_with_retries()
            self._token = token
            self._valid_until = self._clock() + max(0.0, lifetime_s - TOKEN_REFRESH_MARGIN_S)
            return token

    def invalidate(self, token: str) -> None:
        """Gmail answered 401 for `token`: the next `token()` refreshes. A token
        other than the cached one (already replaced) changes nothing."""
        if token == self._token:
            self._token = None
            self._valid_until = -math.inf

    def _cached(self) -> str | None:
        if self._token is not None and self._clock() < self._valid_until:
            return self._token
        return None

    # --- the request ----------------------------------------------------------------------

    async def _fetch_with_retries(self) -> tuple[str, float]:
        failures = 0

        def note_failure(state: RetryCallState) -> None:
            nonlocal failures
            failures += 1
            if failures == 1:  # log "unavailable" once, not every attempt (rule 8)
                exc = state.outcome.exception() if state.outcome else None
                log.warning("gmail_token_unavailable", mailbox=self._mailbox.address, error=exc)

        retrying = AsyncRetrying(
            stop=stop_after_attempt(self._attempts),
            wait=wait_exponential(multiplier=self._backoff_initial_s, max=self._backoff_max_s)
            + wait_random(0, self._backoff_initial_s),
            retry=retry_if_exception_type(_TransientTokenFailure),
            before_sleep=note_failure,
            reraise=True,
        )
        try:
            result: tuple[str, float] = await retrying(self._fetch_once)
        except _TransientTokenFailure as exc:
            raise GmailUnavailable(
                f"token endpoint unavailable after {self._attempts} attempts: {exc}"
            ) from exc
        if failures:
            log.info("gmail_token_recovered", mailbox=self._mailbox.address)
        return result

    async def _fetch_once(self) -> tuple[str, float]:
        form = self._grant_form()
        self.requests += 1
        try:
            with anyio.fail_after(TOKEN_REQUEST_TIMEOUT_S):
                async with self._session.post(
                    self._settings.token_url,
                    data=form,
                    headers={"Accept": "application/json"},
                    allow_redirects=False,
                ) as response:
                    status = response.status
                    body = await read_capped(response, TOKEN_ANSWER_MAX_BYTES)
        except TimeoutError as exc:
            raise _TransientTokenFailure("token request timed out") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise _TransientTokenFailure(f"token request failed: {type(exc).__name__}") from exc
        if status == 429 or status >= 500:
            raise _TransientTokenFailure(f"token endpoint answered {status}")
        if body is None:
            raise _TransientTokenFailure(f"token answer larger than {TOKEN_ANSWER_MAX_BYTES} bytes")
        answer = _json_object(body)
        if status != 200:
            code = str(answer.get("error") or f"HTTP {status}")
            description = str(answer.get("error_description") or "")[:DESCRIPTION_MAX_CHARS]
            raise GmailAuthError(
                f"token endpoint refused the {self._grant_name} grant: {code}"
                + (f" ({description})" if description else "")
            )
        return self._read_token(answer)

    @property
    def _grant_name(self) -> str:
        return "refresh_token" if self._mailbox.refresh_token is not None else "service_account"

    def _grant_form(self) -> dict[str, str]:
        settings, mailbox = self._settings, self._mailbox
        if mailbox.refresh_token is not None:
            assert settings.client_id is not None and settings.client_secret is not None
            return {
                "grant_type": "refresh_token",
                "client_id": settings.client_id,
                "client_secret": settings.client_secret.reveal(),
                "refresh_token": mailbox.refresh_token.reveal(),
            }
        assert mailbox.service_account is not None
        key = _service_account_key(mailbox.service_account.reveal())
        now = int(self._wall_clock())
        claims = {
            "iss": key.client_email,
            "sub": mailbox.address,  # domain-wide delegation: act as the mailbox's user
            "scope": GMAIL_SCOPE,
            "aud": settings.token_url,
            "iat": now,
            "exp": now + ASSERTION_LIFETIME_S,
        }
        headers = {"kid": key.private_key_id} if key.private_key_id else None
        try:
            assertion = jwt.encode(claims, key.private_key, algorithm="RS256", headers=headers)
        except (ValueError, TypeError, jwt.PyJWTError) as exc:
            raise GmailConfigError("service_account: private_key is not an RSA key") from exc
        return {"grant_type": JWT_BEARER_GRANT, "assertion": assertion}

    def _read_token(self, answer: Mapping[str, Any]) -> tuple[str, float]:
        token = answer.get("access_token")
        expires_in = answer.get("expires_in")
        if not isinstance(token, str) or not token:
            raise _TransientTokenFailure("token answer without access_token")
        if isinstance(expires_in, str) and expires_in.isdigit():
            expires_in = int(expires_in)
        if isinstance(expires_in, bool) or not isinstance(expires_in, int | float):
            expires_in = 0  # unknown lifetime: use it for this call only
        scope = answer.get("scope")
        if isinstance(scope, str) and GMAIL_READ_SCOPES.isdisjoint(scope.split()):
            raise GmailAuthError(
                f"the {self._grant_name} grant lacks a Gmail read scope "
                f"(need one of {', '.join(sorted(GMAIL_READ_SCOPES))})"
            )
        return token, float(expires_in)


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(body)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _service_account_key(text: str) -> _ServiceAccountKey:
    """The parts of a service-account key JSON we use; GmailConfigError naming what is
    missing (never quoting the key)."""
    try:
        key = json.loads(text)
    except ValueError as exc:
        raise GmailConfigError("service_account: not a service-account key JSON") from exc
    if not isinstance(key, dict):
        raise GmailConfigError("service_account: not a service-account key JSON")
    email, private_key = key.get("client_email"), key.get("private_key")
    if not isinstance(email, str) or not email:
        raise GmailConfigError("service_account: key JSON has no client_email")
    if not isinstance(private_key, str) or "PRIVATE KEY" not in private_key:
        raise GmailConfigError("service_account: key JSON has no private_key")
    key_id = key.get("private_key_id")
    return _ServiceAccountKey(email, private_key, key_id if isinstance(key_id, str) else None)
