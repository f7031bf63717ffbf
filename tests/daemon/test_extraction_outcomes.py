"""What one extraction attempt comes to (daemon/extraction/outcomes.py `attempt`):
an operator's misconfiguration releases the job and pauses the processor; a
result that cannot be stored or a schema that cannot resolve is terminal.

No database: `attempt` maps a backend call onto an outcome; FakeParseApi over HTTP.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import jsonschema
import pytest
from fakes.parse_api import Answer, FakeParseApi

from inboxd.adapters.extraction import HttpBackend, ResultSchema, compile_schema
from inboxd.adapters.extraction.http import UNAUTHORIZED_RETRY_AFTER_S
from inboxd.daemon.extraction.outcomes import Failed, Release, attempt, outcome_of
from inboxd.pipeline.message import MessageData

MESSAGE = MessageData(
    tenant_id="t", mailbox_id="m", external_id="x", raw=b"Subject: hi\r\n\r\nTotal: 12\r\n"
)


@pytest.fixture
async def api() -> AsyncIterator[FakeParseApi]:
    async with FakeParseApi() as server:
        yield server


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


def _backend(api: FakeParseApi, session: aiohttp.ClientSession, schema: object) -> HttpBackend:
    return HttpBackend(
        url=api.url, token="tok", schema=compile_schema(schema), timeout_s=10, session=session
    )


@pytest.mark.parametrize("answer", [Answer(404, b"Not Found"), Answer(401, b"bad token")])
async def test_a_misconfigured_endpoint_releases_the_job_and_pauses(
    api: FakeParseApi, session: aiohttp.ClientSession, answer: Answer
) -> None:
    api.answer = answer
    outcome = await attempt(_backend(api, session, {"type": "object"}), MESSAGE)
    assert isinstance(outcome, Release)
    assert outcome.pause_s == UNAUTHORIZED_RETRY_AFTER_S


async def test_a_proxy_page_is_a_charged_retry_not_needs_review(
    api: FakeParseApi, session: aiohttp.ClientSession
) -> None:
    api.answer = Answer(200, b"<html>maintenance</html>", {"Content-Type": "text/html"})
    outcome = await attempt(_backend(api, session, {"type": "object"}), MESSAGE)
    assert outcome == Failed("endpoint answered 200 with invalid JSON", terminal=False)


async def test_a_schema_that_cannot_resolve_is_terminal_not_an_internal_error(
    api: FakeParseApi, session: aiohttp.ClientSession
) -> None:
    # compile_schema refuses it; one built around it must not cost 8 paid calls a message
    document = {"properties": {"total": {"$ref": "#/$defs/money"}}}
    schema = ResultSchema(document, jsonschema.Draft202012Validator(document))
    backend = HttpBackend(url=api.url, token="tok", schema=schema, timeout_s=10, session=session)
    api.answer = Answer.json(200, {"total": 12})
    outcome = await attempt(backend, MESSAGE)
    assert isinstance(outcome, Failed) and outcome.terminal
    assert outcome.reason.startswith("the schema cannot validate: ")


async def test_an_endpoints_number_json_cannot_carry_is_terminal(
    api: FakeParseApi, session: aiohttp.ClientSession
) -> None:
    # orjson reads 2**64 - 1 as an int; stored, it would fail in orjson.dumps (TypeError)
    api.answer = Answer(200, b'{"total": 18446744073709551615}')
    outcome = await attempt(_backend(api, session, {"type": "object"}), MESSAGE)
    assert outcome == Failed(
        "result cannot be stored: $.total is an integer outside the signed 64-bit range",
        terminal=True,
    )


def test_a_result_orjson_cannot_write_is_terminal_not_an_internal_error() -> None:
    outcome = outcome_of({"total": 2**64})
    assert isinstance(outcome, Failed) and outcome.terminal
    assert outcome.reason.startswith("result cannot be stored as JSON: ")
