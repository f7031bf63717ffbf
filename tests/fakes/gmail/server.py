"""FakeGmail: an aiohttp server on 127.0.0.1 (ephemeral port) that behaves like Gmail.

Routes: /gmail/v1/users/{userId}/… (api.py), POST /batch/gmail/v1 (batch.py),
POST /token, GET /authorize, GET /certs (oauth.py). The Python side seeds
mailboxes (state.py), flips fault switches (faults.py), sets quota (quota.py)
and reads counters (counters.py); see the package docstring for the tour.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
from aiohttp import web
from multidict import CIMultiDict

from .api import WATCH_TTL_MS, Call, GmailApi
from .batch import BatchError, encode_answers, parse_batch
from .counters import Counters
from .errors import Answer, google_error
from .faults import Faults
from .oauth import (
    ACCESS_TOKEN_TTL_S,
    CERTS_MAX_AGE_S,
    GMAIL_SCOPE,
    OAuthRoutes,
    OAuthState,
    ServiceAccountKey,
    load_public_key,
    new_service_account_key,
)
from .quota import DEFAULT_BURST_S, DEFAULT_UNITS_PER_S, Quota
from .state import Mailbox, Message

DEFAULT_CLIENT_ID = "fake-client.apps.googleusercontent.com"
DEFAULT_CLIENT_SECRET = "fake-client-secret"


class FakeGmail:
    """Gmail for tests and benchmarks; `async with FakeGmail(["a@example.com"]) as fake:`."""

    def __init__(
        self,
        users: Iterable[str] = (),
        *,
        quota_units_per_s: float | None = DEFAULT_UNITS_PER_S,
        quota_burst_s: float = DEFAULT_BURST_S,
        history_retention: int | None = None,
        access_token_ttl_s: int = ACCESS_TOKEN_TTL_S,
        certs: dict[str, str] | None = None,
        certs_max_age_s: int = CERTS_MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
        seed: int = 0,
    ) -> None:
        self.seed = seed
        self.watch_ttl_ms = WATCH_TTL_MS  # tests shorten it to see renewals
        # topics that grant gmail-api-push@system.gserviceaccount.com publish rights;
        # None: every well-formed topic (users.watch answers 403 for the others)
        self.publishable_topics: set[str] | None = None
        self.history_retention = history_retention
        self.mailboxes: dict[str, Mailbox] = {}
        self.counters = Counters()
        self.faults = Faults()
        # method → gate: such a call waits on arrival until the gate opens (a request
        # still on its way, e.g. behind a slow network), then runs (hold())
        self._holds: dict[str, anyio.Event] = {}
        self.held: dict[str, int] = {}  # method → calls that waited at a gate
        self.quota = Quota(quota_units_per_s, quota_burst_s, clock)
        self.oauth = OAuthState(
            clock=clock,
            access_token_ttl_s=access_token_ttl_s,
            certs=dict(certs or {}),
            certs_max_age_s=certs_max_age_s,
        )
        self.oauth.clients[DEFAULT_CLIENT_ID] = DEFAULT_CLIENT_SECRET
        self.client_id, self.client_secret = DEFAULT_CLIENT_ID, DEFAULT_CLIENT_SECRET
        self.api = GmailApi(self)
        self._runner: web.AppRunner | None = None
        self.base_url = ""
        for user in users:
            self.add_user(user)

    # -- life cycle --------------------------------------------------------------
    async def start(self) -> FakeGmail:
        """Listen on 127.0.0.1 with an ephemeral port; sets base_url and the *_url fields."""
        routes = OAuthRoutes(self.oauth, self._count_token, self._count_certs)
        app = web.Application()
        app.router.add_route("*", "/gmail/v1/{tail:.*}", self._api)
        app.router.add_post("/batch/gmail/v1", self._batch)
        app.router.add_post("/token", routes.token)
        app.router.add_get("/authorize", routes.authorize)
        app.router.add_get("/certs", routes.certs)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.base_url = f"http://127.0.0.1:{port}"
        self.oauth.token_url = self.token_url
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeGmail:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def api_url(self) -> str:
        """Root of the REST API, like https://gmail.googleapis.com/gmail/v1."""
        return self.base_url + "/gmail/v1"

    @property
    def batch_url(self) -> str:
        return self.base_url + "/batch/gmail/v1"

    @property
    def token_url(self) -> str:
        return self.base_url + "/token"

    @property
    def authorize_url(self) -> str:
        return self.base_url + "/authorize"

    @property
    def certs_url(self) -> str:
        return self.base_url + "/certs"

    # -- mailboxes ---------------------------------------------------------------
    def add_user(self, email: str) -> Mailbox:
        box = Mailbox(email, seed=self.seed, history_retention=self.history_retention)
        self.mailboxes[email] = box
        if self.oauth.consent_user is None:
            self.oauth.consent_user = email
        return box

    def mailbox(self, email: str) -> Mailbox:
        return self.mailboxes[email]

    def seed_files(self, email: str, paths: Iterable[Path | str]) -> list[Message]:
        """Deliver each raw MIME file (byte-exact) into `email`'s mailbox."""
        return self.mailbox(email).add_files(paths)

    # -- credentials -------------------------------------------------------------
    def add_client(self, client_id: str, client_secret: str | None) -> None:
        """Register an OAuth client (secret None: a public client that uses PKCE alone)."""
        self.oauth.clients[client_id] = client_secret

    def issue_refresh_token(
        self, email: str, client_id: str = DEFAULT_CLIENT_ID, scope: str = GMAIL_SCOPE
    ) -> str:
        return self.oauth.issue_refresh_token(email, client_id, scope)

    def issue_access_token(self, email: str) -> str:
        """A bearer token for `email` without a /token round trip (test setup)."""
        return self.oauth.issue_access_token(email)

    def user_of_token(self, access_token: str | None) -> str | None:
        """Whose mailbox a currently valid access token opens (None: none)."""
        grant = self.oauth.access_grant(access_token or "")
        return None if grant is None else grant.user

    def revoke_refresh_token(self, token: str) -> None:
        """The user revoked access: /token answers invalid_grant, its access tokens 401."""
        self.oauth.refresh_tokens[token].revoked = True

    def revoke_user(self, email: str) -> None:
        for grant in self.oauth.refresh_tokens.values():
            if grant.user == email:
                grant.revoked = True

    def expire_access_tokens(self) -> None:
        """Every access token issued so far answers 401 from now on."""
        for grant in self.oauth.access_tokens.values():
            grant.expires_at = float("-inf")

    def add_service_account(
        self, client_email: str, public_key: Any = None, *, subjects: Iterable[str] | None = None
    ) -> ServiceAccountKey | None:
        """Register a service account for the jwt-bearer grant.

        `subjects`: the users it may impersonate (None: any, i.e. domain-wide
        delegation granted). With `public_key` (PEM, certificate, key object)
        the caller keeps the private key and None is returned; without, a key
        pair is made and its JSON key file comes back as a ServiceAccountKey.
        """
        allowed = None if subjects is None else frozenset(subjects)
        if public_key is not None:
            self.oauth.service_accounts[client_email] = (load_public_key(public_key), allowed)
            return None
        pem, public, key_id = new_service_account_key()
        self.oauth.service_accounts[client_email] = (public, allowed)
        return ServiceAccountKey(client_email, pem, key_id, self.token_url)

    def set_certs(self, certs: dict[str, str], max_age_s: int | None = None) -> None:
        """What GET /certs serves: {kid: PEM certificate} (push JWT verification keys)."""
        self.oauth.certs = dict(certs)
        if max_age_s is not None:
            self.oauth.certs_max_age_s = max_age_s

    # -- handlers ----------------------------------------------------------------
    def _count_token(self, grant_type: str) -> None:
        self.counters.token_requests[grant_type] += 1

    def _count_certs(self) -> None:
        self.counters.cert_fetches += 1

    def hold(self, method: str) -> anyio.Event:
        """From now on calls of `method` (e.g. "users.watch") wait on arrival, before
        Gmail sees them, until the returned event is set; `held[method]` counts them."""
        gate = self._holds[method] = anyio.Event()
        return gate

    async def _api(self, request: web.Request) -> web.Response:
        body = await request.read()
        call = Call(request.method, request.path, request.query, request.headers, body)
        method = self.api.method_of(call)
        gate = self._holds.get(method or "")
        if method is not None and gate is not None:
            self.held[method] = self.held.get(method, 0) + 1
            await gate.wait()
        return _to_response(self.api.dispatch(call))

    async def _batch(self, request: web.Request) -> web.Response:
        body = await request.read()
        injected = self.faults.take_batch()
        if injected is not None:
            return _to_response(injected)
        try:
            parts = parse_batch(
                body, request.headers.get("Content-Type", ""), CIMultiDict(request.headers)
            )
        except BatchError as exc:
            return _to_response(google_error(400, str(exc)))
        self.counters.batch_sizes.append(len(parts))
        answers: list[tuple[str | None, Answer]] = []
        for part in parts:
            if part.call is None:
                answers.append((part.content_id, google_error(400, part.problem)))
            elif not part.call.path.startswith("/gmail/v1/"):
                # Batch guide: every inner request must go to the same API.
                answers.append((part.content_id, google_error(404, "not a Gmail API path")))
            else:
                answers.append((part.content_id, self.api.dispatch(part.call)))
        if self.faults.shuffle_batch:
            answers.reverse()
        payload, content_type = encode_answers(answers)
        return web.Response(body=payload, headers={"Content-Type": content_type})


def _to_response(answer: Answer) -> web.Response:
    return web.Response(status=answer.status, body=answer.body or None, headers=answer.headers)
