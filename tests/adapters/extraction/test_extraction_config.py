"""`[[processors]]` tables: parsing, errors naming the key, and the mail filter."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from inboxd.adapters.extraction import ProcessorConfigError
from inboxd.adapters.extraction.config import (
    DEFAULT_CONCURRENCY,
    ProcessorConfig,
    matches,
    matches_fields,
    parse_processor,
)
from inboxd.pipeline.extraction.inbox import FilterFields
from inboxd.pipeline.message import MessageData

from .conftest import BOOKING, TEXT_ATTACHMENTS

Load = Callable[[str], MessageData]

TENANT_FILE = """
[[processors]]
id = "invoices"
mailboxes = ["billing"]
schema = "schemas/invoice.json"
schema_version = 2
backend = "builtin"
concurrency = 8
[processors.filter]
senders = ["*@EASYHOTEL.com"]
subjects = ["Confirmation of *"]
attachment_types = ["application/pdf"]
[processors.rules]
invoice = { regex = 'Invoice_(?P<value>\\d+)', in = "attachment_names" }

[[processors]]
id = "remote"
schema = { type = "object", properties = { total = { type = "number" } } }
schema_version = 1
backend = "http"
url = "https://parse.example/v1/extract"
token = "env:PARSER_TOKEN"
schema_id = "inv"
timeout_s = 12
"""
INVOICE_SCHEMA = {
    "type": "object",
    "properties": {"invoice": {"type": "string"}},
    "additionalProperties": False,
}


def _processors(tmp_path: Path) -> list[ProcessorConfig]:
    (tmp_path / "schemas").mkdir(exist_ok=True)
    (tmp_path / "schemas" / "invoice.json").write_text(json.dumps(INVOICE_SCHEMA), "utf-8")
    tables = tomllib.loads(TENANT_FILE)["processors"]
    return [parse_processor(table, tmp_path) for table in tables]


def test_a_tenant_files_processors_parse(tmp_path: Path) -> None:
    builtin, http = _processors(tmp_path)
    assert (builtin.id, builtin.backend, builtin.schema_version) == ("invoices", "builtin", 2)
    assert builtin.mailboxes == ("billing",) and builtin.concurrency == 8
    assert builtin.schema.schema == INVOICE_SCHEMA
    assert list(builtin.rules) == ["invoice"]
    assert builtin.filter.senders == ("*@easyhotel.com",)
    assert (http.url, http.token, http.schema_id, http.timeout_s) == (
        "https://parse.example/v1/extract",
        "env:PARSER_TOKEN",
        "inv",
        12.0,
    )
    assert http.mailboxes is None and http.concurrency == DEFAULT_CONCURRENCY
    assert http.rules == {}


def test_the_filter_globs_match_a_corpus_message(tmp_path: Path, corpus_message: Load) -> None:
    builtin, http = _processors(tmp_path)
    booking = corpus_message(BOOKING)
    assert matches(builtin, booking, "billing")
    assert not matches(builtin, booking, "sales"), "another mailbox"
    assert not matches(builtin, corpus_message(TEXT_ATTACHMENTS), "billing"), "sender, subject"
    assert matches(http, corpus_message(TEXT_ATTACHMENTS), "any"), "no filter: everything"


@pytest.mark.parametrize(
    ("mailbox_ids", "taken"),
    [(("gm", "billing"), True), (("billing",), True), (("gm", "sales"), False)],
)
def test_a_stored_message_is_taken_for_a_copy_in_any_listed_mailbox(
    tmp_path: Path, mailbox_ids: tuple[str, ...], taken: bool
) -> None:
    fields = FilterFields(
        tenant_id="t",
        message_id=1,
        mailbox_ids=mailbox_ids,  # the primary copy's first: here a Gmail mailbox's
        sender="bookings@easyhotel.com",
        recipients=("deepak@example.com",),
        subject="Confirmation of your booking",
        attachment_types=("application/pdf",),
    )
    invoices, _ = _processors(tmp_path)  # mailboxes = ["billing"]
    assert matches_fields(invoices, fields) is taken


@pytest.mark.parametrize(
    ("filter_", "taken"),
    [
        ({"recipients": ["deepak.*@gmail.com"]}, True),
        ({"recipients": ["*@example.com"]}, False),
        ({"senders": ["*@example.com", "bookings@*"]}, True),
        ({"subjects": ["*booking*"]}, True),
        ({"subjects": ["booking"]}, False),
        ({"attachment_types": ["image/*"]}, False),
        ({"attachment_types": ["application/*"], "senders": ["nobody@*"]}, False),
    ],
)
def test_lists_are_any_of_and_all_lists_must_match(
    corpus_message: Load, filter_: dict[str, list[str]], taken: bool
) -> None:
    table = {
        "id": "p",
        "schema": {},
        "schema_version": 1,
        "backend": "builtin",
        "rules": {"n": {"attachment": "count"}},
        "filter": filter_,
    }
    assert matches(parse_processor(table, Path()), corpus_message(BOOKING), "m") is taken


def _base(**overrides: Any) -> dict[str, Any]:
    table: dict[str, Any] = {
        "id": "p",
        "schema": {"type": "object"},
        "schema_version": 1,
        "backend": "http",
        "url": "https://parse.example/x",
        "token": "file:/run/secrets/parser",
    }
    return {k: v for k, v in (table | overrides).items() if v is not None}


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"schema": {}}, "processor: `id` must be a non-empty string"),
        (_base(backend="ml"), "processor 'p': `backend` must be one of builtin, http"),
        (_base(colour="red"), "`colour`: unknown key"),
        (_base(rules={"a": {"header": "X"}}), "`rules` is only for backend = 'builtin'"),
        (_base(schema=None), "`schema` is required"),
        (_base(schema={"type": "money"}), r"`schema` is not a valid JSON Schema at \$.type"),
        (_base(schema="missing.json"), "`schema`: cannot read"),
        (_base(schema_version=0), "`schema_version` must be an integer ≥ 1"),
        (_base(schema_version="v2"), "`schema_version` must be an integer"),
        (_base(schema_version=True), "`schema_version` must be an integer"),
        (_base(concurrency=65), r"`concurrency` must be an integer 1\.\.64"),
        (_base(concurrency=0), "`concurrency` must be an integer"),
        (_base(mailboxes=[]), "`mailboxes` must be a non-empty list"),
        (_base(filter={"senders": "a@b"}), "`filter.senders` must be a list of glob patterns"),
        (_base(filter={"domains": ["x"]}), "`filter.domains`: unknown key"),
        (_base(url="ftp://x/y"), "`url` must be an http:// or https:// URL"),
        (_base(url=None), "`url` must be"),
        (_base(url="http://:80/x"), "`url` is not a valid URL: .*host is required"),
        (_base(url="http:///x"), "`url` must be an http:// or https:// URL with a host"),
        (_base(url="http://h:99999/x"), "`url` is not a valid URL: Port out of range"),
        (_base(url="http://h:0/x"), "`url` has an invalid host or port"),
        (_base(url="http://h p/x"), "`url` has an invalid host or port"),
        (_base(url="http://[::x]/p"), "`url` has an invalid host or port"),
        (_base(url="http://h/a b"), "`url` must not contain spaces"),
        (_base(url="http://user:pw@h/x"), "`url` must not hold a user or password: .*`token`"),
        (_base(url="https://tok@h/x"), "`url` must not hold a user or password"),
        (_base(token="sk-live-abcdef"), "`token` must be a secret reference"),
        (_base(token="env:"), "`token` must be a secret reference"),
        (_base(schema_id=""), "`schema_id` must be a non-empty string"),
        (_base(timeout_s=0), r"`timeout_s` must be a number of seconds in \(0, 300\]"),
        (_base(timeout_s=301), "`timeout_s` must be"),
        (_base(backend="builtin", url=None, token=None), "`rules` must be a table"),
        (
            _base(
                backend="builtin",
                url=None,
                token=None,
                rules={"a": {"header": "X"}},
                schema={"type": "object", "additionalProperties": False},
            ),
            "`rules.a`: the schema allows no property 'a'",
        ),
    ],
)
def test_bad_tables_name_the_processor_and_key(table: dict[str, Any], message: str) -> None:
    with pytest.raises(ProcessorConfigError, match=message):
        parse_processor(table, Path("/nonexistent"))


@pytest.mark.parametrize(
    "url", ["https://parse.example:8443/v1", "http://[::1]:8080/p", "http://127.0.0.1/x"]
)
def test_good_urls_pass(url: str) -> None:
    assert parse_processor(_base(url=url), Path()).url == url


def test_a_password_in_the_url_is_not_echoed() -> None:
    with pytest.raises(ProcessorConfigError) as caught:
        parse_processor(_base(url="https://ap:hunter2@parse.example/x"), Path())
    assert "hunter2" not in str(caught.value)


def test_a_pasted_token_is_not_echoed() -> None:
    with pytest.raises(ProcessorConfigError) as caught:
        parse_processor(_base(token="sk-live-abcdef"), Path())
    assert "sk-live" not in str(caught.value)
