"""Graph's JSON error body and the Answer type every handler returns.

Shape from "Microsoft Graph error responses and resource types"
(https://learn.microsoft.com/graph/errors) and the json-batching examples:
{"error": {"code", "message", "innerError": {"date", "request-id",
"client-request-id"}}}. `request-id` is new per answer; `client-request-id`
echoes the request's header of that name (a fresh GUID when absent), as Graph
does. 401 answers carry `WWW-Authenticate: Bearer` (RFC 6750 §3).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

JSON_TYPE = "application/json;odata.metadata=minimal;odata.streaming=true;charset=utf-8"


@dataclass
class Answer:
    """One HTTP answer, independent of aiohttp so batch parts reuse it."""

    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def is_json(self) -> bool:
        return self.headers.get("Content-Type", "").startswith("application/json")

    @property
    def json(self) -> object:
        return json.loads(self.body) if self.body else None


def json_answer(
    payload: object, status: int = 200, headers: Mapping[str, str] | None = None
) -> Answer:
    answer = Answer(status, json.dumps(payload).encode(), {"Content-Type": JSON_TYPE})
    answer.headers.update(headers or {})
    return answer


def graph_error(
    status: int,
    code: str,
    message: str,
    *,
    retry_after_s: int | None = None,
    client_request_id: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> Answer:
    """Graph's error body; Retry-After when the caller should wait (429/503)."""
    request_id = str(uuid.uuid4())
    inner = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()),
        "request-id": request_id,
        "client-request-id": client_request_id or request_id,
    }
    answer = json_answer({"error": {"code": code, "message": message, "innerError": inner}}, status)
    answer.headers["request-id"] = request_id
    answer.headers["client-request-id"] = inner["client-request-id"]
    if status == 401:
        answer.headers["WWW-Authenticate"] = 'Bearer realm="", error="invalid_token"'
    if retry_after_s is not None:
        answer.headers["Retry-After"] = str(retry_after_s)
    answer.headers.update(headers or {})
    return answer


def not_found(message: str = "The specified object was not found in the store.") -> Answer:
    """What Outlook answers for an id it does not hold (deleted, moved, never existed)."""
    return graph_error(404, "ErrorItemNotFound", message)


def bad_request(message: str, code: str = "BadRequest") -> Answer:
    return graph_error(400, code, message)
