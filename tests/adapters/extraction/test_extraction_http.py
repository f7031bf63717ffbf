"""The http backend against FakeParseApi: request shape and what each answer means."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import aiohttp
import pytest
from fakes.parse_api import Answer, FakeParseApi

from inboxd.adapters.extraction import (
    ExtractionMisconfigured,
    ExtractionRetryable,
    ExtractionTerminal,
    ExtractionUnauthorized,
    HttpBackend,
    compile_schema,
)
from inboxd.adapters.extraction.http import UNAUTHORIZED_RETRY_AFTER_S, retry_after_s
from inboxd.pipeline.extraction.claims import RETRY_AFTER_MAX_S
from inboxd.pipeline.message import MessageData

from .conftest import BOOKING

TOKEN = "tok-3f9a"
SCHEMA = compile_schema(
    {
        "type": "object",
        "properties": {"invoice": {"type": "string"}, "total": {"type": "number"}},
        "required": ["invoice", "total"],
    }
)
#: Deadline of the slow-endpoint test, seconds: short, since it is waited out.
SHORT_TIMEOUT_S = 0.3
Load = Callable[[str], MessageData]


@pytest.fixture
async def api() -> AsyncIterator[FakeParseApi]:
    async with FakeParseApi() as server:
        yield server


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


@pytest.fixture
def backend(api: FakeParseApi, session: aiohttp.ClientSession) -> HttpBackend:
    return HttpBackend(url=api.url, token=TOKEN, schema=SCHEMA, timeout_s=10, session=session)


@pytest.fixture
def booking(corpus_message: Load) -> MessageData:
    return corpus_message(BOOKING)


async def test_a_valid_result_and_what_the_endpoint_received(
    api: FakeParseApi, backend: HttpBackend, booking: MessageData
) -> None:
    api.answer = Answer.json(200, {"invoice": "302232133150612", "total": 89.5})
    assert await backend.extract(booking) == {"invoice": "302232133150612", "total": 89.5}
    [received] = api.received
    assert received.authorization == f"Bearer {TOKEN}"
    assert received.raw_mime == booking.raw
    assert received.document["schema"] == SCHEMA.schema
    assert "schema_id" not in received.document


async def test_a_schema_id_is_sent_instead_of_the_schema(
    api: FakeParseApi, session: aiohttp.ClientSession, booking: MessageData
) -> None:
    api.answer = Answer.json(201, {"invoice": "A", "total": 1})
    backend = HttpBackend(
        url=api.url, token=TOKEN, schema=SCHEMA, timeout_s=10, session=session, schema_id="inv-v2"
    )
    assert await backend.extract(booking) == {"invoice": "A", "total": 1}
    assert set(api.received[0].document) == {"raw_mime", "schema_id"}
    assert api.received[0].document["schema_id"] == "inv-v2"
    assert TOKEN not in repr(backend)


async def test_a_slow_endpoint_is_a_retryable_timeout(
    api: FakeParseApi, session: aiohttp.ClientSession, booking: MessageData
) -> None:
    api.hold = True
    backend = HttpBackend(
        url=api.url, token=TOKEN, schema=SCHEMA, timeout_s=SHORT_TIMEOUT_S, session=session
    )
    with pytest.raises(ExtractionRetryable) as caught:
        await backend.extract(booking)
    assert caught.value.reason == f"endpoint timed out after {SHORT_TIMEOUT_S:g} s"
    assert caught.value.retry_after_s is None
    assert len(api.received) == 1, "one call is one attempt"


async def test_429_with_retry_after_seconds(
    api: FakeParseApi, backend: HttpBackend, booking: MessageData
) -> None:
    api.answer = Answer.json(429, {"error": "slow down"}, **{"Retry-After": "17"})
    with pytest.raises(ExtractionRetryable) as caught:
        await backend.extract(booking)
    assert caught.value.reason == "endpoint answered 429"
    assert caught.value.retry_after_s == 17.0
    assert len(api.received) == 1


async def test_429_with_retry_after_as_an_http_date(
    api: FakeParseApi, backend: HttpBackend, booking: MessageData
) -> None:
    when = datetime.now(UTC) + timedelta(seconds=120)
    api.answer = Answer(429, b"", {"Retry-After": format_datetime(when, usegmt=True)})
    with pytest.raises(ExtractionRetryable) as caught:
        await backend.extract(booking)
    assert caught.value.retry_after_s is not None
    assert 100 < caught.value.retry_after_s <= 120  # the date has whole seconds


@pytest.mark.parametrize("status", [500, 502, 503, 504, 408])
async def test_server_errors_are_retryable(
    api: FakeParseApi, backend: HttpBackend, booking: MessageData, status: int
) -> None:
    api.answer = Answer(status, b"<html>Service Unavailable</html>")
    with pytest.raises(ExtractionRetryable) as caught:
        await backend.extract(booking)
    assert not isinstance(caught.value, ExtractionUnauthorized)
    assert caught.value.reason == f"endpoint answered {status}"
    assert caught.value.retry_after_s is None


async def test_503_honours_retry_after(
    api: FakeParseApi, backend: HttpBackend, booking: MessageData
) -> None:
    api.answer = Answer(503, b"", {"Retry-After": "5"})
    with pytest.raises(ExtractionRetryable) as caught:
        await backend.extract(booking)
    assert caught.value.retry_after_s == 5.0


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (Answer(200, b"{not json"), "endpoint answered 200 with invalid JSON"),
        (Answer(200, b"<html>Sign in to the proxy</html>"), "endpoint answered 200 with invalid"),
        (Answer(204, b""), "endpoint answered 204 with invalid JSON"),
        (Answer.json(200, [1, 2]), "endpoint answered 200 with JSON list, not an object"),
    ],
)
async def test_a_2xx_that_is_not_a_json_object_is_retryable(
    api: FakeParseApi, backend: HttpBackend, booking: MessageData, answer: Answer, reason: str
) -> None:
    # a proxy's page is not the mail's fault: charged like a 5xx, not needs_review at once
    api.answer = answer
    with pytest.raises(ExtractionRetryable) as caught:
        await backend.extract(booking)
    assert not isinstance(caught.value, ExtractionMisconfigured)
    assert caught.value.reason.startswith(reason)


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (
            Answer.json(200, {"invoice": "A", "total": "12,50"}),
            "result does not validate at $.total: '12,50' is not of type 'number'",
        ),
        (
            Answer.json(200, {"invoice": "A"}),
            "result does not validate at $: 'total' is a required",
        ),
    ],
)
async def test_a_bad_2xx_answer_is_terminal(
    api: FakeParseApi, backend: HttpBackend, booking: MessageData, answer: Answer, reason: str
) -> None:
    api.answer = answer
    with pytest.raises(ExtractionTerminal) as caught:
        await backend.extract(booking)
    assert caught.value.reason.startswith(reason)


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (
            Answer.json(422, {"message": "attachment\nInvoice.pdf is encrypted"}),
            "endpoint answered 422: attachment Invoice.pdf is encrypted",
        ),
        (
            Answer.json(422, {"detail": [{"loc": ["body", "schema"], "msg": "unknown keyword"}]}),
            "endpoint answered 422: body.schema: unknown keyword",
        ),
        (
            Answer.json(400, {"type": "about:blank", "title": "Bad Request"}),
            "endpoint answered 400: Bad Request",
        ),
        (Answer(413, b"too large"), "endpoint answered 413: too large"),
    ],
)
async def test_a_validation_error_is_terminal_with_the_servers_message(
    api: FakeParseApi, backend: HttpBackend, booking: MessageData, answer: Answer, reason: str
) -> None:
    api.answer = answer
    with pytest.raises(ExtractionTerminal) as caught:
        await backend.extract(booking)
    assert caught.value.reason == reason


async def test_a_long_server_message_is_cut_to_one_line(
    api: FakeParseApi, backend: HttpBackend, booking: MessageData
) -> None:
    api.answer = Answer.json(422, {"error": {"message": "bad\r\n" * 500}})
    with pytest.raises(ExtractionTerminal) as caught:
        await backend.extract(booking)
    reason = caught.value.reason
    assert reason.startswith("endpoint answered 422: bad bad")
    assert "\n" not in reason and len(reason) < 240


@pytest.mark.parametrize("status", [401, 403])
async def test_a_refused_token_is_retryable_with_a_long_wait(
    api: FakeParseApi, backend: HttpBackend, booking: MessageData, status: int
) -> None:
    api.answer = Answer.json(status, {"error": "invalid_token"})
    with pytest.raises(ExtractionUnauthorized) as caught:
        await backend.extract(booking)
    assert caught.value.retry_after_s == UNAUTHORIZED_RETRY_AFTER_S
    assert TOKEN not in caught.value.reason
    assert caught.value.reason == f"endpoint refused the token ({status}): invalid_token"


@pytest.mark.parametrize(
    ("retry_after", "wait_s"),
    [
        ("1200", 1200.0),
        ("99999999", RETRY_AFTER_MAX_S),
        ("Fri, 31 Dec 9999 23:59:59 GMT", RETRY_AFTER_MAX_S),
    ],
)
async def test_a_refused_tokens_retry_after_is_honoured_up_to_the_cap(
    api: FakeParseApi, backend: HttpBackend, booking: MessageData, retry_after: str, wait_s: float
) -> None:
    api.answer = Answer.json(401, {"error": "invalid_token"}, **{"Retry-After": retry_after})
    with pytest.raises(ExtractionUnauthorized) as caught:
        await backend.extract(booking)
    assert caught.value.retry_after_s == wait_s


async def test_a_wrong_url_pauses_like_a_refused_token(
    api: FakeParseApi, session: aiohttp.ClientSession, booking: MessageData
) -> None:
    backend = HttpBackend(
        url=api.url + "/nope", token=TOKEN, schema=SCHEMA, timeout_s=10, session=session
    )
    with pytest.raises(ExtractionMisconfigured, match="endpoint answered 404, check the") as caught:
        await backend.extract(booking)
    assert caught.value.retry_after_s == UNAUTHORIZED_RETRY_AFTER_S
    assert api.received == []


@pytest.mark.parametrize(
    "answer",
    [Answer(405, b"Method Not Allowed"), Answer(302, b"", {"Location": "https://elsewhere/"})],
)
async def test_a_redirect_or_a_refused_method_pauses_too(
    api: FakeParseApi, backend: HttpBackend, booking: MessageData, answer: Answer
) -> None:
    api.answer = answer
    with pytest.raises(ExtractionMisconfigured) as caught:
        await backend.extract(booking)
    assert caught.value.reason.startswith(f"endpoint answered {answer.status}, check the")
    assert caught.value.retry_after_s == UNAUTHORIZED_RETRY_AFTER_S


async def test_a_closed_port_is_retryable(
    session: aiohttp.ClientSession, booking: MessageData
) -> None:
    async with FakeParseApi() as gone:
        url = gone.url
    backend = HttpBackend(url=url, token=TOKEN, schema=SCHEMA, timeout_s=10, session=session)
    with pytest.raises(ExtractionRetryable, match="endpoint unreachable: Client"):
        await backend.extract(booking)


async def test_a_message_without_raw_bytes_is_terminal(backend: HttpBackend) -> None:
    message = MessageData(tenant_id="t", mailbox_id="m", external_id="x")
    with pytest.raises(ExtractionTerminal, match="no raw MIME"):
        await backend.extract(message)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (None, None),
        ("120", 120.0),
        (" 0 ", 0.0),
        ("Wed, 21 Oct 2015 07:28:30 GMT", 30.0),
        ("Wed, 21 Oct 2015 07:27:00 GMT", 0.0),
        ("soon", None),
        ("-5", None),
    ],
)
def test_retry_after_is_seconds_or_an_http_date(value: str | None, seconds: Any) -> None:
    now = datetime(2015, 10, 21, 7, 28, 0, tzinfo=UTC)
    assert retry_after_s(value, now) == seconds
