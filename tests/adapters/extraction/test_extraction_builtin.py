"""The builtin backend: per-field rules over corpus messages, validated by the schema."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import anyio
import pytest

import inboxd.adapters.extraction.builtin as builtin_module
from inboxd.adapters.extraction import (
    BuiltinBackend,
    ExtractionTerminal,
    ProcessorConfigError,
    compile_schema,
    extract_fields,
    parse_rules,
)
from inboxd.pipeline.message import Address, AttachmentData, MessageData

from .conftest import BOOKING, SURVEY, TEXT_ATTACHMENTS

Load = Callable[[str], MessageData]
OPEN_SCHEMA = compile_schema({"type": "object"})


def _fields(message: MessageData, rules: dict[str, Any]) -> dict[str, Any]:
    return extract_fields(message, parse_rules(rules))


async def test_a_booking_confirmation_gives_its_invoice(corpus_message: Load) -> None:
    schema = compile_schema(
        {
            "type": "object",
            "properties": {
                "invoice": {"type": "integer"},
                "subject": {"type": "string"},
                "vendor": {"type": "string"},
                "vendor_name": {"type": "string"},
                "customer": {"type": "array", "items": {"type": "string", "format": "email"}},
                "files": {"type": "array"},
                "types": {"type": "array", "contains": {"const": "application/pdf"}},
                "count": {"type": "integer", "minimum": 1},
                "mailer": {"type": "string"},
                "review_url": {"type": "string"},
            },
            "required": ["invoice", "vendor", "count"],
            "additionalProperties": False,
        }
    )
    rules = parse_rules(
        {
            "invoice": {
                "regex": r"Invoice_(?P<value>\d+)\.pdf",
                "in": "attachment_names",
                "type": "integer",
            },
            "subject": {"header": "Subject"},
            "vendor": {"address": "from.domain"},
            "vendor_name": {"address": "from.name"},
            "customer": {"address": "to.emails"},
            "files": {"attachment": "names"},
            "types": {"attachment": "types"},
            "count": {"attachment": "count"},
            "mailer": {"header": "x-mailer"},
            "review_url": {"regex": r"booking details here:\s*(?P<value>\S+)"},
        }
    )
    result = await BuiltinBackend(rules, schema).extract(corpus_message(BOOKING))
    assert result == {
        "invoice": 302232133150612,
        "subject": "Confirmation of Booking with easyHotel",
        "vendor": "easyhotel.com",
        "vendor_name": "easyHotel Booking",
        "customer": ["deepak.prabhakara@gmail.com"],
        "files": ["Invoice_302232133150612.pdf"],
        "types": ["application/pdf"],
        "count": 1,
        "mailer": "Microsoft CDO for Windows 2000",
        "review_url": "https://bookings.easyHotel.com/AccClient/MyInformation-MyBookings.asp",
    }
    assert list(result) == list(rules), "fields come in rule order"


async def test_a_required_field_the_mail_lacks_is_terminal(corpus_message: Load) -> None:
    schema = compile_schema(
        {"type": "object", "properties": {"total": {"type": "number"}}, "required": ["total"]}
    )
    rules = parse_rules({"total": {"regex": r"Total: (?P<value>[\d.,]+)", "type": "number"}})
    backend = BuiltinBackend(rules, schema)
    with pytest.raises(ExtractionTerminal, match=r"at \$: 'total' is a required property"):
        await backend.extract(corpus_message(BOOKING))


def test_a_rule_that_finds_nothing_leaves_its_field_out(corpus_message: Load) -> None:
    result = _fields(
        corpus_message(BOOKING),
        {
            "missing_header": {"header": "X-Not-There"},
            "no_match": {"regex": r"Total (?P<value>\d+)"},
            "no_html": {"regex": r"(?P<value>.+)", "in": "html_text"},
            "no_text_attachment": {"regex": r"(?P<value>.+)", "in": "attachments"},
            "empty_group": {"regex": r"Thank you(?P<value>\s*)for"},
            "count": {"attachment": "count"},
        },
    )
    assert result == {"count": 1}


def test_html_text_and_text_attachments_are_searched(corpus_message: Load) -> None:
    message = corpus_message(TEXT_ATTACHMENTS)
    result = _fields(
        message,
        {
            "heading": {
                "regex": r"(?P<value>Testing MIME E-mail composing with cid)",
                "in": "html_text",
            },
            "style": {"regex": r"(?P<value>font-family)", "in": "html_text"},
            "lorem": {"regex": r"(?P<value>consectetur \w+)", "in": "attachments"},
            "images": {"attachment": "types"},
        },
    )
    assert result == {
        "heading": "Testing MIME E-mail composing with cid",
        "lorem": "consectetur adipiscing",
        "images": ["image/gif", "image/gif", "text/plain"],
    }, "the HTML's style sheet is not visible text"


def test_the_subject_and_case_insensitive_patterns(corpus_message: Load) -> None:
    result = _fields(
        corpus_message(SURVEY),
        {
            "survey": {"regex": r"waiting! (?P<value>\d+)", "in": "subject", "type": "integer"},
            "site": {"regex": r"(?i)(?P<value>mysurvey\.COM)", "in": "subject"},
            "greeting": {"regex": r"(?P<value>hello \w+)", "in": "html_text"},
        },
    )
    assert result == {"survey": 91123105, "site": "MySurvey.com", "greeting": "hello world"}


def _message(**overrides: Any) -> MessageData:
    fields: dict[str, Any] = {"tenant_id": "t", "mailbox_id": "m", "external_id": "x"}
    return MessageData(**(fields | overrides))


@pytest.mark.parametrize(
    ("text", "rule", "value"),
    [
        ("Total: 1,234.50 EUR", {"type": "number"}, 1234.5),
        ("Total: 1.234,50 EUR", {"type": "number", "decimal": ","}, 1234.5),
        ("Total: 1 234,50 EUR", {"type": "number", "decimal": ","}, 1234.5),
        ("Total: 1'234.5 CHF", {"type": "number"}, 1234.5),
        ("Total: -12 EUR", {"type": "integer"}, -12),
        ("Total: 1,234 EUR", {"type": "integer"}, 1234),
        (f"Total: {2**63 - 1} EUR", {"type": "integer"}, 2**63 - 1),
        (f"Total: {-(2**63)} EUR", {"type": "integer"}, -(2**63)),
        (f"Total: 000{2**63 - 1} EUR", {"type": "integer"}, 2**63 - 1),
        ("Total: " + "9" * 300 + " EUR", {"type": "number"}, float("9" * 300)),
        ("Total: 007 EUR", {}, "007"),
    ],
)
def test_values_convert_to_the_rules_type(text: str, rule: dict[str, str], value: object) -> None:
    rules = {"total": {"regex": r"Total: (?P<value>[-\d,.' ]+?) [A-Z]{3}"} | rule}
    result = _fields(_message(text=text), rules)
    assert result == {"total": value}
    assert type(result["total"]) is type(value)


@pytest.mark.parametrize(
    ("text", "value_type", "reason"),
    [
        ("Total: 12.5.1 EUR", "number", "field total: '12.5.1' is not a number"),
        ("Total: 12.5 EUR", "integer", "field total: '12.5' is not an integer"),
        (f"Total: {2**63}", "integer", "field total: '9223372036854775808' is outside the"),
        (f"Total: {2**64}", "integer", "field total: '18446744073709551616' is outside the"),
        (f"Total: {-(2**63) - 1}", "integer", "field total: '-9223372036854775809' is outside"),
        ("Total: " + "1" * 5000, "integer", "field total: '11111"),  # int() refuses > 4300
        ("Total: " + "9" * 400, "number", "field total: '99999"),
    ],
)
def test_a_value_that_does_not_convert_is_terminal(text: str, value_type: str, reason: str) -> None:
    rules = {"total": {"regex": r"Total: (?P<value>\S+)", "type": value_type}}
    with pytest.raises(ExtractionTerminal) as caught:
        _fields(_message(text=text), rules)
    assert caught.value.reason.startswith(reason)


@pytest.mark.parametrize(
    ("value_type", "digits", "reason"),
    [
        ("integer", "1" * 25, "is outside the signed 64-bit integer range"),
        ("number", "9" * 400, "is too large for a JSON number"),
    ],
)
async def test_a_number_json_cannot_carry_is_terminal_with_its_reason(
    value_type: str, digits: str, reason: str
) -> None:
    backend = BuiltinBackend(
        parse_rules({"total": {"regex": r"Total: (?P<value>\d+)", "type": value_type}}),
        compile_schema({"type": "object", "properties": {"total": {"type": "number"}}}),
    )
    with pytest.raises(ExtractionTerminal) as caught:
        await backend.extract(_message(text=f"Total: {digits}"))
    assert caught.value.reason.startswith("field total: ")
    assert caught.value.reason.endswith(reason)


def test_text_attachments_decode_with_their_charset_and_never_crash() -> None:
    attachments = [
        AttachmentData("a.pdf", "application/pdf", 4, content=b"%PDF"),
        AttachmentData("lazy.txt", "text/plain", 10, provider_ref="ref"),  # no bytes at hand
        AttachmentData("bad.txt", "text/plain", 3, content=b"\xff\xfe\x00"),
        AttachmentData(
            "l1.txt", "text/plain; charset=iso-8859-1", 12, content="Réf: ÄB-12".encode("latin-1")
        ),
        AttachmentData("k.txt", "text/plain; charset=x-bogus", 6, content=b"Nr: 7"),
        AttachmentData(
            "p.html", "text/html", 20, content=b"<p>Code <b>Z9</b></p><style>Nr: 1</style>"
        ),
    ]
    message = _message(attachments=attachments)
    result = _fields(
        message,
        {
            "ref": {"regex": r"Réf: (?P<value>\S+)", "in": "attachments"},
            "nr": {"regex": r"Nr: (?P<value>\d)", "in": "attachments", "type": "integer"},
            "code": {"regex": r"Code\s+(?P<value>\w+)", "in": "attachments"},
            "names": {"attachment": "names"},
        },
    )
    assert result == {
        "ref": "ÄB-12",
        "nr": 7,
        "code": "Z9",
        "names": ["a.pdf", "lazy.txt", "bad.txt", "l1.txt", "k.txt", "p.html"],
    }


def test_headers_without_raw_bytes_come_from_the_parsed_fields() -> None:
    message = _message(
        subject="Invoice INV-7",
        from_=Address("billing@example.com", "Billing"),
        internet_message_id="<a@b>",
    )
    result = _fields(
        message,
        {
            "subject": {"header": "subject"},
            "from": {"header": "From"},
            "mid": {"header": "Message-ID"},
            "other": {"header": "X-Mailer"},
            "to": {"address": "to.emails"},
        },
    )
    assert result == {
        "subject": "Invoice INV-7",
        "from": "Billing <billing@example.com>",
        "mid": "<a@b>",
    }


async def test_the_same_message_gives_the_same_result(corpus_message: Load) -> None:
    rules = parse_rules(
        {"url": {"regex": r"(?P<value>https?://\S+)"}, "n": {"attachment": "count"}}
    )
    backend = BuiltinBackend(rules, OPEN_SCHEMA)
    first = await backend.extract(corpus_message(BOOKING))
    assert first == await backend.extract(corpus_message(BOOKING))
    assert first["url"] == "https://bookings.easyHotel.com/AccClient/MyInformation-MyBookings.asp"


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        ({}, "`rules` must be a table"),
        ({"a": "Subject"}, "`rules.a` must be a table"),
        ({"a": {}}, "`rules.a` needs exactly one of header, regex"),
        ({"a": {"header": "X", "regex": "(?P<value>x)"}}, "`rules.a` needs exactly one"),
        ({"a": {"header": ""}}, "`rules.a.header` must be a non-empty string"),
        ({"a": {"header": "X", "in": "text"}}, "`rules.a.in`: unknown key for a header rule"),
        ({"a": {"regex": "x("}}, "`rules.a.regex` does not compile"),
        ({"a": {"regex": "(?P<total>x)"}}, r"`rules.a.regex` needs a named group \(\?P<value>"),
        (
            {"a": {"regex": "(?P<value>x)", "in": "body"}},
            "`rules.a.in` must be one of text, html_text",
        ),
        ({"a": {"regex": "(?P<value>x)", "type": "float"}}, "`rules.a.type` must be one of"),
        ({"a": {"regex": "(?P<value>x)", "decimal": ";"}}, "`rules.a.decimal` must be one of"),
        ({"a": {"attachment": "sizes"}}, "`rules.a.attachment` must be one of names, types, count"),
        ({"a": {"attachment": "count", "type": "integer"}}, "`rules.a.type`: unknown key"),
        ({"a": {"address": "cc.emails"}}, "`rules.a.address` must be one of"),
    ],
)
def test_bad_rules_name_their_key(rules: dict[str, Any], message: str) -> None:
    with pytest.raises(ProcessorConfigError, match=message):
        parse_rules(rules)


#: A pattern the `regex` module backtracks on exponentially: over "a" * 40 it does
#: not finish within any test's patience.
BACKTRACKING = r"(?P<value>(a|a)+)b"
#: Rule timeout of the tests that run into it, seconds (short: it is waited out).
SHORT_RULE_TIMEOUT_S = 0.05
#: Longest a test waits for the event loop to run a task beside a rule, seconds.
LOOP_DEADLINE_S = 10.0


async def test_a_rule_that_backtracks_is_terminal_after_its_timeout() -> None:
    backend = BuiltinBackend(
        parse_rules({"total": {"regex": BACKTRACKING, "in": "subject"}}),
        OPEN_SCHEMA,
        rule_timeout_s=SHORT_RULE_TIMEOUT_S,
    )
    with pytest.raises(ExtractionTerminal) as caught:
        await backend.extract(_message(subject="a" * 40))
    assert caught.value.reason == (
        "field total: the regex rule over subject took over 0.05 s"
        " (a pattern that backtracks on this mail)"
    )


async def test_the_reviewed_quadratic_pattern_over_a_mebibyte_of_digits_is_quick() -> None:
    # with `re`, hours on the event loop; the default limit is not even approached
    backend = BuiltinBackend(
        parse_rules({"total": {"regex": r"(?P<value>\d+)\s*EUR", "type": "integer"}}),
        OPEN_SCHEMA,
    )
    assert await backend.extract(_message(text="1" * (1 << 20))) == {}


async def test_rules_run_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    # The rule blocks until a task on the event loop sets `loop_ran`: were the rules
    # run on the loop, that task could not run and the wait would time out.
    loop_ran = threading.Event()

    def blocking_html_to_text(html: str | None) -> str:
        assert loop_ran.wait(LOOP_DEADLINE_S), "the event loop did not run beside the rule"
        return "Total: 12"

    monkeypatch.setattr(builtin_module, "html_to_text", blocking_html_to_text)
    backend = BuiltinBackend(
        parse_rules({"total": {"regex": r"Total: (?P<value>\d+)", "in": "html_text"}}),
        OPEN_SCHEMA,
    )
    result: dict[str, Any] = {}

    async def extract() -> None:
        result.update(await backend.extract(_message(html="<p>Total: 12</p>")))

    async with anyio.create_task_group() as tg:
        tg.start_soon(extract)
        await anyio.lowlevel.checkpoint()
        loop_ran.set()
    assert result == {"total": "12"}


def test_patterns_are_those_of_the_regex_module() -> None:
    rules = parse_rules({"name": {"regex": r"Dear (?P<value>\p{Lu}\p{Ll}+)"}})
    assert extract_fields(_message(text="Dear Łucja,"), rules) == {"name": "Łucja"}
