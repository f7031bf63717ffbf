"""`inboxd import` and `inboxd migrate`, run as the installed console script.

Each test runs the real `inboxd` executable in a subprocess against a fresh
database (`db_dsn`: schema applied) and checks exit code, stdout/stderr and the
rows it left. Messages are corpus files copied into tmp_path.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import anyio
import anyio.abc
import anyio.to_thread
import asyncpg
import orjson
import pytest
from helpers import CLI_TIMEOUT_S, CliResult, cli_argv, cli_env, run_cli_async
from helpers.db import rows_in

# Nothing listens on port 1 (tcpmux, never served here): connection refused.
DEAD_DSN = "postgresql://postgres@127.0.0.1:1/x"

PLAIN_EMLS = (
    "axllent-mailpit/plain-text.eml",
    "axllent-mailpit/tags.eml",
    "axllent-mailpit/mime-attachment.eml",
    "axllent-mailpit/mixed-attachment.eml",
    "axllent-mailpit/inline-attachment.eml",
    "axllent-mailpit/regular-attachment.eml",
)
MBOX_SAMPLES = (
    "mikel-mail/error_emails__cant_parse_from.eml",
    "mailgun-flanker/complaints__yahoo.eml",
    "mikel-mail/attachment_emails__attachment_message_rfc822.eml",
)
MAILDIR_SAMPLES = (
    "mailgun-talon/standard_replies__gmail.eml",
    "mailgun-talon/standard_replies__yahoo.eml",
    "mailgun-talon/standard_replies__outlook.eml",
)
# Small, with a Message-ID: copies with fresh Message-IDs make a large mbox.
BULK_SAMPLE = "axllent-mailpit/plain-text.eml"
POSTMARK = b"From MAILER-DAEMON Thu Jan  1 00:00:00 1970\n"
_FROM_LINE = re.compile(rb"(?m)^(>*From )")

# Every test here runs the CLI as a subprocess (make test-fast skips them).
pytestmark = pytest.mark.slow


def write_mbox(path: Path, messages: list[bytes]) -> None:
    """mboxrd writer: postmark, ">"-quoted From lines, newline-terminated, blank line."""
    with path.open("wb") as fh:
        for raw in messages:
            fh.write(POSTMARK + _FROM_LINE.sub(rb">\1", raw))
            fh.write(b"\n" if raw.endswith(b"\n") else b"\n\n")


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """The command's environment: no DSN from outside, a data dir of its own."""
    return cli_env(tmp_path / "data")


@pytest.fixture
def inboxd(env: dict[str, str]):
    """The installed console script, with the clean environment of `env`."""

    async def run(*args: str | Path) -> CliResult:
        return await run_cli_async(*args, env=env, script=True)

    return run


@pytest.fixture
def mime(corpus: Path) -> Path:
    return corpus / "mime"


def _copy(src: Path, dst: Path) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    return dst


def outcomes(**counts: int) -> dict[str, int]:
    base = dict.fromkeys(
        ("new", "merged", "duplicate", "conflict", "retriable_failure", "permanent_failure"), 0
    )
    return base | counts


# --- import ----------------------------------------------------------------------------


async def test_import_directory_then_rerun_is_all_duplicates(
    inboxd, db_dsn: str, mime: Path, tmp_path: Path
) -> None:
    top = tmp_path / "in"
    for i, name in enumerate(PLAIN_EMLS):
        _copy(mime / name, top / ("nested" if i % 2 else "") / f"m{i}.{'EML' if i == 3 else 'eml'}")
    _copy(mime / "axllent-mailpit" / "SOURCE.md", top / "SOURCE.md")

    first = await inboxd(
        "import",
        "--create",
        "--dsn",
        db_dsn,
        "--tenant",
        "acme",
        "--mailbox",
        "inbox",
        "--json",
        top,
    )

    assert first.code == 0, first.stderr
    summary = first.json
    assert summary["status"] == "ok"
    assert summary["outcomes"] == outcomes(new=6)
    assert summary["messages"] == 6
    assert summary["files"] == 6
    assert summary["skipped_files"] == 1
    assert summary["skipped"] == [str(top / "SOURCE.md")]
    assert summary["dead"] == []
    assert summary["elapsed_s"] > 0
    assert await rows_in(db_dsn, "messages") == 6

    second = await inboxd(
        "import",
        "--create",
        "--dsn",
        db_dsn,
        "--tenant",
        "acme",
        "--mailbox",
        "inbox",
        "--json",
        top,
    )

    assert second.code == 0, second.stderr
    assert second.json["outcomes"] == outcomes(duplicate=6)
    assert await rows_in(db_dsn, "messages") == 6


async def test_small_messages_live_in_the_database_and_large_ones_in_files(
    inboxd, db_dsn: str, mime: Path, tmp_path: Path, env: dict[str, str]
) -> None:
    small = mime / PLAIN_EMLS[0]  # 7.6 KB: under the default 64 KiB
    large = mime / "mailgun-flanker" / "torture.eml"  # over it
    for path in (small, large):
        _copy(path, tmp_path / "in" / path.name)

    result = await inboxd(
        "import",
        "--create",
        "--dsn",
        db_dsn,
        "--tenant",
        "acme",
        "--mailbox",
        "inbox",
        tmp_path / "in",
    )

    assert result.code == 0, result.stderr
    conn = await asyncpg.connect(db_dsn)
    try:
        rows = await conn.fetch("SELECT tenant_id, key, data FROM small_objects")
        raw_keys = await conn.fetch("SELECT raw_key FROM message_copies ORDER BY raw_key")
    finally:
        await conn.close()
    small_key = f"raw/acme/{hashlib.sha256(small.read_bytes()).hexdigest()}"
    large_key = f"raw/acme/{hashlib.sha256(large.read_bytes()).hexdigest()}"
    assert sorted(r["raw_key"] for r in raw_keys) == sorted([small_key, large_key])
    by_key = {r["key"]: (r["tenant_id"], bytes(r["data"])) for r in rows}
    assert by_key[small_key] == ("acme", small.read_bytes())
    assert large_key not in by_key
    files = [p for p in (Path(env["INBOXD_DATA_DIR"]) / "objects").rglob("*") if p.is_file()]
    assert large.read_bytes() in [p.read_bytes() for p in files]
    assert small.read_bytes() not in [p.read_bytes() for p in files]


async def test_human_summary(inboxd, db_dsn: str, mime: Path, tmp_path: Path) -> None:
    path = _copy(mime / PLAIN_EMLS[0], tmp_path / "a.eml")

    result = await inboxd(
        "import", "--create", "--dsn", db_dsn, "--tenant", "acme", "--mailbox", "inbox", path
    )

    assert result.code == 0, result.stderr
    assert result.stdout.startswith("imported: 1 message from 1 file in ")
    assert re.search(r"^\s+new\s+1$", result.stdout, re.M)
    assert result.error_lines == []


async def test_mbox_file(inboxd, db_dsn: str, mime: Path, tmp_path: Path) -> None:
    originals = [(mime / name).read_bytes() for name in MBOX_SAMPLES]
    archive = tmp_path / "archive"  # no extension: recognised by its "From " first line
    write_mbox(archive, originals)
    config = tmp_path / "inboxd.toml"
    objects = tmp_path / "objects"
    config.write_text(
        f'[object_store]\nkind = "local"\npath = "{objects}"\ndatabase_max_bytes = 0\n'
    )

    result = await inboxd(
        "import",
        "--create",
        "--config",
        config,
        "--dsn",
        db_dsn,
        "--tenant",
        "acme",
        "--mailbox",
        "archive",
        "--json",
        archive,
    )

    assert result.code == 0, result.stderr
    assert result.json["outcomes"] == outcomes(new=3)
    assert await rows_in(db_dsn, "messages") == 3
    assert any(objects.rglob("*")), "raw bytes go to the configured object store"

    # The mbox gave back each message byte for byte: the same files as .eml are the
    # same content-addressed items, hence duplicates.
    emls = [
        _copy(mime / name, tmp_path / "eml" / f"{i}.eml") for i, name in enumerate(MBOX_SAMPLES)
    ]
    again = await inboxd(
        "import",
        "--create",
        "--config",
        config,
        "--dsn",
        db_dsn,
        "--tenant",
        "acme",
        "--mailbox",
        "archive",
        "--json",
        *emls,
    )

    assert again.json["outcomes"] == outcomes(duplicate=3)
    assert await rows_in(db_dsn, "messages") == 3


async def test_maildir(inboxd, db_dsn: str, mime: Path, tmp_path: Path) -> None:
    box = tmp_path / "Maildir"
    for part in ("cur", "new", "tmp"):
        (box / part).mkdir(parents=True)
    _copy(mime / MAILDIR_SAMPLES[0], box / "new" / "1700000001.M1P1.host")
    _copy(mime / MAILDIR_SAMPLES[1], box / "new" / "1700000002.M2P1.host")
    _copy(mime / MAILDIR_SAMPLES[2], box / "cur" / "1700000000.M0P1.host:2,S")
    _copy(mime / PLAIN_EMLS[0], box / "tmp" / "1700000003.M3P1.host")  # not delivered yet

    result = await inboxd(
        "import",
        "--create",
        "--dsn",
        db_dsn,
        "--tenant",
        "acme",
        "--mailbox",
        "maildir",
        "--json",
        box,
    )

    assert result.code == 0, result.stderr
    assert result.json["outcomes"] == outcomes(new=3)
    assert result.json["skipped_files"] == 0
    assert await rows_in(db_dsn, "messages") == 3


async def test_not_mail_is_a_dead_item_and_exit_0(
    inboxd, db_dsn: str, mime: Path, tmp_path: Path
) -> None:
    blob = tmp_path / "blob.bin"
    blob.write_bytes(bytes(range(256)) * 16)  # NUL bytes from the first line on
    good = _copy(mime / PLAIN_EMLS[0], tmp_path / "good.eml")

    result = await inboxd(
        "import",
        "--create",
        "--dsn",
        db_dsn,
        "--tenant",
        "acme",
        "--mailbox",
        "inbox",
        "--json",
        blob,
        good,
    )

    assert result.code == 0, result.stderr
    assert result.json["outcomes"] == outcomes(new=1, permanent_failure=1)
    [dead] = result.json["dead"]
    assert dead["source"] == str(blob)
    assert "NUL" in dead["reason"]
    assert await rows_in(db_dsn, "dead_items") == 1
    assert await rows_in(db_dsn, "messages") == 1

    human = await inboxd(
        "import", "--create", "--dsn", db_dsn, "--tenant", "acme", "--mailbox", "inbox", blob
    )
    assert human.code == 0
    assert f"  {blob}: not_mime: " in human.stdout


async def test_missing_path_writes_nothing(inboxd, db_dsn: str, mime: Path, tmp_path: Path) -> None:
    good = _copy(mime / PLAIN_EMLS[0], tmp_path / "in" / "a.eml")
    missing = tmp_path / "no-such-dir"

    result = await inboxd(
        "import",
        "--create",
        "--dsn",
        db_dsn,
        "--tenant",
        "acme",
        "--mailbox",
        "inbox",
        good,
        missing,
    )

    assert result.code == 1
    assert result.stderr.splitlines() == [f"inboxd: error: {missing}: no such file or directory"]
    assert result.stdout == ""
    assert await rows_in(db_dsn, "messages") == 0
    assert await rows_in(db_dsn, "tenants") == 0


async def test_database_down(inboxd, mime: Path, tmp_path: Path) -> None:
    good = _copy(mime / PLAIN_EMLS[0], tmp_path / "a.eml")

    result = await inboxd(
        "import", "--create", "--dsn", DEAD_DSN, "--tenant", "acme", "--mailbox", "inbox", good
    )

    assert result.code == 1
    [line] = result.stderr.splitlines()
    assert line.startswith("inboxd: error: database at 127.0.0.1:1 did not answer: ")


async def test_password_never_shown(inboxd, mime: Path, tmp_path: Path) -> None:
    good = _copy(mime / PLAIN_EMLS[0], tmp_path / "a.eml")

    result = await inboxd(
        "import",
        "--create",
        "--dsn",
        "postgresql://u:s3cr3t-pw@127.0.0.1:1/x",
        "--tenant",
        "acme",
        "--mailbox",
        "inbox",
        good,
    )

    assert result.code == 1
    assert "s3cr3t-pw" not in result.stderr + result.stdout


@pytest.mark.parametrize(("option", "value"), [("--tenant", "Acme Corp"), ("--mailbox", "-x")])
async def test_invalid_ids_are_usage_errors(
    inboxd, db_dsn: str, mime: Path, tmp_path: Path, option: str, value: str
) -> None:
    good = _copy(mime / PLAIN_EMLS[0], tmp_path / "a.eml")
    ids = {"--tenant": "acme", "--mailbox": "inbox", option: value}

    result = await inboxd(
        "import", "--create", "--dsn", db_dsn, *(f"{k}={v}" for k, v in ids.items()), good
    )

    assert result.code == 2
    [line] = result.stderr.splitlines()
    assert line.startswith(f"inboxd: error: invalid {option[2:]} id ")
    assert await rows_in(db_dsn, "tenants") == 0


async def test_usage_error_is_one_line(inboxd) -> None:
    result = await inboxd("import", "--create", "--tenant", "acme")

    assert result.code == 2
    [line] = result.stderr.splitlines()
    assert line.startswith("inboxd: error: the following arguments are required: ")


async def test_bad_config_file_is_a_usage_error(inboxd, tmp_path: Path) -> None:
    config = tmp_path / "inboxd.toml"
    config.write_text("[database\n")

    result = await inboxd("migrate", "--config", config)

    assert result.code == 2
    [line] = result.stderr.splitlines()
    assert line.startswith(f"inboxd: error: config file {config}: invalid TOML")


def bulk_mbox(path: Path, mime: Path, count: int) -> Path:
    """An mbox of `count` distinct messages: BULK_SAMPLE with fresh Message-IDs."""
    template = (mime / BULK_SAMPLE).read_bytes()
    [message_id] = re.findall(rb"(?mi)^Message-ID:\s*(<[^>]+>)", template)
    write_mbox(
        path,
        [template.replace(message_id, f"<bulk-{n}@test.invalid>".encode()) for n in range(count)],
    )
    return path


def bulk_import_command(dsn: str, archive: Path) -> list[str]:
    """`inboxd import --json --log-level info` of `archive` into acme/bulk."""
    return cli_argv(
        "import",
        "--create",
        "--dsn",
        dsn,
        "--tenant",
        "acme",
        "--mailbox",
        "bulk",
        "--json",
        "--log-level",
        "info",
        archive,
        script=True,
    )


async def run_until_first_commit(
    command: list[str], env: dict[str, str], then: Callable[[anyio.abc.Process], Awaitable[None]]
) -> tuple[int, bytes, bytes]:
    """Run `command` (with --log-level info) and call `then` once a batch committed.

    The log line of the first committed batch is the synchronisation point, not a sleep.
    """
    async with await anyio.open_process(command, env=env) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        stderr = b""
        async for chunk in proc.stderr:
            stderr += chunk
            if b"import_batch_committed" in stderr:
                break
        await then(proc)
        stdout = b"".join([chunk async for chunk in proc.stdout])
        async for chunk in proc.stderr:
            stderr += chunk
        return await proc.wait(), stdout, stderr


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
async def test_signal_stops_after_a_whole_batch(
    env: dict[str, str], db_dsn: str, mime: Path, tmp_path: Path, signum: signal.Signals
) -> None:
    from inboxd.adapters.files import IMPORT_PAGE_SIZE as IMPORT_BATCH_SIZE

    total = IMPORT_BATCH_SIZE * 10
    archive = bulk_mbox(tmp_path / "bulk.mbox", mime, total)
    command = bulk_import_command(db_dsn, archive)

    async def interrupt(proc: anyio.abc.Process) -> None:
        proc.send_signal(signum)

    with anyio.fail_after(CLI_TIMEOUT_S):
        code, stdout, stderr = await run_until_first_commit(command, env, interrupt)

    assert code == 130, stderr.decode()
    summary = orjson.loads(stdout)
    assert summary["status"] == "interrupted"
    assert summary["input_left_unread"] is True
    done = summary["messages"]
    assert 0 < done < total
    assert done % IMPORT_BATCH_SIZE == 0, "never half a batch"
    assert summary["outcomes"] == outcomes(new=done)
    assert await rows_in(db_dsn, "messages") == done
    assert b"inboxd: interrupted" in stderr


def bulk_emls(folder: Path, mime: Path, count: int) -> list[Path]:
    """`count` .eml files of distinct messages (BULK_SAMPLE, fresh Message-IDs), in plan order."""
    template = (mime / BULK_SAMPLE).read_bytes()
    [message_id] = re.findall(rb"(?mi)^Message-ID:\s*(<[^>]+>)", template)
    folder.mkdir(parents=True)
    paths = []
    for n in range(count):
        path = folder / f"{n:06d}.eml"
        path.write_bytes(template.replace(message_id, f"<file-{n}@test.invalid>".encode()))
        paths.append(path)
    return paths


async def test_files_that_change_under_the_import(
    env: dict[str, str], db_dsn: str, mime: Path, tmp_path: Path
) -> None:
    from inboxd.adapters.files import IMPORT_PAGE_SIZE

    # six pages; once the first commits, at most four have been read (one being read,
    # one parsed, one queued, one ingested), so the last page is still on disk as planned
    paths = bulk_emls(tmp_path / "in", mime, IMPORT_PAGE_SIZE * 6)
    gone, broken = paths[-400], paths[-200]
    command = bulk_import_command(db_dsn, tmp_path / "in")

    async def change_files(proc: anyio.abc.Process) -> None:
        gone.unlink()  # expunged by a mail client: skipped, the import goes on
        broken.unlink()
        broken.mkdir()  # opens but cannot be read (EISDIR): the import stops there

    with anyio.fail_after(CLI_TIMEOUT_S):
        code, stdout, stderr = await run_until_first_commit(command, env, change_files)

    assert code == 1, stderr.decode()
    summary = orjson.loads(stdout)
    stored = paths.index(broken) - 1  # every file before the broken one but the gone one
    assert summary["status"] == "failed"
    assert summary["messages"] == stored
    assert summary["outcomes"] == outcomes(new=stored)
    assert summary["skipped"] == [str(gone)]
    assert summary["files"] == len(paths) - 1
    assert summary["error"].startswith(f"{broken}: ")
    assert await rows_in(db_dsn, "messages") == stored, "what was read before it is stored"
    assert f"inboxd: error: {broken}: ".encode() in stderr
    assert b'"import_file_vanished"' in stderr


# --- migrate ---------------------------------------------------------------------------


async def test_migrate_twice(inboxd, empty_db: str) -> None:
    first = await inboxd("migrate", "--dsn", empty_db)
    second = await inboxd("migrate", "--dsn", empty_db, "--json")

    assert first.code == 0, first.stderr
    assert first.stdout.startswith("schema applied to database inboxd_empty_")
    assert second.code == 0, second.stderr
    assert second.json["status"] == "ok"
    assert second.json["dsn_source"] == "cli"
    assert await rows_in(empty_db, "messages") == 0


async def test_import_applies_the_schema_itself(
    inboxd, empty_db: str, mime: Path, tmp_path: Path
) -> None:
    good = _copy(mime / PLAIN_EMLS[0], tmp_path / "a.eml")

    result = await inboxd(
        "import",
        "--create",
        "--dsn",
        empty_db,
        "--tenant",
        "acme",
        "--mailbox",
        "inbox",
        "--json",
        good,
    )

    assert result.code == 0, result.stderr
    assert await rows_in(empty_db, "messages") == 1


async def test_migrate_database_down(inboxd) -> None:
    result = await inboxd("migrate", "--dsn", DEAD_DSN)

    assert result.code == 1
    [line] = result.stderr.splitlines()
    assert line.startswith("inboxd: error: database at 127.0.0.1:1 did not answer: ")


# --- database lost mid-way -------------------------------------------------------------


@pytest.fixture
def embedded_pg() -> Iterator[tuple[Path, dict[str, str]]]:
    """A data directory for an embedded server this test may stop and start at will."""
    from inboxd.daemon.embedded_pg.binaries import find_binaries
    from inboxd.daemon.embedded_pg.server import stop_embedded

    if not find_binaries():
        pytest.skip("no PostgreSQL server binaries for an embedded server")
    environ = {"PATH": os.environ.get("PATH", os.defpath)}
    if os.geteuid() == 0:  # postgres refuses root; run it as an unprivileged account
        environ["INBOXD_EMBEDDED_PG_USER"] = "nobody"
    base = Path(tempfile.mkdtemp(prefix="inboxd-cli-pg-"))
    base.chmod(0o755)  # the server's account must traverse it
    try:
        yield base / "data", environ
    finally:
        try:
            stop_embedded(base / "data", environ=environ)
        finally:
            shutil.rmtree(base)


# Both runs of the test below import up to 5,000 messages (BULK_BATCHES batches) into
# an embedded server, CPU-bound: a rerun of 9,500 messages took 32 s on the 2 cores here
# beside a 3-worker suite, and ran past CLI_TIMEOUT_S (60 s, the deadline of a small
# command) beside `make test`'s workers on a busier machine. Past this it hangs; the
# test's own limit leaves room for both runs and the initdb.
BULK_IMPORT_TIMEOUT_S = 180.0
# Batches in the archive. The server is stopped as soon as the first batch's commit is
# logged (a signal to the postmaster ends the import's connection at once), so any
# number that leaves batches behind proves the same; 20 made this the longest import
# test (68-83 s beside a suite) for nothing: 9 batches left is still ~15 s of import at
# the rate above.
BULK_BATCHES = 10


@pytest.mark.timeout(BULK_IMPORT_TIMEOUT_S * 2 + 60)
async def test_database_lost_midway_then_rerun_completes(
    env: dict[str, str], embedded_pg: tuple[Path, dict[str, str]], mime: Path, tmp_path: Path
) -> None:
    from inboxd.adapters.files import IMPORT_PAGE_SIZE as IMPORT_BATCH_SIZE
    from inboxd.daemon.embedded_pg.server import ensure_embedded, stop_embedded

    data, pg_env = embedded_pg
    dsn = (await anyio.to_thread.run_sync(lambda: ensure_embedded(data, environ=pg_env))).dsn
    total = IMPORT_BATCH_SIZE * BULK_BATCHES
    archive = bulk_mbox(tmp_path / "bulk.mbox", mime, total)
    command = bulk_import_command(dsn, archive)

    async def stop_server(proc: anyio.abc.Process) -> None:
        await anyio.to_thread.run_sync(lambda: stop_embedded(data, environ=pg_env))

    with anyio.fail_after(BULK_IMPORT_TIMEOUT_S):
        code, stdout, stderr = await run_until_first_commit(command, env, stop_server)

    assert code == 1, stderr.decode()
    summary = orjson.loads(stdout)
    assert summary["status"] == "incomplete"
    assert summary["not_imported"] > 0
    assert summary["outcomes"]["retriable_failure"] == summary["not_imported"]
    committed = summary["outcomes"]["new"]
    assert 0 < committed < total
    assert committed % IMPORT_BATCH_SIZE == 0, "never half a batch"
    [error] = [line for line in stderr.decode().splitlines() if not line.startswith("{")]
    assert error.startswith(
        f"inboxd: error: {summary['not_imported']} messages not imported (database at "
    )
    assert "re-running the same command is safe" in error

    dsn = (await anyio.to_thread.run_sync(lambda: ensure_embedded(data, environ=pg_env))).dsn
    assert await rows_in(dsn, "messages") == committed
    rerun = await run_cli_async(
        *bulk_import_command(dsn, archive)[1:],
        env=env,
        script=True,
        timeout_s=BULK_IMPORT_TIMEOUT_S,
    )

    assert rerun.code == 0, rerun.stderr
    assert rerun.json["outcomes"] == outcomes(new=total - committed, duplicate=committed)
    assert await rows_in(dsn, "messages") == total


async def test_import_into_a_mailbox_nobody_defined_is_refused_without_create(
    inboxd, db_dsn: str, mime: Path, tmp_path: Path
) -> None:
    good = _copy(mime / PLAIN_EMLS[0], tmp_path / "in" / "a.eml")
    refused = await inboxd(
        "import", "--dsn", db_dsn, "--tenant", "acme", "--mailbox", "inbx", good
    )  # fmt: skip
    assert refused.code == 2, refused.stderr
    assert "mailbox 'inbx' of tenant 'acme' is not in any configuration nor in the database" in (
        refused.stderr
    )
    assert "--create" in refused.stderr
    assert await rows_in(db_dsn, "mailboxes") == 0 and await rows_in(db_dsn, "messages") == 0

    # a mailbox the configuration names needs no --create
    (tmp_path / "tenants").mkdir()
    (tmp_path / "tenants" / "acme.toml").write_text(
        f'id = "acme"\n[[mailboxes]]\nid = "inbox"\nprovider = "maildir"\n'
        f'path = "{tmp_path / "md"}"\n'
    )
    config = tmp_path / "inboxd.toml"
    config.write_text('[tenants]\ndir = "tenants"\n')
    configured = await inboxd(
        "import", "--config", config, "--dsn", db_dsn, "--tenant", "acme", "--mailbox", "inbox",
        good,
    )  # fmt: skip
    assert configured.code == 0, configured.stderr
    # ... nor one the database has already (an earlier import with --create)
    created = await inboxd(
        "import", "--create", "--dsn", db_dsn, "--tenant", "acme", "--mailbox", "archive", good
    )  # fmt: skip
    assert created.code == 0, created.stderr
    again = await inboxd(
        "import", "--dsn", db_dsn, "--tenant", "acme", "--mailbox", "archive", good
    )  # fmt: skip
    assert again.code == 0, again.stderr
