"""Reading the untrusted parts of a webhook request, the same way for every provider.

The provider modules share these rules: a body is one JSON document; a field
of a provider object is a string or absent; an event time is ISO 8601 (UTC
when it has no offset) or Unix seconds; a signed timestamp header is ASCII
digits within the source's tolerance of the receive time.

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

from .base import MalformedPayload, VerificationFailed

__all__ = [
    "MAX_TIMESTAMP_DIGITS",
    "InputError",
    "check_timestamp",
    "load_json",
    "optional_str",
    "parse_iso_time",
    "parse_json_object",
    "read_iso_time",
    "read_unix_time",
    "required_str",
]

#: The two exception families a bad request value can raise (module docstring).
InputError = type[MalformedPayload] | type[VerificationFailed]

#: Significant digits of a signed Unix-seconds timestamp beyond which it cannot be
#: within any tolerance of now: 10^12 s is the year 33658. Checking the length
#: first keeps int() off attacker-sized digit strings (CPython refuses more than
#: 4,300 digits with ValueError, and converting fewer is still wasted work).
MAX_TIMESTAMP_DIGITS = 12


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


def required_str(obj: Mapping[str, Any], key: str, *, where: str = "") -> str:
    """`obj[key]`, which must be a string (possibly empty); MalformedPayload otherwise."""
    value = obj.get(key)
    if not isinstance(value, str):
        raise MalformedPayload(f"{where}{key} is missing or not a string")
    return value


def optional_str(obj: Mapping[str, Any], key: str, *, where: str = "") -> str | None:
    """`obj[key]` as given when a string, None when absent or null; MalformedPayload
    for any other type."""
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise MalformedPayload(f"{where}{key} is not a string")
    return value


def parse_iso_time(
    text: str, *, what: str = "event time", error: InputError = MalformedPayload
) -> datetime:
    """An ISO-8601 time, tz-aware; `error` naming `what` when `text` is not one.

    A time without an offset is read as UTC, never as the host's local time:
    the providers write UTC (SES and SNS with a `Z`; Postmark and Resend
    sometimes without an offset).
    """
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        raise error(f"{what} is not an ISO-8601 time") from None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


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
    MalformedPayload when not a number or out of datetime's range."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MalformedPayload(f"{what} is not a number")
    try:
        return datetime.fromtimestamp(value, tz=UTC)
    except (OverflowError, OSError, ValueError):
        raise MalformedPayload(f"{what} out of range") from None


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
