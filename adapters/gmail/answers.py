"""What Gmail answers, read strictly: the client's result types and the readers of
Gmail's JSON, its error body and its Retry-After header.

A field Gmail must send and did not (or sent malformed) is GmailUnavailable — a
broken answer is retried like an outage, never guessed at; optional fields read
as absent.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson

from inboxd.adapters.gmail.errors import GmailRequestRejected, GmailUnavailable
from inboxd.adapters.retry_after import retry_after_s

#: Longest Retry-After honoured, seconds; longer ones are the runner's backoff's business.
MAX_RETRY_AFTER_S = 3600.0
#: Longest Google error message kept in an exception text.
ERROR_MESSAGE_MAX_CHARS = 200


@dataclass(frozen=True, slots=True)
class Profile:
    """users.getProfile: the mailbox's address and current historyId."""

    email_address: str
    history_id: str
    messages_total: int
    threads_total: int


@dataclass(frozen=True, slots=True)
class MessageRef:
    """One messages.list entry: the message id and its thread id."""

    id: str
    thread_id: str


@dataclass(frozen=True, slots=True)
class MessagePage:
    """One messages.list page; `next_page_token` None on the last page."""

    messages: list[MessageRef]
    next_page_token: str | None
    result_size_estimate: int = 0


@dataclass(frozen=True, slots=True)
class HistoryPage:
    """One history.list page: the records as Gmail sends them (id, messages,
    messagesAdded, messagesDeleted, labelsAdded, labelsRemoved), the mailbox's
    current `history_id`, and `next_page_token` (None on the last page)."""

    records: list[dict[str, Any]]
    history_id: str
    next_page_token: str | None


@dataclass(frozen=True, slots=True)
class WatchResult:
    """users.watch: the mailbox's historyId now, and when the watch lapses."""

    history_id: str
    expiration_ms: int

    @property
    def expiration(self) -> datetime:
        return datetime.fromtimestamp(self.expiration_ms / 1000, tz=UTC)


@dataclass(frozen=True, slots=True)
class HttpAnswer:
    """One HTTP answer as the client read it; header names lowercased."""

    status: int
    headers: Mapping[str, str]
    body: bytes


@dataclass(slots=True)
class RawBatch:
    """What get_raw_batch fetched: `raw` bytes by id (byte-exact), the ids that are
    `gone` (404: deleted since they were listed; permanent), and ids Gmail
    `rejected` with another 4xx (permanent for that id)."""

    raw: dict[str, bytes] = field(default_factory=dict)
    gone: set[str] = field(default_factory=set)
    rejected: dict[str, GmailRequestRejected] = field(default_factory=dict)


def raw_of(body: bytes, message_id: str) -> bytes | None:
    """The message bytes of a messages.get format=raw answer: `raw` is base64url
    (users.messages resource), padding optional. None when absent or not base64."""
    try:
        message = _loads(body)
    except ValueError:
        return None
    raw = message.get("raw") if isinstance(message, dict) else None
    if not isinstance(raw, str) or message.get("id", message_id) != message_id:
        return None
    try:
        return base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4))
    except (binascii.Error, ValueError):
        return None


def google_error(body: bytes) -> tuple[str | None, str]:
    """(first errors[].reason, message) of Google's error body (handle-errors guide)."""
    try:
        document = _loads(body)
    except ValueError:
        return None, ""
    error = document.get("error") if isinstance(document, dict) else None
    if not isinstance(error, dict):
        return None, ""
    reason = None
    details = error.get("errors")
    if isinstance(details, list):
        for detail in details:
            if isinstance(detail, dict) and isinstance(detail.get("reason"), str):
                reason = detail["reason"]
                break
    if reason is None and isinstance(error.get("status"), str):
        reason = error["status"]
    message = error.get("message")
    return reason, (message if isinstance(message, str) else "")[:ERROR_MESSAGE_MAX_CHARS]


def retry_after_of(headers: Mapping[str, str]) -> float | None:
    """Retry-After in seconds (adapters/retry_after.py), at most MAX_RETRY_AFTER_S."""
    seconds = retry_after_s(headers.get("retry-after"))
    return None if seconds is None else min(seconds, MAX_RETRY_AFTER_S)


def json_object(body: bytes, what: str) -> dict[str, Any]:
    try:
        value = _loads(body)
    except ValueError as exc:
        raise GmailUnavailable(f"{what}: answer is not JSON") from exc
    if not isinstance(value, dict):
        raise GmailUnavailable(f"{what}: answer is not a JSON object")
    return value


def text_field(document: Mapping[str, Any], key: str) -> str:
    value = document.get(key)
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # int64 fields are JSON strings, but accept numbers
    if not isinstance(value, str) or not value:
        raise GmailUnavailable(f"Gmail answer without {key}")
    return value


def optional_text_field(document: Mapping[str, Any], key: str) -> str | None:
    value = document.get(key)
    return value if isinstance(value, str) and value else None


def int_field(value: object) -> int:
    if isinstance(value, bool):
        return 0
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return 0


def list_of_objects(document: Mapping[str, Any], key: str) -> list[dict[str, Any]]:
    """A list field of objects; absent means empty (an empty list page has no key)."""
    value = document.get(key, [])
    if not isinstance(value, list):
        raise GmailUnavailable(f"Gmail answer's {key} is not a list")
    return [item for item in value if isinstance(item, dict)]


def _loads(body: bytes) -> Any:
    """json.loads, through orjson first: a messages.get format=raw answer of a 2 KB
    message parses in 1.75 µs instead of json.loads' 5.8 (measured on the 2-core VM of
    bench/README.md's gmail.py section, both in one process; raw_of as a whole 15.1 →
    11.0 µs, most of the rest is the base64 decode). What only the stdlib reads (UTF-16/32,
    lone surrogate escapes, NaN, integers past 64 bits: none of it Gmail's UTF-8 JSON)
    still reads as before; ValueError when neither can."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return json.loads(body)
