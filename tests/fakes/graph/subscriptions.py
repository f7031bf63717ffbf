"""Change notifications: subscriptions, the validation handshake, notifications, lifecycle.

From "Receive change notifications through webhooks"
(change-notifications-delivery-webhooks), its notificationUrl validation
include, "Reduce missing subscriptions and change notifications"
(change-notifications-lifecycle-events) and "subscription resource type":

- POST /subscriptions {changeType, notificationUrl, lifecycleNotificationUrl?,
  resource (`users/{u}/mailFolders('inbox')/messages`, `/me/mailfolders/…`,
  `users/{u}/messages`), expirationDateTime, clientState} → before answering,
  Graph POSTs `{url}?validationToken={url-encoded token}` (Content-Type
  text/plain) to the notificationUrl and to the lifecycleNotificationUrl;
  each must answer "within 10 seconds" 200, text/plain, the decoded token as
  the body, else "Microsoft Graph doesn't create the subscription" (400
  ValidationError here) → 201 with the subscription;
- an expirationDateTime too far ahead is refused: 400 ExtensionError
  "Subscription expiration can only be N minutes in the future." (the
  service's wording, microsoft-graph-docs-contrib#7726). The maximum for
  Outlook messages was 4,230 minutes ("under three days") and is 10,080
  minutes ("under 7 days") in the current lifetime table; the fake enforces
  10,070, a little under 7 days as the old limit was a little under 3, so a
  client inside it is inside the service's limit
  (`fake.subscriptions.max_minutes`; `overlong = "clamp"` clamps instead);
- PATCH /subscriptions/{id} {expirationDateTime} renews (200), DELETE answers
  204, GET lists; POST /subscriptions/{id}/reauthorize answers 204;
- a change notification: {"value": [{"id", "subscriptionId",
  "subscriptionExpirationDateTime", "clientState", "changeType", "resource",
  "tenantId", "resourceData": {"@odata.type": "#Microsoft.Graph.Message",
  "@odata.id", "@odata.etag", "id"}}]}, several per POST allowed; ids are
  immutable when the subscription was created with Prefer IdType="ImmutableId";
- a lifecycle notification: {"value": [{"subscriptionId",
  "subscriptionExpirationDateTime", "tenantId", "clientState",
  "lifecycleEvent": "reauthorizationRequired" | "subscriptionRemoved" |
  "missed"}]} to the lifecycleNotificationUrl; subscriptionRemoved also drops
  the subscription. Receivers should answer 202 within 3 s (Graph's client
  timeout), which the helpers report back as the status they got.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import aiohttp
import anyio
from anyio.abc import TaskStatus
from yarl import URL

from .errors import Answer, bad_request, graph_error, json_answer
from .state import Mailbox, Message

if TYPE_CHECKING:
    from .server import FakeGraph

MAX_MINUTES = 10_070  # see the module docstring
VALIDATION_TIMEOUT_S = 10.0  # validation include: "within 10 seconds"
NOTIFICATION_TIMEOUT_S = 3.0  # webhooks page: "an HTTP client with a 3-second timeout"
LIFECYCLE_EVENTS = ("reauthorizationRequired", "subscriptionRemoved", "missed")
_RESOURCE = re.compile(
    r"^/?(?:users/(?P<user>[^/]+)|(?P<me>me))"
    r"(?:/mailFolders(?:\('(?P<fq>[^']+)'\)|/(?P<f>[^/(]+)))?/messages$",
    re.IGNORECASE,
)


@dataclass
class Subscription:
    id: str
    resource: str
    change_types: list[str]
    notification_url: str
    lifecycle_url: str | None
    client_state: str | None
    expires_at: datetime
    user: str  # mailbox address
    folder_id: str | None  # None: every folder of the mailbox
    immutable: bool
    application_id: str
    creator_id: str

    def as_json(self) -> dict[str, Any]:
        return {
            "@odata.type": "#microsoft.graph.subscription",
            "id": self.id,
            "resource": self.resource,
            "applicationId": self.application_id,
            "changeType": ",".join(self.change_types),
            "clientState": self.client_state,
            "notificationUrl": self.notification_url,
            "lifecycleNotificationUrl": self.lifecycle_url,
            "expirationDateTime": _iso(self.expires_at),
            "creatorId": self.creator_id,
            "includeResourceData": False,
            "latestSupportedTlsVersion": "v1_2",
            "encryptionCertificate": None,
            "encryptionCertificateId": None,
            "notificationQueryOptions": None,
            "notificationUrlAppId": None,
        }


class Subscriptions:
    """The subscriptions of one FakeGraph (fake.subscriptions) and their deliveries."""

    def __init__(self, fake: FakeGraph) -> None:
        self.fake = fake
        self.by_id: dict[str, Subscription] = {}
        self.max_minutes = MAX_MINUTES
        self.overlong = "reject"  # or "clamp"
        self.validation_timeout_s = VALIDATION_TIMEOUT_S
        self.notification_timeout_s = NOTIFICATION_TIMEOUT_S
        self.http: aiohttp.ClientSession | None = None
        self._send, self._receive = anyio.create_memory_object_stream[list[dict[str, Any]]](
            math.inf
        )

    # -- HTTP side ---------------------------------------------------------------
    async def create(self, body: bytes, user_of_token: str | None, immutable: bool) -> Answer:
        try:
            request = json.loads(body or b"{}")
        except ValueError:
            return bad_request("Invalid JSON body.")
        if not isinstance(request, dict):
            return bad_request("Invalid JSON body.")
        for key in ("changeType", "notificationUrl", "resource", "expirationDateTime"):
            if not isinstance(request.get(key), str) or not request[key]:
                return bad_request(f"The '{key}' property is required.", "InvalidRequest")
        match = _RESOURCE.match(request["resource"])
        if match is None:
            return bad_request(f"Unsupported resource '{request['resource']}'.", "ExtensionError")
        who = user_of_token if match.group("me") else match.group("user")
        box = self.fake.find_user(who or "")
        if box is None:
            return graph_error(404, "ErrorInvalidUser", f"The requested user '{who}' is invalid.")
        folder_name = match.group("fq") or match.group("f")
        folder = box.folder(folder_name) if folder_name else None
        if folder_name and folder is None:
            return graph_error(404, "ErrorItemNotFound", "The specified folder was not found.")
        expires, problem = self._expiration(request["expirationDateTime"])
        if problem is not None or expires is None:
            return problem or bad_request("bad expirationDateTime")
        lifecycle = request.get("lifecycleNotificationUrl") or None
        for url in filter(None, (request["notificationUrl"], lifecycle)):
            if not await self._validate(url):
                return bad_request(
                    "Subscription validation request failed. Notification endpoint must "
                    "respond with 200 OK to validation request.",
                    "ValidationError",
                )
        sub = Subscription(
            id=str(uuid.uuid4()),
            resource=request["resource"],
            change_types=[c.strip() for c in request["changeType"].split(",")],
            notification_url=request["notificationUrl"],
            lifecycle_url=lifecycle,
            client_state=request.get("clientState"),
            expires_at=expires,
            user=box.address,
            folder_id=folder.id if folder else None,
            immutable=immutable,
            application_id=self.fake.client_id,
            creator_id=box.id if user_of_token else self.fake.service_principal_id,
        )
        self.by_id[sub.id] = sub
        body_out = sub.as_json() | {
            "@odata.context": f"{self.fake.graph_url}/$metadata#subscriptions/$entity"
        }
        return json_answer(body_out, 201)

    def update(self, sub_id: str, body: bytes) -> Answer:
        sub = self.by_id.get(sub_id)
        if sub is None:
            return graph_error(404, "ResourceNotFound", "The object was not found.")
        try:
            request = json.loads(body or b"{}")
        except ValueError:
            return bad_request("Invalid JSON body.")
        value = request.get("expirationDateTime") if isinstance(request, dict) else None
        if not isinstance(value, str):
            return bad_request("The 'expirationDateTime' property is required.", "InvalidRequest")
        expires, problem = self._expiration(value)
        if problem is not None or expires is None:
            return problem or bad_request("bad expirationDateTime")
        sub.expires_at = expires
        return json_answer(sub.as_json())

    def delete(self, sub_id: str) -> Answer:
        if self.by_id.pop(sub_id, None) is None:
            return graph_error(404, "ResourceNotFound", "The object was not found.")
        return Answer(204)

    def get(self, sub_id: str | None) -> Answer:
        if sub_id is None:
            value = [s.as_json() for s in self.by_id.values()]
            return json_answer(
                {"@odata.context": f"{self.fake.graph_url}/$metadata#subscriptions", "value": value}
            )
        sub = self.by_id.get(sub_id)
        if sub is None:
            return graph_error(404, "ResourceNotFound", "The object was not found.")
        return json_answer(sub.as_json())

    def reauthorize(self, sub_id: str) -> Answer:
        if sub_id not in self.by_id:
            return graph_error(404, "ResourceNotFound", "The object was not found.")
        return Answer(204)

    # -- Python side ---------------------------------------------------------------
    def expire(self, sub_id: str) -> None:
        """The subscription lapsed: Graph deletes it; no more notifications, PATCH 404."""
        del self.by_id[sub_id]

    def change_notification(
        self, sub: Subscription, box: Mailbox, message: Message, change_type: str
    ) -> dict[str, Any]:
        item_id = message.immutable_id if sub.immutable else message.rest_id
        path = f"Users/{box.id}/Messages/{item_id}"
        return {
            "id": uuid.uuid4().hex,
            "subscriptionId": sub.id,
            "subscriptionExpirationDateTime": _iso(sub.expires_at),
            "clientState": sub.client_state,
            "changeType": change_type,
            "resource": path,
            "tenantId": self.fake.directory_id,
            "resourceData": {
                "@odata.type": "#Microsoft.Graph.Message",
                "@odata.id": path,
                "@odata.etag": f'W/"{message.change_key}"',
                "id": item_id,
            },
        }

    def matching(self, box: Mailbox, message: Message, change_type: str) -> list[Subscription]:
        now = self._now()
        return [
            s
            for s in self.by_id.values()
            if s.user == box.address
            and s.folder_id in (None, message.folder_id)
            and change_type in s.change_types
            and s.expires_at > now
        ]

    def queue(self, box: Mailbox, message: Message, change_type: str) -> None:
        """auto_notify: hand the notifications to serve() (no task of its own here)."""
        for sub in self.matching(box, message, change_type):
            self._send.send_nowait([self.change_notification(sub, box, message, change_type)])

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Deliver queued notifications until cancelled (`await tg.start(...)`)."""
        task_status.started()
        with self._receive.clone() as receive:
            async for batch in receive:
                await self.send(batch)

    def close(self) -> None:
        """End serve() loops and release the queue (FakeGraph.close)."""
        self._send.close()
        self._receive.close()

    async def send(self, items: list[dict[str, Any]]) -> int | None:
        """POST `items` as one changeNotificationCollection to their subscription's
        notificationUrl; the receiver's status (None: no answer in time)."""
        sub = self.by_id.get(items[0]["subscriptionId"]) if items else None
        if sub is None:
            raise KeyError("the first notification names no live subscription")
        self.fake.counters.notifications_sent += len(items)
        return await self._post(sub.notification_url, {"value": items})

    async def lifecycle(self, sub_id: str, event: str) -> int | None:
        if event not in LIFECYCLE_EVENTS:
            raise ValueError(f"lifecycleEvent must be one of {LIFECYCLE_EVENTS}")
        sub = self.by_id[sub_id]
        if sub.lifecycle_url is None:
            raise ValueError(f"subscription {sub_id} has no lifecycleNotificationUrl")
        item = {
            "subscriptionId": sub.id,
            "subscriptionExpirationDateTime": _iso(sub.expires_at),
            "tenantId": self.fake.directory_id,
            "clientState": sub.client_state,
            "lifecycleEvent": event,
        }
        if event == "subscriptionRemoved":
            del self.by_id[sub_id]
        return await self._post(sub.lifecycle_url, {"value": [item]})

    # -- internals -------------------------------------------------------------------
    def _now(self) -> datetime:
        return datetime.fromtimestamp(self.fake.clock(), UTC)

    def _expiration(self, value: str) -> tuple[datetime | None, Answer | None]:
        try:
            expires = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None, bad_request(f"Invalid expirationDateTime '{value}'.", "InvalidRequest")
        if expires.tzinfo is None:
            expires = expires.replace(tzinfo=UTC)
        now = self._now()
        latest = now + timedelta(minutes=self.max_minutes)
        if expires <= now:
            return None, bad_request(
                "Subscription expiration must be in the future.", "ExtensionError"
            )
        if expires > latest:
            if self.overlong == "clamp":
                return latest, None
            return None, bad_request(
                f"Subscription expiration can only be {self.max_minutes} minutes in the future.",
                "ExtensionError",
            )
        return expires, None

    async def _validate(self, url: str) -> bool:
        # The shape of the token Graph sends (spaces and ':' exercise URL decoding).
        token = (
            "Validation: Testing client application reachability for subscription "
            f"Request-Id: {uuid.uuid4()}"
        )
        self.fake.counters.validations[url] += 1
        target = URL(url).update_query({"validationToken": token})
        try:
            with anyio.fail_after(self.validation_timeout_s):
                async with self._session().post(
                    target, data=b"", headers={"Content-Type": "text/plain; charset=utf-8"}
                ) as resp:
                    text = await resp.text()
                    return (
                        resp.status == 200 and resp.content_type == "text/plain" and text == token
                    )
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def _post(self, url: str, payload: dict[str, Any]) -> int | None:
        try:
            with anyio.fail_after(self.notification_timeout_s):
                async with self._session().post(url, json=payload) as resp:
                    await resp.read()
                    return resp.status
        except (TimeoutError, aiohttp.ClientError):
            return None

    def _session(self) -> aiohttp.ClientSession:
        if self.http is None:
            raise RuntimeError("FakeGraph is not started")
        return self.http


def _iso(value: datetime) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f0Z")
