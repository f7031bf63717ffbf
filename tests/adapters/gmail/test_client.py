"""GmailClient against the fake Gmail over HTTP (tests/fakes/gmail, CONTRIBUTING.md rule 12).

What a sync loop relies on: every page of a list, history paging and its 404,
raw bytes byte-exact in batches of at most 20 with per-part failures retried,
gone messages reported, tokens refreshed on 401, revoked access as an auth
error, and quota: our own pacing never draws a 429.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import anyio
import pytest
from helpers.waiting import eventually

from inboxd.adapters.gmail import (
    GMAIL_BATCH_SIZE,
    GmailAuthError,
    GmailClient,
    GmailRateLimited,
    GmailUnavailable,
    HistoryExpired,
    QuotaPacer,
)
from inboxd.adapters.gmail import client as client_module
from inboxd.adapters.gmail.errors import GmailConfigError
from inboxd.pipeline.errors import Family, family_of

from .conftest import ALICE, make_client, needs_fake, refresh_mailbox

pytestmark = needs_fake

GET = "users.messages.get"


@pytest.fixture
async def fake() -> AsyncIterator[object]:
    from fakes.gmail import FakeGmail

    # No quota here (None: unlimited), so only the quota test below meets 429s from it.
    async with FakeGmail([ALICE], quota_units_per_s=None) as server:
        yield server


@pytest.fixture
def client(fake, http) -> GmailClient:
    return make_client(fake, http)


async def test_profile(fake, client: GmailClient) -> None:
    fake.mailbox(ALICE).add_generated(3)
    profile = await client.get_profile()
    assert profile.email_address == ALICE
    assert profile.history_id == str(fake.mailbox(ALICE).history_id)
    assert profile.messages_total == 3


async def test_list_messages_pages_through_everything(fake, client: GmailClient) -> None:
    box = fake.mailbox(ALICE)
    added = box.add_generated(1203)
    seen: list[str] = []
    threads: dict[str, str] = {}
    token: str | None = None
    pages = 0
    while True:
        page = await client.list_messages(["INBOX"], None, token)
        pages += 1
        seen += [ref.id for ref in page.messages]
        threads |= {ref.id: ref.thread_id for ref in page.messages}
        token = page.next_page_token
        if token is None:
            break
    assert pages == 3  # 500 + 500 + 203: the largest page Gmail serves
    assert sorted(seen) == sorted(m.id for m in added)
    assert len(seen) == len(set(seen))
    assert all(threads[m.id] == m.thread_id for m in added)


async def test_list_messages_label_and_query(fake, client: GmailClient) -> None:
    box = fake.mailbox(ALICE)
    inbox = box.add_generated(3)
    sent = box.add_generated(2)
    for message in sent:
        box.modify_labels(message.id, add=["SENT"], remove=["INBOX"])
    page = await client.list_messages(["SENT"])
    assert {ref.id for ref in page.messages} == {m.id for m in sent}
    assert page.next_page_token is None
    empty = await client.list_messages(["INBOX"], "before:2000/01/01")
    assert empty.messages == [] and inbox


async def test_history_pages_then_expires(fake, client: GmailClient) -> None:
    box = fake.mailbox(ALICE)
    start = str(box.history_id)
    added = box.add_generated(700)  # one messageAdded record each
    records, token = [], None
    while True:
        page = await client.list_history(start, ["messageAdded"], token)
        records += page.records
        token = page.next_page_token
        if token is None:
            break
    assert page.history_id == str(box.history_id)
    ids = [entry["message"]["id"] for r in records for entry in r.get("messagesAdded", [])]
    assert ids == [m.id for m in added]  # oldest first, each once
    box.expire_history()
    with pytest.raises(HistoryExpired):
        await client.list_history(start)


async def test_raw_batch_is_byte_exact_in_batches_of_twenty(fake, client: GmailClient, corpus):
    box = fake.mailbox(ALICE)
    files = sorted((corpus / "mime").rglob("*.eml"))[:45]
    messages = box.add_files(files)
    result = await client.get_raw_batch([m.id for m in messages])
    assert result.raw == {m.id: f.read_bytes() for m, f in zip(messages, files, strict=True)}
    assert not result.gone and not result.rejected
    assert fake.counters.batch_sizes == [20, 20, 5]
    assert fake.counters.max_downloads() == 1


async def test_no_silent_cap_and_duplicates_fetched_once(fake, http) -> None:
    client = make_client(fake, http, pacer=QuotaPacer(1e6, 1e6))  # pacing: tested below
    messages = fake.mailbox(ALICE).add_generated(130)
    ids = [m.id for m in messages]
    result = await client.get_raw_batch(ids + ids[:10])
    assert set(result.raw) == set(ids)
    assert max(fake.counters.batch_sizes) <= GMAIL_BATCH_SIZE
    assert sum(fake.counters.batch_sizes) == 130
    assert fake.counters.max_downloads() == 1


async def test_deleted_message_is_gone_not_retried(fake, client: GmailClient) -> None:
    box = fake.mailbox(ALICE)
    messages = box.add_generated(5)
    box.delete_message(messages[2].id)
    result = await client.get_raw_batch([m.id for m in messages])
    assert result.gone == {messages[2].id}
    assert set(result.raw) == {m.id for i, m in enumerate(messages) if i != 2}
    assert fake.counters.batch_sizes == [5]  # a 404 is permanent: no second batch


async def test_per_part_429_is_retried_in_a_smaller_group(fake, client: GmailClient) -> None:
    messages = fake.mailbox(ALICE).add_generated(20)
    fake.faults.fail_message(messages[7].id, 429, reason="rateLimitExceeded")
    fake.faults.fail_message(messages[11].id, 503)
    result = await client.get_raw_batch([m.id for m in messages])
    assert set(result.raw) == {m.id for m in messages}
    assert fake.counters.rejected(429) == 1 and fake.counters.rejected(503) == 1
    # The first batch had all 20; the retry asked only for the two that failed.
    assert fake.counters.batch_sizes[0] == 20
    assert sum(fake.counters.batch_sizes[1:]) == 2
    assert max(fake.counters.batch_sizes[1:]) <= 10  # halved group


async def test_persistent_per_part_429_raises_retriable(fake, http) -> None:
    client = make_client(fake, http, batch_attempts=2)
    messages = fake.mailbox(ALICE).add_generated(4)
    fake.faults.fail_message(messages[1].id, 429, times=None, retry_after_s=1)
    with pytest.raises(GmailRateLimited) as caught:
        await client.get_raw_batch([m.id for m in messages])
    assert caught.value.retry_after_s == 1
    assert family_of(caught.value) is Family.RETRIABLE
    assert fake.counters.rejected(429) == 2  # one per round, then given up


async def test_whole_batch_5xx_is_retried(fake, client: GmailClient) -> None:
    messages = fake.mailbox(ALICE).add_generated(3)
    fake.faults.fail_next_batches(2, 503)
    result = await client.get_raw_batch([m.id for m in messages])
    assert set(result.raw) == {m.id for m in messages}


async def test_5xx_of_a_list_is_retried_then_raised(fake, http) -> None:
    client = make_client(fake, http, call_attempts=2)
    fake.faults.fail_next_calls(1, 500, methods={"users.messages.list"})
    assert (await client.list_messages(["INBOX"])).messages == []
    fake.faults.fail_next_calls(2, 503, methods={"users.messages.list"})
    with pytest.raises(GmailUnavailable):
        await client.list_messages(["INBOX"])


async def test_rate_limit_answer_holds_the_pacer(fake, http) -> None:
    pacer = QuotaPacer()
    client = make_client(fake, http, pacer=pacer)
    fake.faults.rate_limit({"users.getProfile"}, times=1, retry_after_s=1)
    await client.get_profile()
    assert fake.counters.rejected(429) == 1
    assert pacer.held_until > 0  # Retry-After honoured before the retry left


async def test_expired_access_token_is_refreshed_once(fake, client: GmailClient) -> None:
    fake.mailbox(ALICE).add_generated(2)
    await client.get_profile()
    fake.expire_access_tokens()
    assert (await client.get_profile()).messages_total == 2
    assert fake.counters.rejected(401) == 1
    assert fake.counters.token_requests["refresh_token"] == 2
    fake.expire_access_tokens()  # also inside a batch
    ids = [m.id for m in fake.mailbox(ALICE).messages.values()]
    assert set((await client.get_raw_batch(ids)).raw) == set(ids)
    assert fake.counters.token_requests["refresh_token"] == 3


async def test_revoked_access_is_an_auth_error(fake, http) -> None:
    mailbox = refresh_mailbox(fake)
    client = make_client(fake, http, mailbox)
    await client.get_profile()
    fake.revoke_user(ALICE)  # its access tokens now answer 401, /token invalid_grant
    with pytest.raises(GmailAuthError) as caught:
        await client.get_profile()
    assert "invalid_grant" in str(caught.value)
    assert family_of(caught.value) is Family.ATTENTION


async def test_mailbox_without_gmail_is_a_config_error(fake, http) -> None:
    client = make_client(fake, http, refresh_mailbox(fake))
    del fake.mailboxes[ALICE]  # the user exists, its mailbox does not
    with pytest.raises(GmailConfigError, match=r"^address"):
        await client.get_profile()


async def test_watch_and_stop(fake, client: GmailClient) -> None:
    box = fake.mailbox(ALICE)
    result = await client.watch("projects/my-project/topics/gmail", ["INBOX"])
    assert result.history_id == str(box.history_id)
    assert result.expiration_ms > 0 and result.expiration.year >= 2024
    assert box.watch is not None and box.watch.label_ids == ["INBOX"]
    await client.stop()
    assert box.watch is None


@pytest.mark.parametrize("units_per_s", [250.0, 1000.0])
async def test_our_pacing_never_draws_a_429(http, units_per_s: float) -> None:
    """The fake meters quota like Gmail (units per user per second, one second of
    burst); a client paced at that rate with the pacer's default headroom gets no
    429 while fetching well over a burst's worth; unpaced, the same load does."""
    from fakes.gmail import FakeGmail

    burst = units_per_s * 150.0 / 250.0  # the default headroom, scaled with the rate
    count = int(units_per_s * 1.2 / 5)  # 1.2 s of messages.get: twice the burst
    async with FakeGmail([ALICE], quota_units_per_s=units_per_s) as fake:
        ids = [m.id for m in fake.mailbox(ALICE).add_generated(count)]
        pacer = QuotaPacer(units_per_s, burst)
        client = make_client(fake, http, pacer=pacer)
        page = await client.list_messages(["INBOX"])
        result = await client.get_raw_batch(ids)
        assert len(result.raw) == count and page.messages
        assert fake.counters.rejected(429) == 0
        assert fake.counters.units[ALICE] == pacer.spent_units  # every unit paid first

    # The control, on a quota clock that stands still: the bucket refills nothing, so
    # whether the unpaced load outruns the refill does not depend on how fast this
    # machine sends it (a loaded runner with parallel test workers sent too slowly
    # to draw a 429 in real time). One attempt: the 429s are what is counted.
    frozen = time.monotonic()
    async with FakeGmail([ALICE], quota_units_per_s=units_per_s, clock=lambda: frozen) as fake:
        ids = [m.id for m in fake.mailbox(ALICE).add_generated(count)]
        unpaced = make_client(fake, http, pacer=QuotaPacer(1e9, 1e9), batch_attempts=1)
        with pytest.raises(GmailRateLimited):
            await unpaced.get_raw_batch(ids)
        assert fake.counters.rejected(429) > 0  # the test can fail


@pytest.fixture
async def trickling_gmail() -> AsyncIterator[str]:
    """A stub Gmail whose getProfile answer arrives in three pieces (chunked)."""
    import anyio
    from aiohttp import web

    async def profile(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        body = json.dumps(
            {"emailAddress": ALICE, "historyId": "77", "padding": "x" * 200_000}
        ).encode()
        for start in range(0, len(body), 70_000):
            await response.write(body[start : start + 70_000])
            await anyio.sleep(0.01)
        await response.write_eof()
        return response

    async def token(request: web.Request) -> web.Response:
        return web.json_response({"access_token": "t", "expires_in": 3599})

    app = web.Application()
    app.router.add_get("/gmail/v1/users/me/profile", profile)
    app.router.add_post("/token", token)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_an_answer_arriving_in_pieces_is_read_whole(trickling_gmail: str, http) -> None:
    from inboxd.adapters.gmail import AccessTokens, GmailMailbox, GmailSettings

    from .conftest import Ref

    settings = GmailSettings.from_settings(
        {
            "client_id": "c",
            "client_secret": Ref("s"),
            "api_url": trickling_gmail,
            "token_url": trickling_gmail + "/token",
        }
    )
    mailbox = GmailMailbox.from_settings({"refresh_token": Ref("r")}, address=ALICE)
    client = GmailClient(
        settings, mailbox, http, QuotaPacer(), AccessTokens(settings, mailbox, http)
    )
    assert (await client.get_profile()).history_id == "77"


async def test_403_translation(fake, client: GmailClient) -> None:
    """403 is "too much" for the usage-limit reasons (retried) and "forbidden" otherwise."""
    fake.faults.fail_next_calls(1, 403, methods={"users.getProfile"}, reason="rateLimitExceeded")
    await client.get_profile()  # retried after the hold
    fake.faults.fail_next_calls(
        1, 403, methods={"users.getProfile"}, reason="insufficientPermissions"
    )
    with pytest.raises(GmailAuthError, match="insufficientPermissions") as caught:
        await client.get_profile()
    assert family_of(caught.value) is Family.ATTENTION


async def test_per_part_400_is_rejected_for_that_id_only(fake, client: GmailClient) -> None:
    messages = fake.mailbox(ALICE).add_generated(3)
    fake.faults.fail_message(messages[0].id, 400, reason="invalidArgument")
    result = await client.get_raw_batch([m.id for m in messages])
    assert set(result.rejected) == {messages[0].id}
    assert family_of(result.rejected[messages[0].id]) is Family.PERMANENT
    assert set(result.raw) == {m.id for m in messages[1:]}
    assert fake.counters.batch_sizes == [3]  # permanent: not sent again


async def test_waiting_for_a_connection_of_the_shared_bound_is_not_the_calls_deadline(
    fake, http, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The door's mailboxes share a bound on requests in flight (daemon/sync/registry.py);
    a call that waited for its turn longer than its own deadline still gets its answer
    instead of "no answer within 30 s", which would blame Gmail for our queue."""
    monkeypatch.setattr(client_module, "CALL_TIMEOUT_S", 0.5)
    connections = anyio.CapacityLimiter(1)
    client = make_client(fake, http, connections=connections, call_attempts=1)
    answers: list[str] = []

    async def call() -> None:
        answers.append((await client.get_profile()).history_id)

    holder = object()
    await connections.acquire_on_behalf_of(holder)  # another mailbox's call in flight
    async with anyio.create_task_group() as tg:
        tg.start_soon(call)
        await eventually(lambda: connections.statistics().tasks_waiting == 1, 10, what="queued")
        await anyio.sleep(1.0)  # twice the call's deadline, spent waiting for a turn
        connections.release_on_behalf_of(holder)
    assert len(answers) == 1
