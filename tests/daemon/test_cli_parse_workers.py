"""`inboxd import` and `inboxd reprocess` when their parse worker processes are hit.

    SIGTERM to the whole process group   (systemd's control-group kill, Docker,
                                          `timeout`): the same as a SIGTERM to the
                                          command, exit 130 and the interrupted summary
    SIGKILL of the workers               (the OOM killer): a failed summary, exit 1,
                                          what is stored and how to resume

Each test runs the installed console script in a session of its own with
`--parse-in process`, and acts once a batch has committed. To kill the workers
while the command waits for one of them, the test stops them and waits until
one holds the command (helpers.parse_workers): nothing depends on timing.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import anyio.abc
import orjson
import pytest
from helpers import CLI_TIMEOUT_S, cli_argv, cli_env, eventually, run_cli_async
from helpers.db import rows_in
from helpers.parse_workers import READ_SYSCALL, holds_the_parent, parse_workers, signal_all

from inboxd.pipeline.mime.workers import WORKER_DIED

# Small, with a Message-ID: copies with fresh Message-IDs make a large mbox.
BULK_SAMPLE = "axllent-mailpit/plain-text.eml"
POSTMARK = b"From MAILER-DAEMON Thu Jan  1 00:00:00 1970\n"
# Ten import pages (IMPORT_PAGE_SIZE 500) and twenty reprocess batches (200), seconds
# of work: plenty left to parse once the test has seen the first commit (a reprocess
# batch of unchanged messages takes ~0.15 s).
IMPORT_MESSAGES = 5000
REPROCESS_MESSAGES = 4000
# The import that fills the database before a reprocess test: thousands of messages,
# CPU-bound, not the small command CLI_TIMEOUT_S (60 s) is for. 4,000 took 27 s beside a
# suite and ran past 60 s with two suites at once (load 22 on 2 cores).
SETUP_IMPORT_TIMEOUT_S = 180.0
# A reprocess test's own limit: the setup import, then its commands (CLI_TIMEOUT_S each).
REPROCESS_TEST_TIMEOUT_S = SETUP_IMPORT_TIMEOUT_S + 3 * CLI_TIMEOUT_S
# Workers take a chunk every ~25 ms while a page is parsed, and pages follow each
# other while the import runs: one holds the command within a second or so.
PENDING_TIMEOUT_S = 30.0

pytestmark = [
    pytest.mark.slow,  # subprocesses
    pytest.mark.skipif(READ_SYSCALL is None, reason="read(2)'s number unknown on this machine"),
]


def bulk_mbox(path: Path, corpus: Path, count: int) -> Path:
    """An mbox of `count` distinct messages: BULK_SAMPLE with fresh Message-IDs."""
    template = (corpus / "mime" / BULK_SAMPLE).read_bytes()
    [message_id] = re.findall(rb"(?mi)^Message-ID:\s*(<[^>]+>)", template)
    assert not re.search(rb"(?m)^>*From ", template)  # no quoting needed
    with path.open("wb") as fh:
        for n in range(count):
            fh.write(POSTMARK + template.replace(message_id, f"<w-{n}@test.invalid>".encode()))
            fh.write(b"\n")
    return path


async def term_the_group(proc: anyio.abc.Process, workers: list[int]) -> None:
    os.killpg(proc.pid, signal.SIGTERM)  # the command leads its own process group


async def kill_the_workers(proc: anyio.abc.Process, workers: list[int]) -> None:
    signal_all(workers, signal.SIGSTOP)  # never let go: see helpers.parse_workers
    try:
        await eventually(
            lambda: any(holds_the_parent(pid) for pid in workers),
            PENDING_TIMEOUT_S,
            what="a stopped worker the command waits for",
        )
    finally:
        signal_all(workers, signal.SIGKILL)  # the OOM killer, mid-chunk


Hit = Callable[[anyio.abc.Process, list[int]], Awaitable[None]]


async def hit_mid_chunk(
    command: list[str], env: dict[str, str], committed: bytes, hit: Hit
) -> tuple[int, dict[str, object], str, list[int]]:
    """Run `command`; `hit` it and its workers once `committed` is logged. Returns
    exit code, the --json summary, stderr and the workers.

    stderr is read all along: a command blocked writing its log would stop sending
    chunks to its workers."""
    stderr = bytearray()
    logged = anyio.Event()
    async with await anyio.open_process(command, env=env, start_new_session=True) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        receive = proc.stderr

        async def read_stderr() -> None:
            async for chunk in receive:
                stderr.extend(chunk)
                if committed in stderr:
                    logged.set()
            logged.set()  # ended before it: the assertion below says so

        async with anyio.create_task_group() as tg:
            tg.start_soon(read_stderr)
            await logged.wait()
            workers = parse_workers(proc.pid)
            assert committed in stderr and workers, stderr.decode()
            await hit(proc, workers)
            stdout = b"".join([chunk async for chunk in proc.stdout])
            code = await proc.wait()
    assert stdout, stderr.decode()
    return code, orjson.loads(stdout), stderr.decode(), workers


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


async def assert_gone(workers: list[int]) -> None:
    """The workers ended with the command, though they ignore SIGTERM."""
    await eventually(
        lambda: [pid for pid in workers if running(pid)],
        PENDING_TIMEOUT_S,
        what="no worker outlives the command",
        until=lambda left: not left,
    )


def import_command(dsn: str, archive: Path, parse_in: str) -> list[str]:
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
        "--parse-in",
        parse_in,
        archive,
        script=True,
    )


@pytest.mark.parametrize(
    ("hit", "code", "status"),
    [(term_the_group, 130, "interrupted"), (kill_the_workers, 1, "failed")],
    ids=["SIGTERM-group", "SIGKILL-workers"],
)
async def test_import(
    db_dsn: str, corpus: Path, tmp_path: Path, hit: Hit, code: int, status: str
) -> None:
    archive = bulk_mbox(tmp_path / "bulk.mbox", corpus, IMPORT_MESSAGES)
    command = import_command(db_dsn, archive, "process")

    with anyio.fail_after(CLI_TIMEOUT_S):
        result = await hit_mid_chunk(
            command, cli_env(tmp_path / "data"), b"import_batch_committed", hit
        )

    exit_code, summary, stderr, workers = result
    assert exit_code == code, stderr
    assert summary["status"] == status
    assert summary["input_left_unread"] is True
    done = summary["messages"]
    assert isinstance(done, int) and 0 < done < IMPORT_MESSAGES
    assert await rows_in(db_dsn, "messages") == done, "every page counted is stored"
    if status == "failed":
        assert summary["error"] == WORKER_DIED
        assert f"inboxd: error: {WORKER_DIED}; the messages before it are stored" in stderr
    else:
        assert "inboxd: interrupted" in stderr
    assert "unexpected" not in stderr and "Traceback" not in stderr
    await assert_gone(workers)


@pytest.mark.parametrize(
    ("hit", "code", "status"),
    [(term_the_group, 130, "interrupted"), (kill_the_workers, 1, "failed")],
    ids=["SIGTERM-group", "SIGKILL-workers"],
)
@pytest.mark.timeout(REPROCESS_TEST_TIMEOUT_S)
async def test_reprocess(
    db_dsn: str, corpus: Path, tmp_path: Path, hit: Hit, code: int, status: str
) -> None:
    env = cli_env(tmp_path / "data")
    archive = bulk_mbox(tmp_path / "bulk.mbox", corpus, REPROCESS_MESSAGES)
    imported = await run_cli_async(
        *import_command(db_dsn, archive, "thread")[1:], env=env, timeout_s=SETUP_IMPORT_TIMEOUT_S
    )
    assert imported.code == 0, imported.stderr
    command = cli_argv(
        "reprocess",
        "--dsn",
        db_dsn,
        "--tenant",
        "acme",
        "--json",
        "--log-level",
        "info",
        "--parse-in",
        "process",
        script=True,
    )

    with anyio.fail_after(CLI_TIMEOUT_S):
        result = await hit_mid_chunk(command, env, b"reprocess_batch_committed", hit)

    exit_code, summary, stderr, workers = result
    assert exit_code == code, stderr
    assert summary["status"] == status
    examined, last = summary["examined"], summary["last_message_id"]
    assert isinstance(examined, int) and 0 < examined < REPROCESS_MESSAGES
    assert isinstance(last, int)
    assert f"resume with --after-id {last} " in stderr
    if status == "failed":
        assert summary["error"] == WORKER_DIED
        assert f"inboxd: error: {WORKER_DIED}; every committed batch is stored" in stderr
    else:
        assert "inboxd: interrupted" in stderr
    assert "unexpected" not in stderr and "Traceback" not in stderr
    await assert_gone(workers)


# One Ctrl-C while a worker starts (issue 22 item 12): the worker's interpreter
# starts, imports anyio, then the command's modules (anyio's "init" runs the console
# script as __mp_main__, the first chunk unpickles inboxd.pipeline.mime.workers) — about
# 100-150 ms on an idle machine. The SIGINT lands at the moment a worker appears and
# at points through that start-up: where it lands is what each try varies, nothing
# waits on it.
START_UP_OFFSETS_S = (0.0, 0.0, 0.03, 0.06, 0.1, 0.15)
# Polling /proc for the first worker: it must see the worker within its start-up.
WORKER_POLL_S = 0.001
# Enough parsing left after the first worker appears that the command is still
# working when the signal lands (a page is 500 messages, a reprocess batch 200).
START_UP_IMPORT_MESSAGES = 2000


async def interrupt_at_worker_start(
    command: list[str], env: dict[str, str], offset_s: float
) -> tuple[int, bytes, str]:
    """Run `command` in a session of its own; SIGINT its whole process group (a
    terminal's Ctrl-C) `offset_s` after its first parse worker appears. Returns the
    exit code, stdout and stderr."""
    stderr = bytearray()
    async with await anyio.open_process(command, env=env, start_new_session=True) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        receive, out = proc.stderr, proc.stdout
        stdout = bytearray()

        async def read(stream: anyio.abc.ByteReceiveStream, into: bytearray) -> None:
            async for chunk in stream:
                into.extend(chunk)

        async with anyio.create_task_group() as tg:
            tg.start_soon(read, receive, stderr)
            tg.start_soon(read, out, stdout)
            await eventually(
                lambda: parse_workers(proc.pid),
                PENDING_TIMEOUT_S,
                what="a parse worker",
                poll_s=WORKER_POLL_S,
                abort=lambda: None if proc.returncode is None else "the command ended",
                context=lambda: stderr.decode(errors="replace"),
            )
            if offset_s:
                await anyio.sleep(offset_s)  # where in the start-up the signal lands
            os.killpg(proc.pid, signal.SIGINT)
            code = await proc.wait()
    return code, bytes(stdout), stderr.decode(errors="replace")


def assert_interrupted(code: int, stdout: bytes, stderr: str, offset_s: float) -> dict[str, object]:
    where = f"SIGINT {offset_s} s after a worker appeared\n{stderr}"
    assert code == 130, where
    for crash in ("Traceback", "KeyboardInterrupt", "unexpected"):
        assert crash not in stderr, where
    assert "inboxd: interrupted" in stderr, where
    summary: dict[str, object] = orjson.loads(stdout)
    assert summary["status"] == "interrupted", where
    return summary


async def test_import_ctrl_c_while_a_worker_starts(
    db_dsn: str, corpus: Path, tmp_path: Path
) -> None:
    env = cli_env(tmp_path / "data")
    archive = bulk_mbox(tmp_path / "bulk.mbox", corpus, START_UP_IMPORT_MESSAGES)
    for n, offset_s in enumerate(START_UP_OFFSETS_S):
        command = import_command(db_dsn, archive, "process")
        command[command.index("bulk")] = f"bulk-{n}"  # all new: every try parses
        with anyio.fail_after(CLI_TIMEOUT_S):  # a hang is a failure
            code, stdout, stderr = await interrupt_at_worker_start(command, env, offset_s)
        summary = assert_interrupted(code, stdout, stderr, offset_s)
        assert "re-running the same command imports the rest" in stderr
        assert summary["input_left_unread"] is True


@pytest.mark.timeout(REPROCESS_TEST_TIMEOUT_S + len(START_UP_OFFSETS_S) * CLI_TIMEOUT_S)
async def test_reprocess_ctrl_c_while_a_worker_starts(
    db_dsn: str, corpus: Path, tmp_path: Path
) -> None:
    env = cli_env(tmp_path / "data")
    archive = bulk_mbox(tmp_path / "bulk.mbox", corpus, START_UP_IMPORT_MESSAGES)
    imported = await run_cli_async(
        *import_command(db_dsn, archive, "thread")[1:], env=env, timeout_s=SETUP_IMPORT_TIMEOUT_S
    )
    assert imported.code == 0, imported.stderr
    command = cli_argv(
        "reprocess",
        "--dsn",
        db_dsn,
        "--tenant",
        "acme",
        "--json",
        "--parse-in",
        "process",
        script=True,
    )
    for offset_s in START_UP_OFFSETS_S:
        with anyio.fail_after(CLI_TIMEOUT_S):  # a hang is a failure
            code, stdout, stderr = await interrupt_at_worker_start(command, env, offset_s)
        summary = assert_interrupted(code, stdout, stderr, offset_s)
        last = summary["last_message_id"]  # None: stopped before its first batch
        assert f"resume with --after-id {last or 0} " in stderr
