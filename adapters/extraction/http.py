"""The `http` parse backend: one POST to a parse API per extraction attempt.

Request (JSON)::

    POST <url>
    Authorization: Bearer <token>
    {"raw_mime": "<base64 of the raw RFC 5322 bytes>", "schema_id": "<id>"}
                                               or  "schema": {…the inline schema…}

`schema_id` is sent when the processor names one (the endpoint knows the schema
by that id), else the whole schema. The token arrives resolved (the daemon
reveals `env:`/`file:` references); it is never logged or put into a reason.

What an answer means (one call = one attempt: no retry here, the claim
protocol's backoff retries; pipeline/extraction/claims.py)::

    2xx, a JSON object valid against the schema   → the result
    2xx, a JSON object the schema rejects          → ExtractionTerminal
    2xx, not JSON / not an object / too large      → ExtractionRetryable: a proxy's
                                                     page or a 204 is not the mail's
    400, 413, 422                                  → ExtractionTerminal with the
                                                     server's message (one line, cut)
    401, 403                                       → ExtractionUnauthorized
    3xx, 404, 405                                  → ExtractionMisconfigured (a wrong
                                                     URL is the operator's, not the mail's)
    408, 429, 5xx                                  → ExtractionRetryable with Retry-After
    any other status                               → ExtractionRetryable
    connection error, timeout (`timeout_s` total)  → ExtractionRetryable

Both misconfigurations are retryable, not before UNAUTHORIZED_RETRY_AFTER_S (a
longer Retry-After is honoured up to RETRY_AFTER_MAX_S), and a daemon stage
pauses the processor and releases the job uncharged (daemon/extraction/
outcomes.py): a revoked token or a mistyped URL is an operator problem; sending
every message of the backlog to needs_review would make a human re-queue mail
that was never at fault, and the long wait keeps a broken setup from hammering
the endpoint. A 2xx that is not a JSON object is charged like a 5xx: if every
answer is one, each job still reaches needs_review after MAX_ATTEMPTS, at the
backoff's pace instead of the whole backlog at once. Redirects are not
followed: a 3xx would carry the bearer token to another address.
"""

from __future__ import annotations

import base64
from typing import Any

import aiohttp
import anyio
import orjson

from inboxd.adapters.extraction.errors import (
    ExtractionMisconfigured,
    ExtractionRetryable,
    ExtractionTerminal,
    ExtractionUnauthorized,
)
from inboxd.adapters.extraction.schema import ResultSchema
from inboxd.adapters.http_fetch import read_prefix
from inboxd.adapters.retry_after import retry_after_s
from inboxd.pipeline.extraction.claims import RETRY_AFTER_MAX_S
from inboxd.pipeline.extraction.messages import Reads
from inboxd.pipeline.mailbox.leases import one_line
from inboxd.pipeline.message import MessageData

#: Wait after a 401/403 before the job is claimed again, seconds: the claim protocol's
#: longest backoff step (pipeline/extraction/claims.py RETRY_MAX_S), long enough for
#: an operator to fix the token, short enough to resume soon after.
UNAUTHORIZED_RETRY_AFTER_S = 600.0
#: Largest answer read, bytes: a result is a row's JSON (a few KB); an error page can
#: be long, but only its start is kept.
RESPONSE_MAX_BYTES = 8 << 20
#: Longest server message kept in a reason, characters.
SERVER_MESSAGE_MAX_CHARS = 200
#: Statuses where the request itself is at fault: a validation error (400, 422,
#: RFC 9110 §15.5.1, RFC 4918 §11.2) or a message too large for the endpoint (413).
TERMINAL_STATUSES = frozenset({400, 413, 422})
#: Statuses that say "later": request timeout (408), too many requests (429, RFC 6585 §4).
RETRY_STATUSES = frozenset({408, 429})
UNAUTHORIZED_STATUSES = frozenset({401, 403})
#: Statuses of a URL that names no parse endpoint: not found (404), method not allowed
#: (405, RFC 9110 §15.5.5/6); and every 3xx, since redirects are not followed.
MISCONFIGURED_STATUSES = frozenset({404, 405, *range(300, 400)})


class HttpBackend:
    """A parse API behind `url`; `await extract(message)` is one attempt.

    `session` belongs to the caller (one per daemon, closed by its owner); the
    backend only opens requests on it."""

    def __init__(
        self,
        *,
        url: str,
        token: str,
        schema: ResultSchema,
        timeout_s: float,
        session: aiohttp.ClientSession,
        schema_id: str | None = None,
    ) -> None:
        self.url = url
        self._token = token
        self.schema = schema
        self.schema_id = schema_id
        self.timeout_s = timeout_s
        self.session = session
        self.reads = Reads.RAW  # the raw MIME is all it sends

    def __repr__(self) -> str:  # never the token
        return f"HttpBackend(url={self.url!r}, schema_id={self.schema_id!r})"

    async def extract(self, message: MessageData) -> dict[str, Any]:
        """The endpoint's result for `message`, validated against the schema;
        ExtractionRetryable / ExtractionTerminal as in the module docstring."""
        if message.raw is None:
            # The stage loads raw bytes from the object store before calling; a message
            # stored without them cannot be sent, however often we try.
            raise ExtractionTerminal("message has no raw MIME to send")
        status, headers, body = await self._post(self._request_body(message.raw))
        if 200 <= status < 300:
            return self.schema.validate_result(_json_object(status, body))
        retry_after = retry_after_s(headers.get("Retry-After"))
        if status in TERMINAL_STATUSES:
            raise ExtractionTerminal(f"endpoint answered {status}: {server_message(body)}")
        if status in UNAUTHORIZED_STATUSES:
            raise ExtractionUnauthorized(
                f"endpoint refused the token ({status}): {server_message(body)}",
                unauthorized_wait_s(retry_after),
            )
        if status in MISCONFIGURED_STATUSES:
            raise ExtractionMisconfigured(
                f"endpoint answered {status}, check the processor's url: {server_message(body)}",
                unauthorized_wait_s(retry_after),
            )
        if status in RETRY_STATUSES or status >= 500:
            raise ExtractionRetryable(f"endpoint answered {status}", retry_after)
        raise ExtractionRetryable(
            f"endpoint answered unexpected {status}: {server_message(body)}", retry_after
        )

    def _request_body(self, raw: bytes) -> bytes:
        document: dict[str, Any] = {"raw_mime": base64.b64encode(raw).decode("ascii")}
        if self.schema_id is not None:
            document["schema_id"] = self.schema_id
        else:
            document["schema"] = self.schema.schema
        return orjson.dumps(document)

    async def _post(self, body: bytes) -> tuple[int, dict[str, str], bytes]:
        """Status, headers and (capped) body of one POST; network failures and the
        deadline become ExtractionRetryable."""
        headers = {
            "Authorization": f"Bearer {self._token}",
            "Content-Type": "application/json",
            "Accept": "application/json",
        }
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            # anyio's deadline bounds the whole exchange, body read included
            # (CONTRIBUTING.md rule 7); aiohttp's total timeout is the same bound.
            with anyio.fail_after(self.timeout_s):
                async with self.session.post(
                    self.url, data=body, headers=headers, timeout=timeout, allow_redirects=False
                ) as response:
                    # One byte over the cap tells "too large"; an error page's start is kept.
                    content = await read_prefix(response, RESPONSE_MAX_BYTES)
                    return response.status, dict(response.headers), content
        except TimeoutError as exc:
            raise ExtractionRetryable(f"endpoint timed out after {self.timeout_s:g} s") from exc
        except aiohttp.ClientError as exc:
            raise ExtractionRetryable(f"endpoint unreachable: {type(exc).__name__}") from exc


def unauthorized_wait_s(retry_after: float | None) -> float:
    """Wait after a 401/403 or a wrong URL: at least UNAUTHORIZED_RETRY_AFTER_S, the server's
    Retry-After when longer, never past the claim protocol's RETRY_AFTER_MAX_S (a
    far-future date or a typo of a header would otherwise pause the processor for years)."""
    return min(max(retry_after or 0.0, UNAUTHORIZED_RETRY_AFTER_S), RETRY_AFTER_MAX_S)


def _json_object(status: int, body: bytes) -> dict[str, Any]:
    """The 2xx body as a JSON object; ExtractionRetryable when it is not one
    (module docstring: the endpoint's or a proxy's fault, not the mail's)."""
    if len(body) > RESPONSE_MAX_BYTES:
        raise ExtractionRetryable(
            f"endpoint answered {status} with over {RESPONSE_MAX_BYTES} bytes"
        )
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ExtractionRetryable(f"endpoint answered {status} with invalid JSON") from exc
    if not isinstance(document, dict):
        raise ExtractionRetryable(
            f"endpoint answered {status} with JSON {type(document).__name__}, not an object"
        )
    return document


def server_message(body: bytes) -> str:
    """The server's own words about a failure, one line, at most
    SERVER_MESSAGE_MAX_CHARS: `message`, `error` (text or {message}), `detail`
    (text, or FastAPI's list of {loc, msg}) or `title` (RFC 9457 problem
    details) of a JSON body, else the body as text."""
    text = ""
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        document = None
    if isinstance(document, dict):
        text = _message_of(document)
    if not text:
        text = body[: SERVER_MESSAGE_MAX_CHARS * 4].decode("utf-8", "replace")
    return one_line(text or "no message", SERVER_MESSAGE_MAX_CHARS)


def _message_of(document: dict[str, Any]) -> str:
    for key in ("message", "error", "detail", "title"):
        value = document.get(key)
        if isinstance(value, str) and value:
            return value
        if isinstance(value, dict) and isinstance(value.get("message"), str):
            return str(value["message"])
        if isinstance(value, list) and value:
            return "; ".join(_detail_item(item) for item in value)
    return ""


def _detail_item(item: object) -> str:
    if isinstance(item, dict) and "msg" in item:
        where = ".".join(str(part) for part in item.get("loc", []) or [])
        return f"{where}: {item['msg']}" if where else str(item["msg"])
    return str(item)
