"""Contract tests of the fake Graph's mail side, through plain aiohttp calls.

They pin the published behaviour a Graph client relies on (delta rounds and
their links, @removed entries, REST vs immutable ids, $value bytes, $batch
format and inner failures, error bodies), so a client test failing against the
fake points at the client.
"""

from __future__ import annotations

import base64
import json
from email.message import EmailMessage
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
from helpers.corpus import corpus_files

from fakes.graph import FakeGraph
from fakes.graph.testkit import (
    ALICE,
    BOB,
    ManualClock,
    app_token,
    delta_round,
    get_json,
    headers,
)

GRAPH_SAMPLES = Path(__file__).resolve().parents[2] / "corpus" / "api" / "graph"


def inbox_delta(fake: FakeGraph, user: str = ALICE, spelling: str = "delta()") -> str:
    return f"{fake.graph_url}/users/{user}/mailFolders/inbox/messages/{spelling}"


# -- delta rounds ------------------------------------------------------------------
async def test_first_round_pages_every_message_and_serves_exact_bytes(
    fake: FakeGraph, http: aiohttp.ClientSession, corpus: Path
) -> None:
    files = corpus_files(corpus / "mime" / "mailgun-flanker", 7)
    seeded = fake.mailbox(ALICE).add_files(files)
    fake.mailbox(ALICE).add_generated(2, folder="archive")  # another folder: not in the round
    token = await app_token(http, fake)
    hdrs = headers(token, maxpagesize=3)
    items, delta_link, pages = await delta_round(http, inbox_delta(fake), hdrs)

    assert [len(p["value"]) for p in pages] == [3, 3, 1]
    for page in pages:
        link = page.get("@odata.nextLink") or page["@odata.deltaLink"]
        parts = urlsplit(link)
        assert f"{parts.scheme}://{parts.netloc}" == fake.base_url  # absolute, back at the fake
        assert "$skiptoken=" in parts.query or "$deltatoken=" in parts.query
        assert page["@odata.context"] == f"{fake.graph_url}/$metadata#Collection(message)"
    assert "$deltatoken=" in delta_link
    assert sorted(i["id"] for i in items) == sorted(m.immutable_id for m in seeded)
    inbox = fake.mailbox(ALICE).folder("inbox")
    assert inbox is not None
    for item in items:
        assert item["@odata.type"] == "#microsoft.graph.message"
        assert item["parentFolderId"] == inbox.id
        assert item["receivedDateTime"].endswith("Z") and "conversationId" in item
        assert {"internetMessageId", "subject", "from", "isRead"} <= item.keys()

    for message, path in zip(seeded, files, strict=True):
        url = f"{fake.graph_url}/users/{ALICE}/messages/{message.immutable_id}/$value"
        async with http.get(url, headers=headers(token)) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain")
            assert await resp.read() == path.read_bytes()
    counters = fake.counters
    assert counters.max_downloads() == 1
    assert counters.missing_immutable_total() == 0
    assert counters.calls_of("message.delta", ALICE) == 3
    assert counters.maxpagesize[(ALICE, "message.delta", True)] == 3
    assert counters.without_maxpagesize() == 0


async def test_next_round_reports_new_moved_read_and_removed(
    fake: FakeGraph, http: aiohttp.ClientSession
) -> None:
    box = fake.mailbox(ALICE)
    stay, leave, gone, reread = box.add_generated(4)
    (comes_in,) = box.add_generated(1, folder="archive")
    hdrs = headers(await app_token(http, fake), maxpagesize=50)
    _, delta_link, _ = await delta_round(http, inbox_delta(fake), hdrs)

    (new,) = box.add_generated(1)
    fake.move_message(leave.immutable_id, "deleteditems")
    fake.move_message(comes_in.immutable_id, "inbox")
    fake.delete_message(gone.immutable_id)
    fake.mark_read(reread.immutable_id)
    items, next_link, _ = await delta_round(http, delta_link, hdrs)

    removed = {i["id"]: i["@removed"]["reason"] for i in items if "@removed" in i}
    assert removed == {leave.immutable_id: "deleted", gone.immutable_id: "deleted"}
    current = {i["id"]: i for i in items if "@removed" not in i}
    assert set(current) == {new.immutable_id, comes_in.immutable_id, reread.immutable_id}
    assert current[reread.immutable_id]["isRead"] is True
    assert stay.immutable_id not in current
    # Nothing changed since: the next round is empty and ends in a deltaLink again.
    items, _, pages = await delta_round(http, next_link, hdrs)
    assert items == [] and len(pages) == 1

    fake.faults.moved_out_reason = "changed"
    fake.move_message(stay.immutable_id, "archive")
    items, _, _ = await delta_round(http, next_link, hdrs)
    assert items == [
        {
            "@odata.type": "#microsoft.graph.message",
            "id": stay.immutable_id,
            "@removed": {"reason": "changed"},
        }
    ]


async def test_delta_pages_have_the_keys_of_the_docs_samples(
    fake: FakeGraph, http: aiohttp.ClientSession
) -> None:
    samples = [
        json.loads(
            (
                GRAPH_SAMPLES / f"concepts-delta-query-messages-0{n}-delta-query-messages_{n}.json"
            ).read_text()
        )
        for n in (1, 3, 4)
    ]
    box = fake.mailbox(ALICE)
    first, second, _third = box.add_generated(3)
    hdrs = headers(await app_token(http, fake), maxpagesize=2)
    _, delta_link, pages = await delta_round(http, inbox_delta(fake, spelling="delta"), hdrs)
    assert pages[0].keys() == samples[0].keys()  # @odata.context, @odata.nextLink, value
    assert pages[-1].keys() == samples[1].keys()  # @odata.context, @odata.deltaLink, value
    sample_item = samples[0]["value"][0]
    assert sample_item.keys() - {"sender"} <= pages[0]["value"][0].keys()
    fake.delete_message(first.immutable_id)
    fake.mark_read(second.immutable_id)
    items, _, _ = await delta_round(http, delta_link, hdrs)
    sample_removed = next(i for i in samples[2]["value"] if "@removed" in i)
    ours = next(i for i in items if "@removed" in i)
    assert ours.keys() == sample_removed.keys() and ours["@removed"] == sample_removed["@removed"]


async def test_a_message_arriving_mid_round_comes_in_the_next_round(
    fake: FakeGraph, http: aiohttp.ClientSession
) -> None:
    box = fake.mailbox(ALICE)
    box.add_generated(4)
    hdrs = headers(await app_token(http, fake), maxpagesize=2)
    status, page = await get_json(http, inbox_delta(fake), hdrs)
    assert status == 200 and len(page["value"]) == 2
    (late,) = box.add_generated(1)
    status, page = await get_json(http, page["@odata.nextLink"], hdrs)
    assert [i["id"] for i in page["value"]] != [] and late.immutable_id not in {
        i["id"] for i in page["value"]
    }
    items, _, _ = await delta_round(http, page["@odata.deltaLink"], hdrs)
    assert [i["id"] for i in items] == [late.immutable_id]


async def test_filter_select_and_default_page_size(
    fake: FakeGraph, http: aiohttp.ClientSession
) -> None:
    box = fake.mailbox(ALICE)
    box.add_generated(12)  # generated dates: 2026-01-01T00:00Z + n minutes
    hdrs = headers(await app_token(http, fake))  # no maxpagesize: pages of 10
    params = {"$filter": "receivedDateTime ge 2026-01-01T00:05:00Z", "$select": "subject"}
    items, _, pages = await delta_round(http, inbox_delta(fake), hdrs, params)
    assert len(items) == 7 and len(pages) == 1
    assert all(i["subject"].startswith("generated") for i in items)
    assert items[0].keys() == {"@odata.type", "@odata.etag", "id", "parentFolderId", "subject"}
    items, _, pages = await delta_round(http, inbox_delta(fake), hdrs)
    assert [len(p["value"]) for p in pages] == [10, 2]
    assert fake.counters.without_maxpagesize() == 3
    status, error = await get_json(http, inbox_delta(fake), hdrs, {"$filter": "subject eq 'x'"})
    assert status == 400 and error["error"]["code"] == "ErrorInvalidUrlQueryFilter"
    assert {"date", "request-id", "client-request-id"} <= error["error"]["innerError"].keys()


async def test_expired_tokens_answer_410_or_400_and_can_expire_mid_round(
    fake: FakeGraph, http: aiohttp.ClientSession
) -> None:
    box = fake.mailbox(ALICE)
    box.add_generated(3)
    hdrs = headers(await app_token(http, fake), maxpagesize=2)
    _, delta_link, _ = await delta_round(http, inbox_delta(fake), hdrs)
    box.expire_delta_tokens("inbox")
    async with http.get(delta_link, headers=hdrs) as resp:
        assert resp.status == 410
        assert (await resp.json())["error"]["code"] == "resyncRequired"
        restart = resp.headers["Location"]
    items, delta_link, _ = await delta_round(http, restart, hdrs)  # empty $deltatoken: full
    assert len(items) == 3
    fake.faults.expire_style = "400"
    box.expire_delta_tokens()
    status, error = await get_json(http, delta_link, hdrs)
    assert status == 400 and error["error"]["code"] == "syncStateNotFound"

    fake.delta.expire_next_skiptoken = True
    status, page = await get_json(http, inbox_delta(fake), hdrs)
    assert status == 200
    status, error = await get_json(http, page["@odata.nextLink"], hdrs)
    assert status == 400 and error["error"]["code"] == "syncStateNotFound"


# -- ids -------------------------------------------------------------------------
async def test_rest_ids_change_on_move_immutable_ids_do_not(
    clock: ManualClock, http: aiohttp.ClientSession
) -> None:
    async with FakeGraph([ALICE], clock=clock, strict_immutable=False) as fake:
        (message,) = fake.mailbox(ALICE).add_generated(1)
        token = await app_token(http, fake)
        base = f"{fake.graph_url}/users/{ALICE}/messages"
        status, rest = await get_json(
            http, f"{base}/{message.rest_id}", headers(token, immutable=False)
        )
        assert status == 200 and rest["id"] == message.rest_id != message.immutable_id
        old_rest = message.rest_id
        move = {"destinationId": "archive"}
        async with http.post(
            f"{base}/{old_rest}/move", json=move, headers=headers(token, immutable=False)
        ) as resp:
            assert resp.status == 201
            moved = await resp.json()
        archive = fake.mailbox(ALICE).folder("archive")
        assert archive is not None
        assert moved["id"] != old_rest and moved["parentFolderId"] == archive.id
        status, error = await get_json(http, f"{base}/{old_rest}", headers(token, immutable=False))
        assert status == 404 and error["error"]["code"] == "ErrorItemNotFound"
        status, same = await get_json(http, f"{base}/{message.immutable_id}", headers(token))
        assert status == 200 and same["id"] == message.immutable_id


async def test_strict_immutable_refuses_requests_without_the_preference(
    fake: FakeGraph, http: aiohttp.ClientSession
) -> None:
    (message,) = fake.mailbox(ALICE).add_generated(1)
    token = await app_token(http, fake)
    url = f"{fake.graph_url}/users/{ALICE}/messages/{message.immutable_id}/$value"
    async with http.get(url, headers=headers(token, immutable=False)) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["code"] == "ErrorInvalidRequest"
    # Several Prefer headers are one list of preferences too.
    two = {"Authorization": f"Bearer {token}"}
    async with http.get(
        url,
        headers=[
            *two.items(),
            ("Prefer", "odata.maxpagesize=5"),
            ("Prefer", 'IdType="ImmutableId"'),
        ],
    ) as resp:
        assert resp.status == 200
    assert fake.counters.missing_immutable == {(ALICE, "message.value"): 1}
    assert fake.counters.max_downloads() == 1


async def test_conversation_id_follows_the_thread_root(fake: FakeGraph) -> None:
    def mail(msgid: str, references: str | None) -> bytes:
        out = EmailMessage()
        out["From"], out["Subject"], out["Message-ID"] = "x@example.org", "t", msgid
        if references:
            out["In-Reply-To"] = references.split()[-1]
            out["References"] = references
        return bytes(out)

    box = fake.mailbox(ALICE)
    root = box.add_message(mail("<a@x>", None))
    reply = box.add_message(mail("<b@x>", "<a@x>"), folder="sentitems")
    deeper = box.add_message(mail("<c@x>", "<a@x> <b@x>"))
    other = box.add_message(mail("<d@x>", None), received="2026-02-01T10:00:00Z")
    assert root.conversation_id == reply.conversation_id == deeper.conversation_id
    assert other.conversation_id != root.conversation_id
    assert other.received.isoformat() == "2026-02-01T10:00:00+00:00"
    assert root.internet_message_id == "<a@x>" and root.from_address == "x@example.org"


# -- errors and auth ---------------------------------------------------------------
async def test_value_of_unknown_or_deleted_ids_is_item_not_found(
    fake: FakeGraph, http: aiohttp.ClientSession
) -> None:
    (message,) = fake.mailbox(ALICE).add_generated(1)
    hdrs = headers(await app_token(http, fake))
    url = f"{fake.graph_url}/users/{ALICE}/messages/{{}}/$value"
    fake.delete_message(message.immutable_id)
    for item_id in ("AAkALgnope=", message.immutable_id):
        status, error = await get_json(http, url.format(item_id), hdrs)
        assert status == 404 and error["error"]["code"] == "ErrorItemNotFound"


async def test_tokens_users_and_mailboxes(
    fake: FakeGraph, http: aiohttp.ClientSession, clock: ManualClock
) -> None:
    fake.add_user("nomail@contoso.com", mailbox=False)
    folders = f"{fake.graph_url}/users/{{}}/mailFolders/inbox"
    async with http.get(folders.format(ALICE)) as resp:
        assert resp.status == 401
        assert (await resp.json())["error"]["code"] == "InvalidAuthenticationToken"
    app = headers(await app_token(http, fake))
    assert (await get_json(http, folders.format(BOB), app))[0] == 200
    assert (await get_json(http, folders.format(fake.mailbox(BOB).id), app))[0] == 200
    status, error = await get_json(http, folders.format("who@contoso.com"), app)
    assert status == 404 and error["error"]["code"] == "ErrorInvalidUser"
    status, error = await get_json(http, folders.format("nomail@contoso.com"), app)
    assert status == 404 and error["error"]["code"] == "MailboxNotEnabledForRESTAPI"
    status, error = await get_json(http, f"{fake.graph_url}/me/mailFolders/inbox", app)
    assert status == 400
    delegated = headers(fake.issue_access_token(ALICE))
    status, inbox = await get_json(http, f"{fake.graph_url}/me/mailFolders/inbox", delegated)
    assert status == 200 and inbox["displayName"] == "Inbox"
    status, error = await get_json(http, folders.format(BOB), delegated)
    assert status == 403 and error["error"]["code"] == "ErrorAccessDenied"
    clock.now += 3600  # access tokens live 3599 s
    status, error = await get_json(http, folders.format(BOB), app)
    assert status == 401 and error["error"]["code"] == "InvalidAuthenticationToken"


# -- $batch --------------------------------------------------------------------------
async def test_batch_value_bodies_are_base64_and_inner_requests_fail_alone(
    fake: FakeGraph, http: aiohttp.ClientSession, corpus: Path
) -> None:
    files = corpus_files(corpus / "mime" / "mailgun-flanker", 3)
    messages = fake.mailbox(ALICE).add_files(files)
    token = await app_token(http, fake)
    prefer = {"Prefer": 'IdType="ImmutableId"'}
    requests = [
        {
            "id": str(n),
            "method": "GET",
            "url": f"/users/{ALICE}/messages/{m.immutable_id}/$value",
            "headers": prefer,
        }
        for n, m in enumerate(messages)
    ]
    requests.append({"id": "nopref", "method": "GET", "url": f"users/{ALICE}/mailFolders/inbox"})
    fake.faults.fail_message(messages[1].immutable_id, 429, retry_after_s=7)
    fake.faults.reverse_batch = True
    batch_url = f"{fake.graph_url}/$batch"
    # The outer Prefer does not reach inner requests: "nopref" is refused.
    async with http.post(batch_url, json={"requests": requests}, headers=headers(token)) as resp:
        assert resp.status == 200
        responses = (await resp.json())["responses"]
    assert [r["id"] for r in responses] == ["nopref", "2", "1", "0"]
    by_id = {r["id"]: r for r in responses}
    for n in (0, 2):
        assert by_id[str(n)]["status"] == 200
        assert by_id[str(n)]["headers"]["Content-Type"] == "text/plain"
        assert base64.b64decode(by_id[str(n)]["body"]) == files[n].read_bytes()
    assert by_id["1"]["status"] == 429 and by_id["1"]["headers"]["Retry-After"] == "7"
    assert by_id["1"]["body"]["error"]["code"] == "TooManyRequests"
    assert by_id["nopref"]["status"] == 400
    assert fake.counters.missing_immutable == {(ALICE, "mailFolder.get"): 1}
    assert fake.counters.throttled[ALICE] == 1 and fake.counters.batch_sizes == [4]

    too_many = [{**requests[0], "id": str(n)} for n in range(21)]
    async with http.post(batch_url, json={"requests": too_many}, headers=headers(token)) as resp:
        assert resp.status == 400 and (await resp.json())["error"]["code"] == "BadRequest"
    twice = [requests[0], requests[0]]
    async with http.post(batch_url, json={"requests": twice}, headers=headers(token)) as resp:
        assert resp.status == 400


async def test_batch_depends_on_runs_in_order_and_fails_dependents(
    fake: FakeGraph, http: aiohttp.ClientSession
) -> None:
    (message,) = fake.mailbox(ALICE).add_generated(1)
    token = await app_token(http, fake)
    prefer = {"Prefer": 'IdType="ImmutableId"'}
    requests = [
        {
            "id": "1",
            "method": "GET",
            "url": f"/users/{ALICE}/messages/missing/$value",
            "headers": prefer,
        },
        {
            "id": "2",
            "method": "GET",
            "url": f"/users/{ALICE}/messages/{message.immutable_id}",
            "headers": prefer,
            "dependsOn": ["1"],
        },
    ]
    async with http.post(
        f"{fake.graph_url}/$batch", json={"requests": requests}, headers=headers(token)
    ) as resp:
        statuses = {r["id"]: r["status"] for r in (await resp.json())["responses"]}
    assert statuses == {"1": 404, "2": 424}
