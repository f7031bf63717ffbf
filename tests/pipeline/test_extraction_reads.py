"""A row read (ROW, RAW) gives a builtin rule the same fields as a re-parse (PARSED).

`reads_of` (adapters/extraction/builtin.py) lets a processor read the row ingest
wrote instead of parsing the raw MIME again, on the claim that every rule it may
then declare finds the same value either way. Checked here on the real corpus:
every file goes through the ingest stage into a database-tier store (the daemon's
default), every stored message is loaded the three ways of
pipeline/extraction/messages.py, and the same rules run over each.

The regexes capture a whole text or its first word, so a body, subject, name or
address that the row holds differently from a fresh parse shows as a different
value; test_a_row_that_differs_is_seen shows that it does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import aiohttp
import asyncpg
import pytest
from fakes.parse_api import FakeParseApi

from inboxd.adapters.extraction import HttpBackend, compile_schema
from inboxd.adapters.extraction.builtin import Rule, extract_fields, parse_rules, reads_of
from inboxd.pipeline.extraction.messages import Reads, load_messages
from inboxd.pipeline.ingest.stage import IngestBatch, IngestStage
from inboxd.pipeline.message import MessageData
from inboxd.pipeline.mime.parse import parse_raw
from inboxd.pipeline.objectstore.database_tier import DEFAULT_MAX_BYTES, DatabaseTierStore
from inboxd.pipeline.objectstore.local import LocalDirectoryStore
from inboxd.pipeline.objectstore.store import ObjectUnreadable
from inboxd.pipeline.outcomes import Outcome

TENANT = "acme"
#: Files per ingest batch (tests/pipeline/test_ingest_corpus.py imports the same way).
BATCH = 40
WORD = r"(?P<value>\w+)"
WHOLE = r"(?s)(?P<value>.+)"  # the whole text (up to SEARCH_MAX_CHARS), stripped

#: Every rule kind that reads no attachment bytes: what reads_of answers ROW for.
ROW_RULES = parse_rules(
    {
        "subject_word": {"regex": WORD, "in": "subject"},
        "subject_whole": {"regex": WHOLE, "in": "subject"},
        "text_word": {"regex": WORD, "in": "text"},
        "text_whole": {"regex": WHOLE, "in": "text"},
        "text_number": {"regex": r"(?P<value>\d+)", "in": "text", "type": "integer"},
        "html_word": {"regex": WORD, "in": "html_text"},
        "html_whole": {"regex": WHOLE, "in": "html_text"},
        "file_word": {"regex": WORD, "in": "attachment_names"},
        "file_whole": {"regex": WHOLE, "in": "attachment_names"},
        "names": {"attachment": "names"},
        "types": {"attachment": "types"},
        "count": {"attachment": "count"},
        "from_email": {"address": "from.email"},
        "from_domain": {"address": "from.domain"},
        "from_name": {"address": "from.name"},
        "to_emails": {"address": "to.emails"},
    }
)
#: Header rules: RAW for them, never ROW.
HEADER_RULES = parse_rules(
    {
        "h_subject": {"header": "Subject"},
        "h_from": {"header": "From"},
        "h_message_id": {"header": "Message-ID"},
        "h_date": {"header": "Date"},
        "h_missing": {"header": "X-Inboxd-Not-A-Header"},
    }
)
ALL_RULES = {**ROW_RULES, **HEADER_RULES}

PLAIN = "axllent-mailpit/plain-text.eml"
ATTACHED = "axllent-mailpit/mime-attachment.eml"  # an inline JPEG and a PDF
LARGE_HTML = "nodemailer-mailparser/htmllargecallstack.eml"  # 570 KB of HTML: under html_key
NAME_ONLY_SENDER = "sisimai-set-of-emails/bsd__lhost-barracuda-01.eml"  # From: MAILER-DAEMON <>
SLICE = (PLAIN, ATTACHED, LARGE_HTML, NAME_ONLY_SENDER)


@pytest.fixture
def tiered(pool: asyncpg.Pool, store: LocalDirectoryStore) -> DatabaseTierStore:
    return DatabaseTierStore(pool, store, max_bytes=DEFAULT_MAX_BYTES)


@pytest.fixture
def ingest(pool: asyncpg.Pool, tiered: DatabaseTierStore, make_mailbox):
    """`await ingest(files)`: the files ingested as `inboxd import` would; the
    message_id each one is stored under (duplicates share one)."""

    async def run(files: list[Path]) -> dict[Path, int]:
        await make_mailbox(TENANT, "inbox")
        stage = IngestStage(pool, tiered)
        ids: dict[Path, int] = {}
        for start in range(0, len(files), BATCH):
            chunk = files[start : start + BATCH]
            items = [
                parse_raw(f.read_bytes(), tenant_id=TENANT, mailbox_id="inbox", source="import")
                for f in chunk
            ]
            results = await stage.ingest(IngestBatch(TENANT, "inbox", items))
            for f, r in zip(chunk, results, strict=True):
                assert r.outcome is not Outcome.RETRIABLE_FAILURE, f
                if r.message_id is not None:
                    ids[f] = r.message_id
        return ids

    return run


@pytest.fixture
async def sliced(ingest, corpus: Path) -> dict[str, int]:
    ids = await ingest([corpus / "mime" / name for name in SLICE])
    return {name: ids[corpus / "mime" / name] for name in SLICE}


async def load_all(
    pool: asyncpg.Pool, store: DatabaseTierStore, ids: list[int]
) -> dict[Reads, dict[int, MessageData]]:
    loaded = {reads: await load_messages(pool, store, TENANT, ids, reads=reads) for reads in Reads}
    for reads, messages in loaded.items():
        assert sorted(messages) == sorted(ids), reads
    # PARSED really parsed (a row-built message has no raw_sha256); RAW carries the
    # bytes PARSED parsed, ROW none
    for mid in ids:
        parsed = loaded[Reads.PARSED][mid]
        assert parsed.raw_sha256 is not None and parsed.raw is not None, mid
        assert loaded[Reads.RAW][mid].raw == parsed.raw, mid
        assert loaded[Reads.ROW][mid].raw is None, mid
    return loaded


def differences(
    loaded: dict[Reads, dict[int, MessageData]], mid: int
) -> dict[str, tuple[str, str]]:
    """Field → (PARSED's value, the other's), shortened, for every rule that differs:
    all rules for RAW (`raw.field`), the non-header rules for ROW (`row.field`)."""
    parsed = loaded[Reads.PARSED][mid]
    out: dict[str, tuple[str, str]] = {}
    for reads, rules in ((Reads.RAW, ALL_RULES), (Reads.ROW, ROW_RULES)):
        want = extract_fields(parsed, rules)
        got = extract_fields(loaded[reads][mid], rules)
        for field in rules:
            if want.get(field) != got.get(field):
                out[f"{reads}.{field}"] = (repr(want.get(field))[:120], repr(got.get(field))[:120])
    return out


def found(messages: Mapping[int, MessageData], rules: Mapping[str, Rule]) -> dict[str, int]:
    """Field → how many messages a rule found it in."""
    counts = dict.fromkeys(rules, 0)
    for message in messages.values():
        for field in extract_fields(message, rules):
            counts[field] += 1
    return counts


@pytest.mark.slow
async def test_row_and_raw_reads_extract_what_a_reparse_extracts(
    pool: asyncpg.Pool, tiered: DatabaseTierStore, ingest, corpus: Path
) -> None:
    files = sorted((corpus / "mime").rglob("*.eml"))
    stored = await ingest(files)
    ids = sorted(set(stored.values()))
    name_of = {mid: path.relative_to(corpus / "mime").as_posix() for path, mid in stored.items()}
    assert len(ids) > 300  # the corpus, less its duplicates and its one non-mail file
    html_keyed = await pool.fetchval(
        "SELECT count(*) FROM messages WHERE html_key IS NOT NULL AND html_body IS NULL"
    )
    assert html_keyed >= 1  # an HTML body read back from the object store

    loaded = await load_all(pool, tiered, ids)

    differing = {}
    for mid in ids:
        if diff := differences(loaded, mid):
            differing[name_of[mid]] = diff
    assert differing == {}
    # every rule found something in many messages (the comparison compared values);
    # the missing header in none
    counts = found(loaded[Reads.PARSED], ALL_RULES)
    assert counts.pop("h_missing") == 0
    assert counts.pop("count") == len(ids)
    assert min(counts.values()) >= 20, counts


async def test_a_row_that_differs_is_seen(
    pool: asyncpg.Pool, tiered: DatabaseTierStore, sliced: dict[str, int]
) -> None:
    """The comparison above can fail: rows changed behind the parse show up, field by
    field, in both row reads, while header rules (raw bytes) stay the same."""
    ids = sorted(sliced.values())
    async with pool.acquire() as conn:
        await conn.execute(
            "UPDATE messages SET subject = subject || ' zzq', text_body = text_body || ' zzq', "
            "html_body = html_body || '<p>zzq</p>', from_name = from_name || ' zzq'"
        )
        await conn.execute(
            "UPDATE message_participants SET address = 'zzq' || address WHERE role = 'to'"
        )
        await conn.execute(
            "UPDATE attachments SET filename = 'zzq' || filename, content_type = 'text/zzq'"
        )

    loaded = await load_all(pool, tiered, ids)

    mutated = {"subject_whole", "text_whole", "html_whole", "from_name", "to_emails"}
    mutated |= {"names", "types", "file_word", "file_whole"}
    seen = {mid: differences(loaded, mid) for mid in ids}
    for mid, diff in seen.items():
        assert diff, mid
        assert {k.partition(".")[2] for k in diff} <= mutated, diff
        assert {k.partition(".")[0] for k in diff} == {Reads.RAW, Reads.ROW}, diff
    assert {k.partition(".")[2] for diff in seen.values() for k in diff} == mutated
    text = extract_fields(loaded[Reads.ROW][sliced[PLAIN]], ROW_RULES)["text_whole"]
    assert text.endswith(" zzq")


async def test_a_sender_with_a_name_and_no_address_keeps_its_name(
    pool: asyncpg.Pool, tiered: DatabaseTierStore, sliced: dict[str, int]
) -> None:
    """A sender written "MAILER-DAEMON <>" is stored as from_address '' and from_name
    'MAILER-DAEMON'; the row read gave no sender at all, so from.name found the
    name only in a re-parse."""
    mid = sliced[NAME_ONLY_SENDER]
    loaded = await load_all(pool, tiered, [mid])
    rules = parse_rules({"sender": {"address": "from.name"}, "email": {"address": "from.email"}})
    for reads in Reads:
        assert extract_fields(loaded[reads][mid], rules) == {"sender": "MAILER-DAEMON"}, reads


# What can happen to a raw object: deleted, or cut short under its key (a torn copy,
# a truncated file): bytes that no longer hash to the key are never handed out.
DAMAGE = {
    "gone": "DELETE FROM small_objects o USING messages m "
    "WHERE o.key = m.raw_key AND m.message_id = $1 RETURNING o.key",
    "truncated": "UPDATE small_objects o SET data = substr(o.data, 1, 300) FROM messages m "
    "WHERE o.key = m.raw_key AND m.message_id = $1 RETURNING o.key",
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
async def test_a_message_whose_raw_is_gone_or_corrupt_is_read_from_its_row(
    pool: asyncpg.Pool, tiered: DatabaseTierStore, sliced: dict[str, int], damage: str
) -> None:
    mid = sliced[PLAIN]
    before = await load_messages(pool, tiered, TENANT, [mid], reads=Reads.PARSED)
    assert before[mid].raw is not None
    damaged = await pool.fetch(DAMAGE[damage], mid)
    assert len(damaged) == 1  # a 7.6 KB message: its raw bytes were in the table

    rules = {
        field: ROW_RULES[field]
        for field in ("subject_whole", "text_whole", "from_email", "from_name", "to_emails")
    }
    want = extract_fields(before[mid], rules)
    assert set(want) == set(rules)
    headers = parse_rules({"subject": {"header": "Subject"}, "date": {"header": "Date"}})
    for reads in Reads:
        message = (await load_messages(pool, tiered, TENANT, [mid], reads=reads))[mid]
        assert message.raw is None and message.raw_sha256 is None, reads  # built from the row
        assert extract_fields(message, rules) == want, reads
        # without raw bytes a Subject header rule reads the stored subject; Date has no
        # stored field to fall back on
        assert extract_fields(message, headers) == {"subject": want["subject_whole"]}, reads


class UnreadableObject:
    """The tiered store, except that one key answers ObjectUnreadable (EIO, a
    directory where its file goes, S3 denying it)."""

    def __init__(self, store: DatabaseTierStore, key: str) -> None:
        self.store, self.key = store, key

    async def get_many(self, keys: list[str]) -> dict[str, bytes | Exception]:
        got = await self.store.get_many(keys)
        got[self.key] = ObjectUnreadable(self.key, "Input/output error")
        return got


async def test_a_message_whose_raw_cannot_be_read_is_read_from_its_row(
    pool: asyncpg.Pool, tiered: DatabaseTierStore, sliced: dict[str, int]
) -> None:
    """Not an error of the batch: raising gave the claim batch back uncharged and
    claimed it again, for ever, stalling every job claimed with it."""
    mid, other = sliced[PLAIN], next(i for i in sliced.values() if i != sliced[PLAIN])
    key = await pool.fetchval("SELECT raw_key FROM messages WHERE message_id = $1", mid)
    store = UnreadableObject(tiered, key)
    got = await load_messages(pool, store, TENANT, [mid, other], reads=Reads.RAW)  # type: ignore[arg-type]
    assert got[mid].raw is None and got[mid].subject  # the row alone
    assert got[other].raw is not None  # the others are read as usual


@pytest.fixture
async def parse_api() -> AsyncIterator[FakeParseApi]:
    async with FakeParseApi() as server:
        yield server


async def test_the_http_backend_reads_and_sends_the_raw_bytes(
    pool: asyncpg.Pool,
    tiered: DatabaseTierStore,
    sliced: dict[str, int],
    corpus: Path,
    parse_api: FakeParseApi,
) -> None:
    async with aiohttp.ClientSession() as session:
        backend = HttpBackend(
            url=parse_api.url,
            token="tok",
            schema=compile_schema({"type": "object"}),
            timeout_s=10,
            session=session,
        )
        assert backend.reads is Reads.RAW
        messages = await load_messages(
            pool, tiered, TENANT, list(sliced.values()), reads=backend.reads
        )
        for mid in sliced.values():
            assert await backend.extract(messages[mid]) == {}
    sent = [received.raw_mime for received in parse_api.received]
    assert sent == [(corpus / "mime" / name).read_bytes() for name in sliced]


def test_reads_of_the_rules_compared_here() -> None:
    assert reads_of(ROW_RULES) is Reads.ROW
    assert reads_of(ALL_RULES) is Reads.RAW
    in_attachments = parse_rules({"total": {"regex": WORD, "in": "attachments"}})
    assert reads_of({**ALL_RULES, **in_attachments}) is Reads.PARSED
