"""adapters.esp.fields: only what the provider tests do not already reach.

Tolerance boundaries, non-digit timestamps, bodies that are not JSON objects
and event times are covered per provider (test_sendgrid, test_mailgun,
test_standard_webhooks, test_postmark, test_ses, test_sns); here: timestamp
headers of absurd length, and the caller choosing the exception family.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from multidict import CIMultiDict

from inboxd.adapters.esp.base import MalformedPayload, VerificationFailed
from inboxd.adapters.esp.fields import (
    MAX_ID_CHARS,
    MAX_JSON_DEPTH,
    check_depth,
    check_timestamp,
    optional_str,
    parse_iso_time,
    parse_json_object,
    read_unix_time,
    single_header,
)

NOW = 1_700_000_000
TOLERANCE_S = 300.0


@pytest.mark.parametrize("digits", [13, 400, 5000])
def test_overlong_timestamp_is_refused_without_int_conversion(digits: int) -> None:
    # CPython's int() refuses more than 4,300 digits with ValueError, which would
    # escape as a 500; the length check answers first.
    with pytest.raises(VerificationFailed, match="too new"):
        check_timestamp("9" * digits, NOW, TOLERANCE_S)


def test_leading_zeros_are_the_same_number() -> None:
    check_timestamp("0" * 20 + str(NOW), NOW, TOLERANCE_S)


def test_error_family_is_the_callers_choice() -> None:
    with pytest.raises(VerificationFailed, match=r"^sns: body is not JSON$"):
        parse_json_object(b"{", what="sns: body", error=VerificationFailed)
    with pytest.raises(MalformedPayload, match=r"^body is not a JSON object$"):
        parse_json_object(b"[]")
    with pytest.raises(VerificationFailed, match="Timestamp"):
        parse_iso_time("yesterday", what="Timestamp", error=VerificationFailed)


def test_time_without_offset_is_utc() -> None:
    assert parse_iso_time("2026-11-30T09:00:00") == datetime(2026, 11, 30, 9, tzinfo=UTC)


# -- bounds: what PostgreSQL cannot hold is refused before SQL -------------------------


@pytest.mark.parametrize(
    "text", ["0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00", "1969-12-31T23:59:59Z"]
)
def test_event_times_outside_the_storable_range_are_refused(text: str) -> None:
    with pytest.raises(MalformedPayload, match="out of range"):
        parse_iso_time(text)
    with pytest.raises(VerificationFailed, match="out of range"):
        parse_iso_time(text, error=VerificationFailed)


def test_unix_times_outside_the_range_are_refused() -> None:
    for value in (-1, 253402300799, 1e300):
        with pytest.raises(MalformedPayload):
            read_unix_time(value)
    assert read_unix_time(0) == datetime(1970, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize("value", ["x" * (MAX_ID_CHARS + 1), "a\x00b", "lone \udcff"])
def test_text_that_cannot_be_stored_is_refused(value: str) -> None:
    with pytest.raises(MalformedPayload):
        optional_str({"id": value}, "id", max_chars=MAX_ID_CHARS)
    assert optional_str({"id": "é" * MAX_ID_CHARS}, "id", max_chars=MAX_ID_CHARS)


def test_depth_is_measured_without_recursion() -> None:
    value: object = "leaf"
    for _ in range(MAX_JSON_DEPTH):
        value = [value]
    check_depth(value)
    with pytest.raises(MalformedPayload, match="nested deeper"):
        check_depth({"k": value})
    deep: object = 1
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(MalformedPayload):
        check_depth(deep)


def test_a_repeated_single_header_is_refused() -> None:
    headers = CIMultiDict([("webhook-id", "a"), ("Webhook-Id", "b")])
    with pytest.raises(VerificationFailed, match="more than once"):
        single_header(headers, "webhook-id")
    assert single_header(CIMultiDict([("webhook-id", "a")]), "WEBHOOK-ID") == "a"
    assert single_header({"webhook-id": "a"}, "webhook-id") == "a"
    assert single_header(CIMultiDict(), "webhook-id") is None
