"""The device authorization grant behind `inboxd connect outlook`: a delegated refresh token.

OAuth 2.0 device authorization grant (RFC 8628) at the Microsoft identity platform
v2.0 ("Microsoft identity platform and the OAuth 2.0 device authorization grant
flow"), for an operator at a terminal without a browser on the same machine:

    1. POST {authority_url}/{directory_id}/oauth2/v2.0/devicecode (client_id, scope)
       → device_code, user_code, verification_uri, expires_in, interval, message
    2. print `message` (the page to open, the code to enter) on stderr
    3. wait `interval` s, then POST …/oauth2/v2.0/token with grant_type
       urn:ietf:params:oauth:grant-type:device_code, client_id, device_code (and
       the app's credential when [outlook] has one: its client_secret, or a client
       assertion signed with its certificate, made anew for each poll since one
       lives 10 minutes and the code 15; Entra requires the credential from a
       confidential client: AADSTS7000218 without it), and read the answer:
         authorization_pending    → wait, poll again
         slow_down                → interval += 5 s for good (RFC 8628 §3.5), poll again
         200 with a refresh token → done
         authorization_declined, expired_token, bad_verification_code, anything
                                  else → CommandError; nothing is written
       until `expires_in` has elapsed since step 1 (the code is dead by then)

Scope `{graph}/.default offline_access`: the Graph permissions the app registration
holds (the resource derived from graph_url as adapters/outlook/auth.py derives it
for its refreshes, so national clouds work), and offline_access for the refresh
token. The token never reaches stdout, stderr or a log: errors carry Entra's error
name and AADSTS code only.

Every wait is `anyio.sleep`, every request has a deadline, so Ctrl-C cancels the
flow at once (the CLI then reports "interrupted", exit 130). A dropped connection,
429 or 5xx while polling is retried (RFC 8628 §3.5: back off exponentially).

Where the file goes and how it is written is the business of `connect.py`, shared
with `connect gmail`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import anyio
import structlog
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
    wait_random,
)

from inboxd.adapters.outlook.auth import client_authentication
from inboxd.adapters.outlook.config import OutlookSettings
from inboxd.adapters.outlook.errors import OutlookAuthError
from inboxd.daemon.commands.common import EXIT_USAGE, CommandError

__all__ = ["ENV_TEST_POLL_SCALE", "device_flow", "poll_scale"]

log = structlog.get_logger(__name__)

DEVICE_CODE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"
#: RFC 8628 §3.2: "If no value is provided, clients MUST use 5 as the default."
DEFAULT_POLL_INTERVAL_S = 5.0
#: RFC 8628 §3.5: on slow_down "the interval MUST be increased by 5 seconds for
#: this and all subsequent requests".
SLOW_DOWN_STEP_S = 5.0
#: A server answering interval 0 would otherwise have us poll in a hot loop.
MIN_POLL_INTERVAL_S = 1.0
#: When the answer lacks expires_in: Entra's codes live 15 minutes (device code guide).
DEFAULT_CODE_TTL_S = 900.0
#: Deadline of one request to the identity platform.
HTTP_TIMEOUT_S = 30.0
#: Attempts of one poll through dropped connections, 429s and 5xx; with the backoff
#: below they span about a minute, well inside the code's 15 minutes.
POLL_ATTEMPTS = 5
POLL_BACKOFF_S = 2.0
POLL_BACKOFF_MAX_S = 30.0
#: Test-only: a factor (0 < f <= 1) applied to every wait between polls, the
#: server's interval and slow_down's 5 s alike, so that tests of the flow take
#: milliseconds. Polling faster than the server asks breaks RFC 8628 §3.5; the
#: command says so on stderr whenever it is set.
ENV_TEST_POLL_SCALE = "INBOXD_TEST_POLL_SCALE"

# Token endpoint errors that end the flow (RFC 8628 §3.5; Entra's device code guide).
_FAILURES = {
    "authorization_declined": "sign-in declined at the verification page",
    "expired_token": "the code expired before anyone signed in: run connect again",
    "bad_verification_code": "the identity platform does not know this device code",
    "invalid_grant": "the identity platform refused the device code (used or revoked)",
    "invalid_client": "the app's credential was refused: check [outlook] client_secret "
    "or certificate (without either, the app registration must allow public client flows)",
    "unauthorized_client": "the app registration does not allow this flow "
    "(Authentication → Allow public client flows) or is not in this directory",
}


class _Unavailable(Exception):
    """A dropped connection, a deadline, a 429 or 5xx: worth another attempt."""


@dataclass(frozen=True, slots=True)
class _DeviceCode:
    device_code: str
    message: str
    interval_s: float
    expires_in_s: float


def poll_scale(environ: Mapping[str, str]) -> float:
    """The test-only factor of ENV_TEST_POLL_SCALE (1.0 when unset); CommandError
    (exit 2) for anything but a number in (0, 1]."""
    text = environ.get(ENV_TEST_POLL_SCALE)
    if text is None:
        return 1.0
    try:
        scale = float(text)
    except ValueError:
        scale = math.nan
    if not 0 < scale <= 1:
        raise CommandError(f"{ENV_TEST_POLL_SCALE}: expected a number in (0, 1]", EXIT_USAGE)
    if scale < 1:
        print(
            f"inboxd: {ENV_TEST_POLL_SCALE}={scale:g}: polling faster than the identity "
            "platform asks (for tests only)",
            file=sys.stderr,
        )
    return scale


async def device_flow(
    settings: OutlookSettings, session: aiohttp.ClientSession, *, wait_scale: float = 1.0
) -> str:
    """The refresh token of whoever signs in with the printed code (module docstring).

    CommandError when the sign-in is declined, the code expires, or the identity
    platform refuses the app; cancellation (Ctrl-C) ends the wait at once.
    `wait_scale` is poll_scale's test-only factor."""
    _credential(settings)  # a certificate that cannot sign: before anyone signs in
    code = await _request_code(session, settings)
    print(code.message, file=sys.stderr, flush=True)
    form = {
        "grant_type": DEVICE_CODE_GRANT,
        "client_id": settings.client_id,
        "device_code": code.device_code,
    }
    interval_s = code.interval_s
    with anyio.move_on_after(code.expires_in_s):
        while True:
            await anyio.sleep(interval_s * wait_scale)
            status, answer = await _poll(session, settings.token_url, form | _credential(settings))
            refresh = answer.get("refresh_token")
            if status == 200:
                if not isinstance(refresh, str) or not refresh.strip():
                    raise CommandError(
                        "the token endpoint issued no refresh token (is offline_access "
                        "allowed for the app?): nothing written"
                    )
                return refresh.strip()
            error = str(answer.get("error") or f"http_{status}")
            if error == "authorization_pending":
                continue
            if error == "slow_down":
                interval_s += SLOW_DOWN_STEP_S
                log.info("device_code_slow_down", interval_s=interval_s)
                continue
            reason = _FAILURES.get(error, f"the token endpoint answered {status}")
            raise CommandError(f"{reason} ({error}{_aadsts(answer)}): nothing written")
    raise CommandError(
        f"nobody signed in within {code.expires_in_s:g} s, the code has expired: run connect again"
    )


def _credential(settings: OutlookSettings) -> dict[str, str]:
    """The app's credential fields of a token request (adapters/outlook/auth.py);
    CommandError when [outlook] certificate cannot sign."""
    try:
        return client_authentication(settings)
    except OutlookAuthError as exc:
        raise CommandError(f"[outlook] {exc}: nothing written", EXIT_USAGE) from exc


async def _request_code(session: aiohttp.ClientSession, settings: OutlookSettings) -> _DeviceCode:
    url = settings.device_code_url
    form = {"client_id": settings.client_id, "scope": f"{settings.graph_scope} offline_access"}
    try:
        status, answer = await _post(session, url, form)
    except _Unavailable as exc:
        raise CommandError(f"device code endpoint {url}: {exc}") from exc
    device_code, message = answer.get("device_code"), answer.get("message")
    if status != 200 or not isinstance(device_code, str) or not isinstance(message, str):
        error = str(answer.get("error") or "no device code")
        reason = _FAILURES.get(error, "refused")
        raise CommandError(f"device code endpoint {url}: {reason} ({error}{_aadsts(answer)})")
    return _DeviceCode(
        device_code=device_code,
        message=" ".join(message.split()),
        interval_s=max(
            MIN_POLL_INTERVAL_S, _seconds(answer.get("interval"), DEFAULT_POLL_INTERVAL_S)
        ),
        expires_in_s=_seconds(answer.get("expires_in"), DEFAULT_CODE_TTL_S),
    )


async def _poll(
    session: aiohttp.ClientSession, url: str, form: dict[str, str]
) -> tuple[int, dict[str, Any]]:
    """One poll of the token endpoint, through transient failures (bounded)."""
    retrying = AsyncRetrying(
        stop=stop_after_attempt(POLL_ATTEMPTS),
        wait=wait_exponential(multiplier=POLL_BACKOFF_S, max=POLL_BACKOFF_MAX_S)
        + wait_random(0, POLL_BACKOFF_S),
        retry=retry_if_exception_type(_Unavailable),
        before_sleep=_unavailable_once,
        reraise=True,
    )
    try:
        result: tuple[int, dict[str, Any]] = await retrying(_post, session, url, form)
    except _Unavailable as exc:
        raise CommandError(f"token endpoint {url}: {exc}") from exc
    if retrying.statistics.get("attempt_number", 1) > 1:
        log.warning("token_endpoint_recovered")
    return result


def _unavailable_once(state: RetryCallState) -> None:
    if state.attempt_number == 1:
        exc = state.outcome.exception() if state.outcome is not None else None
        log.warning("token_endpoint_unavailable", reason=str(exc))


async def _post(
    session: aiohttp.ClientSession, url: str, form: dict[str, str]
) -> tuple[int, dict[str, Any]]:
    """(status, JSON object answered); _Unavailable for what a retry may cure."""
    try:
        with anyio.fail_after(HTTP_TIMEOUT_S):
            async with session.post(url, data=form) as response:
                status = response.status
                body = await response.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise _Unavailable(type(exc).__name__) from exc
    except ValueError:  # not JSON: a proxy's error page
        body = None
    if status == 429 or status >= 500:
        raise _Unavailable(f"answered {status}")
    return status, body if isinstance(body, dict) else {}


def _aadsts(answer: Mapping[str, Any]) -> str:
    codes = answer.get("error_codes")
    return f", AADSTS{codes[0]}" if isinstance(codes, list) and codes else ""


def _seconds(value: object, default: float) -> float:
    """A duration of the answer (a number, or a numeric string as Entra's v1.0 sent)."""
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return default
    return seconds if math.isfinite(seconds) and seconds >= 0 else default
