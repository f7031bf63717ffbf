"""Contract tests of the fake Gmail's API side, through plain aiohttp calls.

They pin the published behaviour the real client relies on (paging, history
growth, 404 for an expired startHistoryId, batch format, quota 429, injected
faults), so a client test failing against the fake points at the client.
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import aiohttp
import anyio
from helpers import eventually
from helpers.corpus import corpus_files

from fakes.gmail import FakeGmail
from fakes.gmail.testkit import (
    ALICE,
    BOB,
    ManualClock,
    batch_body,
    bearer,
    get_json,
    parse_answer,
    refresh,
)


# -- messages --------------------------------------------------------------------
async def test_full_sync_pages_every_message_once_with_exact_bytes(
    fake: FakeGmail, http: aiohttp.ClientSession, corpus: Path
) -> None:
    files = corpus_files(corpus / "mime" / "mailgun-flanker", 7)
    seeded = fake.seed_files(ALICE, files)
    status, token_body = await refresh(http, fake, fake.issue_refresh_token(ALICE))
    assert status == 200 and token_body["token_type"] == "Bearer"
    token = token_body["access_token"]
    base = f"{fake.api_url}/users/me"

    status, profile = await get_json(http, f"{base}/profile", token)
    assert status == 200
    assert profile["emailAddress"] == ALICE and profile["messagesTotal"] == 7
    assert int(profile["historyId"]) >= max(m.history_id for m in seeded)

    ids: list[str] = []
    params: dict[str, str] = {"maxResults": "3"}
    while True:
        status, page = await get_json(http, f"{base}/messages", token, params)
        assert status == 200 and page["resultSizeEstimate"] == 7
        ids += [m["id"] for m in page["messages"]]
        if "nextPageToken" not in page:
            break
        params["pageToken"] = page["nextPageToken"]
    assert sorted(ids) == sorted(m.id for m in seeded) and len(ids) == 7

    for message, path in zip(seeded, files, strict=True):
        status, body = await get_json(
            http, f"{base}/messages/{message.id}", token, {"format": "raw"}
        )
        assert status == 200
        assert base64.urlsafe_b64decode(body["raw"]) == path.read_bytes()
        assert body["threadId"] == message.thread_id and body["labelIds"] == ["INBOX", "UNREAD"]
        assert body["sizeEstimate"] == len(path.read_bytes())
        assert body["historyId"] == str(message.history_id)
        assert body["internalDate"].isdigit()
    assert fake.counters.max_downloads() == 1
    assert fake.counters.calls_of("users.messages.get", ALICE) == 7
    assert fake.counters.units[ALICE] == 1 + 3 * 5 + 7 * 5


async def test_list_filters_labels_dates_and_spam_trash(
    fake: FakeGmail, http: aiohttp.ClientSession, corpus: Path
) -> None:
    box = fake.mailbox(ALICE)
    raw = corpus_files(corpus / "mime" / "mailgun-flanker", 1)[0].read_bytes()
    old = box.add_message(raw, internal_date_ms=1_600_000_000_000)
    new = box.add_message(raw, internal_date_ms=1_700_000_000_000, label_ids=["SENT"])
    spam = box.add_message(raw, internal_date_ms=1_700_000_000_000, label_ids=["SPAM"])
    token = fake.issue_access_token(ALICE)
    url = f"{fake.api_url}/users/{ALICE}/messages"

    async def ids(params: object) -> list[str]:
        status, body = await get_json(http, url, token, params)
        assert status == 200, body
        return [m["id"] for m in body.get("messages", [])]

    assert await ids({}) == [new.id, old.id]  # newest first, spam left out
    assert set(await ids({"includeSpamTrash": "true"})) == {old.id, new.id, spam.id}
    assert await ids({"labelIds": "SPAM"}) == [spam.id]
    assert await ids({"labelIds": "INBOX"}) == [old.id]
    assert await ids({"q": "after:1650000000"}) == [new.id]
    assert await ids({"q": "before:2021/01/01 -in:spam -in:trash"}) == [old.id]
    assert set(await ids({"q": "in:anywhere after:1650000000"})) == {spam.id, new.id}
    status, empty = await get_json(http, url, token, {"q": "after:1800000000"})
    assert status == 200 and empty == {"resultSizeEstimate": 0}
    status, bad = await get_json(http, url, token, {"q": "from:someone"})
    assert status == 400 and bad["error"]["code"] == 400


async def test_newer_than_and_older_than_count_back_from_now_on_internal_date(
    fake: FakeGmail, http: aiohttp.ClientSession, corpus: Path
) -> None:
    box = fake.mailbox(ALICE)
    raw = corpus_files(corpus / "mime" / "mailgun-flanker", 1)[0].read_bytes()
    now_ms = int(time.time() * 1000)
    day_ms = 86_400_000
    recent = box.add_message(raw, internal_date_ms=now_ms - 2 * day_ms)
    # delivered late: a new history record, an internalDate of 40 days ago
    late = box.add_message(raw, internal_date_ms=now_ms - 40 * day_ms)
    token = fake.issue_access_token(ALICE)
    url = f"{fake.api_url}/users/{ALICE}/messages"

    async def ids(q: str) -> list[str]:
        status, body = await get_json(http, url, token, {"q": q})
        assert status == 200, body
        return [m["id"] for m in body.get("messages", [])]

    assert await ids("newer_than:30d") == [recent.id]
    assert await ids("newer_than:1d") == []
    assert await ids("newer_than:2m") == [recent.id, late.id]
    assert await ids("older_than:30d") == [late.id]
    assert await ids("newer_than:1y older_than:1d") == [recent.id, late.id]
    status, bad = await get_json(http, url, token, {"q": "newer_than:30"})
    assert status == 400 and bad["error"]["code"] == 400


async def test_history_grows_pages_and_filters(
    fake: FakeGmail, http: aiohttp.ClientSession, corpus: Path
) -> None:
    box = fake.mailbox(ALICE)
    first, second = box.add_files(corpus_files(corpus / "mime" / "mailgun-flanker", 2))
    token = fake.issue_access_token(ALICE)
    base = f"{fake.api_url}/users/me"
    _, profile = await get_json(http, f"{base}/profile", token)
    start = profile["historyId"]

    third = box.add_message(corpus_files(corpus / "mime" / "mailgun-flanker", 3)[2].read_bytes())
    box.modify_labels(first.id, add=["STARRED"], remove=["UNREAD"])
    box.delete_message(second.id)
    assert box.history_id > int(start)

    records: list[dict] = []
    params = {"startHistoryId": start, "maxResults": "1"}
    while True:
        status, page = await get_json(http, f"{base}/history", token, params)
        assert status == 200 and page["historyId"] == str(box.history_id)
        records += page.get("history", [])
        if "nextPageToken" not in page:
            break
        params["pageToken"] = page["nextPageToken"]
    assert [int(r["id"]) for r in records] == sorted(int(r["id"]) for r in records)
    assert all(int(r["id"]) > int(start) for r in records)
    assert records[0]["messagesAdded"][0]["message"]["id"] == third.id
    assert records[1]["labelsAdded"][0]["labelIds"] == ["STARRED"]
    assert records[1]["labelsRemoved"][0]["labelIds"] == ["UNREAD"]
    assert records[2]["messagesDeleted"][0]["message"]["id"] == second.id

    _, only_added = await get_json(
        http, f"{base}/history", token, {"startHistoryId": start, "historyTypes": "messageAdded"}
    )
    assert [r["messagesAdded"][0]["message"]["id"] for r in only_added["history"]] == [third.id]
    _, starred = await get_json(
        http, f"{base}/history", token, {"startHistoryId": start, "labelId": "STARRED"}
    )
    assert [r["messages"][0]["id"] for r in starred["history"]] == [first.id]
    _, nothing_new = await get_json(
        http, f"{base}/history", token, {"startHistoryId": str(box.history_id)}
    )
    assert "history" not in nothing_new and "nextPageToken" not in nothing_new
    status, gone = await get_json(http, f"{base}/messages/{second.id}", token, {"format": "raw"})
    assert status == 404 and gone["error"]["errors"][0]["reason"] == "notFound"


async def test_history_older_than_the_window_is_404(
    http: aiohttp.ClientSession, corpus: Path, clock: ManualClock
) -> None:
    async with FakeGmail([ALICE], history_retention=2, clock=clock) as fake:
        box = fake.mailbox(ALICE)
        token = fake.issue_access_token(ALICE)
        url = f"{fake.api_url}/users/me/history"
        start = str(box.history_id)
        box.add_files(corpus_files(corpus / "mime" / "mailgun-flanker", 2))
        status, ok = await get_json(http, url, token, {"startHistoryId": start})
        assert status == 200 and len(ok["history"]) == 2
        # the window keeps 2 records: start fell out
        box.add_files(corpus_files(corpus / "mime" / "mailgun-flanker", 1))
        status, body = await get_json(http, url, token, {"startHistoryId": start})
        assert status == 404
        assert body["error"]["status"] == "NOT_FOUND"
        assert body["error"]["errors"][0]["reason"] == "notFound"
        recent = str(box.history_id)
        box.expire_history()
        status, _ = await get_json(http, url, token, {"startHistoryId": str(int(recent) - 1)})
        assert status == 404
        status, _ = await get_json(http, url, token, {"startHistoryId": recent})
        assert status == 200


# -- batch -----------------------------------------------------------------------
async def test_batch_round_trip_with_a_per_part_429(
    fake: FakeGmail, http: aiohttp.ClientSession, corpus: Path
) -> None:
    messages = fake.seed_files(ALICE, corpus_files(corpus / "mime" / "mailgun-flanker", 3))
    token = fake.issue_access_token(ALICE)
    fake.faults.fail_message(messages[1].id, 429, retry_after_s=2)
    fake.faults.shuffle_batch = True
    paths = [f"/gmail/v1/users/me/messages/{m.id}?format=raw" for m in messages]
    headers = bearer(token) | {"Content-Type": "multipart/mixed; boundary=xyz-boundary"}
    async with http.post(fake.batch_url, data=batch_body(paths), headers=headers) as resp:
        assert resp.status == 200
        answers = parse_answer(await resp.read(), resp.headers["Content-Type"])
    assert set(answers) == {"<response-item0>", "<response-item1>", "<response-item2>"}
    status, part_headers, payload = answers["<response-item1>"]
    assert status == 429 and part_headers["Retry-After"] == "2"
    assert b"rateLimitExceeded" in payload
    for n in (0, 2):
        status, _, payload = answers[f"<response-item{n}>"]
        assert status == 200
        raw = base64.urlsafe_b64decode(json.loads(payload)["raw"])
        assert raw == corpus_files(corpus / "mime" / "mailgun-flanker", 3)[n].read_bytes()
    assert fake.counters.batch_sizes == [3]
    assert fake.counters.calls_of("users.messages.get") == 3

    # The retried part succeeds; the ones already fetched are not downloaded again.
    async with http.post(fake.batch_url, data=batch_body(paths[1:2]), headers=headers) as resp:
        answers = parse_answer(await resp.read(), resp.headers["Content-Type"])
    assert answers["<response-item0>"][0] == 200
    assert fake.counters.max_downloads() == 1

    too_many = batch_body([paths[0]] * 101)
    async with http.post(fake.batch_url, data=too_many, headers=headers) as resp:
        assert resp.status == 400


async def test_batch_parts_need_their_bearer(fake: FakeGmail, http: aiohttp.ClientSession) -> None:
    body = batch_body(["/gmail/v1/users/me/profile"])
    headers = {"Content-Type": "multipart/mixed; boundary=xyz-boundary"}
    async with http.post(fake.batch_url, data=body, headers=headers) as resp:
        answers = parse_answer(await resp.read(), resp.headers["Content-Type"])
    assert answers["<response-item0>"][0] == 401


# -- quota and faults ------------------------------------------------------------
async def test_quota_answers_429_with_retry_after_and_recovers(
    http: aiohttp.ClientSession, corpus: Path, clock: ManualClock
) -> None:
    async with FakeGmail([ALICE], quota_units_per_s=10, clock=clock) as fake:
        message = fake.seed_files(ALICE, corpus_files(corpus / "mime" / "mailgun-flanker", 1))[0]
        token = fake.issue_access_token(ALICE)
        url = f"{fake.api_url}/users/me/messages/{message.id}"
        for _ in range(2):
            status, _ = await get_json(http, url, token, {"format": "minimal"})
            assert status == 200
        async with http.get(url, headers=bearer(token), params={"format": "minimal"}) as resp:
            assert resp.status == 429
            assert int(resp.headers["Retry-After"]) >= 1
            error = (await resp.json())["error"]
        assert error["code"] == 429 and error["status"] == "RESOURCE_EXHAUSTED"
        assert error["errors"][0]["reason"] == "userRateLimitExceeded"
        clock.now += 0.5  # half a second refills 5 units: one more messages.get
        status, _ = await get_json(http, url, token, {"format": "minimal"})
        assert status == 200
        assert fake.counters.units[ALICE] == 15 and fake.counters.rejected(429) == 1


async def test_a_client_pacing_at_the_rate_never_sees_429(
    http: aiohttp.ClientSession, clock: ManualClock
) -> None:
    async with FakeGmail([ALICE], quota_units_per_s=250, clock=clock) as fake:
        token = fake.issue_access_token(ALICE)
        url = f"{fake.api_url}/users/me/profile"
        for _ in range(600):  # 600 units at exactly 250 units/s, after a full burst
            status, _ = await get_json(http, url, token)
            assert status == 200
            clock.now += 1 / 250
        assert fake.counters.rejected(429) == 0


async def test_injected_failures_and_rate_limits(
    fake: FakeGmail, http: aiohttp.ClientSession
) -> None:
    token = fake.issue_access_token(ALICE)
    url = f"{fake.api_url}/users/me/profile"
    fake.faults.fail_next_calls(2, 500)
    statuses = [(await get_json(http, url, token))[0] for _ in range(3)]
    assert statuses == [500, 500, 200]
    fake.faults.rate_limit({"users.getProfile"}, times=1, retry_after_s=7)
    async with http.get(url, headers=bearer(token)) as resp:
        assert resp.status == 429 and resp.headers["Retry-After"] == "7"
        assert (await resp.json())["error"]["errors"][0]["reason"] == "rateLimitExceeded"
    fake.faults.fail_next_batches(1, 503)
    headers = bearer(token) | {"Content-Type": "multipart/mixed; boundary=xyz-boundary"}
    body = batch_body(["/gmail/v1/users/me/profile"])
    async with http.post(fake.batch_url, data=body, headers=headers) as resp:
        assert resp.status == 503
    async with http.post(fake.batch_url, data=body, headers=headers) as resp:
        assert resp.status == 200


async def test_watch_and_stop(fake: FakeGmail, http: aiohttp.ClientSession) -> None:
    token = fake.issue_access_token(ALICE)
    body = {"topicName": "projects/p/topics/gmail", "labelIds": ["INBOX"]}
    async with http.post(f"{fake.api_url}/users/me/watch", json=body, headers=bearer(token)) as r:
        assert r.status == 200
        answer = await r.json()
    box = fake.mailbox(ALICE)
    assert answer["historyId"] == str(box.history_id)
    assert int(answer["expiration"]) > time.time() * 1000
    assert box.watch is not None and box.watch.label_ids == ["INBOX"]
    async with http.post(f"{fake.api_url}/users/me/stop", headers=bearer(token)) as r:
        assert r.status == 200 and await r.json() == {}
    assert box.watch is None
    assert fake.counters.units[ALICE] == 150


async def test_watch_on_a_topic_without_gmails_publish_right_is_403(
    fake: FakeGmail, http: aiohttp.ClientSession
) -> None:
    token = fake.issue_access_token(ALICE)
    fake.publishable_topics = {"projects/p/topics/granted"}
    url = f"{fake.api_url}/users/me/watch"
    body = {"topicName": "projects/p/topics/gmail"}
    async with http.post(url, json=body, headers=bearer(token)) as r:
        assert r.status == 403
        error = (await r.json())["error"]
    assert "not authorized" in error["message"] and fake.mailbox(ALICE).watch is None
    body = {"topicName": "projects/p/topics/granted"}
    async with http.post(url, json=body, headers=bearer(token)) as r:
        assert r.status == 200
    assert fake.mailbox(ALICE).watch is not None


async def test_a_held_call_reaches_gmail_only_when_released(
    fake: FakeGmail, http: aiohttp.ClientSession
) -> None:
    token = fake.issue_access_token(ALICE)
    gate = fake.hold("users.watch")
    statuses: list[int] = []

    async def watch() -> None:
        body = {"topicName": "projects/p/topics/gmail"}
        url = f"{fake.api_url}/users/me/watch"
        async with http.post(url, json=body, headers=bearer(token)) as r:
            statuses.append(r.status)

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        await eventually(lambda: fake.held.get("users.watch"), 30.0, what="the held call")
        assert fake.mailbox(ALICE).watch is None  # not seen by Gmail yet
        gate.set()
    assert statuses == [200] and fake.mailbox(ALICE).watch is not None


async def test_a_live_watch_publishes_watched_changes_and_a_lapsed_one_nothing(
    fake: FakeGmail, http: aiohttp.ClientSession, corpus: Path
) -> None:
    box = fake.mailbox(ALICE)
    raw = corpus_files(corpus / "mime" / "mailgun-flanker", 1)[0].read_bytes()
    box.add_message(raw)  # no watch yet: published to no one
    token = fake.issue_access_token(ALICE)
    body = {"topicName": "projects/p/topics/gmail", "labelIds": ["INBOX"]}
    async with http.post(f"{fake.api_url}/users/me/watch", json=body, headers=bearer(token)) as r:
        assert r.status == 200
    inbox = box.add_message(raw)
    box.add_message(raw, label_ids=["SENT"])  # not a watched label
    assert box.published == [{"emailAddress": ALICE, "historyId": str(inbox.history_id)}]
    assert box.watch is not None
    box.watch.expiration_ms = int(time.time() * 1000) - 1  # the watch lapsed
    box.add_message(raw)
    assert len(box.published) == 1


async def test_batch_is_charged_per_call_and_quota_is_per_user(
    http: aiohttp.ClientSession, corpus: Path, clock: ManualClock
) -> None:
    async with FakeGmail([ALICE, BOB], quota_units_per_s=10, clock=clock) as fake:
        messages = fake.seed_files(ALICE, corpus_files(corpus / "mime" / "mailgun-flanker", 3))
        alice, bob = fake.issue_access_token(ALICE), fake.issue_access_token(BOB)
        paths = [f"/gmail/v1/users/me/messages/{m.id}?format=metadata" for m in messages]
        headers = bearer(alice) | {"Content-Type": "multipart/mixed; boundary=xyz-boundary"}
        async with http.post(fake.batch_url, data=batch_body(paths), headers=headers) as resp:
            assert resp.status == 200
            answers = parse_answer(await resp.read(), resp.headers["Content-Type"])
        statuses = [answers[f"<response-item{n}>"][0] for n in range(3)]
        assert statuses == [200, 200, 429]  # 5 + 5 units fit in 10, the third does not
        error = json.loads(answers["<response-item2>"][2])["error"]
        assert error["errors"][0]["reason"] == "userRateLimitExceeded"
        first = json.loads(answers["<response-item0>"][2])
        assert "raw" not in first and first["payload"]["headers"]
        assert fake.counters.max_downloads() == 0  # metadata is not a body download
        # Bob's bucket is his own.
        assert (await get_json(http, f"{fake.api_url}/users/me/profile", bob))[0] == 200
        assert fake.counters.units == {ALICE: 10, BOB: 1}
