"""The last line of defence of the delivery intake: whatever an adapter lets through,
a prepared row is one asyncpg encodes and PostgreSQL stores (intake_rows.py)."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import orjson
import pytest
from delivery_helpers import POLICY, event, store_events

from inboxd.pipeline.delivery.intake_rows import (
    MAX_KEY_BYTES,
    MAX_PAYLOAD_DEPTH,
    TOO_DEEP,
    prepare_rows,
)
from inboxd.pipeline.delivery.model import DeliveryEvent, EventType

RECEIVED = time.time()


def nested(depth: int) -> object:
    value: object = "leaf"
    for _ in range(depth):
        value = {"k": [value]} if depth % 2 else [value]
    return value


def raw(**kw: object) -> DeliveryEvent:
    fields: dict[str, object] = {
        "provider_event_id": "e1",
        "provider_type": "x.delivered",
        "event_type": EventType.DELIVERED,
        "occurred_at": None,
        "payload": {"kind": "delivered"},
    }
    fields.update(kw)
    return DeliveryEvent(**fields)  # type: ignore[arg-type]


def row_of(ev: DeliveryEvent, payload_fields: tuple[str, ...] = ("kind",)) -> tuple:
    policy = type(POLICY)(payload_fields=payload_fields, keep_recipients=True)
    (row,) = prepare_rows("acme", "esp", "test", [ev], policy, RECEIVED)
    return row


@pytest.mark.parametrize(
    "text", ["0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00", "1969-12-31T23:59:59Z"]
)
def test_an_event_time_out_of_range_becomes_the_receive_time(text: str) -> None:
    row = row_of(raw(occurred_at=datetime.fromisoformat(text)))
    assert row[6] == datetime.fromtimestamp(RECEIVED, UTC)


def test_keys_over_the_btree_budget_are_hashed_stably() -> None:
    long_id = "é" * 3000  # 6,000 UTF-8 bytes
    first = row_of(raw(provider_event_id=long_id, provider_message_id=long_id, list_id=long_id))
    again = row_of(raw(provider_event_id=long_id, provider_message_id=long_id, list_id=long_id))
    for column in (2, 10, 15):  # dedup_key, message_key, list_id
        assert first[column].startswith("sha256:")
        assert len(first[column].encode()) <= MAX_KEY_BYTES
        assert first[column] == again[column]
    assert row_of(raw(provider_event_id="short"))[2] == "id:short"


def test_a_payload_too_deep_for_orjson_is_fingerprinted_and_stored_bounded() -> None:
    deep = {"kind": nested(300)}
    row = row_of(raw(provider_event_id=None, payload=deep))
    assert row[2].startswith("fp:")
    stored = orjson.loads(row[16])
    assert TOO_DEEP in orjson.dumps(stored).decode()
    depth, node = 0, stored["kind"]
    while isinstance(node, list | dict):
        node = node[0] if isinstance(node, list) else node["k"]
        depth += 1
    assert depth <= MAX_PAYLOAD_DEPTH
    # the same deep event fingerprints the same every time (a retry is a duplicate)
    assert row_of(raw(provider_event_id=None, payload=deep))[2] == row[2]


def test_shallow_payloads_are_stored_as_they_were() -> None:
    payload = {"kind": {"a": [1, 2.5, None, True, "x\x00y"]}}
    assert orjson.loads(row_of(raw(payload=payload))[16]) == {
        "kind": {"a": [1, 2.5, None, True, "x\ufffdy"]}
    }


async def test_hostile_events_are_stored_not_refused(pool) -> None:
    hostile = [
        raw(provider_event_id="t1", occurred_at=datetime.fromisoformat("0001-01-01T00:00+14:00")),
        raw(provider_event_id="x" * 3000),
        raw(provider_event_id=None, payload={"kind": nested(300)}),
        raw(provider_event_id="nul\x00", provider_type="a\x00b", recipient="r\x00@x"),
        raw(provider_event_id="sur\udcff", list_id="l\ud800", provider_message_id="m" * 3000),
        event(EventType.DELIVERED),
    ]
    outcome = await store_events(pool, hostile)
    assert (outcome.new, outcome.duplicates) == (6, 0)
    assert (await store_events(pool, hostile)).duplicates == 6


def test_only_real_nul_escapes_are_replaced_in_stored_payloads() -> None:
    from inboxd.pipeline.delivery.intake_rows import _json_for_postgres

    assert orjson.loads(_json_for_postgres({"k": "a\x00b"}))["k"] == "a\ufffdb"
    # the six characters \u0000 written literally are text, kept as they are
    assert orjson.loads(_json_for_postgres({"k": r"see \u0000"}))["k"] == r"see \u0000"
    assert orjson.loads(_json_for_postgres({"k": "x\\\x00"}))["k"] == "x\\\ufffd"
