"""Contract tests of the fake's OAuth side: bearer checks, the refresh grant and
revocation (invalid_grant), authorization code + PKCE, the jwt-bearer grant of
service accounts, /certs, and google-auth's own requests against /token.
"""

from __future__ import annotations

import time
from urllib.parse import parse_qs, urlsplit

import aiohttp
import anyio.to_thread
import jwt
import pytest

from fakes.gmail import DEFAULT_CLIENT_ID, DEFAULT_CLIENT_SECRET, FakeGmail, pkce_s256
from fakes.gmail.testkit import (
    ALICE,
    BOB,
    ManualClock,
    get_json,
    refresh,
)


# -- auth ------------------------------------------------------------------------
async def test_api_calls_need_a_valid_bearer_for_that_user(
    fake: FakeGmail, http: aiohttp.ClientSession, clock: ManualClock
) -> None:
    url = f"{fake.api_url}/users/me/profile"
    async with http.get(url) as resp:
        assert resp.status == 401
        assert (await resp.json())["error"]["status"] == "UNAUTHENTICATED"
    assert (await get_json(http, url, "not-a-token"))[0] == 401
    token = fake.issue_access_token(ALICE)
    assert (await get_json(http, f"{fake.api_url}/users/{BOB}/profile", token))[0] == 403
    assert (await get_json(http, f"{fake.api_url}/users/{ALICE}/profile", token))[0] == 200
    clock.now += 3600  # access tokens live 3599 s
    assert (await get_json(http, url, token))[0] == 401


async def test_refresh_grant_and_revocation(fake: FakeGmail, http: aiohttp.ClientSession) -> None:
    refresh_token = fake.issue_refresh_token(ALICE)
    status, body = await refresh(http, fake, refresh_token)
    assert status == 200 and body["expires_in"] == 3599 and "refresh_token" not in body
    url = f"{fake.api_url}/users/me/profile"
    assert (await get_json(http, url, body["access_token"]))[0] == 200
    fake.revoke_refresh_token(refresh_token)
    status, error = await refresh(http, fake, refresh_token)
    assert status == 400 and error["error"] == "invalid_grant"
    assert (await get_json(http, url, body["access_token"]))[0] == 401
    form = {"grant_type": "refresh_token", "refresh_token": "x", "client_id": DEFAULT_CLIENT_ID}
    async with http.post(fake.token_url, data=form | {"client_secret": "wrong"}) as resp:
        assert resp.status == 401 and (await resp.json())["error"] == "invalid_client"


async def test_authorization_code_with_pkce(fake: FakeGmail, http: aiohttp.ClientSession) -> None:
    verifier = "v" * 64
    redirect = "http://127.0.0.1:9/callback"
    params = {
        "client_id": DEFAULT_CLIENT_ID,
        "redirect_uri": redirect,
        "response_type": "code",
        "scope": "https://www.googleapis.com/auth/gmail.readonly",
        "state": "st-1",
        "access_type": "offline",
        "login_hint": BOB,
        "code_challenge": pkce_s256(verifier),
        "code_challenge_method": "S256",
    }

    async def authorize() -> str:
        async with http.get(fake.authorize_url, params=params, allow_redirects=False) as resp:
            assert resp.status == 302
            location = urlsplit(resp.headers["Location"])
        assert f"{location.scheme}://{location.netloc}{location.path}" == redirect
        query = parse_qs(location.query)
        assert query["state"] == ["st-1"]
        return query["code"][0]

    form = {
        "grant_type": "authorization_code",
        "redirect_uri": redirect,
        "client_id": DEFAULT_CLIENT_ID,
        "client_secret": DEFAULT_CLIENT_SECRET,
    }
    code = await authorize()
    async with http.post(
        fake.token_url, data=form | {"code": code, "code_verifier": "w" * 64}
    ) as r:
        assert r.status == 400 and (await r.json())["error"] == "invalid_grant"
    code = await authorize()
    async with http.post(
        fake.token_url, data=form | {"code": code, "code_verifier": verifier}
    ) as r:
        assert r.status == 200
        tokens = await r.json()
    async with http.post(
        fake.token_url, data=form | {"code": code, "code_verifier": verifier}
    ) as r:
        assert r.status == 400  # a code is good once
    status, profile = await get_json(
        http, f"{fake.api_url}/users/me/profile", tokens["access_token"]
    )
    assert status == 200 and profile["emailAddress"] == BOB
    assert (await refresh(http, fake, tokens["refresh_token"]))[0] == 200


async def test_service_account_jwt_bearer(fake: FakeGmail, http: aiohttp.ClientSession) -> None:
    key = fake.add_service_account("sync@fake-project.iam.gserviceaccount.com", subjects=[ALICE])
    assert key is not None
    now = int(time.time())

    def assertion(sub: str, signing_key: str = key.private_key_pem) -> str:
        claims = {
            "iss": key.client_email,
            "sub": sub,
            "scope": "https://www.googleapis.com/auth/gmail.readonly",
            "aud": fake.token_url,
            "iat": now,
            "exp": now + 3600,
        }
        return jwt.encode(claims, signing_key, "RS256", headers={"kid": key.private_key_id})

    async def grant(jwt_assertion: str) -> tuple[int, dict]:
        form = {"grant_type": "urn:ietf:params:oauth:grant-type:jwt-bearer"}
        async with http.post(fake.token_url, data=form | {"assertion": jwt_assertion}) as resp:
            return resp.status, await resp.json()

    status, body = await grant(assertion(ALICE))
    assert status == 200
    status, profile = await get_json(http, f"{fake.api_url}/users/me/profile", body["access_token"])
    assert status == 200 and profile["emailAddress"] == ALICE
    status, body = await grant(assertion(BOB))
    assert status == 401 and body["error"] == "unauthorized_client"
    other = fake.add_service_account("other@fake-project.iam.gserviceaccount.com")
    assert other is not None
    status, body = await grant(assertion(ALICE, other.private_key_pem))
    assert status == 400 and body["error"] == "invalid_grant"
    assert fake.counters.token_requests["urn:ietf:params:oauth:grant-type:jwt-bearer"] == 3


async def test_certs_in_googles_v1_format(fake: FakeGmail, http: aiohttp.ClientSession) -> None:
    certs = {"kid-1": "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"}
    fake.set_certs(certs, max_age_s=1234)
    async with http.get(fake.certs_url) as resp:
        assert resp.status == 200
        assert "max-age=1234" in resp.headers["Cache-Control"]
        assert await resp.json() == certs
    assert fake.counters.cert_fetches == 1


async def test_google_auth_library_speaks_to_the_token_endpoint(fake: FakeGmail) -> None:
    """google-auth's own refresh and service-account requests are what /token accepts."""
    transport = pytest.importorskip("google.auth.transport.requests")
    from google.auth.exceptions import RefreshError
    from google.oauth2 import credentials, service_account

    refresh_token = fake.issue_refresh_token(ALICE)
    user = credentials.Credentials(
        None,
        refresh_token=refresh_token,
        token_uri=fake.token_url,
        client_id=fake.client_id,
        client_secret=fake.client_secret,
    )
    await anyio.to_thread.run_sync(user.refresh, transport.Request())
    assert fake.user_of_token(user.token) == ALICE

    key = fake.add_service_account("sa@fake-project.iam.gserviceaccount.com")
    assert key is not None
    robot = service_account.Credentials.from_service_account_info(
        key.info(), scopes=["https://www.googleapis.com/auth/gmail.readonly"], subject=BOB
    )
    await anyio.to_thread.run_sync(robot.refresh, transport.Request())
    assert fake.user_of_token(robot.token) == BOB

    fake.revoke_refresh_token(refresh_token)
    with pytest.raises(RefreshError, match="invalid_grant"):
        await anyio.to_thread.run_sync(user.refresh, transport.Request())
