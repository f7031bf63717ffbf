"""AccessTokens against the fake's OAuth token endpoint, and a stub for transient failures.

Cached until shortly before expiry, refreshed single-flight; invalid_grant,
unauthorized_client and a too-narrow scope are GmailAuthError (attention); 5xx
and refused connections are retried, then GmailUnavailable (retriable).
"""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator

import aiohttp
import anyio
import jwt
import pytest
from aiohttp import web

from inboxd.adapters.gmail.auth import GMAIL_SCOPE, TOKEN_REFRESH_MARGIN_S, AccessTokens
from inboxd.adapters.gmail.config import GmailMailbox, GmailSettings
from inboxd.adapters.gmail.errors import GmailAuthError, GmailConfigError, GmailUnavailable
from inboxd.pipeline.errors import Family, family_of

from .conftest import ALICE, FAST, Ref, fake_settings, needs_fake, refresh_mailbox

pytestmark = needs_fake


class Clock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def fake() -> AsyncIterator[object]:
    from fakes.gmail import FakeGmail

    async with FakeGmail([ALICE]) as server:
        yield server


async def test_refresh_grant_is_cached_until_shortly_before_expiry(fake, http) -> None:
    clock = Clock()
    tokens = AccessTokens(fake_settings(fake), refresh_mailbox(fake), http, clock=clock)
    first = await tokens.token()
    assert await tokens.token() == first
    assert fake.counters.token_requests["refresh_token"] == 1
    lifetime = 3599  # what the fake (like Google) answers in expires_in
    clock.now += lifetime - TOKEN_REFRESH_MARGIN_S - 1
    assert await tokens.token() == first
    clock.now += 2  # inside the margin: refresh before Gmail would refuse it
    second = await tokens.token()
    assert second != first
    assert fake.counters.token_requests["refresh_token"] == 2


async def test_concurrent_callers_share_one_refresh(fake, http) -> None:
    tokens = AccessTokens(fake_settings(fake), refresh_mailbox(fake), http)
    seen: list[str] = []

    async def take() -> None:
        seen.append(await tokens.token())

    async with anyio.create_task_group() as tg:
        for _ in range(10):
            tg.start_soon(take)
    assert len(set(seen)) == 1 and len(seen) == 10
    assert fake.counters.token_requests["refresh_token"] == 1


async def test_invalidate_forces_a_refresh_only_for_the_current_token(fake, http) -> None:
    tokens = AccessTokens(fake_settings(fake), refresh_mailbox(fake), http)
    first = await tokens.token()
    tokens.invalidate("some-older-token")
    assert await tokens.token() == first
    tokens.invalidate(first)
    assert await tokens.token() != first
    assert fake.counters.token_requests["refresh_token"] == 2


async def test_revoked_refresh_token_is_an_auth_error_without_the_secret(fake, http) -> None:
    refresh = fake.issue_refresh_token(ALICE)
    mailbox = GmailMailbox.from_settings({"refresh_token": Ref(refresh)}, address=ALICE)
    fake.revoke_refresh_token(refresh)
    tokens = AccessTokens(fake_settings(fake), mailbox, http, **FAST)
    with pytest.raises(GmailAuthError, match="invalid_grant") as caught:
        await tokens.token()
    assert refresh not in str(caught.value)
    assert fake.client_secret not in str(caught.value)
    assert family_of(caught.value) is Family.ATTENTION
    assert fake.counters.token_requests["refresh_token"] == 1  # not retried


async def test_wrong_client_secret_is_an_auth_error(fake, http) -> None:
    settings = fake_settings(fake, client_secret=Ref("not-the-secret"))
    with pytest.raises(GmailAuthError, match="invalid_client"):
        await AccessTokens(settings, refresh_mailbox(fake), http).token()


async def test_consent_without_a_gmail_read_scope_is_an_auth_error(fake, http) -> None:
    metadata_only = fake.issue_refresh_token(
        ALICE, scope="https://www.googleapis.com/auth/gmail.metadata"
    )
    mailbox = GmailMailbox.from_settings({"refresh_token": Ref(metadata_only)}, address=ALICE)
    with pytest.raises(GmailAuthError, match="scope"):
        await AccessTokens(fake_settings(fake), mailbox, http).token()


def service_mailbox(key_info: dict[str, str], address: str = ALICE) -> GmailMailbox:
    return GmailMailbox.from_settings(
        {"service_account": Ref(json.dumps(key_info))}, address=address
    )


async def test_service_account_assertion_impersonates_the_mailbox(fake, http) -> None:
    key = fake.add_service_account("sync@p.iam.gserviceaccount.com")
    settings = GmailSettings.from_settings({"api_url": fake.base_url, "token_url": fake.token_url})
    tokens = AccessTokens(settings, service_mailbox(key.info()), http)
    token = await tokens.token()
    assert fake.counters.token_requests["urn:ietf:params:oauth:grant-type:jwt-bearer"] == 1
    # The token acts for the mailbox: the fake resolves it to ALICE (sub = address).
    assert fake.oauth.access_grant(token).user == ALICE


async def test_service_account_assertion_claims(fake, http) -> None:
    """The JWT we send: RS256 with the key id, iss/sub/scope/aud and a one-hour life."""
    key = fake.add_service_account("sync@p.iam.gserviceaccount.com")
    settings = GmailSettings.from_settings({"token_url": fake.token_url})
    tokens = AccessTokens(settings, service_mailbox(key.info()), http, wall_clock=lambda: 1e9)
    form = tokens._grant_form()
    assert form["grant_type"] == "urn:ietf:params:oauth:grant-type:jwt-bearer"
    header = jwt.get_unverified_header(form["assertion"])
    assert header["alg"] == "RS256" and header["kid"] == key.private_key_id
    claims = jwt.decode(form["assertion"], options={"verify_signature": False})
    assert claims == {
        "iss": "sync@p.iam.gserviceaccount.com",
        "sub": ALICE,
        "scope": GMAIL_SCOPE,
        "aud": fake.token_url,
        "iat": 1_000_000_000,
        "exp": 1_000_000_000 + 3600,
    }


async def test_delegation_not_granted_is_an_auth_error(fake, http) -> None:
    key = fake.add_service_account("sync@p.iam.gserviceaccount.com", subjects=["bob@example.com"])
    settings = GmailSettings.from_settings({"token_url": fake.token_url})
    with pytest.raises(GmailAuthError, match="unauthorized_client"):
        await AccessTokens(settings, service_mailbox(key.info()), http).token()


@pytest.mark.parametrize(
    "key_text",
    ["not json", "[]", '{"private_key": "x"}', '{"client_email": "a@b", "private_key": "x"}'],
)
async def test_unusable_service_account_key_is_a_config_error(http, key_text: str) -> None:
    settings = GmailSettings.from_settings({})
    mailbox = GmailMailbox.from_settings({"service_account": Ref(key_text)}, address=ALICE)
    with pytest.raises(GmailConfigError, match=r"^service_account"):
        await AccessTokens(settings, mailbox, http).token()


# --- transient failures ----------------------------------------------------------------


@pytest.fixture
async def flaky_token_endpoint() -> AsyncIterator[tuple[str, list[int]]]:
    """A token endpoint answering 503 twice, then a token; yields (url, statuses sent)."""
    sent: list[int] = []

    async def token(request: web.Request) -> web.Response:
        if len(sent) < 2:
            sent.append(503)
            return web.json_response({"error": "backendError"}, status=503)
        sent.append(200)
        return web.json_response(
            {"access_token": "ya29.ok", "expires_in": 3599, "scope": GMAIL_SCOPE}
        )

    app = web.Application()
    app.router.add_post("/token", token)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}/token", sent
    finally:
        await runner.cleanup()


def refresh_settings(token_url: str) -> tuple[GmailSettings, GmailMailbox]:
    settings = GmailSettings.from_settings(
        {"client_id": "c", "client_secret": Ref("s"), "token_url": token_url}
    )
    return settings, GmailMailbox.from_settings({"refresh_token": Ref("r")}, address=ALICE)


async def test_5xx_is_retried_then_succeeds(flaky_token_endpoint, http) -> None:
    url, sent = flaky_token_endpoint
    settings, mailbox = refresh_settings(url)
    tokens = AccessTokens(settings, mailbox, http, **FAST)
    assert await tokens.token() == "ya29.ok"
    assert sent == [503, 503, 200]


async def test_5xx_beyond_the_attempts_is_retriable(flaky_token_endpoint, http) -> None:
    url, sent = flaky_token_endpoint
    settings, mailbox = refresh_settings(url)
    tokens = AccessTokens(settings, mailbox, http, attempts=2, **FAST)
    with pytest.raises(GmailUnavailable) as caught:
        await tokens.token()
    assert sent == [503, 503]
    assert family_of(caught.value) is Family.RETRIABLE


async def test_refused_connection_is_retried_then_retriable(http: aiohttp.ClientSession) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings, mailbox = refresh_settings(f"http://127.0.0.1:{port}/token")
    tokens = AccessTokens(settings, mailbox, http, attempts=3, **FAST)
    with pytest.raises(GmailUnavailable, match="after 3 attempts"):
        await tokens.token()
    assert tokens.requests == 3
