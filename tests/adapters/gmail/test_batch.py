"""The batch codec: requests as the batch guide shapes them, answers read back by Content-ID.

Round trips go through the fake Gmail's own multipart code (tests/fakes/gmail/batch.py),
an independent reading of the same guide, so one side's mistake is not mirrored by the
other; hand-written answers cover what Google sends that the fake does not.
"""

from __future__ import annotations

import json

import pytest
from multidict import CIMultiDict

from inboxd.adapters.gmail.batch import (
    MAX_BATCH_CALLS,
    BatchCall,
    BatchFormatError,
    decode_batch,
    encode_batch,
)
from inboxd.adapters.gmail.errors import GmailUnavailable

from .conftest import needs_fake

BINARY = bytes(range(256)) + b"\r\n--not-a-delimiter\r\n" + "Grüße".encode("latin-1")


def calls(n: int) -> list[BatchCall]:
    return [BatchCall(f"m{i}", f"/gmail/v1/users/me/messages/id{i}?format=raw") for i in range(n)]


def test_encode_shape() -> None:
    content_type, body = encode_batch(calls(3), boundary="b0undary")
    assert content_type == "multipart/mixed; boundary=b0undary"
    assert body.startswith(b"--b0undary\r\nContent-Type: application/http\r\nContent-ID: <m0>\r\n")
    assert body.count(b"\r\n--b0undary\r\n") == 2
    assert body.endswith(b"\r\n--b0undary--\r\n")
    assert b"GET /gmail/v1/users/me/messages/id2?format=raw HTTP/1.1\r\n" in body


def test_encode_picks_a_fresh_boundary() -> None:
    first, _ = encode_batch(calls(1))
    second, _ = encode_batch(calls(1))
    assert first != second


@pytest.mark.parametrize(
    "bad",
    [
        [],
        calls(MAX_BATCH_CALLS + 1),
        [BatchCall("a", "/x"), BatchCall("a", "/y")],
        [BatchCall("a>\r\nX-Injected: 1", "/x")],
        [BatchCall("a", "/x HTTP/1.1\r\nHost: evil")],
        [BatchCall("a", "relative/path")],
    ],
)
def test_encode_refuses(bad: list[BatchCall]) -> None:
    with pytest.raises(ValueError):
        encode_batch(bad)


def answer(*parts: tuple[str, bytes], boundary: str = "batch_x", preamble: bytes = b"") -> bytes:
    body = preamble
    for content_id, http in parts:
        body += (
            (
                f"--{boundary}\r\nContent-Type: application/http\r\n"
                f"Content-ID: <response-{content_id}>\r\n\r\n"
            ).encode()
            + http
            + b"\r\n"
        )
    return body + f"--{boundary}--\r\nepilogue".encode()


def test_decode_by_content_id_in_any_order_bytes_kept() -> None:
    ok = b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n\r\n" + BINARY
    limited = (
        b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 3\r\n"
        b"Content-Type: application/json; charset=UTF-8\r\n\r\n"
        b'{"error": {"code": 429, "errors": [{"reason": "rateLimitExceeded"}]}}'
    )
    gone = b"HTTP/1.1 404 Not Found\r\n\r\n"
    body = answer(("m2", gone), ("m0", ok), ("m1", limited), preamble=b"ignored preamble\r\n")
    parts = decode_batch('multipart/mixed; boundary="batch_x"', body)
    assert set(parts) == {"m0", "m1", "m2"}
    assert parts["m0"].status == 200 and parts["m0"].body == BINARY
    assert parts["m1"].status == 429
    assert parts["m1"].headers["retry-after"] == "3"
    assert json.loads(parts["m1"].body)["error"]["errors"][0]["reason"] == "rateLimitExceeded"
    assert parts["m2"].status == 404 and parts["m2"].body == b""


def test_decode_content_length_and_lf_only_lines() -> None:
    lf = (
        b"--b\nContent-Type: application/http\nContent-ID: <response-a>\n\n"
        b"HTTP/1.1 200 OK\nContent-Length: 5\n\nhello\n"
        b"--b--\n"
    )
    parts = decode_batch("multipart/mixed; boundary=b", lf)
    assert parts["a"].body == b"hello"
    padded = (
        b"--b  \r\nContent-Type: application/http\r\nContent-ID: <response-a>\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc\r\n\r\n--b--"
    )
    assert decode_batch("multipart/mixed; boundary=b", padded)["a"].body == b"abc"


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        ("application/json", b"{}"),
        ("multipart/mixed", b"--b\r\n\r\n--b--"),
        ("multipart/mixed; boundary=b", b"no delimiter at all"),
        ("multipart/mixed; boundary=b", b"--b\r\nContent-ID: <response-a>\r\n\r\nHTTP/1.1 200"),
        ("multipart/mixed; boundary=b", b"--b\r\nContent-ID: <a>\r\n\r\nnot http\r\n--b--"),
        ("multipart/mixed; boundary=b", b"--b\r\n\r\nHTTP/1.1 200 OK\r\n\r\n{}\r\n--b--"),
    ],
)
def test_decode_refuses_what_is_not_a_batch_answer(content_type: str, body: bytes) -> None:
    with pytest.raises(BatchFormatError) as caught:
        decode_batch(content_type, body)
    assert isinstance(caught.value, GmailUnavailable)  # a mangled answer is transient


@needs_fake
def test_round_trip_through_the_fakes_multipart_code() -> None:
    from fakes.gmail import Answer, google_error
    from fakes.gmail.batch import encode_answers, parse_batch

    content_type, body = encode_batch(calls(3))
    parsed = parse_batch(body, content_type, CIMultiDict({"Authorization": "Bearer t"}))
    assert [p.content_id for p in parsed] == ["m0", "m1", "m2"]
    assert all(p.call is not None and p.call.verb == "GET" for p in parsed)
    assert parsed[1].call is not None
    assert parsed[1].call.path == "/gmail/v1/users/me/messages/id1"
    assert parsed[1].call.query["format"] == "raw"
    assert parsed[1].call.headers["Authorization"] == "Bearer t"  # outer header applies

    answers = [
        ("m2", Answer(200, BINARY, {"Content-Type": "application/octet-stream"})),
        ("m0", google_error(429, reason="rateLimitExceeded", retry_after_s=2)),
        ("m1", google_error(404)),
    ]
    payload, answer_type = encode_answers(answers)
    parts = decode_batch(answer_type, payload)
    assert parts["m2"].status == 200 and parts["m2"].body == BINARY
    assert parts["m0"].status == 429 and parts["m0"].headers["retry-after"] == "2"
    assert parts["m1"].status == 404
