"""`inboxd reprocess`, run as the installed console script after `inboxd import`.

Each test imports a few corpus files into a fresh database (`db_dsn`), then runs
the real executable and checks exit code, output and the rows it left.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import asyncpg
import pytest
from helpers import CliResult, cli_env, run_cli_async

FILES = (
    "axllent-mailpit/plain-text.eml",
    "axllent-mailpit/mime-attachment.eml",
    "mikel-mail/plain_emails__raw_email10.eml",
    "sisimai-set-of-emails/bsd__lhost-postfix-01.eml",
    "sisimai-set-of-emails/dos__lhost-postfix-01.eml",  # merged with the one above
)
MESSAGES = len(FILES) - 1
# Nothing listens on port 1 (tcpmux, never served here): connection refused.
DEAD_DSN = "postgresql://postgres@127.0.0.1:1/x"

# Every test here runs the CLI as a subprocess (make test-fast skips them).
pytestmark = pytest.mark.slow


@pytest.fixture
def inboxd(tmp_path: Path):
    env = cli_env(tmp_path / "data")

    async def run(*args: str | Path) -> CliResult:
        return await run_cli_async(*args, env=env, script=True)

    return run


@pytest.fixture
async def imported(inboxd, db_dsn: str, corpus: Path, tmp_path: Path) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    for i, name in enumerate(FILES):
        shutil.copyfile(corpus / "mime" / name, folder / f"m{i}.eml")
    result = await inboxd(
        "import", "--create", "--dsn", db_dsn, "--tenant", "acme", "--mailbox", "inbox", folder
    )
    assert result.code == 0, result.stderr


async def row_versions(dsn: str) -> tuple[list[tuple[object, ...]], int]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT message_id, xmin::text, updated_at FROM messages")
        return sorted(map(tuple, rows)), await conn.fetchval("SELECT count(*) FROM events")
    finally:
        await conn.close()


async def test_reprocess_twice_changes_nothing(inboxd, db_dsn: str, imported: None) -> None:
    before = await row_versions(db_dsn)

    for _ in range(2):
        result = await inboxd("reprocess", "--dsn", db_dsn, "--tenant", "acme", "--json")

        assert result.code == 0, result.stderr
        summary = result.json
        assert isinstance(summary, dict)
        assert summary["status"] == "ok"
        assert (summary["examined"], summary["unchanged"], summary["updated"]) == (
            MESSAGES,
            MESSAGES,
            0,
        )
        assert (summary["reported"], summary["no_raw"], summary["raw_missing"]) == (0, 0, 0)
        assert summary["updated_fields"] == {} and summary["reported_messages"] == []
        assert summary["last_message_id"] is not None and summary["elapsed_s"] > 0
    assert await row_versions(db_dsn) == before


async def test_human_summary_and_scopes(inboxd, db_dsn: str, imported: None) -> None:
    human = await inboxd("reprocess", "--dsn", db_dsn, "--tenant", "acme", "--parse-in", "thread")
    other = await inboxd(
        "reprocess", "--dsn", db_dsn, "--tenant", "acme", "--mailbox", "other", "--json"
    )
    later = await inboxd(
        "reprocess", "--dsn", db_dsn, "--tenant", "acme", "--since", "2999-01-01", "--json"
    )

    assert human.code == 0, human.stderr
    assert human.stdout.startswith(f"reprocessed: {MESSAGES} messages of tenant acme in ")
    assert f"  unchanged    {MESSAGES:>8}" in human.stdout
    for result in (other, later):
        assert result.code == 0, result.stderr
        assert result.json["examined"] == 0  # type: ignore[index]


@pytest.mark.parametrize(
    "args",
    [
        ("--tenant", "Acme Corp"),
        ("--tenant", "acme", "--since", "yesterday"),
        ("--tenant", "acme", "--after-id", "-3"),
        ("--mailbox", "inbox"),
    ],
    ids=["bad-tenant", "bad-since", "bad-after-id", "no-tenant"],
)
async def test_bad_arguments_are_a_one_line_usage_error(
    inboxd, db_dsn: str, args: tuple[str, ...]
) -> None:
    result = await inboxd("reprocess", "--dsn", db_dsn, *args)

    assert result.code == 2
    assert len(result.error_lines) == 1 and result.error_lines[0].startswith("inboxd: error: ")
    assert result.stdout == ""


async def test_an_unreachable_database_is_a_one_line_error(inboxd) -> None:
    result = await inboxd("reprocess", "--dsn", DEAD_DSN, "--tenant", "acme")

    assert result.code == 1
    assert len(result.error_lines) == 1 and "127.0.0.1:1" in result.error_lines[0]


async def test_a_row_the_parser_now_derives_differently_is_rewritten_with_an_event(
    inboxd, db_dsn: str, imported: None
) -> None:
    conn = await asyncpg.connect(db_dsn)
    try:  # a row as an older parser left it
        target, subject = await conn.fetchrow(
            "SELECT message_id, subject FROM messages ORDER BY message_id LIMIT 1"
        )
        await conn.execute(
            "UPDATE messages SET subject = 'as an older parser read it' WHERE message_id = $1",
            target,
        )
        events_before = await conn.fetchval("SELECT count(*) FROM events")
    finally:
        await conn.close()

    result = await inboxd("reprocess", "--dsn", db_dsn, "--tenant", "acme", "--json")

    assert result.code == 0, result.stderr
    summary = result.json
    assert isinstance(summary, dict)
    assert (summary["updated"], summary["unchanged"]) == (1, MESSAGES - 1)
    assert summary["updated_fields"] == {"subject": 1}
    conn = await asyncpg.connect(db_dsn)
    try:
        assert (
            await conn.fetchval("SELECT subject FROM messages WHERE message_id = $1", target)
            == subject
        )
        events = await conn.fetch(
            "SELECT kind, message_id, payload->'fields' AS fields FROM events "
            "ORDER BY event_id OFFSET $1",
            events_before,
        )
    finally:
        await conn.close()
    assert [(e["kind"], e["message_id"], e["fields"]) for e in events] == [
        ("message.updated", target, '["subject"]')
    ]


async def test_a_corrupt_raw_object_is_reported_and_its_row_kept(
    inboxd, db_dsn: str, imported: None
) -> None:
    conn = await asyncpg.connect(db_dsn)
    try:  # the raw object cut off inside its headers, under the same key
        target = await conn.fetchval(
            "UPDATE small_objects o SET data = substr(o.data, 1, 40) FROM messages m "
            "WHERE o.key = m.raw_key AND m.message_id = (SELECT min(message_id) FROM messages) "
            "RETURNING m.message_id"
        )
    finally:
        await conn.close()
    before = await row_versions(db_dsn)

    result = await inboxd("reprocess", "--dsn", db_dsn, "--tenant", "acme", "--json")

    assert result.code == 0, result.stderr
    summary = result.json
    assert isinstance(summary, dict)
    assert (summary["status"], summary["updated"], summary["unchanged"]) == ("ok", 0, MESSAGES - 1)
    [reported] = summary["reported_messages"]
    assert (reported["message_id"], reported["reason"]) == (target, "raw_corrupt")
    assert reported["detail"].startswith("raw/acme/")  # the key whose bytes do not hash to it
    assert await row_versions(db_dsn) == before  # subject, sender, body and events as they were
