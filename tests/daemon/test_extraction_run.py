"""Extraction through `inboxd run` as a real process: Maildir mail in, results out,
exactly once across SIGTERM, SIGKILL between the parse call and its commit, and a
process paused past its lease (SIGSTOP) whose late commit must change nothing.

The parse API is FakeParseApi, served by this test's event loop on 127.0.0.1.
"""

from __future__ import annotations

import signal
from functools import partial
from pathlib import Path

import aiohttp
import asyncpg
import orjson
import pytest
from fakes.parse_api import Answer, FakeParseApi
from harness import DaemonProcess, deliver, maildir, write_config
from helpers import run_cli_async
from helpers.db import extraction_jobs, fetch

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.slow,
    pytest.mark.own_database,  # daemon subprocesses (tests/conftest.py)
]

TOKEN_ENV = {"PARSE_TOKEN": "t0ken-for-tests"}
SCHEMA = '{type = "object", properties = {order = {type = "string"}}, required = ["order"]}'
DEADLINE_S = 60.0


def add_processor(tmp: Path, body: str) -> None:
    tenant_file = tmp / "tenants" / "acme.toml"
    tenant_file.write_text(tenant_file.read_text() + "\n[[processors]]\n" + body)


def builtin_processor() -> str:
    return f"""id = "orders"
backend = "builtin"
schema = {SCHEMA}
schema_version = 1
[processors.rules]
order = {{ regex = 'Order (?P<value>[A-Z]+-\\d+)', in = "subject" }}
"""


def http_processor(url: str) -> str:
    return f"""id = "parser"
backend = "http"
url = "{url}"
token = "env:PARSE_TOKEN"
timeout_s = 60
concurrency = 2
schema = {SCHEMA}
schema_version = 1
"""


def order_mail(i: int) -> bytes:
    return (
        f"From: shop@vendor.example\r\nTo: ap@acme.example\r\nSubject: Order A-{i}\r\n"
        f"Message-ID: <order-{i}@vendor.example>\r\nDate: Mon, 02 Nov 2026 09:30:00 +0000\r\n"
        f"\r\nYour order {i}.\r\n"
    ).encode()


#: `await jobs(db_dsn)`: every job, oldest first, with whether its lease has expired.
jobs = partial(
    extraction_jobs,
    columns="job_id, state, result, lease_owner, attempts, lease_expires_at < now() AS expired",
    order_by="job_id",
)


async def results(dsn: str) -> list[dict]:
    rows = await fetch(
        dsn, "SELECT payload FROM events WHERE kind = 'extraction.completed' ORDER BY event_id"
    )
    return [orjson.loads(r["payload"])["result"] for r in rows]


async def import_dir(config: Path, dsn: str, directory: Path) -> None:
    """`inboxd import` of `directory` into acme's mailbox "archive"; must exit 0."""
    imported = await run_cli_async(
        "import", "--create", "--config", config, "--dsn", dsn, "--tenant", "acme",
        "--mailbox", "archive", directory,
    )  # fmt: skip
    assert imported.code == 0, imported.stderr


def start(tmp: Path, config: Path, dsn: str, name: str) -> DaemonProcess:
    daemon = DaemonProcess(config, dsn, tmp / f"{name}.log", env=TOKEN_ENV)
    daemon.wait_ready()
    return daemon


def states_are(state: str, n: int):
    return lambda rows: len(rows) == n and all(r["state"] == state for r in rows)


async def test_maildir_mail_is_extracted_once_and_sigterm_holds_no_claim(tmp_path, db_dsn) -> None:
    config = write_config(tmp_path)
    add_processor(tmp_path, builtin_processor())
    box = maildir(tmp_path, "acme", "inbox")
    daemon = start(tmp_path, config, db_dsn, "daemon")
    try:
        deliver(box, [order_mail(i) for i in range(3)])
        await daemon.eventually(
            lambda: jobs(db_dsn), DEADLINE_S, what="3 completed", until=states_are("completed", 3)
        )
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{daemon.port}/metrics") as response,
        ):
            metrics = await response.text()
        assert (
            'inboxd_extractions_total{outcome="completed",processor="orders",tenant="acme"} 3.0'
            in metrics
        )
        daemon.signal(signal.SIGTERM)
        assert daemon.wait_exit() == 0
    finally:
        daemon.kill()
    assert sorted(r["order"] for r in await results(db_dsn)) == ["A-0", "A-1", "A-2"]
    assert {r["lease_owner"] for r in await jobs(db_dsn)} == {None}


async def test_sigkill_between_the_call_and_its_commit_gives_exactly_one_result(
    tmp_path, db_dsn
) -> None:
    async with FakeParseApi() as api:
        api.hold = True  # the call is made, its answer never arrives before the kill
        config = write_config(tmp_path, lease_ttl_s=2.0)
        add_processor(tmp_path, http_processor(api.url))
        box = maildir(tmp_path, "acme", "inbox")
        first = start(tmp_path, config, db_dsn, "first")
        try:
            deliver(box, [order_mail(1)])
            await first.eventually(lambda: len(api.received), DEADLINE_S, what="the call")
        finally:
            first.kill()  # SIGKILL: no release, no commit
        api.hold = False
        api.answer = Answer.json(200, {"order": "A-1"})
        api.release_held()  # the killed daemon's answer goes nowhere
        second = start(tmp_path, config, db_dsn, "second")
        try:
            await second.eventually(
                lambda: jobs(db_dsn), DEADLINE_S, what="completed", until=states_are("completed", 1)
            )
        finally:
            second.kill()
    assert await results(db_dsn) == [{"order": "A-1"}]
    assert len(api.received) == 2  # the parse API has no idempotency key: called again
    assert api.received[1].raw_mime == order_mail(1)


async def test_a_process_paused_past_its_lease_cannot_overwrite_the_reclaimed_result(
    tmp_path, db_dsn
) -> None:
    async with FakeParseApi() as api:
        api.hold = True
        config = write_config(tmp_path, lease_ttl_s=2.0)
        add_processor(tmp_path, http_processor(api.url))
        box = maildir(tmp_path, "acme", "inbox")
        paused = start(tmp_path, config, db_dsn, "paused")
        other: DaemonProcess | None = None
        try:
            deliver(box, [order_mail(1)])
            await paused.eventually(lambda: len(api.received), DEADLINE_S, what="the call")
            paused.signal(signal.SIGSTOP)
            await paused.eventually(
                lambda: jobs(db_dsn),
                DEADLINE_S,
                what="lease expired",
                until=lambda rows: len(rows) == 1 and rows[0]["expired"],
            )
            api.hold = False
            api.answer = Answer.json(200, {"order": "from-reclaimer"})
            other = start(tmp_path, config, db_dsn, "other")
            await other.eventually(
                lambda: jobs(db_dsn), DEADLINE_S, what="completed", until=states_are("completed", 1)
            )
            api.answer = Answer.json(200, {"order": "from-paused"})
            paused.signal(signal.SIGCONT)
            api.release_held()
            await paused.eventually(
                lambda: any(
                    e.get("event") == "extraction_results_fenced_out" for e in paused.events()
                ),
                DEADLINE_S,
                what="the paused worker's late commit, fenced out",
            )
        finally:
            paused.signal(signal.SIGCONT)
            paused.kill()
            if other is not None:
                other.kill()
    assert await results(db_dsn) == [{"order": "from-reclaimer"}]
    (job,) = await jobs(db_dsn)
    assert orjson.loads(job["result"]) == {"order": "from-reclaimer"}


async def test_imported_mail_reaches_the_running_daemons_processors(tmp_path, db_dsn) -> None:
    config = write_config(tmp_path)
    add_processor(tmp_path, builtin_processor())
    maildir(tmp_path, "acme", "inbox")
    archive = tmp_path / "archive"
    archive.mkdir()
    for i in range(4):
        (archive / f"{i}.eml").write_bytes(order_mail(100 + i))
    await import_dir(config, db_dsn, archive)
    # handed over in the import's own transactions, waiting for a daemon
    assert len(await fetch(db_dsn, "SELECT message_id FROM extraction_inbox")) == 4
    daemon = start(tmp_path, config, db_dsn, "daemon")
    try:
        await daemon.eventually(
            lambda: jobs(db_dsn), DEADLINE_S, what="4 completed", until=states_are("completed", 4)
        )
    finally:
        daemon.kill()
    assert sorted(r["order"] for r in await results(db_dsn)) == [f"A-{100 + i}" for i in range(4)]


async def test_import_without_processors_hands_nothing_over(tmp_path, db_dsn) -> None:
    config = write_config(tmp_path)
    archive = tmp_path / "archive"
    archive.mkdir()
    (archive / "1.eml").write_bytes(order_mail(1))
    await import_dir(config, db_dsn, archive)
    assert await fetch(db_dsn, "SELECT message_id FROM extraction_inbox") == []


async def test_sigkill_after_the_answer_and_before_the_commit_gives_exactly_one_result(
    tmp_path, db_dsn
) -> None:
    async with FakeParseApi() as api:
        api.hold = True
        config = write_config(tmp_path, lease_ttl_s=2.0)
        add_processor(tmp_path, http_processor(api.url))
        box = maildir(tmp_path, "acme", "inbox")
        first = start(tmp_path, config, db_dsn, "first")
        blocker = await asyncpg.connect(db_dsn)
        try:
            deliver(box, [order_mail(1)])
            await first.eventually(lambda: len(api.received), DEADLINE_S, what="the call")
            # hold the job's row, so the commit of the answer waits on it
            lock = blocker.transaction()
            await lock.start()
            await blocker.execute("SELECT 1 FROM extraction_jobs FOR UPDATE")
            api.answer = Answer.json(200, {"order": "first answer"})
            api.hold = False
            api.release_held()
            await first.eventually(
                lambda: fetch(
                    db_dsn,
                    "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND query LIKE '%extraction_jobs%'",
                ),
                DEADLINE_S,
                what="the answer's commit waiting on the row",
            )
            first.kill()  # SIGKILL: the answer is lost with the process
            await lock.rollback()
        finally:
            first.kill()
            await blocker.close()
        api.answer = Answer.json(200, {"order": "second answer"})
        second = start(tmp_path, config, db_dsn, "second")
        try:
            await second.eventually(
                lambda: jobs(db_dsn), DEADLINE_S, what="completed", until=states_are("completed", 1)
            )
        finally:
            second.kill()
    assert await results(db_dsn) == [{"order": "second answer"}]
    assert len(api.received) == 2
