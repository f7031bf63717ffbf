"""Gmail batch requests: multipart/mixed in, multipart/mixed out.

Batch guide (https://developers.google.com/gmail/api/guides/batch):
- POST /batch/gmail/v1 with Content-Type multipart/mixed; each part is
  `Content-Type: application/http` (optionally `Content-ID`) wrapping a whole
  HTTP request that names only a path;
- headers of the outer request apply to every part unless the part sets its own
  (so one outer Authorization serves all parts); Content-* headers do not carry;
- at most 100 calls per batch ("Gmail recommends ≤ 50": larger batches draw
  rate limiting, which here is the quota's per-part 429s);
- the answer is 200 multipart/mixed, one application/http part per call with
  that call's own status line, headers and body, and `Content-ID:
  <response-ID>` for a request part `Content-ID: <ID>`; parts may come in any
  order (faults.shuffle_batch reverses them to prove a client pairs by id).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from multidict import CIMultiDict
from yarl import URL

from .api import Call
from .errors import REASON_PHRASES, Answer

MAX_BATCH_CALLS = 100  # batch guide: "limited to 100 calls"


class BatchError(Exception):
    """The batch as a whole is malformed: Gmail answers 400."""


@dataclass
class Part:
    content_id: str | None
    call: Call | None  # None: the part is not a parsable HTTP request
    problem: str | None = None


def boundary_of(content_type: str) -> str:
    mime, _, params = content_type.partition(";")
    if mime.strip().lower() != "multipart/mixed":
        raise BatchError("batch requests must be multipart/mixed")
    for param in params.split(";"):
        key, _, value = param.strip().partition("=")
        if key.lower() == "boundary" and value:
            return value.strip().strip('"')
    raise BatchError("multipart/mixed without a boundary")


def split_parts(body: bytes, boundary: str) -> list[bytes]:
    """The bodies between `--boundary` lines (RFC 2046 §5.1.1), CRLF or LF."""
    delimiter = b"--" + boundary.encode()
    pieces = body.split(delimiter)
    parts = []
    for piece in pieces[1:]:
        if piece.startswith(b"--"):
            break  # close delimiter
        # Drop transport padding + the line break after the delimiter, and the
        # line break before the next one (it belongs to the delimiter).
        line_end = piece.find(b"\n")
        piece = piece[line_end + 1 :] if line_end != -1 else b""
        if piece.endswith(b"\r\n"):
            piece = piece[:-2]
        elif piece.endswith(b"\n"):
            piece = piece[:-1]
        parts.append(piece)
    return parts


def _split_head(data: bytes) -> tuple[list[str], bytes]:
    for sep in (b"\r\n\r\n", b"\n\n"):
        pos = data.find(sep)
        if pos != -1:
            head, rest = data[:pos], data[pos + len(sep) :]
            break
    else:
        head, rest = data, b""
    return head.decode("latin-1").replace("\r\n", "\n").split("\n"), rest


def _parse_headers(lines: list[str]) -> CIMultiDict[str]:
    headers: CIMultiDict[str] = CIMultiDict()
    for line in lines:
        name, sep, value = line.partition(":")
        if sep:
            headers.add(name.strip(), value.strip())
    return headers


def parse_batch(body: bytes, content_type: str, outer_headers: CIMultiDict[str]) -> list[Part]:
    """The calls of a batch request, outer headers applied where a part sets none."""
    raw_parts = split_parts(body, boundary_of(content_type))
    if not raw_parts:
        raise BatchError("batch request without parts")
    if len(raw_parts) > MAX_BATCH_CALLS:
        raise BatchError(f"A batch request cannot contain more than {MAX_BATCH_CALLS} requests")
    parts = []
    for raw in raw_parts:
        head_lines, inner = _split_head(raw)
        part_headers = _parse_headers(head_lines)
        content_id = part_headers.get("Content-ID")
        if content_id is not None:
            content_id = content_id.strip().removeprefix("<").removesuffix(">")
        if part_headers.get("Content-Type", "").split(";")[0].strip() != "application/http":
            parts.append(Part(content_id, None, "part is not application/http"))
            continue
        request_lines, request_body = _split_head(inner)
        request_line = request_lines[0].split() if request_lines and request_lines[0] else []
        if len(request_line) < 2 or not request_line[1].startswith("/"):
            parts.append(Part(content_id, None, "part is not an HTTP request with a path"))
            continue
        headers: CIMultiDict[str] = CIMultiDict(
            (k, v) for k, v in outer_headers.items() if not k.lower().startswith("content-")
        )
        for name, value in _parse_headers(request_lines[1:]).items():
            headers.popall(name, None)
            headers.add(name, value)
        length = headers.get("Content-Length")
        if length is not None and length.isdigit():
            request_body = request_body[: int(length)]
        url = URL(request_line[1])
        parts.append(
            Part(
                content_id,
                Call(request_line[0].upper(), url.path, url.query, headers, request_body),
            )
        )
    return parts


def encode_answers(answers: list[tuple[str | None, Answer]]) -> tuple[bytes, str]:
    """The multipart/mixed body of a batch answer and its Content-Type."""
    boundary = "batch_" + secrets.token_urlsafe(12)
    out = bytearray()
    for content_id, answer in answers:
        out += f"--{boundary}\r\nContent-Type: application/http\r\n".encode()
        if content_id is not None:
            out += f"Content-ID: <response-{content_id}>\r\n".encode()
        phrase = REASON_PHRASES.get(answer.status, "")
        out += f"\r\nHTTP/1.1 {answer.status} {phrase}\r\n".encode()
        for name, value in answer.headers.items():
            out += f"{name}: {value}\r\n".encode()
        out += f"Content-Length: {len(answer.body)}\r\n\r\n".encode()
        out += answer.body + b"\r\n"
    out += f"--{boundary}--\r\n".encode()
    return bytes(out), f"multipart/mixed; boundary={boundary}"
