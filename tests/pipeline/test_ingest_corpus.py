"""The whole shared corpus through the ingest stage: the mail our users actually get."""

from __future__ import annotations

import collections
import email
import email.policy
import hashlib
from html.parser import HTMLParser
from pathlib import Path

import asyncpg
import pytest
from helpers.corpus import corpus_files

from inboxd.pipeline.ingest.stage import IngestBatch, IngestStage
from inboxd.pipeline.message import DeadItem, MessageData
from inboxd.pipeline.mime.parse import parse_raw
from inboxd.pipeline.objectstore.local import LocalDirectoryStore
from inboxd.pipeline.outcomes import Outcome

BATCH = 40
TRIPLES = ("lhost-exchange2007-01", "lhost-postfix-01")


async def import_all(stage: IngestStage, files: list[Path]) -> dict[Path, Outcome]:
    outcomes: dict[Path, Outcome] = {}
    for start in range(0, len(files), BATCH):
        chunk = files[start : start + BATCH]
        items = [
            parse_raw(f.read_bytes(), tenant_id="acme", mailbox_id="inbox", source="import")
            for f in chunk
        ]
        results = await stage.ingest(IngestBatch("acme", "inbox", items))
        assert [r.index for r in results] == list(range(len(chunk)))
        for f, r in zip(chunk, results, strict=True):
            outcomes[f] = r.outcome
    return outcomes


@pytest.fixture
async def imported(stage, make_mailbox, corpus) -> dict[Path, Outcome]:
    await make_mailbox("acme", "inbox")
    return await import_all(stage, corpus_files(corpus / "mime"))


@pytest.mark.slow
async def test_every_file_is_accounted_for(imported, corpus) -> None:
    files = corpus_files(corpus / "mime")
    assert len(files) == 394
    assert set(imported) == set(files)
    counts = collections.Counter(imported.values())
    assert Outcome.RETRIABLE_FAILURE not in counts
    # the one Outlook .msg (CFB binary) file is not RFC 5322 mail
    dead = [f.name for f, o in imported.items() if o is Outcome.PERMANENT_FAILURE]
    assert dead == ["mail_outlook_1.eml"]


@pytest.mark.slow
async def test_second_import_is_all_duplicates_and_writes_nothing(
    imported, stage, pool: asyncpg.Pool, corpus
) -> None:
    async with pool.acquire() as conn:
        before = await _table_counts(conn)
    again = await import_all(stage, corpus_files(corpus / "mime"))
    counts = collections.Counter(again.values())
    assert counts[Outcome.DUPLICATE] == 393
    assert counts[Outcome.PERMANENT_FAILURE] == 1  # reported again, not stored again
    async with pool.acquire() as conn:
        assert await _table_counts(conn) == before


@pytest.mark.slow
async def test_line_ending_triples_are_one_message(imported, pool: asyncpg.Pool, corpus) -> None:
    sisimai = corpus / "mime" / "sisimai-set-of-emails"
    async with pool.acquire() as conn:
        for name in TRIPLES:
            shas = [
                hashlib.sha256((sisimai / f"{style}__{name}.eml").read_bytes()).hexdigest()
                for style in ("bsd", "dos", "mac")
            ]
            assert len(set(shas)) == 3  # three different byte sequences...
            ids = await conn.fetch(
                "SELECT DISTINCT message_id FROM message_copies WHERE tenant_id = 'acme' "
                "AND raw_sha256 = ANY($1::text[])",
                shas,
            )
            assert len(ids) == 1, name  # ...one message with three copies
            assert (
                await conn.fetchval(
                    "SELECT count(*) FROM message_copies WHERE tenant_id = 'acme' "
                    "AND message_id = $1",
                    ids[0][0],
                )
                == 3
            )


def _reused_mid_groups(corpus: Path) -> dict[str, list[Path]]:
    groups: dict[str, list[Path]] = collections.defaultdict(list)
    for f in corpus_files(corpus / "mime"):
        item = parse_raw(f.read_bytes(), tenant_id="acme", mailbox_id="inbox")
        if isinstance(item, MessageData) and item.message_id_norm:
            groups[item.message_id_norm].append(f)
    return {
        mid: fs
        for mid, fs in groups.items()
        if len({hashlib.sha256(f.read_bytes()).digest() for f in fs}) > 1
    }


class _VisibleText(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.words: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag: str, attrs: object) -> None:
        self._skip += tag in ("style", "script", "head", "title")

    def handle_endtag(self, tag: str) -> None:
        self._skip -= tag in ("style", "script", "head", "title") and self._skip > 0

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.words.append(data)


def _independent_view(path: Path) -> tuple[str, ...]:
    """What a reader sees, extracted with the stdlib only (not our parser or fingerprint).

    From, Subject, To, and the visible words of every text part (HTML rendered
    by html.parser). Markup-only differences (the PHP fixtures renaming a cid:
    reference to identical image bytes) are not visible, so they may merge.
    """
    raw = path.read_bytes().replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    msg = email.message_from_bytes(raw, policy=email.policy.compat32)
    parts = []
    for part in msg.walk():
        if part.get_content_maintype() != "text":
            continue
        text = (part.get_payload(decode=True) or b"").decode("latin-1")
        if part.get_content_subtype() == "html":
            parser = _VisibleText()
            parser.feed(text)
            text = " ".join(parser.words)
        words = "".join(text.split())
        if words:
            parts.append(words)
    return (
        str(msg.get("From", "")),
        " ".join(str(msg.get("Subject", "")).split()),
        " ".join(str(msg.get("To", "")).split()),
        *parts,
    )


@pytest.mark.slow
async def test_reused_message_ids_never_merge_different_content(
    imported, pool: asyncpg.Pool, corpus
) -> None:
    groups = _reused_mid_groups(corpus)
    assert len(groups) == 22  # 20 fixture groups + the two line-ending triples
    async with pool.acquire() as conn:
        for mid, files in groups.items():
            by_message: dict[int, list[Path]] = collections.defaultdict(list)
            for f in files:
                sha = hashlib.sha256(f.read_bytes()).hexdigest()
                message_id = await conn.fetchval(
                    "SELECT message_id FROM message_copies WHERE tenant_id = 'acme' "
                    "AND raw_sha256 = $1",
                    sha,
                )
                assert message_id is not None, f
                by_message[message_id].append(f)
            for merged in by_message.values():
                # files stored as one message must read the same to an independent parser
                views = {_independent_view(f) for f in merged}
                assert len(views) == 1, [f.name for f in merged]
            # every row beyond the first for this Message-ID is a recorded conflict
            rows = await conn.fetchval(
                "SELECT count(*) FROM messages WHERE tenant_id = 'acme' AND message_id_norm = $1",
                mid,
            )
            conflicts = await conn.fetchval(
                "SELECT count(*) FROM ingest_conflicts WHERE tenant_id = 'acme' "
                "AND message_id_norm = $1",
                mid,
            )
            assert conflicts == rows - 1


@pytest.mark.slow
async def test_known_different_pairs_are_separate_rows(imported, pool, corpus) -> None:
    # hand-checked: these share a Message-ID but differ in what a reader sees
    pairs = [
        (
            "django-mailbox/message_with_defective_attachment_association.eml",
            "django-mailbox/message_with_many_multiparts.eml",
        ),  # extra HTML part
        (
            "sisimai-set-of-emails/bsd__lhost-outlook-01.eml",
            "sisimai-set-of-emails/bsd__rhost-outlook-01.eml",
        ),  # different DSN report
        (
            "mikel-mail/plain_emails__basic_email_lf.eml",
            "mikel-mail/plain_emails__raw_email_with_at_display_name.eml",
        ),  # other recipients
    ]
    async with pool.acquire() as conn:
        for a, b in pairs:
            ids = set()
            for rel in (a, b):
                path = corpus / "mime" / rel
                if not path.exists():
                    pytest.fail(f"corpus file missing: {rel}")
                ids.add(
                    await conn.fetchval(
                        "SELECT message_id FROM message_copies WHERE tenant_id = 'acme' "
                        "AND raw_sha256 = $1",
                        hashlib.sha256(path.read_bytes()).hexdigest(),
                    )
                )
            assert len(ids) == 2 and None not in ids, (a, b)


@pytest.mark.slow
async def test_raw_bytes_are_recoverable_byte_exact(
    imported, pool: asyncpg.Pool, store: LocalDirectoryStore, corpus
) -> None:
    async with pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT raw_sha256, raw_key FROM message_copies WHERE tenant_id = 'acme' "
            "UNION SELECT raw_sha256, raw_key FROM dead_items WHERE tenant_id = 'acme'"
        )
    assert len(rows) >= 393
    for sha, key in rows:
        assert key == f"raw/acme/{sha}"
        assert hashlib.sha256(await store.get(key)).hexdigest() == sha
    for f in corpus_files(corpus / "mime"):
        assert hashlib.sha256(f.read_bytes()).hexdigest() in {r[0] for r in rows}, f


@pytest.mark.slow
async def test_thread_metadata_matches_messages(imported, pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        wrong = await conn.fetch(
            "SELECT t.thread_id FROM threads t LEFT JOIN LATERAL ("
            " SELECT count(*) n, min(coalesce(sent_at, received_at)) f,"
            "        max(coalesce(sent_at, received_at)) l"
            " FROM messages m WHERE m.tenant_id = t.tenant_id AND m.thread_id = t.thread_id) a"
            " ON true WHERE t.tenant_id = 'acme' AND (t.message_count <> a.n"
            " OR t.first_message_at IS DISTINCT FROM a.f"
            " OR t.last_message_at IS DISTINCT FROM a.l)"
        )
        assert wrong == []
        assert (
            await conn.fetchval(
                "SELECT count(*) FROM messages WHERE tenant_id = 'acme' AND external_id = ''"
            )
            == 0
        )


@pytest.mark.slow
async def test_dead_item_keeps_reason_and_raw(imported, pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        row = await conn.fetchrow("SELECT reason, detail, raw_key FROM dead_items")
    assert row["reason"] == "not_mime"
    assert "Outlook .msg" in row["detail"]
    assert row["raw_key"].startswith("raw/acme/")


def test_parse_never_raises_and_dead_only_for_non_mail(corpus) -> None:
    for f in corpus_files(corpus / "mime"):
        item = parse_raw(f.read_bytes(), tenant_id="t", mailbox_id="m")
        if isinstance(item, DeadItem):
            assert f.name == "mail_outlook_1.eml"


async def _table_counts(conn: asyncpg.Connection) -> dict[str, int]:
    tables = (
        "messages",
        "message_copies",
        "threads",
        "message_participants",
        "attachments",
        "ingest_conflicts",
        "dead_items",
        "events",
    )
    return {t: await conn.fetchval(f"SELECT count(*) FROM {t}") for t in tables}
