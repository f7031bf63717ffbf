"""Contract tests of the fake's change notifications: subscription create with the
validation handshake on both URLs, expiration limits, renew/list/delete, change
notifications (one, several per POST, automatic), lifecycle events and expiry.
Receivers are real HTTP endpoints (testkit.Receiver); tests wait on what they
received, never sleep.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import anyio
import pytest

from fakes.graph import FakeGraph
from fakes.graph.testkit import ALICE, BOB, ManualClock, Receiver, app_token, headers


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    async with Receiver() as server:
        yield server


def expiry(clock: ManualClock, minutes: float) -> str:
    moment = datetime.fromtimestamp(clock.now, UTC) + timedelta(minutes=minutes)
    return moment.isoformat().replace("+00:00", "Z")


async def subscribe(
    http: aiohttp.ClientSession,
    fake: FakeGraph,
    receiver: Receiver,
    clock: ManualClock,
    *,
    minutes: float = 60,
    resource: str = f"users/{ALICE}/mailFolders('Inbox')/messages",
    token: str | None = None,
) -> tuple[int, dict[str, Any]]:
    body = {
        "changeType": "created,updated",
        "notificationUrl": f"{receiver.url}/notify?route=a",
        "lifecycleNotificationUrl": f"{receiver.url}/lifecycle",
        "resource": resource,
        "expirationDateTime": expiry(clock, minutes),
        "clientState": "secret-state",
    }
    hdrs = headers(token or await app_token(http, fake))
    async with http.post(f"{fake.graph_url}/subscriptions", json=body, headers=hdrs) as resp:
        return resp.status, await resp.json()


async def test_create_validates_both_urls_then_notifies(
    fake: FakeGraph, http: aiohttp.ClientSession, receiver: Receiver, clock: ManualClock
) -> None:
    status, sub = await subscribe(http, fake, receiver, clock)
    assert status == 201, sub
    assert len(receiver.validations) == 2  # notificationUrl and lifecycleNotificationUrl
    assert all(t.startswith("Validation: ") and " " in t for t in receiver.validations)
    assert sub["clientState"] == "secret-state" and sub["applicationId"] == fake.client_id
    assert sub["expirationDateTime"].startswith(expiry(clock, 60)[:19])
    (message,) = fake.mailbox(ALICE).add_generated(1)
    assert await fake.notify(ALICE, "inbox") == [202]
    (item,) = await receiver.wait_for(1)
    assert item["subscriptionId"] == sub["id"] and item["clientState"] == "secret-state"
    assert item["changeType"] == "created" and item["tenantId"] == fake.directory_id
    assert item["resourceData"]["@odata.type"] == "#Microsoft.Graph.Message"
    # created with Prefer IdType="ImmutableId": immutable ids in notifications
    assert item["resourceData"]["id"] == message.immutable_id
    assert item["resource"].endswith(f"/Messages/{message.immutable_id}")
    fake.mailbox(BOB).add_generated(1)
    assert await fake.notify(BOB, "inbox") == []  # no subscription covers Bob


async def test_failed_validation_or_overlong_expiry_creates_nothing(
    fake: FakeGraph, http: aiohttp.ClientSession, receiver: Receiver, clock: ManualClock
) -> None:
    receiver.validate = False
    status, error = await subscribe(http, fake, receiver, clock)
    assert status == 400 and error["error"]["code"] == "ValidationError"
    receiver.validate = True
    status, error = await subscribe(http, fake, receiver, clock, minutes=10_071)
    assert status == 400 and error["error"]["code"] == "ExtensionError"
    assert "10070 minutes" in error["error"]["message"]
    assert fake.subscriptions.by_id == {}
    fake.subscriptions.overlong = "clamp"
    status, sub = await subscribe(http, fake, receiver, clock, minutes=20_000)
    assert status == 201 and sub["expirationDateTime"].startswith(expiry(clock, 10_070)[:19])


async def test_renew_list_delete_and_expire(
    fake: FakeGraph, http: aiohttp.ClientSession, receiver: Receiver, clock: ManualClock
) -> None:
    token = await app_token(http, fake)
    _, sub = await subscribe(http, fake, receiver, clock, token=token)
    url = f"{fake.graph_url}/subscriptions/{sub['id']}"
    renew = {"expirationDateTime": expiry(clock, 4000)}
    async with http.patch(url, json=renew, headers=headers(token)) as resp:
        assert resp.status == 200
        assert (await resp.json())["expirationDateTime"].startswith(
            renew["expirationDateTime"][:19]
        )
    async with http.get(f"{fake.graph_url}/subscriptions", headers=headers(token)) as resp:
        assert [s["id"] for s in (await resp.json())["value"]] == [sub["id"]]
    async with http.delete(url, headers=headers(token)) as resp:
        assert resp.status == 204
    async with http.patch(url, json=renew, headers=headers(token)) as resp:
        assert resp.status == 404
    _, sub = await subscribe(http, fake, receiver, clock, token=token)
    fake.mailbox(ALICE).add_generated(1)
    fake.expire_subscription(sub["id"])
    assert await fake.notify(ALICE) == []
    async with http.patch(
        f"{fake.graph_url}/subscriptions/{sub['id']}", json=renew, headers=headers(token)
    ) as resp:
        assert resp.status == 404


async def test_batched_notifications_carry_rest_ids_without_the_preference(
    fake: FakeGraph, http: aiohttp.ClientSession, receiver: Receiver, clock: ManualClock
) -> None:
    token = await app_token(http, fake)
    body = {
        "changeType": "created",
        "notificationUrl": f"{receiver.url}/notify",
        "resource": f"/users/{ALICE}/mailFolders/inbox/messages",
        "expirationDateTime": expiry(clock, 60),
        "clientState": "s",
    }
    async with http.post(
        f"{fake.graph_url}/subscriptions", json=body, headers=headers(token, immutable=False)
    ) as resp:
        assert resp.status == 201
        sub_id = (await resp.json())["id"]
    box = fake.mailbox(ALICE)
    messages = box.add_generated(3)
    sub = fake.subscriptions.by_id[sub_id]
    items = [fake.subscriptions.change_notification(sub, box, m, "created") for m in messages]
    assert await fake.send_notifications(items) == 202
    assert len(receiver.received) == 1  # one POST
    got = await receiver.wait_for(3)
    # created without Prefer IdType: REST ids
    assert [i["resourceData"]["id"] for i in got] == [m.rest_id for m in messages]
    receiver.status = 500
    assert await fake.send_notifications(items[:1]) == 500


async def test_lifecycle_events_reach_the_lifecycle_url(
    fake: FakeGraph, http: aiohttp.ClientSession, receiver: Receiver, clock: ManualClock
) -> None:
    _, sub = await subscribe(http, fake, receiver, clock)
    for event in ("reauthorizationRequired", "missed"):
        assert await fake.send_lifecycle(sub["id"], event) == 202
    assert await fake.send_lifecycle(sub["id"], "subscriptionRemoved") == 202
    got = await receiver.wait_for(3)
    assert [i["lifecycleEvent"] for i in got] == [
        "reauthorizationRequired",
        "missed",
        "subscriptionRemoved",
    ]
    assert got[0].keys() == {
        "subscriptionId",
        "subscriptionExpirationDateTime",
        "tenantId",
        "clientState",
        "lifecycleEvent",
    }
    assert sub["id"] not in fake.subscriptions.by_id  # removed means removed


async def test_auto_notify_delivers_as_messages_arrive(
    fake: FakeGraph, http: aiohttp.ClientSession, receiver: Receiver, clock: ManualClock
) -> None:
    delegated = fake.issue_access_token(ALICE)
    status, _ = await subscribe(
        http, fake, receiver, clock, resource="/me/mailFolders('inbox')/messages", token=delegated
    )
    assert status == 201
    fake.auto_notify = True
    async with anyio.create_task_group() as tg:
        await tg.start(fake.serve_notifications)
        box = fake.mailbox(ALICE)
        first, _ = box.add_generated(2)
        box.add_generated(1, folder="archive")  # not the subscribed folder
        fake.mark_read(first.immutable_id)  # an updated change
        got = await receiver.wait_for(3)
        tg.cancel_scope.cancel()
    assert [i["changeType"] for i in got] == ["created", "created", "updated"]
    assert fake.counters.notifications_sent == 3
