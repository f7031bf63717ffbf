"""Reprocess (pipeline/reprocess/run.py): stored raw bytes re-derived with the current parser.

A slice of the corpus goes through the ingest stage into a database-tier store
(small objects in PostgreSQL, as the daemon's default), then `reprocess` runs in
this process, parsing in a thread so that a parser change made here (a charset
alias, a wrapped parse_raw) reaches it.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import asyncpg
import pytest

from inboxd.pipeline.ingest.stage import IngestBatch, IngestStage
from inboxd.pipeline.message import MessageData
from inboxd.pipeline.mime import charsets
from inboxd.pipeline.mime import workers as parsing
from inboxd.pipeline.mime.parse import parse_raw
from inboxd.pipeline.objectstore.database_tier import DEFAULT_MAX_BYTES, DatabaseTierStore
from inboxd.pipeline.objectstore.local import LocalDirectoryStore
from inboxd.pipeline.objectstore.store import ObjectStoreError
from inboxd.pipeline.outcomes import Outcome
from inboxd.pipeline.reprocess.run import Report, Reported, Scope, reprocess

X_UNKNOWN = "mikel-mail/plain_emails__raw_email10.eml"  # text/plain; charset=X-UNKNOWN
TRIPLE = tuple(
    f"sisimai-set-of-emails/{style}__lhost-postfix-01.eml" for style in ("bsd", "dos", "mac")
)
PLAIN = "axllent-mailpit/plain-text.eml"
ATTACHED = "axllent-mailpit/mime-attachment.eml"  # an inline JPEG and a PDF
LARGE_HTML = "nodemailer-mailparser/htmllargecallstack.eml"  # 570 KB of HTML: object store
SLICE = (*TRIPLE, X_UNKNOWN, PLAIN, ATTACHED, LARGE_HTML, "axllent-mailpit/tags.eml")


@pytest.fixture
def tiered(pool: asyncpg.Pool, store: LocalDirectoryStore) -> DatabaseTierStore:
    return DatabaseTierStore(pool, store, max_bytes=DEFAULT_MAX_BYTES)


@pytest.fixture
async def imported(
    pool: asyncpg.Pool, tiered: DatabaseTierStore, make_mailbox, corpus: Path
) -> dict[str, int]:
    """The slice ingested as `inboxd import` would (the bsd copy of the triple first,
    so it is the primary); message_id by corpus name (the triple's copies share one)."""
    await make_mailbox("acme", "inbox")
    items = [
        parse_raw((corpus / "mime" / name).read_bytes(), tenant_id="acme", mailbox_id="inbox")
        for name in SLICE
    ]
    results = await IngestStage(pool, tiered).ingest(IngestBatch("acme", "inbox", items))
    assert [r.outcome for r in results] == [Outcome.NEW, Outcome.MERGED, Outcome.MERGED] + [
        Outcome.NEW
    ] * (len(SLICE) - 3)
    ids = {name: r.message_id for name, r in zip(SLICE, results, strict=True)}
    assert all(isinstance(i, int) for i in ids.values())
    return ids  # type: ignore[return-value]


async def snapshot(pool: asyncpg.Pool) -> dict[str, object]:
    """Every row version a reprocess could touch (xmin changes with any write)."""
    queries = {
        "messages": "SELECT message_id, xmin::text, updated_at FROM messages",
        "participants": "SELECT message_id, role, position, xmin::text FROM message_participants",
        "attachments": "SELECT attachment_id, xmin::text FROM attachments",
        "threads": "SELECT thread_id, xmin::text FROM threads",
        "copies": "SELECT external_id, xmin::text FROM message_copies",
        "events": "SELECT event_id FROM events",
        "small_objects": "SELECT key, xmin::text FROM small_objects",
    }
    return {name: sorted(map(tuple, await pool.fetch(sql))) for name, sql in queries.items()}


def run(pool: asyncpg.Pool, store: DatabaseTierStore, **scope: object):
    return reprocess(pool, store, Scope("acme", **scope), in_thread=True, batch_size=4)  # type: ignore[arg-type]


def counts(report: Report) -> tuple[int, int, int, int, int]:
    return report.examined, report.unchanged, report.updated, len(report.reported), report.no_raw


async def test_reprocessing_twice_writes_nothing(
    pool: asyncpg.Pool, tiered: DatabaseTierStore, imported: dict[str, int]
) -> None:
    messages = len(set(imported.values()))
    before = await snapshot(pool)

    first = await run(pool, tiered)
    second = await run(pool, tiered)

    for report in (first, second):
        assert counts(report) == (messages, messages, 0, 0, 0)
        assert report.raw_missing == [] and report.app_sent == 0
        assert report.last_message_id == max(imported.values())
    assert await snapshot(pool) == before


async def test_a_charset_alias_added_updates_exactly_the_affected_message(
    pool: asyncpg.Pool,
    tiered: DatabaseTierStore,
    imported: dict[str, int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    target = imported[X_UNKNOWN]
    old = await pool.fetchrow(
        "SELECT text_body, content_fingerprint, updated_at FROM messages WHERE message_id = $1",
        target,
    )
    assert "Envoyé" in old["text_body"]  # X-UNKNOWN read as windows-1252 today
    before = await snapshot(pool)
    monkeypatch.setitem(charsets._ALIASES, "x-unknown", "koi8_r")  # the "parser upgrade"

    report = await run(pool, tiered)

    assert counts(report) == (len(set(imported.values())), len(set(imported.values())) - 1, 1, 0, 0)
    assert report.fields == {"text_body": 1, "content_fingerprint": 1}
    new = await pool.fetchrow(
        "SELECT text_body, content_fingerprint, updated_at FROM messages WHERE message_id = $1",
        target,
    )
    assert "Envoyé" not in new["text_body"] and "Envoy" in new["text_body"]
    assert new["content_fingerprint"] != old["content_fingerprint"]
    assert new["updated_at"] > old["updated_at"]
    events = await pool.fetch(
        "SELECT kind, message_id, payload::text FROM events WHERE event_id > $1",
        max([e[0] for e in before["events"]], default=0),
    )
    assert [(e["kind"], e["message_id"]) for e in events] == [("message.updated", target)]
    assert '"fields": ["content_fingerprint", "text_body"]' in events[0]["payload"]
    after = await snapshot(pool)
    changed_messages = set(before["messages"]) ^ set(after["messages"])
    assert {row[0] for row in changed_messages} == {target}
    for table in ("participants", "attachments", "copies", "small_objects"):
        assert after[table] == before[table], table

    again = await run(pool, tiered)  # the upgrade is replayed once, not every run
    assert (again.updated, again.unchanged) == (0, len(set(imported.values())))
    assert await snapshot(pool) == after


def changing(pick: Callable[[bytes, MessageData], bool], change: Callable[[MessageData], None]):
    """parse_raw, then `change` applied to the items `pick` selects: a simulated parser change."""
    real = parse_raw

    def parse(raw: bytes, **kwargs: object):
        item = real(raw, **kwargs)  # type: ignore[arg-type]
        if isinstance(item, MessageData) and pick(raw, item):
            change(item)
        return item

    return parse


async def test_a_merged_message_whose_copies_now_disagree_is_reported_and_left_alone(
    pool: asyncpg.Pool,
    tiered: DatabaseTierStore,
    imported: dict[str, int],
    monkeypatch: pytest.MonkeyPatch,
    corpus: Path,
) -> None:
    target = imported[TRIPLE[0]]
    assert (
        await pool.fetchval("SELECT count(*) FROM message_copies WHERE message_id = $1", target)
        == 3
    )
    lf_only = (corpus / "mime" / TRIPLE[0]).read_bytes()

    def upgraded(item: MessageData) -> None:  # the LF copy now decodes another subject
        item.subject += " (decoded anew)"
        item.content_fingerprint = "0" * 64

    monkeypatch.setattr(parsing, "parse_raw", changing(lambda raw, _: raw == lf_only, upgraded))
    before = await snapshot(pool)

    report = await run(pool, tiered)

    assert report.reported == [Reported(target, "copies_disagree")]
    assert report.updated == 0 and report.unchanged == len(set(imported.values())) - 1
    assert await snapshot(pool) == before


async def test_attachments_and_a_large_html_body_are_rewritten_and_stored(
    pool: asyncpg.Pool,
    tiered: DatabaseTierStore,
    imported: dict[str, int],
    monkeypatch: pytest.MonkeyPatch,
    corpus: Path,
) -> None:
    attached, large = imported[ATTACHED], imported[LARGE_HTML]
    raws = {(corpus / "mime" / name).read_bytes() for name in (ATTACHED, LARGE_HTML)}
    ids_before = await pool.fetch(
        "SELECT position, attachment_id FROM attachments WHERE message_id = $1 ORDER BY position",
        attached,
    )
    old_html_key = await pool.fetchval("SELECT html_key FROM messages WHERE message_id = $1", large)
    assert old_html_key is not None

    def upgraded(item: MessageData) -> None:
        if item.attachments:  # a filename decoded anew; the PDF no longer an attachment
            item.attachments[0].filename = "inline-image (1).jpg"
            del item.attachments[1:]
        if item.html:
            item.html += "<p>rendered anew</p>"

    monkeypatch.setattr(parsing, "parse_raw", changing(lambda raw, _: raw in raws, upgraded))

    report = await run(pool, tiered)

    assert report.reported == []
    assert report.updated == 2
    assert report.fields == {"attachments": 1, "html_body": 2}
    rows = await pool.fetch(
        "SELECT position, attachment_id, filename, stored, storage_key FROM attachments "
        "WHERE message_id = $1 ORDER BY position",
        attached,
    )
    assert [(r["position"], r["attachment_id"], r["filename"], r["stored"]) for r in rows] == [
        (0, ids_before[0]["attachment_id"], "inline-image (1).jpg", True)
    ]
    assert await tiered.exists(rows[0]["storage_key"])
    assert await pool.fetchval(
        "SELECT has_attachments FROM messages WHERE message_id = $1", attached
    )
    html = await pool.fetchrow(
        "SELECT html_key, html_body FROM messages WHERE message_id = $1", large
    )
    assert html["html_body"] is None and html["html_key"] not in (None, old_html_key)
    assert (await tiered.get(html["html_key"])).endswith(b"<p>rendered anew</p>")
    again = await run(pool, tiered)
    assert again.updated == 0 and again.reported == []


async def test_a_missing_raw_object_is_listed_and_the_run_goes_on(
    pool: asyncpg.Pool, tiered: DatabaseTierStore, imported: dict[str, int]
) -> None:
    target = imported[PLAIN]
    key = await pool.fetchval("SELECT raw_key FROM messages WHERE message_id = $1", target)
    assert await pool.fetchval("DELETE FROM small_objects WHERE key = $1 RETURNING 1", key) == 1

    report = await run(pool, tiered)

    assert report.raw_missing == [(target, key)]
    assert report.examined == len(set(imported.values()))
    assert report.unchanged == report.examined - 1


async def test_scope_mailbox_since_and_resume(
    pool: asyncpg.Pool, tiered: DatabaseTierStore, imported: dict[str, int], make_mailbox
) -> None:
    await make_mailbox("acme", "other")
    ids = sorted(set(imported.values()))

    assert (await run(pool, tiered, mailbox_id="other")).examined == 0
    assert (await run(pool, tiered, mailbox_id="inbox")).examined == len(ids)
    received = await pool.fetchval("SELECT max(received_at) FROM messages")
    assert (await run(pool, tiered, since=received + timedelta(seconds=1))).examined == 0
    resumed = await reprocess(pool, tiered, Scope("acme"), after_id=ids[2], in_thread=True)
    assert resumed.examined == len(ids) - 3 and resumed.unchanged == len(ids) - 3
    assert (await reprocess(pool, tiered, Scope("other-tenant"), in_thread=True)).examined == 0


async def test_a_new_fingerprint_another_message_holds_is_reported(
    pool: asyncpg.Pool,
    tiered: DatabaseTierStore,
    imported: dict[str, int],
    monkeypatch: pytest.MonkeyPatch,
    corpus: Path,
) -> None:
    taken = await pool.fetchrow(
        "SELECT message_id_norm, content_fingerprint FROM messages WHERE message_id = $1",
        imported[PLAIN],
    )
    raw = (corpus / "mime" / X_UNKNOWN).read_bytes()

    def upgraded(item: MessageData) -> None:  # now derives exactly the other message's key
        item.message_id_norm = taken["message_id_norm"]
        item.content_fingerprint = taken["content_fingerprint"]

    monkeypatch.setattr(parsing, "parse_raw", changing(lambda r, _: r == raw, upgraded))
    before = await snapshot(pool)

    report = await run(pool, tiered)

    assert report.reported == [Reported(imported[X_UNKNOWN], "fingerprint_collision")]
    assert report.updated == 0
    assert await snapshot(pool) == before


async def truncate_raw(
    pool: asyncpg.Pool, store: LocalDirectoryStore, message_id: int, keep_bytes: int = 200
) -> str:
    """Cut the message's raw object to its first `keep_bytes`, wherever it lives (the
    table or a file): what a torn write or a bad copy leaves under the same key."""
    key = await pool.fetchval("SELECT raw_key FROM messages WHERE message_id = $1", message_id)
    in_table = await pool.fetchval(
        "UPDATE small_objects SET data = substr(data, 1, $2) WHERE key = $1 RETURNING 1",
        key,
        keep_bytes,
    )
    if not in_table:
        path = store.path_for(key)
        path.write_bytes(path.read_bytes()[:keep_bytes])
    return key


async def test_a_corrupt_raw_object_is_reported_and_its_row_left_as_stored(
    pool: asyncpg.Pool,
    tiered: DatabaseTierStore,
    store: LocalDirectoryStore,
    imported: dict[str, int],
) -> None:
    # one raw object in the table, one in a file: both cut off inside the headers
    plain, large = imported[PLAIN], imported[LARGE_HTML]
    plain_key = await truncate_raw(pool, store, plain)
    large_key = await truncate_raw(pool, store, large)
    assert store.path_for(large_key).is_file()
    before = await snapshot(pool)

    report = await run(pool, tiered)

    assert sorted(report.reported, key=lambda r: r.message_id) == sorted(
        [Reported(plain, "raw_corrupt", plain_key), Reported(large, "raw_corrupt", large_key)],
        key=lambda r: r.message_id,
    )
    assert report.updated == 0 and report.unchanged == report.examined - 2
    assert await snapshot(pool) == before  # no row, no event: the stored subject and body stay


async def test_an_unreadable_raw_object_is_reported_and_the_rest_of_its_batch_goes_on(
    pool: asyncpg.Pool,
    tiered: DatabaseTierStore,
    store: LocalDirectoryStore,
    imported: dict[str, int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # PLAIN's raw object moved out of the table, and a directory where its file goes
    target = imported[PLAIN]
    key = await pool.fetchval("SELECT raw_key FROM messages WHERE message_id = $1", target)
    assert await pool.fetchval("DELETE FROM small_objects WHERE key = $1 RETURNING 1", key) == 1
    store.path_for(key).mkdir(parents=True)
    monkeypatch.setitem(charsets._ALIASES, "x-unknown", "koi8_r")  # changes X_UNKNOWN

    # one batch for all: X_UNKNOWN is updated in the batch PLAIN could not be read in
    report = await reprocess(pool, tiered, Scope("acme"), in_thread=True)

    [reported] = report.reported
    assert (reported.message_id, reported.reason) == (target, "raw_unreadable")
    assert key in (reported.detail or "") and "Is a directory" in (reported.detail or "")
    assert report.updated == 1 and report.fields["text_body"] == 1
    assert report.examined == len(set(imported.values()))
    assert report.unchanged == report.examined - 2


class _DownStore(LocalDirectoryStore):
    """A store that does not answer at all (its endpoint refuses connections)."""

    async def get(self, key: str) -> bytes:
        raise ObjectStoreError(f"s3 get_object {key!r} failed: connection refused")


async def test_a_store_that_is_down_stops_the_run_with_nothing_written(
    pool: asyncpg.Pool, tmp_path: Path, imported: dict[str, int]
) -> None:
    before = await snapshot(pool)

    with pytest.raises(ObjectStoreError, match="connection refused"):
        await run(pool, _DownStore(tmp_path / "down"))  # type: ignore[arg-type]

    assert await snapshot(pool) == before
