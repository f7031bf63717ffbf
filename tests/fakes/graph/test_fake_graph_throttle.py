"""Contract tests of the fake's Outlook throttling: the per-mailbox request window
(with Retry-After), the per-mailbox concurrency cap measured on requests really in
flight, batch inner requests counted one by one and run at most 4 at a time.
Overlap is made with fake.faults.hold() and awaited with wait_in_flight, never
with sleeps.
"""

from __future__ import annotations

import aiohttp
import anyio

from fakes.graph import FakeGraph
from fakes.graph.testkit import ALICE, BOB, ManualClock, app_token, get_json, headers


def folder_url(fake: FakeGraph, user: str) -> str:
    return f"{fake.graph_url}/users/{user}/mailFolders/inbox"


async def test_request_window_per_mailbox_with_retry_after(
    clock: ManualClock, http: aiohttp.ClientSession
) -> None:
    async with FakeGraph([ALICE, BOB], requests_per_10_min=3, window_s=60, clock=clock) as fake:
        hdrs = headers(await app_token(http, fake))
        for _ in range(3):
            assert (await get_json(http, folder_url(fake, ALICE), hdrs))[0] == 200
            clock.now += 10
        async with http.get(folder_url(fake, ALICE), headers=hdrs) as resp:
            assert resp.status == 429
            assert (await resp.json())["error"]["code"] == "ApplicationThrottled"
            # Now t=30 and this refused request counts too, so one more fits once
            # both t=0 and t=10 left the 60 s window: at t=70.
            assert resp.headers["Retry-After"] == "40"
        assert (await get_json(http, folder_url(fake, BOB), hdrs))[0] == 200  # Bob's own window
        clock.now += 30
        # t=60, too early: the t=10, t=20 and refused t=30 requests are in the window
        assert (await get_json(http, folder_url(fake, ALICE), hdrs))[0] == 429
        clock.now += 60
        assert (await get_json(http, folder_url(fake, ALICE), hdrs))[0] == 200
        assert fake.counters.throttled == {ALICE: 2}
        assert fake.counters.rejected(429, BOB) == 0


async def test_concurrency_is_counted_on_requests_in_flight(
    fake: FakeGraph, http: aiohttp.ClientSession
) -> None:
    hdrs = headers(await app_token(http, fake))
    statuses: list[int] = []

    async def call(user: str) -> None:
        statuses.append((await get_json(http, folder_url(fake, user), hdrs))[0])

    fake.faults.hold()
    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(call, ALICE)
        await fake.wait_in_flight(ALICE, 4)
        status, error = await get_json(http, folder_url(fake, ALICE), hdrs)
        assert status == 429 and error["error"]["code"] == "ApplicationThrottled"
        assert "MailboxConcurrency" in error["error"]["message"]
        tg.start_soon(call, BOB)  # another mailbox has its own 4 slots
        await fake.wait_in_flight(BOB, 1)
        fake.faults.release()
    assert statuses == [200] * 5
    assert fake.counters.max_concurrency == {ALICE: 4, BOB: 1}
    assert fake.counters.throttled == {ALICE: 1}
    assert fake.throttle.in_flight == {ALICE: 0, BOB: 0}


async def test_batch_runs_four_inner_requests_at_a_time(
    fake: FakeGraph, http: aiohttp.ClientSession
) -> None:
    messages = fake.mailbox(ALICE).add_generated(8)
    token = await app_token(http, fake)
    requests = [
        {
            "id": str(n),
            "method": "GET",
            "url": f"/users/{ALICE}/messages/{m.immutable_id}/$value",
            "headers": {"Prefer": 'IdType="ImmutableId"'},
        }
        for n, m in enumerate(messages)
    ]
    answers: list[dict[str, object]] = []

    async def batch() -> None:
        async with http.post(
            f"{fake.graph_url}/$batch", json={"requests": requests}, headers=headers(token)
        ) as resp:
            answers.extend((await resp.json())["responses"])

    fake.faults.hold()
    async with anyio.create_task_group() as tg:
        tg.start_soon(batch)
        await fake.wait_in_flight(ALICE, 4)
        assert fake.throttle.in_flight[ALICE] == 4  # never the whole batch at once
        # A fifth request to the mailbox meanwhile is over the limit.
        assert (await get_json(http, folder_url(fake, ALICE), headers(token)))[0] == 429
        fake.faults.release()
    assert sorted(a["status"] for a in answers) == [200] * 8  # type: ignore[type-var]
    assert fake.counters.max_concurrency[ALICE] == 4
    assert fake.counters.max_downloads() == 1


async def test_batch_inner_requests_count_toward_the_window(
    clock: ManualClock, http: aiohttp.ClientSession
) -> None:
    async with FakeGraph([ALICE], requests_per_10_min=5, clock=clock) as fake:
        messages = fake.mailbox(ALICE).add_generated(7)
        token = await app_token(http, fake)
        requests = [
            {
                "id": str(n),
                "method": "GET",
                "url": f"/users/{ALICE}/messages/{m.immutable_id}",
                "headers": {"Prefer": 'IdType="ImmutableId"'},
                "dependsOn": [str(n - 1)] if n else [],
            }
            for n, m in enumerate(messages)
        ]
        async with http.post(
            f"{fake.graph_url}/$batch", json={"requests": requests}, headers=headers(token)
        ) as resp:
            assert resp.status == 200
            responses = (await resp.json())["responses"]
        statuses = [r["status"] for r in responses]
        assert statuses == [200] * 5 + [429, 424]  # sequential: a failed dependency is 424
        throttled = responses[5]
        assert throttled["headers"]["Retry-After"] == "600"
        assert throttled["body"]["error"]["code"] == "ApplicationThrottled"
        assert fake.counters.calls_of(user=ALICE) == 6 and fake.counters.throttled[ALICE] == 1


async def test_unlimited_and_service_latency_make_real_overlap(
    http: aiohttp.ClientSession,
) -> None:
    async with FakeGraph(
        [ALICE], requests_per_10_min=None, concurrent_per_mailbox=None, service_latency_s=0.05
    ) as fake:
        hdrs = headers(await app_token(http, fake))
        async with anyio.create_task_group() as tg:
            for _ in range(6):
                tg.start_soon(get_json, http, folder_url(fake, ALICE), hdrs)
        assert fake.counters.max_concurrency[ALICE] == 6
        assert fake.counters.rejected(429) == 0
