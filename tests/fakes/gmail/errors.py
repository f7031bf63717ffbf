"""Google's JSON error body, the one shape every Gmail API failure takes.

Shape from the Google APIs error model as the Gmail API answers it
(https://developers.google.com/gmail/api/guides/handle-errors):
{"error": {"code", "message", "errors": [{"domain", "reason", "message"}], "status"}}.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# HTTP status -> (google.rpc status, default reason, default message); handle-errors guide.
_DEFAULTS: dict[int, tuple[str, str, str]] = {
    400: ("INVALID_ARGUMENT", "invalidArgument", "Invalid argument."),
    401: (
        "UNAUTHENTICATED",
        "authError",
        "Request had invalid authentication credentials. Expected OAuth 2 access token, "
        "login cookie or other valid authentication credential.",
    ),
    403: ("PERMISSION_DENIED", "forbidden", "The caller does not have permission"),
    404: ("NOT_FOUND", "notFound", "Requested entity was not found."),
    429: ("RESOURCE_EXHAUSTED", "rateLimitExceeded", "Rate Limit Exceeded"),
    500: ("INTERNAL", "backendError", "Backend Error"),
    503: ("UNAVAILABLE", "backendError", "The service is currently unavailable."),
}
REASON_PHRASES = {
    200: "OK",
    204: "No Content",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    429: "Too Many Requests",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
JSON_TYPE = "application/json; charset=UTF-8"


@dataclass
class Answer:
    """One HTTP answer of the API, independent of aiohttp so batch parts reuse it."""

    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def json(self) -> object:
        return json.loads(self.body) if self.body else None


def json_answer(payload: object, status: int = 200) -> Answer:
    return Answer(status, json.dumps(payload).encode(), {"Content-Type": JSON_TYPE})


def google_error(
    status: int,
    message: str | None = None,
    *,
    reason: str | None = None,
    retry_after_s: int | None = None,
) -> Answer:
    """The Google error body for `status`, with Retry-After when the caller should wait."""
    rpc_status, default_reason, default_message = _DEFAULTS.get(
        status, ("UNKNOWN", "unknown", "Unknown error")
    )
    message = message or default_message
    detail: dict[str, str] = {
        "message": message,
        "domain": "usageLimits" if status == 429 else "global",
        "reason": reason or default_reason,
    }
    if status == 401:
        detail |= {"location": "Authorization", "locationType": "header"}
    answer = json_answer(
        {"error": {"code": status, "message": message, "errors": [detail], "status": rpc_status}},
        status,
    )
    if status == 401:
        # RFC 6750 §3: a bearer-protected resource names the scheme and the error.
        answer.headers["WWW-Authenticate"] = (
            'Bearer realm="https://accounts.google.com/", error="invalid_token"'
        )
    if retry_after_s is not None:
        answer.headers["Retry-After"] = str(retry_after_s)
    return answer
