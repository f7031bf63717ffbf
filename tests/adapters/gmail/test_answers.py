"""Readers of Gmail's answers: what the client takes from a messages.get format=raw body."""

from __future__ import annotations

import base64
import json

from inboxd.adapters.gmail.answers import google_error, raw_of

RAW = b"From: a@example.com\r\nSubject: caf\xc3\xa9\r\n\r\nbody\r\n"


def answer(message_id: str = "m1", **extra: object) -> dict[str, object]:
    raw = base64.urlsafe_b64encode(RAW).decode().rstrip("=")  # Gmail may drop the padding
    return {"id": message_id, "threadId": "t1", "raw": raw, **extra}


def test_raw_bytes_of_an_answer() -> None:
    assert raw_of(json.dumps(answer()).encode(), "m1") == RAW


def test_not_the_message_asked_for_or_not_raw() -> None:
    assert raw_of(json.dumps(answer("other")).encode(), "m1") is None
    assert raw_of(b'{"id": "m1", "raw": 12}', "m1") is None
    assert raw_of(b'{"id": "m1", "raw": "not base64 \xe2\x82\xac"}', "m1") is None
    assert raw_of(b"<html>502 Bad Gateway</html>", "m1") is None


def test_json_only_the_standard_library_reads_still_reads() -> None:
    # orjson reads RFC 8259 UTF-8 JSON; UTF-16, a lone surrogate escape or NaN are
    # read as json.loads read them before orjson came in front of it.
    utf16 = json.dumps(answer()).encode("utf-16")
    assert raw_of(utf16, "m1") == RAW
    odd = json.dumps(answer(snippet="\ud800", sizeEstimate=float("nan"))).encode()
    assert raw_of(odd, "m1") == RAW
    assert google_error(b'{"error": {"code": NaN, "message": "m", "status": "S"}}') == ("S", "m")
