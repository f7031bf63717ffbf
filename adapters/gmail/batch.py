"""Gmail batch requests: many GET calls in one multipart/mixed request, and the answer back.

The format (Gmail "Batching requests" guide,
https://developers.google.com/gmail/api/guides/batch): one `POST /batch/gmail/v1`
whose body is `multipart/mixed` (RFC 2046 §5.1); every part has
`Content-Type: application/http`, a `Content-ID`, and an HTTP request as its
body. Headers of the outer request other than Content-* (Authorization) apply
to every inner call. The answer is `multipart/mixed` with a boundary of
Google's choosing; each part is an HTTP response (status line, headers, body)
whose `Content-ID` is `response-` + the request's, and "the server might
perform your calls in any order", so parts are matched by Content-ID only.

The parser is a small explicit one over bytes, not the stdlib `email` parser:

* bodies stay bytes end to end (a part's body is a JSON document carrying a
  whole message as base64url; nothing is decoded as text until `json.loads`);
* it is a few `bytes.find` calls per part over offsets into the one answer
  body (a payload is copied once), where `email.parser` pushes every line of
  every payload through its feed parser: for 20 parts of 1 MiB each (a batch
  of large messages) this parser took ~25 ms and `BytesParser(policy=compat32)`
  ~370 ms on the development machine, both on the event loop
  (`python -m inboxd.adapters.gmail.batch` prints the comparison);
* it accepts what RFC 2046 allows and Google sends: an optional preamble,
  transport padding after a delimiter, LF-only line ends, an inner
  Content-Length shorter than the part (the CRLF before the next delimiter).

A part that cannot be read at all (no status line) is a `BatchFormatError`
(a GmailUnavailable: a mangled answer is a transient server or proxy fault);
the client then retries the calls it did not get an answer for.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from inboxd.adapters.gmail.errors import GmailUnavailable

__all__ = [
    "BATCH_PATH",
    "MAX_BATCH_CALLS",
    "BatchCall",
    "BatchFormatError",
    "BatchPart",
    "decode_batch",
    "encode_batch",
]

#: Gmail's batch endpoint path (batch guide: "/batch/api_name/api_version").
BATCH_PATH = "/batch/gmail/v1"
#: "You're limited to 100 calls in a single batch request" (batch guide). The client
#: sends far fewer (client.GMAIL_BATCH_SIZE); this is the protocol's own bound.
MAX_BATCH_CALLS = 100
#: Prefix Google puts before a request's Content-ID in the answer (batch guide example).
RESPONSE_ID_PREFIX = "response-"

# Content-IDs and paths we emit must not be able to break out of their header line.
_CONTENT_ID = re.compile(r"[A-Za-z0-9._+-]{1,200}")
_PATH = re.compile(r"/[\x21-\x7e]*")
_BOUNDARY_PARAM = re.compile(rb'boundary\s*=\s*(?:"([^"]+)"|([^\s;]+))', re.IGNORECASE)
_STATUS_LINE = re.compile(rb"HTTP/\d(?:\.\d)?\s+(\d{3})")


class BatchFormatError(GmailUnavailable):
    """The batch answer is not the multipart/mixed Gmail documents."""


@dataclass(frozen=True, slots=True)
class BatchCall:
    """One inner GET: `content_id` pairs it with its answer; `path` is the
    absolute path with query, e.g. `/gmail/v1/users/me/messages/ID?format=raw`."""

    content_id: str
    path: str


@dataclass(frozen=True, slots=True)
class BatchPart:
    """One inner answer. `headers` are the inner HTTP response's, names lowercased."""

    status: int
    headers: Mapping[str, str]
    body: bytes


def encode_batch(calls: Iterable[BatchCall], *, boundary: str | None = None) -> tuple[str, bytes]:
    """(Content-Type header value, body) of a batch of GET calls.

    ValueError for no calls, more than MAX_BATCH_CALLS, a repeated Content-ID, or
    a Content-ID or path that is not a plain token / absolute path.
    """
    calls = list(calls)
    if not calls:
        raise ValueError("a batch needs at least one call")
    if len(calls) > MAX_BATCH_CALLS:
        raise ValueError(f"a batch holds at most {MAX_BATCH_CALLS} calls, got {len(calls)}")
    seen: set[str] = set()
    boundary = boundary or f"batch_inboxd_{secrets.token_hex(16)}"
    out = bytearray()
    for call in calls:
        if not _CONTENT_ID.fullmatch(call.content_id):
            raise ValueError(f"content_id {call.content_id!r} is not a plain token")
        if call.content_id in seen:
            raise ValueError(f"content_id {call.content_id!r} appears twice")
        if not _PATH.fullmatch(call.path):
            raise ValueError(f"path {call.path!r} is not an absolute path without spaces")
        seen.add(call.content_id)
        out += (
            f"--{boundary}\r\n"
            "Content-Type: application/http\r\n"
            f"Content-ID: <{call.content_id}>\r\n"
            "\r\n"
            f"GET {call.path} HTTP/1.1\r\n"
            "\r\n"
            "\r\n"  # the CRLF before a delimiter belongs to the delimiter (RFC 2046 §5.1.1)
        ).encode("ascii")
    out += f"--{boundary}--\r\n".encode("ascii")
    return f"multipart/mixed; boundary={boundary}", bytes(out)


def decode_batch(content_type: str, body: bytes) -> dict[str, BatchPart]:
    """The answer's parts by request Content-ID (`response-` prefix and angle
    brackets removed). BatchFormatError when `content_type` is not multipart
    with a boundary, or a part has no Content-ID or no HTTP status line."""
    match = _BOUNDARY_PARAM.search(content_type.encode("latin-1", "replace"))
    if not content_type.lower().lstrip().startswith("multipart/") or match is None:
        raise BatchFormatError("batch answer is not multipart/mixed with a boundary")
    boundary = match.group(1) or match.group(2)
    parts: dict[str, BatchPart] = {}
    for start, end in _part_spans(body, boundary):
        part_headers, inner = _read_head(body, start, end)
        content_id = _unwrap_content_id(part_headers.get("content-id", ""))
        if not content_id:
            raise BatchFormatError("batch answer part without Content-ID")
        parts[content_id] = _read_http_response(body, inner, end)
    return parts


# --- parsing -----------------------------------------------------------------------------
#
# Everything works on offsets into the one answer body, so a part's payload is copied
# once, when its BatchPart is made (a batch of large messages is tens of MiB).


def _part_spans(body: bytes, boundary: bytes) -> list[tuple[int, int]]:
    """(start, end) of each body between delimiter lines (RFC 2046 §5.1.1);
    preamble and epilogue dropped, the line break before a delimiter excluded."""
    dash = b"--" + boundary
    spans: list[tuple[int, int]] = []
    pos = _find_delimiter(body, dash, 0)
    if pos < 0:
        raise BatchFormatError("batch answer has no delimiter line")
    while True:
        if body[pos + len(dash) : pos + len(dash) + 2] == b"--":
            return spans  # close delimiter: the rest is the epilogue
        line_end = body.find(b"\n", pos + len(dash))
        if line_end < 0:
            raise BatchFormatError("batch answer ends inside a delimiter line")
        start = line_end + 1
        nxt = _find_delimiter(body, dash, start)
        if nxt < 0:
            raise BatchFormatError("batch answer has no close delimiter")
        end = nxt
        if end > start and body[end - 1] == 0x0A:  # \n
            end -= 1
        if end > start and body[end - 1] == 0x0D:  # \r
            end -= 1
        spans.append((start, end))
        pos = nxt


def _find_delimiter(body: bytes, dash: bytes, start: int) -> int:
    """Index of the next `--boundary` that begins a line, at or after `start`."""
    while True:
        found = body.find(dash, start)
        if found < 0:
            return -1
        if found == 0 or body[found - 1] == 0x0A:
            return found
        start = found + 1


def _read_head(body: bytes, start: int, end: int) -> tuple[dict[str, str], int]:
    """Header fields of body[start:end] (lowercased names, latin-1) and the offset
    where what follows the blank line begins (`end` when there is none)."""
    crlf = body.find(b"\r\n\r\n", start, end)
    # An LF-only blank line counts only before the first CRLF one: never scan the
    # payload behind the header block twice.
    lf = body.find(b"\n\n", start, end if crlf < 0 else crlf)
    if lf >= 0:
        head_end, rest = lf, lf + 2
    elif crlf >= 0:
        head_end, rest = crlf, crlf + 4
    else:
        head_end, rest = end, end
    headers: dict[str, str] = {}
    for line in body[start:head_end].split(b"\n"):
        name, colon, value = line.partition(b":")
        if colon and name.strip():
            headers[name.strip().decode("latin-1").lower()] = value.strip().decode("latin-1")
    return headers, rest


def _unwrap_content_id(value: str) -> str:
    value = value.strip()
    if value.startswith("<") and value.endswith(">"):
        value = value[1:-1]
    if value.startswith(RESPONSE_ID_PREFIX):
        value = value[len(RESPONSE_ID_PREFIX) :]
    return value


def _read_http_response(body: bytes, start: int, end: int) -> BatchPart:
    line_end = body.find(b"\n", start, end)
    status_end = end if line_end < 0 else line_end
    match = _STATUS_LINE.match(body[start:status_end].strip())
    if match is None:
        raise BatchFormatError("batch answer part without an HTTP status line")
    rest = end if line_end < 0 else line_end + 1
    if body.startswith(b"\r\n", rest, end):  # no header fields at all
        headers: dict[str, str] = {}
        payload = rest + 2
    elif body.startswith(b"\n", rest, end):
        headers, payload = {}, rest + 1
    else:
        headers, payload = _read_head(body, rest, end)
    length = headers.get("content-length", "")
    if length.isdigit() and int(length) <= end - payload:
        end = payload + int(length)
    return BatchPart(int(match.group(1)), headers, body[payload:end])


def _measure() -> None:  # pragma: no cover - the figure quoted in the module docstring
    import time
    from email import policy
    from email.parser import BytesParser

    blob = b'{"id": "x", "raw": "' + b"QUJD" * (1 << 18) + b'"}'
    boundary = "batch_measure"
    body = (
        b"".join(
            f"--{boundary}\r\nContent-Type: application/http\r\nContent-ID: <response-{i}>\r\n\r\n"
            "HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n".encode()
            + blob
            + b"\r\n"
            for i in range(20)
        )
        + f"--{boundary}--\r\n".encode()
    )
    content_type = f"multipart/mixed; boundary={boundary}"
    started = time.perf_counter()
    decode_batch(content_type, body)
    ours = time.perf_counter() - started
    started = time.perf_counter()
    message = BytesParser(policy=policy.compat32).parsebytes(
        f"Content-Type: {content_type}\r\n\r\n".encode() + body
    )
    for part in message.walk():
        part.get_payload(decode=True)
    stdlib = time.perf_counter() - started
    print(
        f"20 parts x {len(blob) / 2**20:.1f} MiB: explicit {ours * 1e3:.1f} ms, "
        f"email.parser {stdlib * 1e3:.1f} ms"
    )


if __name__ == "__main__":  # pragma: no cover
    _measure()
