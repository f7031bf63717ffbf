"""Reading the untrusted parts of a webhook request, the same way for every provider.

The provider modules share these rules: a body is one JSON document; a field
of a provider object is a string or absent; an event time is ISO 8601 (UTC
when it has no offset) or Unix seconds; a signed timestamp header is ASCII
digits within the source's tolerance of the receive time.

Every value is bounded before it can reach SQL (docs/architecture.md §8: a
value PostgreSQL or asyncpg refuses must be the sender's 4xx, never a 503):

    ids and keys      at most MAX_ID_CHARS (event, message, list ids: they end
                      up in unique/btree indexes), Message-IDs MAX_MESSAGE_ID_CHARS,
                      any other text field MAX_FIELD_CHARS
    text              no NUL (PostgreSQL text cannot hold it) and no lone
                      surrogate (asyncpg cannot encode it as UTF-8)
    event times       between EARLIEST_EVENT_TIME and LATEST_EVENT_TIME, once
                      converted to UTC
    JSON nesting      at most MAX_JSON_DEPTH levels (orjson cannot serialise
                      more than 254, and the payload is serialised to be stored)
    single headers    a header a scheme defines once (signature, timestamp, id)
                      may not come twice: VerificationFailed (`single_header`)

Which exception a bad value raises is the caller's decision, passed as
`error`: content that is already verified (or unsigned) is MalformedPayload
(400), while a value that must be read *before* the signature can be checked
(Mailgun's body, the SNS envelope) is VerificationFailed (401) — see
adapters/esp/base.py. `where` prefixes messages (`"ses: "`, `"event-data."`)
so a log line says which object was wrong; messages never quote a value.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import orjson

from inboxd.pipeline.delivery.intake_rows import (
    EARLIEST_OCCURRED_AT,
    LATEST_OCCURRED_AT,
    storable_time,
)

from .base import MalformedPayload, VerificationFailed

__all__ = [
    "EARLIEST_EVENT_TIME",
    "LATEST_EVENT_TIME",
    "MAX_FIELD_CHARS",
    "MAX_ID_CHARS",
    "MAX_JSON_DEPTH",
    "MAX_MESSAGE_ID_CHARS",
    "MAX_TIMESTAMP_DIGITS",
    "InputError",
    "check_depth",
    "check_event_time",
    "check_text",
    "check_timestamp",
    "load_json",
    "optional_str",
    "parse_iso_time",
    "parse_json_object",
    "read_iso_time",
    "read_unix_time",
    "required_str",
    "single_header",
]

#: The two exception families a bad request value can raise (module docstring).
InputError = type[MalformedPayload] | type[VerificationFailed]

#: Significant digits of a signed Unix-seconds timestamp beyond which it cannot be
#: within any tolerance of now: 10^12 s is the year 33658. Checking the length
#: first keeps int() off attacker-sized digit strings (CPython refuses more than
#: 4,300 digits with ValueError, and converting fewer is still wasted work).
MAX_TIMESTAMP_DIGITS = 12

#: Longest provider id kept (event ids, message ids, list ids, event types). Ids
#: become keys of btree indexes (delivery_events UNIQUE (tenant_id, source,
#: dedup_key), the evidence key, the suppression scope), whose entries PostgreSQL
#: refuses above 2,704 bytes (btree version 4 on 8 kB pages, SQLSTATE 54000):
#: 256 characters are at most 1,024 UTF-8 bytes, far inside it with tenant and
#: source. Real ids are much shorter: Svix msg_ ids 31, SNS MessageId (UUID) 36,
#: sg_event_id 22-48, Mailgun event ids 22 characters.
MAX_ID_CHARS = 256
#: Longest Message-ID kept: RFC 5322 §2.1.1 limits a header line to 998
#: characters, so a longer one is not a Message-ID any mail carried.
MAX_MESSAGE_ID_CHARS = 998
#: Longest other text field read (addresses, reasons, codes): the same RFC line
#: limit; these are not keys, so the bound only keeps rows sane.
MAX_FIELD_CHARS = 998

#: Event times outside these (after conversion to UTC) are refused. The lower
#: bound is the Unix epoch: no delivery event predates it, and Unix-seconds
#: fields are non-negative. The upper bound is Python's datetime.max minus a
#: day: an aware time within it stays inside Python's range at any UTC offset
#: (offsets are under 24 h), so converting it — as asyncpg does to encode a
#: timestamptz — cannot overflow; PostgreSQL holds years up to 294276.
#: (One definition, shared with the intake's last check: intake_rows.storable_time.)
EARLIEST_EVENT_TIME = EARLIEST_OCCURRED_AT
LATEST_EVENT_TIME = LATEST_OCCURRED_AT

#: Deepest nesting of a provider's JSON object accepted (objects and arrays
#: count a level each). The documented shapes are at most 6 deep (SES
#: subscription.newTopicPreferences.topicSubscriptionStatus[].topicName); 32
#: leaves the sender's own tags and metadata room, and stays far below the 254
#: levels orjson can serialise (the payload is serialised to be stored).
MAX_JSON_DEPTH = 32


def load_json(
    data: bytes | str, *, what: str = "body", error: InputError = MalformedPayload
) -> Any:
    """`data` parsed as JSON (any document); `error` naming `what` when it is not JSON."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        raise error(f"{what} is not JSON") from None


def parse_json_object(
    data: bytes | str, *, what: str = "body", error: InputError = MalformedPayload
) -> dict[str, Any]:
    """`data` as a JSON object; `error` naming `what` when it is not JSON or not an object."""
    parsed = load_json(data, what=what, error=error)
    if not isinstance(parsed, dict):
        raise error(f"{what} is not a JSON object")
    return parsed


def check_text(
    value: str,
    *,
    what: str,
    max_chars: int = MAX_FIELD_CHARS,
    error: InputError = MalformedPayload,
) -> str:
    """`value` when PostgreSQL can store it: at most `max_chars` characters, no NUL,
    no lone surrogate (aiohttp decodes header bytes that are not UTF-8 to them);
    `error` naming `what` otherwise."""
    if len(value) > max_chars:
        raise error(f"{what} is longer than {max_chars} characters")
    if "\x00" in value:
        raise error(f"{what} contains NUL")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise error(f"{what} is not valid Unicode text") from None
    return value


def required_str(
    obj: Mapping[str, Any], key: str, *, where: str = "", max_chars: int = MAX_FIELD_CHARS
) -> str:
    """`obj[key]`, which must be a string (possibly empty) that `check_text` accepts;
    MalformedPayload otherwise."""
    value = obj.get(key)
    if not isinstance(value, str):
        raise MalformedPayload(f"{where}{key} is missing or not a string")
    return check_text(value, what=f"{where}{key}", max_chars=max_chars)


def optional_str(
    obj: Mapping[str, Any], key: str, *, where: str = "", max_chars: int = MAX_FIELD_CHARS
) -> str | None:
    """`obj[key]` as given when a string `check_text` accepts, None when absent or
    null; MalformedPayload for any other type or text."""
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise MalformedPayload(f"{where}{key} is not a string")
    return check_text(value, what=f"{where}{key}", max_chars=max_chars)


def check_depth(
    value: Any,
    *,
    what: str = "body",
    max_depth: int = MAX_JSON_DEPTH,
    error: InputError = MalformedPayload,
) -> None:
    """Refuse parsed JSON nested deeper than `max_depth` levels (a scalar is level
    0, the members of a top-level object or array level 1). Iterative, so any
    depth orjson parsed (up to its own 1,024) is measured without recursion."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth >= max_depth:
            raise error(f"{what} is nested deeper than {max_depth} levels")
        stack.extend((child, depth + 1) for child in children)


def check_event_time(
    value: datetime, *, what: str = "event time", error: InputError = MalformedPayload
) -> datetime:
    """`value` (tz-aware) when its instant lies between EARLIEST_EVENT_TIME and
    LATEST_EVENT_TIME; `error` naming `what` otherwise."""
    if not storable_time(value):
        raise error(f"{what} out of range")
    return value


def single_header(headers: Mapping[str, str], name: str) -> str | None:
    """The one value of header `name`, or None when absent; VerificationFailed when
    it comes more than once.

    The schemes define their signature, timestamp and id headers once each; with
    two, which one the sender signed is ambiguous, so the request cannot be
    verified (401, nothing stored) — refused before any verification work.
    `headers` is aiohttp's multidict in the daemon (`getall`), a plain mapping
    (one value per name) in some tests.
    """
    getall = getattr(headers, "getall", None)
    if getall is None:
        return headers.get(name)
    values = getall(name, [])
    if len(values) > 1:
        raise VerificationFailed(f"header {name} appears more than once")
    return values[0] if values else None


def parse_iso_time(
    text: str, *, what: str = "event time", error: InputError = MalformedPayload
) -> datetime:
    """An ISO-8601 time, tz-aware, within the event-time range (`check_event_time`);
    `error` naming `what` when `text` is not one.

    A time without an offset is read as UTC, never as the host's local time:
    the providers write UTC (SES and SNS with a `Z`; Postmark and Resend
    sometimes without an offset).
    """
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        raise error(f"{what} is not an ISO-8601 time") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return check_event_time(parsed, what=what, error=error)


def read_iso_time(value: Any, *, what: str = "event time") -> datetime | None:
    """`parse_iso_time` of a field value: None when absent, MalformedPayload when
    present but not a string or not a time."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise MalformedPayload(f"{what} is not a string")
    return parse_iso_time(value, what=what)


def read_unix_time(value: Any, *, what: str = "timestamp") -> datetime | None:
    """A field in Unix seconds (int or float) as a UTC datetime; None when absent,
    MalformedPayload when not a number or outside the event-time range."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MalformedPayload(f"{what} is not a number")
    try:
        parsed = datetime.fromtimestamp(value, tz=UTC)
    except (OverflowError, OSError, ValueError):
        raise MalformedPayload(f"{what} out of range") from None
    return check_event_time(parsed, what=what)


def check_timestamp(timestamp_text: str, received_at: float, tolerance_s: float) -> None:
    """Refuse a signed timestamp that is not Unix seconds within `tolerance_s` of
    `received_at` (Unix seconds), in either direction; the boundary itself passes.

    Raises VerificationFailed: "not Unix seconds" unless ASCII digits only (no
    sign, point, space or other scripts' digits — str.isdigit and int() accept
    those), else "too old" / "too new", both saying "outside tolerance".
    """
    if not (timestamp_text.isascii() and timestamp_text.isdigit()):
        raise VerificationFailed("timestamp is not Unix seconds")
    significant = timestamp_text.lstrip("0") or "0"
    if len(significant) > MAX_TIMESTAMP_DIGITS:
        raise VerificationFailed("timestamp too new, outside tolerance")
    # int() of the significant digits only: CPython refuses strings of more than
    # 4,300 digits, and leading zeros would otherwise count towards that.
    # Compared, not subtracted: int/float comparison is exact for any size of int.
    signed_at = int(significant)
    if signed_at < received_at - tolerance_s:
        raise VerificationFailed("timestamp too old, outside tolerance")
    if signed_at > received_at + tolerance_s:
        raise VerificationFailed("timestamp too new, outside tolerance")
