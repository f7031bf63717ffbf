"""`inboxd run` as a real process: Maildir door, signals, reload, leases, shutdown."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import shutil
import signal
import socket
import time
from pathlib import Path

import aiohttp
import anyio
import asyncpg
import orjson
import pytest
from harness import (
    DaemonProcess,
    deliver,
    generated_messages,
    maildir,
    write_config,
    write_tenant,
)
from helpers import run_cli, run_cli_async
from helpers.db import count, fetchval

# Real `inboxd run` processes (make test-fast skips them).
pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.slow,
    pytest.mark.own_database,  # daemon subprocesses (tests/conftest.py)
]


async def wait_rows(
    dsn: str,
    daemon: DaemonProcess,
    n: int,
    timeout_s: float,
    *,
    what: str,
    sql: str = "SELECT count(*) FROM messages",
    at_least: bool = False,
) -> None:
    """Wait until `sql` counts exactly `n` (or at least `n`), or fail with the daemon's log."""

    await daemon.eventually(
        lambda: count(dsn, sql),
        timeout_s,
        what=f"{what}: {sql} {'>=' if at_least else '=='} {n}",
        until=lambda got: got >= n if at_least else got == n,
    )


def start(tmp: Path, config: Path, dsn: str, name: str = "daemon") -> DaemonProcess:
    daemon = DaemonProcess(config, dsn, tmp / f"{name}.log")
    daemon.wait_ready()
    return daemon


async def test_maildir_drop_becomes_rows_and_moves_to_cur(tmp_path, db_dsn) -> None:
    config = write_config(tmp_path)
    box = maildir(tmp_path, "acme", "inbox")
    daemon = start(tmp_path, config, db_dsn)
    try:
        deliver(box, generated_messages(3, tag="drop"))

        await wait_rows(db_dsn, daemon, 3, 30, what="3 messages ingested")
        await daemon.eventually(lambda: _moved(box, 3), 10, what="files moved to cur/")
        created = "SELECT count(*) FROM events WHERE kind = 'message.created'"
        assert await count(db_dsn, created) == 3
        # `inboxd status` sees it: its row in inboxd_daemons, by pid
        mine = f"SELECT count(*) FROM inboxd_daemons WHERE pid = {daemon.proc.pid}"
        await daemon.eventually(lambda: count(db_dsn, mine), 10, what="daemon row", until=bool)
        # a run the poll scanner's claim asked for counts from that claim: its start is
        # the claim's time, so waiting for a turn does not stretch the period
        claimed = (
            "SELECT count(*) FROM mailboxes WHERE sync_started_at = last_polled_at "
            "AND last_success_at >= sync_started_at"
        )
        await daemon.eventually(
            lambda: count(db_dsn, claimed), 20, what="a claimed run from its claim", until=bool
        )
    finally:
        daemon.signal(signal.SIGTERM)
        assert daemon.wait_exit(60) == 0
    assert await count(db_dsn, mine) == 0  # a clean stop removes it


async def _moved(box: Path, n: int) -> bool:
    return len(list((box / "cur").iterdir())) == n and not list((box / "new").iterdir())


# The backfill SIGTERM interrupts: the signal goes as soon as the first page (250) is
# counted, with no process to start in between, so the 9 pages after it (several
# seconds even on 2 idle cores) are still to come. 5,000 made the test run 2 minutes
# beside a suite.
BACKFILL_MESSAGES = 2500


async def test_sigterm_mid_backfill_then_restart_loses_and_doubles_nothing(
    tmp_path, db_dsn
) -> None:
    n = BACKFILL_MESSAGES
    config = write_config(tmp_path)
    box = maildir(tmp_path, "acme", "inbox")
    deliver(box, generated_messages(n, tag="bf"))
    daemon = start(tmp_path, config, db_dsn)

    await wait_rows(db_dsn, daemon, 250, 60, what="first pages committed", at_least=True)
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit(60) == 0
    partial = await count(db_dsn, "SELECT count(*) FROM messages")
    assert 0 < partial <= n
    # every file already moved to cur/ has its row (nothing acknowledged unstored)
    assert len(list((box / "cur").iterdir())) <= partial
    daemon = start(tmp_path, config, db_dsn, "daemon2")
    try:
        await wait_rows(db_dsn, daemon, n, 240, what="backfill finished after restart")
        await daemon.eventually(lambda: _moved(box, n), 60, what="all files in cur/")
        assert await count(db_dsn, "SELECT count(*) FROM message_copies") == n
        assert await count(db_dsn, "SELECT count(DISTINCT message_id_norm) FROM messages") == n
    finally:
        daemon.signal(signal.SIGTERM)
        assert daemon.wait_exit(60) == 0


async def test_mail_delivered_while_the_daemon_is_down_is_stored_after_restart(
    tmp_path, db_dsn
) -> None:
    """Issue 22's property for the Maildir door: the directory is the state, so what
    an MTA delivers while no daemon runs is stored by the next one, once."""
    config = write_config(tmp_path)
    box = maildir(tmp_path, "acme", "inbox")
    daemon = start(tmp_path, config, db_dsn)
    try:
        deliver(box, generated_messages(2, tag="up"), prefix="up")
        await wait_rows(db_dsn, daemon, 2, 30, what="mail delivered while running")
    finally:
        daemon.signal(signal.SIGTERM)
        assert daemon.wait_exit(60) == 0
    deliver(box, generated_messages(3, tag="down"), prefix="down")  # nobody running

    daemon = start(tmp_path, config, db_dsn, "daemon2")
    try:
        await wait_rows(db_dsn, daemon, 5, 30, what="mail delivered while down")
        deliver(box, generated_messages(1, tag="after"), prefix="after")
        await wait_rows(db_dsn, daemon, 6, 30, what="mail delivered after the restart")
        await daemon.eventually(lambda: _moved(box, 6), 10, what="files moved to cur/")
        assert await count(db_dsn, "SELECT count(*) FROM message_copies") == 6
    finally:
        daemon.signal(signal.SIGTERM)
        assert daemon.wait_exit(60) == 0


async def test_sighup_adds_a_tenant_live(tmp_path, db_dsn) -> None:
    config = write_config(tmp_path)
    maildir(tmp_path, "acme", "inbox")
    daemon = start(tmp_path, config, db_dsn)
    try:
        write_tenant(tmp_path, "globex", ["support"])
        box = maildir(tmp_path, "globex", "support")
        daemon.signal(signal.SIGHUP)
        deliver(box, generated_messages(2, tag="hup"))

        await wait_rows(
            db_dsn,
            daemon,
            2,
            30,
            what="new tenant's mail ingested",
            sql="SELECT count(*) FROM messages WHERE tenant_id = 'globex'",
        )
    finally:
        daemon.signal(signal.SIGTERM)
        assert daemon.wait_exit(60) == 0


async def test_broken_tenant_file_on_sighup_keeps_the_old_config(tmp_path, db_dsn) -> None:
    config = write_config(tmp_path)
    box = maildir(tmp_path, "acme", "inbox")
    daemon = start(tmp_path, config, db_dsn)
    try:
        (tmp_path / "tenants" / "acme.toml").write_text('id = "acme"\n[[mailboxes]\nbroken')
        daemon.signal(signal.SIGHUP)
        await daemon.eventually(lambda: _logged(daemon, "config_reloaded"), 20, what="reload")
        deliver(box, generated_messages(2, tag="keep"))

        await wait_rows(db_dsn, daemon, 2, 30, what="old config still syncing")
    finally:
        daemon.signal(signal.SIGTERM)
        assert daemon.wait_exit(60) == 0


async def _logged(daemon: DaemonProcess, event: str) -> bool:
    return any(e.get("event") == event for e in daemon.events())


async def test_database_cancel_flag_stops_between_pages_and_sync_now_resumes(
    tmp_path, db_dsn
) -> None:
    config = write_config(tmp_path)
    box = maildir(tmp_path, "acme", "inbox")
    # enough that the sync is still running when `sync cancel` has started (a CLI
    # process) and its flag is read: 4,000 were all stored within ~10 s beside a
    # 4-worker suite once raw bytes went to PostgreSQL
    deliver(box, generated_messages(12000, tag="cx"))
    daemon = start(tmp_path, config, db_dsn)
    try:
        await wait_rows(db_dsn, daemon, 250, 60, what="sync running", at_least=True)
        assert (
            await run_cli_async("sync", "cancel", "--mailbox", "inbox", "--dsn", db_dsn)
        ).code == 0
        await daemon.eventually(
            lambda: _logged(daemon, "sync_cancel_flag_honoured"), 60, what="cancel honoured"
        )
        # files moved to cur/ are exactly those ingested: nothing skipped ahead
        in_db = await count(db_dsn, "SELECT count(*) FROM messages")
        assert len(list((box / "cur").iterdir())) <= in_db < 12000
        assert (await run_cli_async("sync", "now", "--mailbox", "inbox", "--dsn", db_dsn)).code == 0

        await wait_rows(db_dsn, daemon, 12000, 240, what="resumed to the end")
    finally:
        daemon.signal(signal.SIGTERM)
        assert daemon.wait_exit(60) == 0


async def test_sigusr1_cancels_running_syncs_gracefully(tmp_path, db_dsn) -> None:
    config = write_config(tmp_path)
    box = maildir(tmp_path, "acme", "inbox")
    deliver(box, generated_messages(3000, tag="usr"))
    daemon = start(tmp_path, config, db_dsn)
    try:
        await wait_rows(db_dsn, daemon, 250, 60, what="sync running", at_least=True)
        daemon.signal(signal.SIGUSR1)
        await daemon.eventually(
            lambda: _logged(daemon, "sync_cancelled"), 30, what="sync cancelled"
        )
        assert daemon.proc.poll() is None  # the process carries on
        in_db = await count(db_dsn, "SELECT count(*) FROM messages")
        assert len(list((box / "cur").iterdir())) <= in_db

        # the poll scanner starts the next run
        await wait_rows(db_dsn, daemon, 3000, 240, what="next run finishes")
    finally:
        daemon.signal(signal.SIGTERM)
        assert daemon.wait_exit(60) == 0


async def test_two_processes_on_one_database_never_double_ingest(tmp_path, db_dsn) -> None:
    config = write_config(tmp_path, tenants={"acme": ["a", "b", "c"]})
    boxes = [maildir(tmp_path, "acme", m) for m in ("a", "b", "c")]
    one = start(tmp_path, config, db_dsn, "one")
    two = start(tmp_path, config, db_dsn, "two")
    try:
        for i, box in enumerate(boxes):
            deliver(box, generated_messages(800, tag=f"two{i}"))

        await wait_rows(db_dsn, one, 2400, 240, what="all mail from three mailboxes")
        assert await count(db_dsn, "SELECT count(*) FROM message_copies") == 2400
        for box in boxes:
            await one.eventually(lambda b=box: _moved(b, 800), 60, what="moved")
    finally:
        for daemon in (one, two):
            daemon.signal(signal.SIGTERM)
        assert one.wait_exit(60) == 0
        assert two.wait_exit(60) == 0


def test_bad_config_exits_2_naming_file_and_key(tmp_path) -> None:
    config = write_config(tmp_path)
    (tmp_path / "tenants" / "acme.toml").write_text(
        'id = "acme"\n[[mailboxes]]\nid = "inbox"\nprovider = "maildir"\npoll_interval_s = "x"\n'
        'path = "/tmp/x"\n'
    )
    result = run_cli("run", "--config", config, "--dsn", "postgresql://postgres@127.0.0.1:1/none")
    assert result.code == 2
    assert "acme.toml" in result.stderr and "poll_interval_s" in result.stderr


async def test_oversized_request_gets_413_without_the_body_being_read(tmp_path, db_dsn) -> None:
    config = write_config(tmp_path)
    maildir(tmp_path, "acme", "inbox")
    daemon = start(tmp_path, config, db_dsn)
    try:
        with anyio.fail_after(10):
            stream = await anyio.connect_tcp("127.0.0.1", daemon.port)
            async with stream:
                # announce 10 GB, send 3 bytes: a server that reads bodies would hang here
                await stream.send(
                    b"POST /v1/outbound HTTP/1.1\r\nHost: t\r\n"
                    b"Content-Type: application/json\r\n"
                    b'Content-Length: 10000000000\r\n\r\n{"a'
                )
                head = await stream.receive()
        assert head.startswith(b"HTTP/1.1 413")
    finally:
        daemon.signal(signal.SIGTERM)
        assert daemon.wait_exit(60) == 0


async def test_sse_client_receives_events_of_its_tenant_only(tmp_path, db_dsn) -> None:
    import aiohttp

    config = write_config(tmp_path, tenants={})
    write_tenant(tmp_path, "acme", ["inbox"], token="ACME_TOKEN")
    write_tenant(tmp_path, "globex", ["sales"], token="GLOBEX_TOKEN")
    acme, globex = maildir(tmp_path, "acme", "inbox"), maildir(tmp_path, "globex", "sales")
    env = {"ACME_TOKEN": "acme-secret-token-1", "GLOBEX_TOKEN": "globex-secret-token-2"}
    daemon = DaemonProcess(config, db_dsn, tmp_path / "daemon.log", env=env)
    daemon.wait_ready()
    received: list[dict] = []
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(
                f"http://127.0.0.1:{daemon.port}/v1/events?last_event_id=0",
                headers={"Authorization": "Bearer acme-secret-token-1"},
                timeout=aiohttp.ClientTimeout(total=60),
            ) as response:
                assert response.status == 200
                deliver(globex, generated_messages(2, tag="g"))
                deliver(acme, generated_messages(2, tag="a"))
                with anyio.fail_after(45):
                    async for raw in response.content:
                        line = raw.decode().strip()
                        if line.startswith("data:"):
                            received.append(orjson.loads(line[5:]))
                        created = [e for e in received if e["kind"] == "message.created"]
                        if len(created) == 2:
                            break
        assert {e["mailbox_id"] for e in received} == {"inbox"}
        assert [e["event_id"] for e in received] == sorted(e["event_id"] for e in received)
        assert "acme-secret-token-1" not in daemon.log_path.read_text()
    finally:
        daemon.signal(signal.SIGTERM)
        assert daemon.wait_exit(60) == 0


async def test_second_signal_exits_at_once_without_acknowledging_unstored_mail(
    tmp_path, db_dsn
) -> None:
    config = write_config(tmp_path, shutdown_deadline_s=120)
    box = maildir(tmp_path, "acme", "inbox")
    deliver(box, generated_messages(5000, tag="two"))
    daemon = start(tmp_path, config, db_dsn)

    await wait_rows(db_dsn, daemon, 250, 60, what="backfill running", at_least=True)
    daemon.signal(signal.SIGTERM)
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit(20) == 0  # far below the 120 s drain deadline
    in_db = await count(db_dsn, "SELECT count(*) FROM messages")
    assert len(list((box / "cur").iterdir())) <= in_db
    assert await count(db_dsn, "SELECT count(*) FROM message_copies") == in_db


async def test_vanished_maildir_marks_the_mailbox_for_attention_and_the_rest_runs(
    tmp_path, db_dsn
) -> None:
    config = write_config(tmp_path, tenants={"acme": ["gone", "fine"]})
    gone, fine = maildir(tmp_path, "acme", "gone"), maildir(tmp_path, "acme", "fine")
    daemon = start(tmp_path, config, db_dsn)
    try:
        shutil.rmtree(gone)
        state_sql = (
            "SELECT sync_state FROM mailboxes WHERE tenant_id = 'acme' AND mailbox_id = 'gone'"
        )

        await daemon.eventually(
            lambda: fetchval(db_dsn, state_sql),
            30,
            what="mailbox 'gone' in sync_state needs_attention",
            until=lambda state: state == "needs_attention",
        )
        deliver(fine, generated_messages(2, tag="fine"))

        await wait_rows(db_dsn, daemon, 2, 30, what="other mailbox still syncing")
    finally:
        daemon.signal(signal.SIGTERM)
        assert daemon.wait_exit(60) == 0


def _resend_hook(tmp_path: Path, extra: str = "") -> None:
    tenant = tmp_path / "tenants" / "acme.toml"
    tenant.write_text(
        tenant.read_text()
        + f"""
[[delivery_sources]]
id = "resend"
provider = "resend"
secret = "env:TEST_RESEND_SECRET"
{extra}
"""
    )


async def test_webhook_event_is_stored_applied_and_announced(tmp_path, db_dsn) -> None:
    key = b"daemon-test-key"
    config = write_config(tmp_path)
    maildir(tmp_path, "acme", "inbox")
    _resend_hook(tmp_path)
    daemon = DaemonProcess(
        config,
        db_dsn,
        tmp_path / "daemon.log",
        env={"TEST_RESEND_SECRET": "whsec_" + base64.b64encode(key).decode()},
    )
    try:
        port = daemon.wait_ready()
        body = (
            b'{"type": "email.bounced", "created_at": "2026-11-30T09:00:00Z", "data": '
            b'{"email_id": "em_7", "to": ["gone@example.com"], "bounce": '
            b'{"type": "Permanent", "subType": "General"}}}'
        )
        ts = str(int(time.time()))
        mac = hmac.new(key, b"msg_7." + ts.encode() + b"." + body, hashlib.sha256).digest()
        headers = {
            "webhook-id": "msg_7",
            "webhook-timestamp": ts,
            "webhook-signature": "v1," + base64.b64encode(mac).decode(),
            "content-type": "application/json",
        }
        conn = await asyncpg.connect(db_dsn)
        try:
            announced = anyio.Event()
            await conn.add_listener("inboxd_events", lambda *_: announced.set())
            async with (
                aiohttp.ClientSession() as session,
                session.post(
                    f"http://127.0.0.1:{port}/hooks/esp/acme/resend", data=body, headers=headers
                ) as response,
            ):
                assert response.status == 200
            with anyio.fail_after(20):
                await announced.wait()  # the worker applied it: outbox rows committed
            kinds = await conn.fetch("SELECT kind FROM events ORDER BY event_id")
            assert [k["kind"] for k in kinds] == ["delivery.updated", "suppression.added"]
            assert await conn.fetchval("SELECT status FROM delivery_evidence") == "bounced"
            assert await conn.fetchval("SELECT address_hash FROM suppressions") == (
                hashlib.sha256(b"gone@example.com").hexdigest()
            )
        finally:
            await conn.close()
    finally:
        daemon.signal(signal.SIGTERM)
        assert daemon.wait_exit(60) == 0


def test_bad_delivery_source_exits_2_naming_the_key(tmp_path) -> None:
    config = write_config(tmp_path)
    _resend_hook(tmp_path, extra='recipients = "shout"')
    result = run_cli(
        "check-config",
        config,
        env={**os.environ, "TEST_RESEND_SECRET": "whsec_" + "QUFBQUFBQUFBQUFB"},
    )
    assert result.code == 2
    assert "acme.toml: delivery_sources[0].recipients" in result.stderr


READY_MAILBOXES = 300


async def test_readyz_says_ready_only_once_every_mailbox_is_registered(tmp_path, db_dsn) -> None:
    """A load balancer or an operator reading /readyz 200 may ring any mailbox: every
    configured one has its runner by then (its cursor-lag series is there)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mailboxes = [f"box{i}" for i in range(READY_MAILBOXES)]
    config = write_config(tmp_path, tenants={"acme": mailboxes}, port=port)
    daemon = DaemonProcess(config, db_dsn, tmp_path / "daemon.log")
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:

            async def ready() -> bool:
                try:
                    async with http.get(f"{base}/readyz") as answer:
                        return answer.status == 200
                except aiohttp.ClientConnectionError:
                    return False  # not listening yet

            await daemon.eventually(ready, 120, what="/readyz 200")
            async with http.get(f"{base}/metrics") as answer:
                text = await answer.text()
        registered = {
            line.split('mailbox="')[1].split('"')[0]
            for line in text.splitlines()
            if line.startswith("inboxd_cursor_lag_seconds{")
        }
        assert registered == set(mailboxes), f"{len(registered)} of {len(mailboxes)}"
    finally:
        daemon.signal(signal.SIGTERM)
        assert daemon.wait_exit(60) == 0


async def test_a_store_failure_at_run_time_names_the_os_error_and_path(tmp_path, db_dsn) -> None:
    """The object store breaks under a running daemon: the mailbox's last error says
    what the OS said and where, not only that a page failed."""
    config = write_config(tmp_path)
    box = maildir(tmp_path, "acme", "inbox")
    daemon = start(tmp_path, config, db_dsn)
    try:
        objects = tmp_path / "objects"
        if objects.exists():
            shutil.rmtree(objects)
        objects.write_text("a file where the store's directory was")
        # larger than the database tier (64 KiB): its raw bytes go to the directory
        big = generated_messages(1, tag="big")[0] + b"x" * 100_000 + b"\r\n"
        deliver(box, [big])
        error = await daemon.eventually(
            lambda: fetchval(db_dsn, "SELECT last_error FROM mailboxes WHERE mailbox_id = 'inbox'"),
            30,
            what="the store failure in the mailbox's last error",
        )
        assert "Not a directory" in error and str(objects) in error, error
    finally:
        daemon.signal(signal.SIGTERM)
        assert daemon.wait_exit(60) == 0
