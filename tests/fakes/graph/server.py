"""FakeGraph: an aiohttp server on 127.0.0.1 (ephemeral port) that behaves like
Microsoft Graph v1.0 (mail) and the Microsoft identity platform v2.0 token endpoint.

Routes: /v1.0/users/{user}/… and /v1.0/me/… (api.py), POST /v1.0/$batch
(batch.py), /v1.0/subscriptions[/{id}[/reauthorize]] (subscriptions.py),
POST /{tenant}/oauth2/v2.0/token and …/devicecode (identity.py). The Python
side seeds users and messages (state.py), flips fault switches (faults.py),
scales throttling (throttle.py) and reads counters (counters.py).
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

import aiohttp
import anyio
from aiohttp import web
from anyio.abc import TaskStatus

from .api import Call, GraphApi, Prefer, prefer_values
from .batch import run_batch
from .counters import Counters
from .delta import DeltaTokens
from .errors import Answer, graph_error
from .faults import Faults
from .identity import ACCESS_TOKEN_TTL_S, DELEGATED_SCOPE, Identity
from .state import Mailbox, Message
from .subscriptions import Subscriptions
from .throttle import CONCURRENT_PER_MAILBOX, REQUESTS_PER_WINDOW, WINDOW_S, Throttle


class FakeGraph:
    """Graph for tests and benchmarks; `async with FakeGraph(["a@contoso.com"]) as fake:`."""

    def __init__(
        self,
        users: Iterable[str] = (),
        *,
        requests_per_10_min: int | None = REQUESTS_PER_WINDOW,
        concurrent_per_mailbox: int | None = CONCURRENT_PER_MAILBOX,
        window_s: float = WINDOW_S,
        service_latency_s: float = 0.0,
        access_token_ttl_s: int = ACCESS_TOKEN_TTL_S,
        strict_immutable: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.clock = clock
        self.strict_immutable = strict_immutable
        self.auto_notify = False
        self.service_latency_s = service_latency_s
        self.directory_id = str(uuid.uuid4())
        self.client_id = str(uuid.uuid4())
        self.client_secret = "fake~" + secrets.token_urlsafe(24)
        self.service_principal_id = str(uuid.uuid4())
        self.users: dict[str, Mailbox] = {}  # by lowercase address
        self.counters = Counters()
        self.faults = Faults()
        self.delta = DeltaTokens()
        self.throttle = Throttle(
            self.counters,
            requests_per_window=requests_per_10_min,
            window_s=window_s,
            concurrent_per_mailbox=concurrent_per_mailbox,
            clock=clock,
        )
        self.identity = Identity(
            self.directory_id,
            self.client_id,
            self.client_secret,
            clock=clock,
            access_token_ttl_s=access_token_ttl_s,
        )
        self.api = GraphApi(self)
        self.subscriptions = Subscriptions(self)
        self.base_url = ""
        self._runner: web.AppRunner | None = None
        for user in users:
            self.add_user(user)

    # -- life cycle --------------------------------------------------------------
    async def start(self) -> FakeGraph:
        """Listen on 127.0.0.1 with an ephemeral port; sets base_url and the *_url fields."""
        app = web.Application()
        app.router.add_post("/v1.0/$batch", self._batch)
        app.router.add_route("*", "/v1.0/subscriptions", self._subscriptions)
        app.router.add_route("*", "/v1.0/subscriptions/{id}", self._subscriptions)
        app.router.add_post("/v1.0/subscriptions/{id}/reauthorize", self._subscriptions)
        app.router.add_route("*", "/v1.0/{tail:.*}", self._api)
        app.router.add_post("/{tenant}/oauth2/v2.0/token", self._token)
        app.router.add_post("/{tenant}/oauth2/v2.0/devicecode", self._devicecode)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.base_url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        self.identity.token_url = self.token_url  # a client assertion's audience
        self.subscriptions.http = aiohttp.ClientSession()
        return self

    async def close(self) -> None:
        self.subscriptions.close()
        if self.subscriptions.http is not None:
            await self.subscriptions.http.close()
            self.subscriptions.http = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeGraph:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def graph_url(self) -> str:
        """Like https://graph.microsoft.com/v1.0."""
        return self.base_url + "/v1.0"

    @property
    def authority_url(self) -> str:
        """Like https://login.microsoftonline.com (the tenant goes in the path)."""
        return self.base_url

    @property
    def token_url(self) -> str:
        return f"{self.authority_url}/{self.directory_id}/oauth2/v2.0/token"

    @property
    def devicecode_url(self) -> str:
        return f"{self.authority_url}/{self.directory_id}/oauth2/v2.0/devicecode"

    # -- users and messages ----------------------------------------------------
    def add_user(self, address: str, *, mailbox: bool = True) -> Mailbox:
        """A user of the tenant (mailbox=False: no Exchange Online mailbox)."""
        box = Mailbox(address, has_mailbox=mailbox)
        box.listeners.append(self._on_change)
        self.users[address.lower()] = box
        return box

    def mailbox(self, address: str) -> Mailbox:
        return self.users[address.lower()]

    def find_user(self, user: str) -> Mailbox | None:
        """By UPN/address (case-insensitive) or by the user's id."""
        box = self.users.get(user.lower())
        return box or next((b for b in self.users.values() if b.id == user), None)

    def find_message(self, message_id: str) -> tuple[Mailbox, Message]:
        for box in self.users.values():
            message = box.find(message_id)
            if message is not None:
                return box, message
        raise KeyError(f"no message {message_id!r}")

    def move_message(self, message_id: str, to_folder: str) -> Message:
        box, _ = self.find_message(message_id)
        return box.move(message_id, to_folder)

    def delete_message(self, message_id: str) -> None:
        box, _ = self.find_message(message_id)
        box.delete(message_id)

    def mark_read(self, message_id: str, is_read: bool = True) -> Message:
        box, _ = self.find_message(message_id)
        return box.mark_read(message_id, is_read)

    # -- credentials -------------------------------------------------------------
    def issue_access_token(self, user: str | None = None) -> str:
        """An app-only token (user None) or a delegated one, without a /token round trip."""
        return self.identity.issue_access_token(user)

    def issue_refresh_token(self, user: str, scope: str = DELEGATED_SCOPE) -> str:
        return self.identity.issue_refresh_token(user, scope)

    def revoke_refresh_token(self, token: str) -> None:
        """The user's grant is revoked (consent withdrawn, password reset): `token` and
        every refresh token rotated from it answer invalid_grant (AADSTS50173), and
        access tokens minted from them answer 401 from now on (stricter than Entra,
        whose access tokens outlive a revocation unless CAE applies, so a client's
        reaction is testable without waiting an hour)."""
        self.identity.revoke(token)

    def expire_refresh_token(self, token: str) -> None:
        """The refresh token expired from inactivity (AADSTS700082)."""
        self.identity.refresh_tokens[token].expired = True

    def revoke_access_tokens(self, user: str | None = None) -> int:
        """Graph refuses every access token issued so far (of `user`; None: all, the
        app-only ones included) before its expiry — continuous access evaluation, an
        admin's revocation — with 401 InvalidAuthenticationToken; a new token from
        the token endpoint works. Answers how many were revoked."""
        return self.identity.revoke_access_tokens(user)

    def expire_access_tokens(self) -> None:
        for grant in self.identity.access_tokens.values():
            grant.expires_at = float("-inf")

    def user_of_token(self, access_token: str) -> str | None:
        grant = self.identity.access_grant(access_token)
        return None if grant is None else grant.user

    def approve_device_code(self, user_code: str, user: str) -> None:
        """The user signed in at verification_uri and consented."""
        self.identity.device_code_by_user_code(user_code).user = user

    def decline_device_code(self, user_code: str) -> None:
        self.identity.device_code_by_user_code(user_code).declined = True

    def expire_device_code(self, user_code: str) -> None:
        self.identity.device_code_by_user_code(user_code).expires_at = float("-inf")

    def slow_down_device_code(self, user_code: str, times: int = 1) -> None:
        self.identity.device_code_by_user_code(user_code).slow_down = times

    # -- notifications -------------------------------------------------------------
    async def notify(
        self,
        user: str,
        folder: str = "inbox",
        *,
        message_id: str | None = None,
        change_type: str = "created",
    ) -> list[int | None]:
        """POST a change notification about `message_id` (default: the newest message
        in `folder`) to every live subscription that covers it; their statuses."""
        box = self.mailbox(user)
        if message_id is not None:
            message = box.find(message_id)
        else:
            target = box.folder(folder)
            inside = box.in_folder(target.id) if target else []
            message = max(inside, key=lambda m: m.entered_seq, default=None)
        if message is None:
            raise KeyError(f"nothing to notify about in {user}/{folder}")
        subs = self.subscriptions.matching(box, message, change_type)
        return [
            await self.subscriptions.send(
                [self.subscriptions.change_notification(s, box, message, change_type)]
            )
            for s in subs
        ]

    async def send_notifications(self, items: list[dict[str, Any]]) -> int | None:
        """POST several notifications in one changeNotificationCollection."""
        return await self.subscriptions.send(items)

    async def send_lifecycle(self, subscription_id: str, event: str) -> int | None:
        return await self.subscriptions.lifecycle(subscription_id, event)

    def expire_subscription(self, subscription_id: str) -> None:
        self.subscriptions.expire(subscription_id)

    async def serve_notifications(
        self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """With auto_notify on, deliver notifications as messages arrive; run it in
        the caller's task group: `await tg.start(fake.serve_notifications)`."""
        await self.subscriptions.serve(task_status=task_status)

    async def wait_in_flight(self, user: str, count: int, timeout_s: float = 5.0) -> None:
        await self.throttle.wait_in_flight(user, count, timeout_s)

    def _on_change(self, box: Mailbox, message: Message, change: str) -> None:
        if self.auto_notify:
            self.subscriptions.queue(box, message, change)

    # -- handlers ----------------------------------------------------------------
    async def _api(self, request: web.Request) -> web.Response:
        body = await request.read()
        path = request.path.removeprefix("/v1.0")
        call = Call(request.method, path, request.query, request.headers, body)
        return _to_response(await self.api.dispatch(call))

    async def _batch(self, request: web.Request) -> web.Response:
        body = await request.read()
        injected = self.faults.take_batch()
        if injected is not None:
            return _to_response(injected)
        return _to_response(await run_batch(self, body, request.headers.get("Authorization", "")))

    async def _subscriptions(self, request: web.Request) -> web.Response:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        grant = self.identity.access_grant(token.strip()) if scheme.lower() == "bearer" else None
        if grant is None:
            return _to_response(
                graph_error(401, "InvalidAuthenticationToken", "Access token is empty or invalid.")
            )
        sub_id = request.match_info.get("id")
        body = await request.read()
        subs = self.subscriptions
        answer: Answer
        if request.path.endswith("/reauthorize") and sub_id:
            answer = subs.reauthorize(sub_id)
        elif request.method == "POST" and sub_id is None:
            immutable = Prefer.parse(prefer_values(request.headers)).immutable
            answer = await subs.create(body, grant.user, immutable)
        elif request.method == "PATCH" and sub_id:
            answer = subs.update(sub_id, body)
        elif request.method == "DELETE" and sub_id:
            answer = subs.delete(sub_id)
        elif request.method == "GET":
            answer = subs.get(sub_id)
        else:
            answer = graph_error(405, "MethodNotAllowed", "Method not allowed.")
        return _to_response(answer)

    async def _token(self, request: web.Request) -> web.Response:
        form = {k: str(v) for k, v in (await request.post()).items()}
        self.counters.token_requests[form.get("grant_type", "")] += 1
        return _to_response(self.identity.token(request.match_info["tenant"], form))

    async def _devicecode(self, request: web.Request) -> web.Response:
        form = {k: str(v) for k, v in (await request.post()).items()}
        return _to_response(self.identity.devicecode(request.match_info["tenant"], form))


def _to_response(answer: Answer) -> web.Response:
    return web.Response(status=answer.status, body=answer.body or None, headers=answer.headers)
