"""What one verified request's delivery events become: delivery_events column values.

Per event (`prepare_rows`): the dedup key, the payload minimised to the
source's allowlist (`SourcePolicy`) and serialised as jsonb will take it, the
recipient hashed (kept in clear only where the source's policy says so), the
normalised Message-ID and the key that correlates the event with an outbound
message, and an occurred_at that is never missing, naive or infinite (then the
time we received it). Text is cleaned of what PostgreSQL refuses (NUL).

A request's single-use replay token is stored only as a hash that includes its
scope (`replay_token_hash`). Nothing here touches the database; ``intake.py``
prepares a request with these before it queues it for a group commit.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson

from inboxd.pipeline.delivery.model import (
    DeliveryEvent,
    address_hash,
    dedup_key,
    minimise_payload,
)
from inboxd.pipeline.identity import normalise_message_id
from inboxd.pipeline.rows import clean

#: Values in one prepared row (the request's token hash is appended when written).
ROW_FIELDS = 17


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
        occurred = event.occurred_at or received
        if occurred.tzinfo is None or not math.isfinite(occurred.timestamp()):
            occurred = received
        payload = minimise_payload(event.payload, policy.payload_fields)
        rows.append(
            (
                tenant_id,
                source,
                clean(dedup_key(event)),
                provider,
                clean(event.provider_type),
                str(event.event_type),
                occurred,
                received,
                provider_mid,
                clean(mid) or None,
                clean(message_key),
                recipient if policy.keep_recipients else None,
                address_hash(recipient) if recipient else "",
                str(event.bounce_type) if event.bounce_type else None,
                clean(event.bounce_subtype),
                clean(event.list_id),
                _json_for_postgres(payload),
            )
        )
    return rows


def _json_for_postgres(payload: dict[str, Any]) -> str:
    # jsonb refuses \u0000 inside strings; the replacement keeps the event storable.
    text = orjson.dumps(payload, default=str, option=orjson.OPT_NON_STR_KEYS).decode()
    return text.replace("\\u0000", "\\ufffd")
