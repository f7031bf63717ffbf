"""Gmail push verification (adapters/gmail/push.py) against a real local certs server.

Google's certs endpoint is played by an aiohttp server on 127.0.0.1 (ephemeral
port) serving `GoogleSigner.certs_json()` (helpers/google_jwt.py) with a
Cache-Control header the test sets; it counts requests, can answer 503, and can
hold its answer until the test opens a gate. Time is two injected clocks (Unix
seconds for the token, monotonic for the cache), never sleeps.
"""

from __future__ import annotations

import base64
import json
import socket
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import anyio
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from helpers.google_jwt import GoogleSigner

from inboxd.adapters.gmail import google_certs, push
from inboxd.adapters.gmail.push import (
    CERTS_FAILURE_RETRY_S,
    CERTS_MAX_BYTES,
    CERTS_MAX_TTL_S,
    CERTS_MIN_TTL_S,
    CERTS_REFETCH_INTERVAL_S,
    MAX_HISTORY_ID,
    CertsUnavailable,
    GmailNotification,
    GoogleCerts,
    MalformedPush,
    PushClaims,
    PushUnauthorized,
    PushVerifier,
    freshness_s,
    parse_push_body,
)

AUDIENCE = "https://inboxd.example.com/hooks/gmail/acme"
SERVICE_ACCOUNT = "gmail-push@acme-project.iam.gserviceaccount.com"
T0 = 1_700_000_000.0  # token time, Unix seconds
SKEW_S = 60.0


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class CertsEndpoint:
    """Google's certs endpoint: serves the signer's certificates, counts requests."""

    def __init__(self, signer: GoogleSigner) -> None:
        self.signer = signer
        self.cache_control: str | None = "public, max-age=3600, must-revalidate, no-transform"
        self.status = 200
        self.body: bytes | None = None  # overrides the certificates when set
        self.hits = 0
        self.gate: anyio.Event | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.status != 200:
            return web.Response(status=self.status, text="backend error")
        headers = {} if self.cache_control is None else {"Cache-Control": self.cache_control}
        body = self.signer.certs_json() if self.body is None else self.body
        return web.Response(body=body, content_type="application/json", headers=headers)


@pytest.fixture(scope="module")
def signer() -> GoogleSigner:
    """One key for the tests that do not rotate (generating keys is the slow part)."""
    return GoogleSigner()


@pytest.fixture
async def endpoint(signer: GoogleSigner) -> AsyncIterator[tuple[CertsEndpoint, str]]:
    state = CertsEndpoint(signer)

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound("/certs")

    async def hang(request: web.Request) -> web.Response:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    app = web.Application()
    app.router.add_get("/certs", state.handle)
    app.router.add_get("/redirect", redirect)
    app.router.add_get("/hang", hang)
    async with TestServer(app, host="127.0.0.1") as server:
        yield state, str(server.make_url("/certs"))


@pytest.fixture
def server(endpoint: tuple[CertsEndpoint, str]) -> CertsEndpoint:
    return endpoint[0]


@pytest.fixture
def mono() -> Clock:
    return Clock(1000.0)


@pytest.fixture
def wall() -> Clock:
    return Clock(T0)


@pytest.fixture
def certs(endpoint: tuple[CertsEndpoint, str], mono: Clock) -> GoogleCerts:
    return GoogleCerts(endpoint[1], clock=mono)


@pytest.fixture
def verifier(certs: GoogleCerts, wall: Clock) -> PushVerifier:
    return PushVerifier(certs, AUDIENCE, SERVICE_ACCOUNT, clock_skew_s=SKEW_S, clock=wall)


def claims(**extra: Any) -> dict[str, Any]:
    """Valid push claims issued at T0; `extra` overrides (None removes a claim)."""
    audience = extra.pop("aud", AUDIENCE)
    email = extra.pop("email", SERVICE_ACCOUNT)
    made = GoogleSigner.claims(audience=audience, email=email, now=T0, **extra)
    return {name: value for name, value in made.items() if value is not None}


def bearer(token: str) -> str:
    return f"Bearer {token}"


async def refused(verifier: PushVerifier, header: str | None, check: str) -> PushUnauthorized:
    """Verify `header`, expecting PushUnauthorized whose message starts with `check`;
    the message never holds the token or any part of it."""
    with pytest.raises(PushUnauthorized) as info:
        await verifier.verify(header)
    message = str(info.value)
    assert message.startswith(check), message
    if header:
        for part in header.removeprefix("Bearer ").split("."):
            assert len(part) < 8 or part not in message
    return info.value


# --- valid tokens -------------------------------------------------------------------------


@pytest.mark.parametrize("issuer", ["https://accounts.google.com", "accounts.google.com"])
async def test_valid_token_gives_its_claims(
    verifier: PushVerifier, signer: GoogleSigner, server: CertsEndpoint, issuer: str
) -> None:
    result = await verifier.verify(bearer(signer.sign(claims(iss=issuer))))
    assert result == PushClaims(
        email=SERVICE_ACCOUNT,
        subject="113774264463038321964",
        audience=AUDIENCE,
        issuer=issuer,
        issued_at=T0,
        expires_at=T0 + 3600,
        kid=signer.kid,
    )
    assert server.hits == 1


async def test_scheme_is_case_insensitive(verifier: PushVerifier, signer: GoogleSigner) -> None:
    claims_ = await verifier.verify("bearer  " + signer.sign(claims()))
    assert claims_.email == SERVICE_ACCOUNT


async def test_a_second_token_uses_the_cached_certificates(
    verifier: PushVerifier, signer: GoogleSigner, server: CertsEndpoint
) -> None:
    for _ in range(3):
        await verifier.verify(bearer(signer.sign(claims())))
    assert server.hits == 1


# --- signatures and algorithms ---------------------------------------------------------------


async def test_signature_by_another_key_is_refused(
    verifier: PushVerifier, signer: GoogleSigner
) -> None:
    forged = signer.sign(claims(), key=GoogleSigner.new_key())
    await refused(verifier, bearer(forged), "signature: does not verify")


async def test_claims_changed_after_signing_are_refused(
    verifier: PushVerifier, signer: GoogleSigner
) -> None:
    header, _, signature = signer.sign(claims()).split(".")
    other = signer.sign(claims(email="attacker@evil.example")).split(".")[1]
    await refused(verifier, bearer(f"{header}.{other}.{signature}"), "signature: does not verify")


async def test_unsigned_token_is_refused_before_any_fetch(
    verifier: PushVerifier, signer: GoogleSigner, server: CertsEndpoint
) -> None:
    token = signer.sign(claims()).rsplit(".", 1)[0] + "."
    await refused(verifier, bearer(token), "signature: missing")
    assert server.hits == 0


@pytest.mark.parametrize("alg", ["none", "None", "HS256", "RS512", "PS256", "ES256", "rs256", ""])
async def test_any_alg_but_rs256_is_refused_before_any_fetch(
    verifier: PushVerifier, signer: GoogleSigner, server: CertsEndpoint, alg: str
) -> None:
    # HS256 is keyed with the kid's public certificate: the algorithm-confusion attack.
    await refused(verifier, bearer(signer.sign(claims(), alg=alg)), "alg: not RS256")
    assert server.hits == 0


async def test_header_without_alg_is_refused(verifier: PushVerifier, signer: GoogleSigner) -> None:
    token = signer.sign(claims(), headers={"alg": None})
    await refused(verifier, bearer(token), "alg: not RS256")


async def test_missing_kid_is_refused_before_any_fetch(
    verifier: PushVerifier, signer: GoogleSigner, server: CertsEndpoint
) -> None:
    await refused(verifier, bearer(signer.sign(claims(), kid=None)), "kid: missing")
    await refused(verifier, bearer(signer.sign(claims(), kid="")), "kid: missing")
    await refused(verifier, bearer(signer.sign(claims(), kid=7)), "kid: missing")
    assert server.hits == 0


@pytest.mark.parametrize("extra", [{"crit": ["exp"]}, {"b64": False}])
async def test_crit_and_b64_headers_are_refused(
    verifier: PushVerifier, signer: GoogleSigner, extra: dict[str, Any]
) -> None:
    await refused(verifier, bearer(signer.sign(claims(), headers=extra)), "header:")


# --- the Authorization header -----------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda t: None,
        lambda t: "",
        lambda t: "Bearer",
        lambda t: "Bearer ",
        lambda t: t,  # no scheme
        lambda t: f"Basic {t}",
        lambda t: f"Bearer {t}, Bearer {t}",
        lambda t: f"Bearer {t},Bearer {t}",
        lambda t: f"Bearer {t} {t}",
        lambda t: f"Bearer {t}\n",
        lambda t: f"Bearer\t{t}",
        lambda t: f" Bearer {t}",
        lambda t: f"Bearer {t}.x",  # four segments
        lambda t: "Bearer " + t.replace(".", "", 1),  # two segments
        lambda t: f"Bearer {t}=",
        lambda t: "Bearer " + "A" * 5000 + "." + t,
    ],
)
async def test_anything_but_exactly_one_bearer_jwt_is_refused(
    verifier: PushVerifier, signer: GoogleSigner, server: CertsEndpoint, make: Any
) -> None:
    await refused(verifier, make(signer.sign(claims())), "authorization:")
    assert server.hits == 0


async def test_header_segment_that_is_not_json_is_refused(verifier: PushVerifier) -> None:
    await refused(verifier, "Bearer bm90IGpzb24.e30.c2ln", "header: not a JWT header")


# --- claims ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"aud": "https://other.example.com/hooks"}, "aud:"),
        ({"aud": [AUDIENCE]}, "aud:"),
        ({"aud": None}, "aud:"),
        ({"iss": "https://evil.example.com"}, "iss:"),
        ({"iss": "http://accounts.google.com"}, "iss:"),
        ({"iss": None}, "iss:"),
        ({"email": "someone-else@acme-project.iam.gserviceaccount.com"}, "email:"),
        ({"email": SERVICE_ACCOUNT.upper()}, "email:"),
        ({"email": None}, "email:"),
        ({"email_verified": False}, "email_verified:"),
        ({"email_verified": "true"}, "email_verified:"),
        ({"email_verified": None}, "email_verified:"),
        ({"exp": None}, "exp: missing"),
        ({"exp": str(int(T0) + 3600)}, "exp: missing"),
        ({"exp": True}, "exp: missing"),
        ({"iat": None}, "iat: missing"),
        ({"iat": "now"}, "iat: missing"),
        ({"exp": int(T0)}, "exp: not after iat"),
    ],
)
async def test_wrong_claims_are_refused(
    verifier: PushVerifier, signer: GoogleSigner, extra: dict[str, Any], check: str
) -> None:
    await refused(verifier, bearer(signer.sign(claims(**extra))), check)


async def test_claims_that_are_not_an_object_are_refused(
    verifier: PushVerifier, signer: GoogleSigner
) -> None:
    token = signer.sign(claims())
    header, _, _ = token.split(".")
    key = signer.key(signer.kid)
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import padding
    from helpers.google_jwt import b64url

    signing_input = f"{header}.{b64url(b'[1, 2]')}".encode()
    signature = key.sign(signing_input, padding.PKCS1v15(), hashes.SHA256())
    forged = f"{signing_input.decode()}.{b64url(signature)}"
    await refused(verifier, bearer(forged), "claims: not a JSON object")


async def test_expiry_is_judged_with_the_clock_skew(
    verifier: PushVerifier, signer: GoogleSigner, wall: Clock
) -> None:
    token = bearer(signer.sign(claims()))
    wall.now = T0 + 3600 + SKEW_S - 1  # expired, but within the skew
    await verifier.verify(token)
    wall.now = T0 + 3600 + SKEW_S
    await refused(verifier, token, "exp: expired")


async def test_issued_in_the_future_is_judged_with_the_clock_skew(
    verifier: PushVerifier, signer: GoogleSigner, wall: Clock
) -> None:
    token = bearer(signer.sign(claims()))
    wall.now = T0 - SKEW_S  # the token's iat is exactly one skew ahead of us
    await verifier.verify(token)
    wall.now = T0 - SKEW_S - 1
    await refused(verifier, token, "iat: in the future")


def test_verifier_refuses_nonsense_configuration(certs: GoogleCerts) -> None:
    with pytest.raises(ValueError, match="audience"):
        PushVerifier(certs, "", SERVICE_ACCOUNT)
    with pytest.raises(ValueError, match="audience"):
        PushVerifier(certs, AUDIENCE, "")
    with pytest.raises(ValueError, match="clock_skew_s"):
        PushVerifier(certs, AUDIENCE, SERVICE_ACCOUNT, clock_skew_s=3600)
    assert SERVICE_ACCOUNT not in repr(PushVerifier(certs, AUDIENCE, SERVICE_ACCOUNT))


# --- unknown kids and the refetch limit --------------------------------------------------------


async def test_unknown_kid_refetches_once_then_is_refused(
    verifier: PushVerifier, signer: GoogleSigner, server: CertsEndpoint, mono: Clock
) -> None:
    await verifier.verify(bearer(signer.sign(claims())))
    assert server.hits == 1
    mono.advance(CERTS_REFETCH_INTERVAL_S)
    unknown = bearer(signer.sign(claims(), kid="made-up-kid"))
    await refused(verifier, unknown, "kid: unknown")
    assert server.hits == 2  # the one refetch
    await refused(verifier, unknown, "kid: unknown")
    await refused(verifier, bearer(signer.sign(claims(), kid="another-kid")), "kid: unknown")
    assert server.hits == 2  # within the interval: no request
    mono.advance(CERTS_REFETCH_INTERVAL_S)
    await refused(verifier, unknown, "kid: unknown")
    assert server.hits == 3


async def test_unknown_kid_on_first_use_costs_one_fetch(
    verifier: PushVerifier, signer: GoogleSigner, server: CertsEndpoint
) -> None:
    unknown = bearer(signer.sign(claims(), kid="made-up-kid"))
    await refused(verifier, unknown, "kid: unknown")
    await refused(verifier, unknown, "kid: unknown")
    assert server.hits == 1
    await verifier.verify(bearer(signer.sign(claims())))  # the fetched set serves the real kid
    assert server.hits == 1


async def test_flood_of_unknown_kids_makes_one_refetch_per_interval(
    verifier: PushVerifier, signer: GoogleSigner, server: CertsEndpoint, mono: Clock
) -> None:
    await verifier.verify(bearer(signer.sign(claims())))
    outcomes: list[str] = []

    async def forge(i: int) -> None:
        try:
            await verifier.verify(bearer(signer.sign(claims(), kid=f"forged-{i}")))
        except PushUnauthorized as exc:
            outcomes.append(str(exc))

    for _ in range(3):
        mono.advance(CERTS_REFETCH_INTERVAL_S)
        async with anyio.create_task_group() as tg:
            for i in range(40):
                tg.start_soon(forge, i)
    assert outcomes == ["kid: unknown"] * 120
    assert server.hits == 1 + 3


# --- cache lifetime and rotation ---------------------------------------------------------------


async def test_certificates_are_kept_for_max_age(
    verifier: PushVerifier, signer: GoogleSigner, server: CertsEndpoint, mono: Clock
) -> None:
    server.cache_control = "public, max-age=600"
    token = bearer(signer.sign(claims()))
    await verifier.verify(token)
    mono.advance(599)
    await verifier.verify(token)
    assert server.hits == 1
    mono.advance(1)
    await verifier.verify(token)
    assert server.hits == 2


async def test_rotated_key_is_dropped_after_expiry(
    endpoint: tuple[CertsEndpoint, str], mono: Clock, wall: Clock
) -> None:
    server, url = endpoint
    rotating = GoogleSigner(kid="old")
    server.signer = rotating
    server.cache_control = "max-age=600"
    verifier = PushVerifier(GoogleCerts(url, clock=mono), AUDIENCE, SERVICE_ACCOUNT, clock=wall)
    old_token = bearer(rotating.sign(claims()))
    await verifier.verify(old_token)
    rotating.add_key("new")
    rotating.remove_key("old")
    await verifier.verify(old_token)  # still fresh: the cached set says "old" is Google's
    assert server.hits == 1
    mono.advance(600)
    await refused(verifier, old_token, "kid: unknown")  # expired: refetched, "old" is gone
    assert server.hits == 2
    await verifier.verify(bearer(rotating.sign(claims())))
    assert server.hits == 2


async def test_rotated_key_is_picked_up_on_unknown_kid(
    endpoint: tuple[CertsEndpoint, str], mono: Clock, wall: Clock
) -> None:
    server, url = endpoint
    rotating = GoogleSigner(kid="old")
    server.signer = rotating
    verifier = PushVerifier(GoogleCerts(url, clock=mono), AUDIENCE, SERVICE_ACCOUNT, clock=wall)
    await verifier.verify(bearer(rotating.sign(claims())))
    rotating.add_key("new")
    mono.advance(CERTS_REFETCH_INTERVAL_S)  # long before max-age=3600 runs out
    await verifier.verify(bearer(rotating.sign(claims(), kid="new")))
    await verifier.verify(bearer(rotating.sign(claims(), kid="old")))
    assert server.hits == 2


@pytest.mark.parametrize(
    ("cache_control", "lifetime_s"),
    [
        (None, push.CERTS_DEFAULT_TTL_S),
        ("no-cache", CERTS_MIN_TTL_S),
        ("max-age=0", CERTS_MIN_TTL_S),
        ("max-age=99999999", CERTS_MAX_TTL_S),
    ],
)
async def test_lifetime_without_or_with_extreme_max_age_is_clamped(
    verifier: PushVerifier,
    signer: GoogleSigner,
    server: CertsEndpoint,
    mono: Clock,
    cache_control: str | None,
    lifetime_s: float,
) -> None:
    server.cache_control = cache_control
    token = bearer(signer.sign(claims()))
    await verifier.verify(token)
    mono.advance(lifetime_s - 1)
    await verifier.verify(token)
    assert server.hits == 1
    mono.advance(1)
    await verifier.verify(token)
    assert server.hits == 2


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({}, None),
        ({"Cache-Control": "public, max-age=19372, must-revalidate, no-transform"}, 19372.0),
        ({"Cache-Control": "public, max-age=600", "Age": "100"}, 500.0),
        ({"Cache-Control": "max-age=600", "Age": "900"}, 0.0),
        ({"Cache-Control": 'MAX-AGE="60"'}, 60.0),
        ({"Cache-Control": "max-age=-5"}, None),
        ({"Cache-Control": "max-age=1e9"}, None),
        ({"Cache-Control": "max-age=" + "9" * 40}, None),
        ({"Cache-Control": "no-store, max-age=600"}, 0.0),
    ],
)
def test_freshness_is_max_age_minus_age(headers: dict[str, str], expected: float | None) -> None:
    assert freshness_s(headers) == expected


# --- single flight --------------------------------------------------------------------------


async def test_concurrent_verifications_fetch_once(
    verifier: PushVerifier, signer: GoogleSigner, server: CertsEndpoint
) -> None:
    server.gate = anyio.Event()
    results: list[PushClaims] = []

    async def one() -> None:
        results.append(await verifier.verify(bearer(signer.sign(claims()))))

    async with anyio.create_task_group() as tg:
        for _ in range(20):
            tg.start_soon(one)
        await anyio.wait_all_tasks_blocked()  # all 20 waiting: one on the server, 19 on it
        assert server.hits == 1
        server.gate.set()
    assert len(results) == 20
    assert server.hits == 1


async def test_cancelled_fetch_leaves_nothing_behind(
    verifier: PushVerifier, signer: GoogleSigner, server: CertsEndpoint
) -> None:
    server.gate = anyio.Event()
    token = bearer(signer.sign(claims()))
    with anyio.move_on_after(30) as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(verifier.verify, token)
            await anyio.wait_all_tasks_blocked()
            tg.cancel_scope.cancel()  # the request that was fetching went away
    assert not scope.cancelled_caught
    server.gate.set()
    assert (await verifier.verify(token)).email == SERVICE_ACCOUNT  # fetches afresh
    assert server.hits == 2


# --- Google unreachable --------------------------------------------------------------------


async def test_certs_endpoint_down_is_transient_and_not_hammered(
    verifier: PushVerifier, signer: GoogleSigner, server: CertsEndpoint, mono: Clock
) -> None:
    server.status = 503
    token = bearer(signer.sign(claims()))
    with pytest.raises(CertsUnavailable, match="HTTP 503"):
        await verifier.verify(token)
    server.status = 200
    with pytest.raises(CertsUnavailable, match="failed recently"):
        await verifier.verify(token)
    assert server.hits == 1
    mono.advance(CERTS_FAILURE_RETRY_S)
    await verifier.verify(token)
    assert server.hits == 2


async def test_refetch_failure_for_unknown_kid_is_transient_and_keeps_the_set(
    verifier: PushVerifier, signer: GoogleSigner, server: CertsEndpoint, mono: Clock
) -> None:
    token = bearer(signer.sign(claims()))
    await verifier.verify(token)
    server.status = 500
    mono.advance(CERTS_REFETCH_INTERVAL_S)
    with pytest.raises(CertsUnavailable):
        await verifier.verify(bearer(signer.sign(claims(), kid="new-kid")))
    await verifier.verify(token)  # the fresh set still serves known kids
    assert server.hits == 2


@pytest.mark.parametrize(
    "body",
    [
        b"<html>not json</html>",
        b"[]",
        b"{}",
        b'{"kid": 5}',
        b'{"kid": "-----BEGIN CERTIFICATE-----\\nAAAA\\n-----END CERTIFICATE-----\\n"}',
        json.dumps({f"k{i}": "x" for i in range(push.CERTS_MAX_KEYS + 1)}).encode(),
        b"{" + b" " * (CERTS_MAX_BYTES + 1) + b"}",
    ],
)
async def test_certs_that_are_not_googles_format_are_transient(
    verifier: PushVerifier, signer: GoogleSigner, server: CertsEndpoint, body: bytes
) -> None:
    server.body = body
    with pytest.raises(CertsUnavailable):
        await verifier.verify(bearer(signer.sign(claims())))


async def test_non_rsa_certificates_are_skipped(
    verifier: PushVerifier, signer: GoogleSigner, server: CertsEndpoint
) -> None:
    from datetime import timedelta

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ec_key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ec")])
    now = datetime.now(UTC)
    ec_pem = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(ec_key.public_key())
        .serial_number(1)
        .not_valid_before(now - timedelta(days=1))
        .not_valid_after(now + timedelta(days=1))
        .sign(ec_key, hashes.SHA256())
        .public_bytes(serialization.Encoding.PEM)
        .decode()
    )
    server.body = json.dumps({**signer.certs(), "ec-kid": ec_pem}).encode()
    await verifier.verify(bearer(signer.sign(claims())))
    await refused(verifier, bearer(signer.sign(claims(), kid="ec-kid")), "kid: unknown")


@pytest.mark.parametrize("path", ["/redirect", "/missing"])
async def test_default_fetch_refuses_redirects_and_errors(
    endpoint: tuple[CertsEndpoint, str], path: str
) -> None:
    url = endpoint[1].replace("/certs", path)
    with pytest.raises(CertsUnavailable):
        await push.fetch_google_certs(url)


async def test_default_fetch_has_a_deadline(
    endpoint: tuple[CertsEndpoint, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # fetch_google_certs reads the constant where it is defined, not push's re-export.
    monkeypatch.setattr(google_certs, "CERTS_FETCH_TIMEOUT_S", 0.2)
    with pytest.raises(CertsUnavailable, match="timed out"):
        await push.fetch_google_certs(endpoint[1].replace("/certs", "/hang"))


async def test_connection_refused_is_transient(signer: GoogleSigner, wall: Clock) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    certs = GoogleCerts(f"http://127.0.0.1:{port}/certs")
    verifier = PushVerifier(certs, AUDIENCE, SERVICE_ACCOUNT, clock=wall)
    with pytest.raises(CertsUnavailable):
        await verifier.verify(bearer(signer.sign(claims())))


# --- the push body ---------------------------------------------------------------------------


def push_body(notification: Any = None, *, data: str | None = None, **message: Any) -> bytes:
    """A Pub/Sub push envelope around a Gmail notification (Gmail push guide)."""
    if notification is None:
        notification = {"emailAddress": "user@acme.example", "historyId": "9876543210"}
    if data is None:
        data = base64.b64encode(json.dumps(notification).encode()).decode()
    fields: dict[str, Any] = {
        "data": data,
        "messageId": "2070443601311540",
        "message_id": "2070443601311540",
        "publishTime": "2021-02-26T19:13:55.749Z",
        "publish_time": "2021-02-26T19:13:55.749Z",
    }
    fields.update(message)
    envelope = {
        "message": {k: v for k, v in fields.items() if v is not None},
        "subscription": "projects/acme-project/subscriptions/gmail-push",
    }
    return json.dumps(envelope).encode()


@pytest.mark.parametrize("history_id", ["9876543210", 9876543210, str(MAX_HISTORY_ID), 1])
def test_push_body_gives_the_notification(history_id: Any) -> None:
    parsed = parse_push_body(
        push_body({"emailAddress": "user@acme.example", "historyId": history_id})
    )
    assert parsed == GmailNotification(
        email_address="user@acme.example",
        history_id=int(history_id),
        message_id="2070443601311540",
        publish_time=datetime(2021, 2, 26, 19, 13, 55, 749000, tzinfo=UTC),
    )


def test_push_body_with_attributes_and_nanosecond_time() -> None:
    parsed = parse_push_body(
        push_body(attributes={"k": "v"}, publishTime="2014-10-02T15:01:23.045123456+02:00")
    )
    assert parsed.publish_time == datetime(2014, 10, 2, 13, 1, 23, 45123, tzinfo=UTC)


def _b64(obj: Any) -> str:
    return base64.b64encode(json.dumps(obj).encode()).decode()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"not json", "body"),
        (b"[]", "body"),
        (b"{" + b" " * push.MAX_PUSH_BODY_BYTES + b"}", "body"),
        (json.dumps({"message": {}}).encode(), "subscription"),
        (json.dumps({"subscription": "projects/p/subscriptions/s"}).encode(), "message"),
        (
            json.dumps({"subscription": "projects/p/subscriptions/s", "message": "x"}).encode(),
            "message",
        ),
        (push_body(data=None, messageId=None), "message.messageId"),
        (push_body(messageId=""), "message.messageId"),
        (push_body(messageId=12), "message.messageId"),
        (push_body(messageId="a b"), "message.messageId"),
        (push_body(messageId="1" * 257), "message.messageId"),
        (push_body(publishTime=None), "message.publishTime"),
        (push_body(publishTime="yesterday"), "message.publishTime"),
        (push_body(publishTime="2021-02-30T00:00:00Z"), "message.publishTime"),
        (push_body(publishTime="2021-02-26 19:13:55Z"), "message.publishTime"),
        (push_body(attributes=["x"]), "message.attributes"),
        (push_body(data=""), "message.data"),
        (push_body(data="not base64!"), "message.data"),
        (push_body(data="eyJ"), "message.data"),  # bad padding
        (push_body(data=base64.b64encode(b"\xff\xfe").decode()), "message.data"),
        (push_body(data=_b64([1])), "message.data"),
        (push_body(data="A" * 5000), "message.data"),
        (push_body({"historyId": "1"}), "message.data.emailAddress"),
        (push_body({"emailAddress": "no-at-sign", "historyId": "1"}), "message.data.emailAddress"),
        (push_body({"emailAddress": "a b@c", "historyId": "1"}), "message.data.emailAddress"),
        (push_body({"emailAddress": "a\u0000@c", "historyId": "1"}), "message.data.emailAddress"),
        (
            push_body({"emailAddress": "a@" + "b" * 300, "historyId": "1"}),
            "message.data.emailAddress",
        ),
    ],
)
def test_malformed_push_body_is_refused(body: bytes, field: str) -> None:
    with pytest.raises(MalformedPush) as info:
        parse_push_body(body)
    assert str(info.value).startswith(f"{field}:"), str(info.value)


@pytest.mark.parametrize(
    "history_id",
    [
        None,
        0,
        "0",
        -5,
        "-5",
        "+5",
        " 5",
        "5 ",
        "1e3",
        "0x10",
        "١٢٣",  # Arabic-Indic digits: int() would take them
        1.0,
        1.5,
        True,
        [5],
        {"id": 5},
        "",
        str(MAX_HISTORY_ID + 1),
        MAX_HISTORY_ID + 1,
        2**64,  # read by JSON parsers as a float
        "9" * 100,
    ],
)
def test_history_id_must_be_a_positive_integer(history_id: Any) -> None:
    notification: dict[str, Any] = {"emailAddress": "user@acme.example"}
    if history_id is not None:
        notification["historyId"] = history_id
    with pytest.raises(MalformedPush, match=r"^message\.data\.historyId: "):
        parse_push_body(push_body(notification))
