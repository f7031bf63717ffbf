"""`inboxd extract backfill|retry|list` and the extraction section of `inboxd status`,
run as `python -m inboxd.daemon.cli` against a fresh database (`db_dsn`).

Messages are ingested in-process (helpers.mail); each test runs the real command
line and checks exit code, output and the rows it left. The interrupted backfill
is held inside its first batch by a row lock the test owns, not by timing.
"""

from __future__ import annotations

import signal
from functools import partial
from pathlib import Path
from textwrap import dedent

import anyio
import asyncpg
import orjson
import pytest
from helpers import CLI_TIMEOUT_S, CliResult, cli_argv, cli_env, eventually, run_cli_async
from helpers.db import extraction_jobs
from helpers.mail import store_mail

from inboxd.daemon.commands.extract_backfill import BACKFILL_BATCH_SIZE
from inboxd.pipeline.extraction import claims
from inboxd.pipeline.extraction.enqueue import enqueue
from inboxd.pipeline.ingest.stage import IngestStage

T = "acme"
VENDOR = "billing@vendor.example"
OTHER = "someone@elsewhere.example"
LEASE_S = 60.0
TENANT_FILE = """
    id = "acme"
    [[mailboxes]]
    id = "inbox"
    provider = "maildir"
    path = "maildir/inbox"

    [[processors]]
    id = "invoices"
    backend = "builtin"
    schema_version = 2
    schema = {type = "object", properties = {number = {type = "string"}}}
    filter = {senders = ["*@vendor.example"]}
    rules = {number = {regex = 'Invoice (?P<value>[0-9]+)', in = "subject"}}

    [[processors]]
    id = "receipts"
    mailboxes = ["inbox"]
    backend = "builtin"
    schema_version = 1
    schema = {type = "object"}
    rules = {total = {regex = 'Total (?P<value>[0-9.]+)', in = "text"}}
"""

# Every test here runs the CLI as a subprocess (make test-fast skips them).
pytestmark = pytest.mark.slow


@pytest.fixture
def config(tmp_path: Path) -> Path:
    """main.toml and tenants/acme.toml: processors invoices (vendor mail) and receipts."""
    (tmp_path / "tenants" / "maildir" / "inbox").mkdir(parents=True)
    (tmp_path / "tenants" / "acme.toml").write_text(dedent(TENANT_FILE))
    main = tmp_path / "main.toml"
    main.write_text('[tenants]\ndir = "tenants"\n')
    return main


@pytest.fixture
def inboxd(db_dsn: str, tmp_path: Path):
    env = cli_env(tmp_path / "data")

    async def run(*args: str | Path) -> CliResult:
        return await run_cli_async(*args, "--dsn", db_dsn, env=env)

    return run


@pytest.fixture
async def inbox(make_mailbox) -> None:
    await make_mailbox(T, "inbox")


#: `await jobs(pool)`: (message, processor, schema_version, state) of every job.
jobs = partial(
    extraction_jobs,
    columns="message_id, processor_id, schema_version, state",
    order_by="message_id",
)


# --- backfill ------------------------------------------------------------------------------


async def test_backfill_queues_what_the_processor_takes_once(
    inboxd, config: Path, pool: asyncpg.Pool, stage: IngestStage, inbox: None
) -> None:
    ids = await store_mail(stage, T, "inbox", [VENDOR, OTHER, VENDOR, VENDOR, OTHER])
    args = ("extract", "backfill", "--config", config, "--tenant", T, "--processor", "invoices")

    first = await inboxd(*args, "--json")
    again = await inboxd(*args)

    assert first.code == 0, first.stderr
    assert first.json == first.json | {
        "status": "ok",
        "tenant": T,
        "processor": "invoices",
        "schema_version": "2",
        "examined": 5,
        "queued": 3,
        "linked": 0,
        "conflicts": 0,
        "not_matching": 2,
        "last_message_id": max(ids),
    }
    vendor = sorted((ids[0], ids[2], ids[3]))
    assert await jobs(pool) == [(m, "invoices", "2", "pending") for m in vendor]
    assert again.code == 0, again.stderr
    assert again.stdout.startswith(
        f"backfilled: 5 messages of tenant {T} for processor invoices (schema_version 2) in "
    )
    assert "  queued               0\n" in again.stdout
    assert "  linked               3  (already queued or extracted)\n" in again.stdout
    assert f"  last message id {max(ids)}\n" in again.stdout
    assert len(await jobs(pool)) == 3


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--tenant", "globex", "--processor", "invoices"), "no tenant globex in "),
        (
            ("--tenant", T, "--processor", "orders"),
            "no processor orders in tenant acme (its processors: invoices, receipts)",
        ),
        (
            ("--tenant", T, "--processor", "receipts", "--mailbox", "other"),
            "processor receipts takes mailboxes inbox only, not other",
        ),
        (("--tenant", "Acme Corp", "--processor", "invoices"), "invalid tenant id"),
    ],
    ids=["unknown-tenant", "unknown-processor", "mailbox-not-taken", "bad-tenant-id"],
)
async def test_backfill_names_what_it_cannot_find_with_exit_2(
    inboxd, config: Path, pool: asyncpg.Pool, args: tuple[str, ...], message: str
) -> None:
    result = await inboxd("extract", "backfill", "--config", config, *args)

    assert result.code == 2, result.stderr
    assert len(result.error_lines) == 1
    assert result.error_lines[0].startswith("inboxd: error: ")
    assert message in result.error_lines[0]
    assert result.stdout == ""
    assert await jobs(pool) == []


async def test_backfill_needs_the_config_that_holds_the_processor(inboxd) -> None:
    result = await inboxd("extract", "backfill", "--tenant", T, "--processor", "invoices")

    assert result.code == 2
    assert result.error_lines == [
        "inboxd: error: extract backfill needs --config FILE: the processor is read from "
        "the tenant file"
    ]


async def test_sigint_finishes_the_batch_then_resumes_after_it(
    db_dsn: str, config: Path, tmp_path: Path, pool: asyncpg.Pool, stage: IngestStage, inbox
) -> None:
    total = BACKFILL_BATCH_SIZE + 20
    ids = sorted(await store_mail(stage, T, "inbox", [VENDOR] * total))  # backfill order
    database = db_dsn.rsplit("/", 1)[1]
    command = cli_argv(
        "extract", "backfill", "--dsn", db_dsn, "--config", config, "--tenant", T,
        "--processor", "invoices", "--json",
    )  # fmt: skip
    env = cli_env(tmp_path / "data")
    holder = await asyncpg.connect(db_dsn)
    try:
        # Queuing a job reads its message row FOR KEY SHARE (the foreign key): while
        # this transaction holds the first message FOR UPDATE, batch one cannot commit.
        lock = holder.transaction()
        await lock.start()
        await holder.execute(
            "SELECT 1 FROM messages WHERE tenant_id = $1 AND message_id = $2 FOR UPDATE",
            T,
            ids[0],
        )
        with anyio.fail_after(CLI_TIMEOUT_S):
            async with await anyio.open_process(command, env=env) as proc:
                await eventually(
                    lambda: pool.fetchval(
                        "SELECT count(*) FROM pg_stat_activity "
                        "WHERE datname = $1 AND wait_event_type = 'Lock'",
                        database,
                    ),
                    CLI_TIMEOUT_S,
                    what="the backfill waiting inside its first batch",
                )
                proc.send_signal(signal.SIGINT)
                await lock.rollback()
                assert proc.stdout is not None and proc.stderr is not None
                stdout = b"".join([chunk async for chunk in proc.stdout])
                stderr = b"".join([chunk async for chunk in proc.stderr])
                code = await proc.wait()
    finally:
        await holder.close()

    assert code == 130, stderr.decode()
    summary = orjson.loads(stdout)
    assert (summary["status"], summary["examined"], summary["queued"]) == (
        "interrupted",
        BACKFILL_BATCH_SIZE,
        BACKFILL_BATCH_SIZE,
    )
    last = ids[BACKFILL_BATCH_SIZE - 1]
    assert summary["last_message_id"] == last
    assert f"resume with --after-id {last}" in stderr.decode()
    assert len(await jobs(pool)) == BACKFILL_BATCH_SIZE  # the whole batch, never half

    resumed = await run_cli_async(
        *command[3:], "--after-id", str(last), env=env
    )  # the same command line (after the interpreter and -m), resumed
    assert resumed.code == 0, resumed.stderr
    assert (resumed.json["examined"], resumed.json["queued"]) == (20, 20)  # type: ignore[index]
    assert [m for m, *_ in await jobs(pool)] == ids


# --- retry and list ------------------------------------------------------------------------


@pytest.fixture
async def failed_job(pool: asyncpg.Pool, stage: IngestStage, inbox: None) -> tuple[int, int]:
    """Two invoices jobs: one needs_review (returned first), one pending."""
    ids = await store_mail(stage, T, "inbox", [VENDOR, VENDOR])
    await enqueue(pool, T, "invoices", "2", ids)
    [job] = await claims.claim_due(pool, [T], "w", LEASE_S, 1)
    assert await claims.fail_terminal(pool, job, "result does not validate:\n'number' missing")
    pending = await pool.fetchval(
        "SELECT job_id FROM extraction_jobs WHERE job_id <> $1", job.job_id
    )
    return job.job_id, pending


async def test_list_shows_what_needs_review_and_retry_requeues_it_once(
    inboxd, pool: asyncpg.Pool, failed_job: tuple[int, int]
) -> None:
    failed, pending = failed_job

    listed = await inboxd("extract", "list", "--tenant", T, "--state", "needs_review", "--json")
    human = await inboxd("extract", "list", "--tenant", T, "--limit", "1")
    retried = await inboxd("extract", "retry", "--tenant", T, "--id", str(failed))
    again = await inboxd("extract", "retry", "--tenant", T, "--id", str(failed), "--json")
    missing = await inboxd("extract", "retry", "--tenant", T, "--id", "999999")

    assert listed.code == 0, listed.stderr
    body = listed.json
    assert isinstance(body, dict) and body["total"] == 1
    [job] = body["jobs"]
    assert (job["job_id"], job["state"], job["attempts"]) == (failed, "needs_review", 1)
    assert job["review_reason"] == "result does not validate: 'number' missing"
    assert (job["processor"], job["schema_version"]) == ("invoices", "2")
    assert human.code == 0, human.stderr
    header, row, footer = human.stdout.splitlines()
    assert header.split() == [
        "JOB", "PROCESSOR", "VERSION", "MESSAGE", "STATE", "ATTEMPTS", "NEXT", "ATTEMPT", "REASON"
    ]  # fmt: skip
    assert row.split()[:5] == [str(pending), "invoices", "2", row.split()[3], "pending"]
    assert footer == "1 of 2 extraction jobs, newest first (--limit shows more)"
    assert retried.code == 0, retried.stderr
    assert retried.stdout == (
        f"job {failed} re-queued (was needs_review): pending, due now, attempts reset\n"
    )
    state = await pool.fetchrow(
        "SELECT state, attempts FROM extraction_jobs WHERE job_id = $1", failed
    )
    assert tuple(state) == ("pending", 0)
    assert again.code == 1
    assert again.json == {
        "command": "extract retry",
        "status": "not_retried",
        "tenant": T,
        "job_id": failed,
        "previous_state": "pending",
        "state": "pending",
    }
    assert (missing.code, missing.stdout) == (1, f"no job 999999 in tenant {T}\n")


async def test_retry_of_a_processor_requeues_every_failed_job_of_it(
    inboxd, pool: asyncpg.Pool, failed_job: tuple[int, int]
) -> None:
    failed, pending = failed_job
    other = await inboxd("extract", "retry", "--tenant", T, "--processor", "receipts", "--json")
    retried = await inboxd("extract", "retry", "--tenant", T, "--processor", "invoices", "--json")
    too_big = await inboxd("extract", "retry", "--tenant", T, "--id", str(2**63))
    both = await inboxd("extract", "retry", "--tenant", T, "--id", "1", "--processor", "x")

    assert (other.code, other.json["retried"], other.json["status"]) == (
        0,
        0,
        "nothing_to_retry",
    )
    assert retried.code == 0, retried.stderr
    assert retried.json == {
        "command": "extract retry",
        "status": "retried",
        "tenant": T,
        "processor": "invoices",
        "retried": 1,
    }
    rows = await pool.fetch("SELECT job_id, state, attempts FROM extraction_jobs ORDER BY 1")
    assert sorted(tuple(r) for r in rows) == sorted(
        [(failed, "pending", 0), (pending, "pending", 0)]
    )
    # a job id past bigint is the operator's typo, not the database's failure
    assert too_big.code == 2 and "at most" in too_big.stderr
    assert both.code == 2


async def test_list_conflicts_and_an_empty_listing(
    inboxd, pool: asyncpg.Pool, failed_job: tuple[int, int]
) -> None:
    await pool.execute(
        "INSERT INTO extraction_payload_conflicts (tenant_id, job_id, existing_message_id, "
        "existing_fingerprint, new_message_id, new_fingerprint) "
        "SELECT tenant_id, job_id, message_id, payload_fingerprint, message_id, 'other' "
        "FROM extraction_jobs WHERE job_id = $1",
        failed_job[0],
    )

    conflicts = await inboxd("extract", "list", "--tenant", T, "--conflicts", "--json")
    none = await inboxd("extract", "list", "--tenant", T, "--processor", "receipts")
    mixed = await inboxd("extract", "list", "--tenant", T, "--conflicts", "--state", "running")

    assert conflicts.code == 0, conflicts.stderr
    [c] = conflicts.json["conflicts"]  # type: ignore[index]
    assert (c["job_id"], c["processor"], c["schema_version"]) == (failed_job[0], "invoices", "2")
    assert c["dedup_key"].startswith("mid:")
    assert (none.code, none.stdout) == (0, "no extraction jobs (tenant acme, processor receipts)\n")
    assert mixed.code == 2


# --- status --------------------------------------------------------------------------------


async def test_status_shows_the_extraction_backlog_only_where_there_is_one(
    inboxd, pool: asyncpg.Pool, failed_job: tuple[int, int], make_mailbox
) -> None:
    await make_mailbox("globex", "inbox")  # a tenant without processors

    human = await inboxd("status")
    alone = await inboxd("status", "--extraction", "--json")
    mailboxes = await inboxd("status", "--json")
    quiet = await inboxd("status", "--tenant", "globex")

    assert human.code == 0, human.stderr
    section = human.stdout.split("\n\n")[-1].splitlines()
    assert section[0].split() == [
        "TENANT", "PROCESSOR", "PENDING", "RUNNING", "RETRY", "WAIT", "NEEDS", "REVIEW", "DUE",
        "OLDEST", "DUE",
    ]  # fmt: skip
    assert section[1].split()[:7] == [T, "invoices", "1", "0", "0", "1", "1"]
    assert len(section) == 2  # globex has nothing to show
    assert alone.code == 0, alone.stderr
    assert alone.json == [
        {
            "tenant": T,
            "inbox": 0,
            "inbox_oldest_s": 0.0,
            "processors": [
                {
                    "processor": "invoices",
                    "pending": 1,
                    "running": 0,
                    "retry_wait": 0,
                    "needs_review": 1,
                    "due": 1,
                    "oldest_due_s": alone.json[0]["processors"][0]["oldest_due_s"],  # type: ignore[index]
                }
            ],
        }
    ]
    # the plain --json output is still the list of mailboxes it always was
    assert [(m["tenant_id"], m["mailbox_id"]) for m in mailboxes.json] == [  # type: ignore[union-attr]
        (T, "inbox"),
        ("globex", "inbox"),
    ]
    assert quiet.code == 0 and "PROCESSOR" not in quiet.stdout
