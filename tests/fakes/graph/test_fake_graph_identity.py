"""Contract tests of the fake identity platform v2.0: the client credentials grant,
the refresh grant with rotation and revocation, the device code flow with its
polling errors, and Entra's error bodies (error, AADSTS code in error_codes)."""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any

import aiohttp
import jwt
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from helpers.keys import make_certificate, rsa_key

from fakes.graph import DEVICE_CODE_GRANT, GRAPH_DEFAULT_SCOPE, FakeGraph
from fakes.graph.testkit import ALICE, BOB, ManualClock, get_json, headers


async def token(
    http: aiohttp.ClientSession, fake: FakeGraph, form: dict[str, str], tenant: str | None = None
) -> tuple[int, dict[str, Any]]:
    url = f"{fake.authority_url}/{tenant or fake.directory_id}/oauth2/v2.0/token"
    async with http.post(url, data={"client_id": fake.client_id, **form}) as resp:
        return resp.status, await resp.json(content_type=None)


def me_inbox(fake: FakeGraph) -> str:
    return f"{fake.graph_url}/me/mailFolders/inbox"


async def test_client_credentials_and_its_errors(
    fake: FakeGraph, http: aiohttp.ClientSession
) -> None:
    form = {
        "grant_type": "client_credentials",
        "client_secret": fake.client_secret,
        "scope": GRAPH_DEFAULT_SCOPE,
    }
    status, body = await token(http, fake, form)
    assert status == 200 and body["token_type"] == "Bearer" and body["expires_in"] == 3599
    assert "refresh_token" not in body and fake.user_of_token(body["access_token"]) is None
    status, error = await token(http, fake, form | {"client_secret": "wrong"})
    assert status == 401 and error["error"] == "invalid_client"
    assert error["error_codes"] == [7000215] and error["error_description"].startswith("AADSTS")
    status, error = await token(http, fake, form | {"scope": "Mail.Read"})
    assert status == 400 and error["error"] == "invalid_scope"
    status, error = await token(http, fake, form, tenant="other-tenant")
    assert status == 400 and error["error_codes"] == [90002]
    assert fake.counters.token_requests["client_credentials"] == 4


async def test_refresh_rotates_and_revocation_is_invalid_grant(
    fake: FakeGraph, http: aiohttp.ClientSession
) -> None:
    first = fake.issue_refresh_token(ALICE)
    status, body = await token(http, fake, {"grant_type": "refresh_token", "refresh_token": first})
    assert status == 200 and body["refresh_token"] != first
    assert (await get_json(http, me_inbox(fake), headers(body["access_token"])))[0] == 200
    # Entra does not revoke a refresh token when it is used: the old one still works.
    status, again = await token(http, fake, {"grant_type": "refresh_token", "refresh_token": first})
    assert status == 200
    fake.revoke_refresh_token(first)
    status, error = await token(http, fake, {"grant_type": "refresh_token", "refresh_token": first})
    assert status == 400 and error["error"] == "invalid_grant" and error["error_codes"] == [50173]
    assert (await get_json(http, me_inbox(fake), headers(again["access_token"])))[0] == 401
    # Revocation covers the whole sign-in: tokens rotated from `first` too.
    status, error = await token(
        http, fake, {"grant_type": "refresh_token", "refresh_token": body["refresh_token"]}
    )
    assert status == 400 and error["error"] == "invalid_grant"
    other = fake.issue_refresh_token(BOB)
    fake.expire_refresh_token(other)
    status, error = await token(http, fake, {"grant_type": "refresh_token", "refresh_token": other})
    assert status == 400 and error["error"] == "invalid_grant"
    assert error["error_codes"] == [700082]


async def test_device_code_flow(
    fake: FakeGraph, http: aiohttp.ClientSession, clock: ManualClock
) -> None:
    async def start() -> dict[str, Any]:
        async with http.post(
            fake.devicecode_url, data={"client_id": fake.client_id, "scope": "Mail.Read"}
        ) as resp:
            assert resp.status == 200
            return dict(await resp.json())

    async def poll(device_code: str) -> tuple[int, dict[str, Any]]:
        return await token(
            http, fake, {"grant_type": DEVICE_CODE_GRANT, "device_code": device_code}
        )

    code = await start()
    assert code["expires_in"] == 900 and code["interval"] == 5
    assert code["user_code"] in code["message"] and code["verification_uri"].startswith("https://")
    status, error = await poll(code["device_code"])
    assert status == 400 and error["error"] == "authorization_pending"
    fake.slow_down_device_code(code["user_code"])
    assert (await poll(code["device_code"]))[1]["error"] == "slow_down"
    fake.approve_device_code(code["user_code"], BOB)
    status, body = await poll(code["device_code"])
    assert status == 200 and fake.user_of_token(body["access_token"]) == BOB
    assert "refresh_token" in body
    status, inbox = await get_json(http, me_inbox(fake), headers(body["access_token"]))
    assert status == 200 and inbox["displayName"] == "Inbox"
    assert (await poll(code["device_code"]))[1]["error"] == "invalid_grant"  # redeemed once

    declined = await start()
    fake.decline_device_code(declined["user_code"])
    assert (await poll(declined["device_code"]))[1]["error"] == "authorization_declined"
    late = await start()
    clock.now += 901
    assert (await poll(late["device_code"]))[1]["error"] == "expired_token"


async def test_a_revoked_access_token_is_refused_before_its_expiry_and_a_new_one_works(
    fake: FakeGraph, http: aiohttp.ClientSession
) -> None:
    first = fake.issue_refresh_token(ALICE)
    status, body = await token(http, fake, {"grant_type": "refresh_token", "refresh_token": first})
    assert status == 200
    refused = body["access_token"]
    assert fake.revoke_access_tokens(ALICE) == 1  # continuous access evaluation, say
    status, error = await get_json(http, me_inbox(fake), headers(refused))
    assert status == 401 and error["error"]["code"] == "InvalidAuthenticationToken"
    # inside $batch the inner answer carries the 401 (the batch itself is a 200)
    inner = {
        "id": "1",
        "method": "GET",
        "url": "/me/mailFolders/inbox",
        "headers": {"Prefer": 'IdType="ImmutableId"'},
    }
    batch_url = f"{fake.graph_url}/$batch"
    async with http.post(batch_url, json={"requests": [inner]}, headers=headers(refused)) as r:
        assert r.status == 200
        assert (await r.json())["responses"][0]["status"] == 401
    # the grant is intact: a refresh gives a token Graph accepts
    rotated = body["refresh_token"]
    status, again = await token(
        http, fake, {"grant_type": "refresh_token", "refresh_token": rotated}
    )
    assert status == 200
    assert (await get_json(http, me_inbox(fake), headers(again["access_token"])))[0] == 200


async def test_single_use_refresh_tokens_refuse_a_redeemed_one(
    fake: FakeGraph, http: aiohttp.ClientSession
) -> None:
    fake.identity.single_use_refresh_tokens = True
    first = fake.issue_refresh_token(ALICE)
    status, body = await token(http, fake, {"grant_type": "refresh_token", "refresh_token": first})
    assert status == 200
    status, error = await token(http, fake, {"grant_type": "refresh_token", "refresh_token": first})
    assert status == 400 and error["error"] == "invalid_grant"
    assert error["error_codes"] == [70000] and fake.identity.refused_redeemed == 1
    newest = body["refresh_token"]
    status, _ = await token(http, fake, {"grant_type": "refresh_token", "refresh_token": newest})
    assert status == 200


def signed_assertion(fake: FakeGraph, key: Any, cert: bytes, **claims: object) -> str:
    """A certificate client assertion as the identity platform documents it."""
    x509_cert = x509.load_pem_x509_certificate(cert)
    digest = x509_cert.fingerprint(hashes.SHA256())
    now = int(time.time())
    body: dict[str, object] = {
        "aud": fake.token_url, "iss": fake.client_id, "sub": fake.client_id,
        "jti": str(uuid.uuid4()), "nbf": now, "iat": now, "exp": now + 600,
    }  # fmt: skip
    body.update(claims)
    thumbprint = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
    return jwt.encode(body, key, algorithm="RS256", headers={"x5t#S256": thumbprint})


async def test_a_confidential_client_authenticates_with_a_secret_or_a_certificate(
    fake: FakeGraph, http: aiohttp.ClientSession
) -> None:
    key, other = rsa_key(), rsa_key()
    cert, unregistered = make_certificate(key, "app"), make_certificate(other, "app")
    fake.identity.certificates = [cert]
    fake.identity.public_client_flows = False
    refresh = fake.issue_refresh_token(ALICE)
    grant = {"grant_type": "refresh_token", "refresh_token": refresh}
    # no credential: Entra's AADSTS7000218
    status, error = await token(http, fake, grant)
    assert status == 401 and error["error_codes"] == [7000218]
    assertion_type = "urn:ietf:params:oauth:client-assertion-type:jwt-bearer"

    def with_assertion(assertion: str) -> dict[str, str]:
        return grant | {"client_assertion_type": assertion_type, "client_assertion": assertion}

    for refused in (
        signed_assertion(fake, other, unregistered),  # a certificate the app does not know
        signed_assertion(fake, key, cert, aud="https://elsewhere.example/token"),
        signed_assertion(fake, key, cert, exp=int(time.time()) - 60),
        signed_assertion(fake, key, cert, sub="someone-else"),
    ):
        status, error = await token(http, fake, with_assertion(refused))
        assert status == 401 and error["error_codes"] == [700027]
    status, body = await token(http, fake, with_assertion(signed_assertion(fake, key, cert)))
    assert status == 200 and fake.user_of_token(body["access_token"]) == ALICE
    status, body = await token(http, fake, grant | {"client_secret": fake.client_secret})
    assert status == 200
