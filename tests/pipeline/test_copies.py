"""A mailbox's copies as the provider changes them: known ids, removals, labels."""

from __future__ import annotations

import asyncpg
import orjson
from factories import message

from inboxd.pipeline import copies
from inboxd.pipeline.ingest.stage import IngestBatch, IngestStage


async def stored_copy(stage: IngestStage, external_id: str, labels: list[str]) -> None:
    item = message(external_id=external_id)
    item.labels = labels
    [result] = await stage.ingest(IngestBatch("acme", "inbox", [item]))
    assert result.outcome.value == "new"


async def events(pool: asyncpg.Pool, kind: str) -> list[dict]:
    rows = await pool.fetch("SELECT payload FROM events WHERE kind = $1 ORDER BY event_id", kind)
    return [orjson.loads(r[0]) if isinstance(r[0], str) else r[0] for r in rows]


async def test_known_copies_answers_once_per_page(pool, stage, make_mailbox) -> None:
    await make_mailbox("acme", "inbox")
    await stored_copy(stage, "g-1", ["INBOX"])
    assert await copies.known_copies(pool, "acme", "inbox", ["g-1", "g-2", "g-1"]) == {"g-1"}
    assert await copies.known_copies(pool, "acme", "other", ["g-1"]) == set()
    assert await copies.known_copies(pool, "acme", "inbox", []) == set()


async def test_live_copies_under_one_imap_folder(pool, stage, make_mailbox) -> None:
    await make_mailbox("acme", "inbox")
    for external_id in ("INBOX:7:1", "INBOX:7:2", "INBOX:70:1", "INBOX:8:1", "Sent:7:1"):
        await stored_copy(stage, external_id, ["x"])
    async with pool.acquire() as conn:
        await copies.record_removed(conn, "acme", "inbox", ["INBOX:7:2"], "expunged")
    assert await copies.live_copies_under(pool, "acme", "inbox", "INBOX:7:") == ["INBOX:7:1"]
    assert await copies.live_copies_under(pool, "acme", "other", "INBOX:7:") == []


async def test_a_removed_copy_keeps_its_message_and_is_announced_once(
    pool, stage, make_mailbox
) -> None:
    await make_mailbox("acme", "inbox")
    await stored_copy(stage, "g-1", ["INBOX"])
    async with pool.acquire() as conn:
        assert await copies.record_removed(conn, "acme", "inbox", ["g-1", "never"], "deleted") == 1
        assert await copies.record_removed(conn, "acme", "inbox", ["g-1"], "deleted") == 0
    row = await pool.fetchrow("SELECT removed_at, removal_reason FROM message_copies")
    assert row["removed_at"] is not None and row["removal_reason"] == "deleted"
    assert await pool.fetchval("SELECT count(*) FROM messages") == 1  # the data stays
    assert await events(pool, copies.REMOVED_EVENT) == [{"external_id": "g-1", "reason": "deleted"}]


async def test_label_changes_are_stored_announced_and_restore_a_removed_copy(
    pool, stage, make_mailbox
) -> None:
    await make_mailbox("acme", "inbox")
    await stored_copy(stage, "g-1", ["INBOX"])
    async with pool.acquire() as conn:
        assert await copies.update_labels(conn, "acme", "inbox", {"g-1": ["INBOX", "IMPORTANT"]})
        assert not await copies.update_labels(
            conn, "acme", "inbox", {"g-1": ["IMPORTANT", "INBOX"]}
        )
        await copies.record_removed(conn, "acme", "inbox", ["g-1"], "unlabelled")
        assert await copies.update_labels(conn, "acme", "inbox", {"g-1": ["INBOX", "IMPORTANT"]})
    row = await pool.fetchrow("SELECT labels, removed_at FROM message_copies")
    assert list(row["labels"]) == ["IMPORTANT", "INBOX"] and row["removed_at"] is None
    changed = await events(pool, copies.LABELS_EVENT)
    assert [e["labels"] for e in changed] == [["IMPORTANT", "INBOX"]] * 2


async def test_a_removal_from_one_folder_spares_copies_recorded_elsewhere_since(
    pool, stage, make_mailbox
) -> None:
    await make_mailbox("acme", "inbox")
    await stored_copy(stage, "o-moved-back", ["inbox"])  # left archive, back in inbox
    await stored_copy(stage, "o-two", ["archive", "flagged"])
    await stored_copy(stage, "o-gone", ["archive"])
    async with pool.acquire() as conn:
        removed = await copies.record_removed(
            conn, "acme", "inbox", ["o-moved-back", "o-two", "o-gone"], "moved", only_from="archive"
        )
    assert removed == 1
    rows = {
        r["external_id"]: (list(r["labels"]), r["removed_at"] is not None)
        for r in await pool.fetch("SELECT external_id, labels, removed_at FROM message_copies")
    }
    assert rows == {
        "o-moved-back": (["inbox"], False),
        "o-two": (["flagged"], False),
        "o-gone": (["archive"], True),
    }
    assert await events(pool, copies.REMOVED_EVENT) == [
        {"external_id": "o-gone", "reason": "moved"}
    ]
    assert await events(pool, copies.LABELS_EVENT) == [
        {"external_id": "o-two", "labels": ["flagged"]}
    ]
