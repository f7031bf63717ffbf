"""What one verified request's delivery events become: delivery_events column values.

Per event (`prepare_rows`): the dedup key, the payload minimised to the
source's allowlist (`SourcePolicy`) and serialised as jsonb will take it, the
recipient hashed (kept in clear only where the source's policy says so), the
normalised Message-ID and the key that correlates the event with an outbound
message, and an occurred_at that is never missing, naive or infinite (then the
time we received it). Text is cleaned of what PostgreSQL refuses (NUL).

This is the last line of defence behind the adapters' bounds
(adapters/esp/fields.py): whatever an adapter lets through, a row never holds
a value asyncpg cannot encode or PostgreSQL refuses, so one event can never
turn into a 503 (docs/architecture.md §8):

    occurred_at   outside EARLIEST/LATEST_OCCURRED_AT → the receive time (asyncpg
                  converts to UTC and overflows for 0001-01-01+14:00)
    keys          dedup_key, message_key, list_id over MAX_KEY_BYTES of UTF-8 →
                  a sha256 of the value (`_bounded_key`): the same long value
                  still gives the same key, and a btree entry stays under 2,704 B
    payload       copied depth-bounded (`_bounded_json`, MAX_PAYLOAD_DEPTH): a
                  deeper subtree becomes a marker string, strings and keys are
                  cleaned; the fingerprint of an event without an id is taken
                  over that copy when the raw payload is too deep for orjson

A request's single-use replay token is stored only as a hash that includes its
scope (`replay_token_hash`). Nothing here touches the database; ``intake.py``
prepares a request with these before it queues it for a group commit.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson

from inboxd.pipeline.delivery.model import (
    DeliveryEvent,
    address_hash,
    dedup_key,
    minimise_payload,
)
from inboxd.pipeline.identity import normalise_message_id
from inboxd.pipeline.ingest.rows import clean

#: Values in one prepared row (the request's token hash is appended when written).
ROW_FIELDS = 17

#: Longest key kept as it is, in UTF-8 bytes. PostgreSQL refuses a btree entry
#: over 2,704 bytes (version 4 on 8 kB pages: BTMaxItemSize, SQLSTATE 54000).
#: The widest entries are (tenant_id ≤ 63, source, key, 64-hex recipient_hash)
#: and the suppression scope `list:<source>:<list id>`: a 2,048-byte key leaves
#: ~600 bytes for the rest and the tuple headers. The adapters keep ids to
#: 256 characters (≤ 1,024 bytes), so only what slipped past them is hashed.
MAX_KEY_BYTES = 2048
#: Deepest JSON kept in a payload (levels of objects/arrays). orjson refuses to
#: serialise more than 254 ("Recursion limit reached", a TypeError); 64 is well
#: inside that with the fingerprint's wrapper object, and above the adapters'
#: own limit (32), so payloads they accepted are stored unchanged.
MAX_PAYLOAD_DEPTH = 64
#: What replaces a subtree deeper than MAX_PAYLOAD_DEPTH in a stored payload.
TOO_DEEP = "[nested too deep]"
#: The integers orjson serialises: signed and unsigned 64-bit.
_I64, _U64 = -(2**63), 2**64
#: occurred_at outside this range is replaced by the receive time: the Unix
#: epoch to Python's datetime.max less a day (within it, any UTC offset stays in
#: Python's range, so asyncpg's conversion to UTC cannot overflow).
EARLIEST_OCCURRED_AT = datetime(1970, 1, 1, tzinfo=UTC)
LATEST_OCCURRED_AT = datetime.max.replace(tzinfo=UTC) - timedelta(days=1)


@dataclass(frozen=True, slots=True)
class SourcePolicy:
    """How one source's events are stored: payload allowlist, recipient handling."""

    payload_fields: tuple[str, ...]
    keep_recipients: bool = False


def replay_token_hash(scope: str, token: str) -> str:
    """The stored form of a replay token: the scope is part of the hash, so tokens
    match on it alone."""
    return hashlib.sha256(f"{scope}\x1f{token}".encode("utf-8", "surrogateescape")).hexdigest()


def prepare_rows(
    tenant_id: str,
    source: str,
    provider: str,
    events: Sequence[DeliveryEvent],
    policy: SourcePolicy,
    received_at: float,
) -> list[tuple[Any, ...]]:
    """The delivery_events column values of each event (`ROW_FIELDS` of them), in the
    order of intake_write.py's unnest."""
    received = datetime.fromtimestamp(received_at, UTC)
    rows = []
    for event in events:
        mid = normalise_message_id(event.message_id_header) if event.message_id_header else None
        provider_mid = clean(event.provider_message_id)
        message_key = provider_mid or (f"mid:{mid}" if mid else None)
        recipient = clean(event.recipient)
        occurred = _occurred_at(event.occurred_at, received)
        # One depth check; copies only when the payload is too deep for orjson, so
        # the fingerprints of every payload that was storable before stay the same.
        if _deeper_than(event.payload, MAX_PAYLOAD_DEPTH):
            event = replace(event, payload=_bounded_json(event.payload, MAX_PAYLOAD_DEPTH))
        payload = minimise_payload(event.payload, policy.payload_fields)
        list_id = clean(event.list_id)
        rows.append(
            (
                tenant_id,
                source,
                _bounded_key(clean(dedup_key(event))),
                provider,
                clean(event.provider_type),
                str(event.event_type),
                occurred,
                received,
                provider_mid,
                clean(mid) or None,
                _bounded_key(clean(message_key)) if message_key else None,
                recipient if policy.keep_recipients else None,
                address_hash(recipient) if recipient else "",
                str(event.bounce_type) if event.bounce_type else None,
                clean(event.bounce_subtype),
                _bounded_key(list_id) if list_id else None,
                _json_for_postgres(payload),
            )
        )
    return rows


def storable_time(value: datetime) -> bool:
    """True when `value` is tz-aware and its instant lies between
    EARLIEST_OCCURRED_AT and LATEST_OCCURRED_AT: a timestamptz asyncpg encodes
    and every reader converts without overflow. The one range check of the
    delivery intake, the ESP adapters (adapters/esp/fields.py) and the API."""
    if value.tzinfo is None:
        return False
    try:
        instant = value.astimezone(UTC)  # overflows for 0001-01-01+14:00, 9999-12-31-14:00
    except (OverflowError, ValueError):
        return False
    return EARLIEST_OCCURRED_AT <= instant <= LATEST_OCCURRED_AT


def _occurred_at(occurred: datetime | None, received: datetime) -> datetime:
    """`occurred` when storable (`storable_time`), else `received`."""
    return occurred if occurred is not None and storable_time(occurred) else received


def _bounded_key(key: str) -> str:
    """`key`, or `sha256:<hex of its UTF-8>` when it is over MAX_KEY_BYTES (module
    docstring). `key` is already cleaned, so it encodes."""
    encoded = key.encode("utf-8")
    if len(encoded) <= MAX_KEY_BYTES:
        return key
    return "sha256:" + hashlib.sha256(encoded).hexdigest()


def _deeper_than(value: Any, limit: int) -> bool:
    """True when `value` nests objects/arrays more than `limit` levels (iterative)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, Mapping):
            children: Any = node.values()
        elif isinstance(node, list | tuple):
            children = node
        else:
            continue
        if depth >= limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def _bounded_json(value: Any, depth_left: int) -> Any:
    """A copy of parsed JSON that orjson and jsonb take: objects and arrays below
    `depth_left` levels become TOO_DEEP, strings and keys are cleaned. Recursion
    is bounded by `depth_left` (≤ MAX_PAYLOAD_DEPTH), far from Python's limit."""
    if isinstance(value, str):
        return clean(value)
    if isinstance(value, Mapping):
        if depth_left <= 0:
            return TOO_DEEP
        return {clean(str(k)): _bounded_json(v, depth_left - 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        if depth_left <= 0:
            return TOO_DEEP
        return [_bounded_json(v, depth_left - 1) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and not _I64 <= value < _U64:
        return str(value)  # orjson serialises 64-bit integers only
    return value


# A JSON `\u0000` escape: a backslash-u preceded by an even number of backslashes
# (an odd number means the backslash itself is escaped, and the text is literal).
_NUL_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\u0000")


def _json_for_postgres(payload: dict[str, Any]) -> str:
    # jsonb refuses \u0000 inside strings; the replacement keeps the event storable.
    # A payload too deep for orjson was already copied depth-bounded; what still
    # cannot be serialised (a lone surrogate, an int beyond 64 bits: never from
    # orjson.loads) is copied clean and serialised with str() for the rest.
    try:
        text = orjson.dumps(payload, default=str, option=orjson.OPT_NON_STR_KEYS).decode()
    except TypeError:  # orjson.JSONEncodeError
        text = orjson.dumps(
            _bounded_json(payload, MAX_PAYLOAD_DEPTH), default=str, option=orjson.OPT_NON_STR_KEYS
        ).decode()
    return _NUL_ESCAPE.sub(r"\1\\ufffd", text)
