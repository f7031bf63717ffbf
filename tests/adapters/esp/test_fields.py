"""adapters.esp.fields: only what the provider tests do not already reach.

Tolerance boundaries, non-digit timestamps, bodies that are not JSON objects
and event times are covered per provider (test_sendgrid, test_mailgun,
test_standard_webhooks, test_postmark, test_ses, test_sns); here: timestamp
headers of absurd length, and the caller choosing the exception family.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from inboxd.adapters.esp.base import MalformedPayload, VerificationFailed
from inboxd.adapters.esp.fields import check_timestamp, parse_iso_time, parse_json_object

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
