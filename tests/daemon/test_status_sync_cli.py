"""`inboxd status` and `inboxd sync cancel|now`, run as `python -m inboxd.daemon.cli`.

Each test prepares mailbox rows in a fresh database (`db_dsn`) through
pipeline.mailbox.leases and pipeline.mailbox.scheduling, runs the command
in a subprocess and checks exit code, output and the database. `sync now` is
observed the way a daemon would see it: LISTEN on the doorbell channel from a separate connection.
"""

from __future__ import annotations

import re
from pathlib import Path

import anyio
import asyncpg
import pytest
from helpers import CliResult, cli_env, run_cli_async

from inboxd.pipeline.doorbell import DOORBELL_CHANNEL, parse_doorbell
from inboxd.pipeline.mailbox import leases, scheduling

NOTIFY_DEADLINE_S = 10.0
LEASE_TTL_S = 60.0

# Every test here runs the CLI as a subprocess (make test-fast skips them).
pytestmark = pytest.mark.slow


@pytest.fixture
def inboxd(db_dsn: str, tmp_path: Path):
    """Run `python -m inboxd.daemon.cli ARGS --dsn <test db>` with a clean environment."""
    env = cli_env(tmp_path / "data")

    async def run(*args: str, dsn: str | None = db_dsn) -> CliResult:
        return await run_cli_async(*args, *(["--dsn", dsn] if dsn is not None else []), env=env)

    return run


@pytest.fixture
async def mailboxes(pool: asyncpg.Pool, make_mailbox) -> None:
    """acme/support (gmail: cursor, success, leased), acme/inbox and globex/inbox (imap)."""
    await make_mailbox("acme", "support", provider="gmail")
    await make_mailbox("acme", "inbox", provider="imap")
    await make_mailbox("globex", "inbox", provider="imap")
    token = await leases.acquire_lease(pool, "acme", "support", "replica-1", LEASE_TTL_S)
    cursor = "https://graph.example/delta?token=" + "x" * 80
    assert await leases.commit_cursor(pool, "acme", "support", token, cursor)
    await scheduling.record_success(pool, "acme", "support")
    await scheduling.record_failure(
        pool, "globex", "inbox", "login failed:\nbad password", attention=True
    )


# --- status ------------------------------------------------------------------------------


async def test_status_json_lists_every_mailbox(inboxd, mailboxes) -> None:
    result = await inboxd("status", "--json")
    assert result.code == 0, result.stderr
    rows = result.json
    assert isinstance(rows, list)
    assert [(r["tenant_id"], r["mailbox_id"]) for r in rows] == [
        ("acme", "inbox"),
        ("acme", "support"),
        ("globex", "inbox"),
    ]
    inbox, support, globex = rows
    assert support["provider"] == "gmail" and support["sync_mode"] == "auto"
    assert support["cursor"].startswith("https://graph.example/delta?token=")
    assert support["last_success_at"] is not None and 0 <= support["lag_s"] < 60
    assert (support["leased"], support["lease_owner"]) == (True, "replica-1")
    assert (inbox["cursor"], inbox["last_success_at"], inbox["lag_s"]) == (None, None, None)
    assert globex["sync_state"] == "needs_attention"
    assert globex["last_error"] == "login failed: bad password"
    assert globex["throttled"] is True and globex["throttle_until"] is not None


async def test_status_tenant_filter_and_plain_table(inboxd, mailboxes) -> None:
    result = await inboxd("status", "--json", "--tenant", "globex")
    assert result.code == 0, result.stderr
    assert [r["mailbox_id"] for r in result.json] == ["inbox"]

    table = await inboxd("status")  # stdout is a pipe: plain aligned text
    assert table.code == 0, table.stderr
    daemons_line, *lines = table.stdout.splitlines()
    assert daemons_line.startswith("daemons: none has run against this database")
    assert lines[0].split() == [
        "TENANT",
        "MAILBOX",
        "PROVIDER",
        "MODE",
        "CURSOR",
        "LAST",
        "SUCCESS",
        "LAG",
        "THROTTLE",
        "UNTIL",
        "STATE",
        "DEAD",
        "ATT",
        "PENDING",
        "LAST",
        "ERROR",
    ]
    assert len(lines) == 4
    cursor_col = lines[0].index("CURSOR")
    assert all(line[cursor_col - 2 : cursor_col] == "  " for line in lines)  # aligned
    support = next(line for line in lines if " support " in line)
    assert "…" in support and "x" * 80 not in support  # cursor truncated
    assert "never" in next(line for line in lines if line.startswith("acme    inbox"))
    globex = next(line for line in lines if line.startswith("globex"))
    assert "needs_attention" in globex
    assert re.search(r"\d\d:\d\d:\d\dZ: login failed: bad password", globex), globex

    empty = await inboxd("status", "--json", "--tenant", "nobody")
    assert (empty.code, empty.json) == (0, [])


async def test_status_names_the_running_daemons_and_the_last_one_seen(inboxd, pool) -> None:
    async def record(owner: str, host: str, pid: int, age_s: float) -> None:
        await pool.execute(
            "INSERT INTO inboxd_daemons (owner, host, pid, version, started_at, heartbeat_at)"
            " VALUES ($1, $2, $3, '9.9.9', now() - interval '1 hour',"
            " now() - make_interval(secs => $4))",
            owner, host, pid, age_s,
        )  # fmt: skip

    await record("gone:1:aa", "old-host", 11, 7200)
    stopped = await inboxd("status")
    assert stopped.stdout.splitlines()[0] == (
        "daemons: none running (last seen: old-host pid 11, heartbeat 2h00m ago); "
        "mail is not being synced"
    )
    await record("live:2:bb", "vm-1", 4242, 3)
    running = await inboxd("status")
    first = running.stdout.splitlines()[0]
    assert first.startswith("daemons: 1 running — vm-1 pid 4242 inboxd 9.9.9, started "), first
    listed = await inboxd("status", "--daemons", "--json")
    assert [(d["host"], d["pid"], d["running"]) for d in listed.json] == [
        ("vm-1", 4242, True),
        ("old-host", 11, False),
    ]


async def test_status_marks_what_no_configuration_names_and_stale_errors(
    inboxd, pool, mailboxes, tmp_path: Path
) -> None:
    # The configuration names acme/inbox and acme/support; globex/inbox was removed.
    (tmp_path / "tenants").mkdir()
    (tmp_path / "tenants" / "acme.toml").write_text(
        'id = "acme"\n'
        + "".join(
            f'[[mailboxes]]\nid = "{m}"\nprovider = "maildir"\npath = "{tmp_path / m}"\n'
            for m in ("inbox", "support")
        )
    )
    config = tmp_path / "inboxd.toml"
    config.write_text('[tenants]\ndir = "tenants"\n')
    # acme/inbox failed once, then synced: its error is history.
    await scheduling.record_failure(pool, "acme", "inbox", "timeout talking to the server")
    await pool.execute(
        "UPDATE mailboxes SET last_error_at = now() - interval '1 minute'"
        " WHERE tenant_id = 'acme' AND mailbox_id = 'inbox'"
    )
    await scheduling.record_success(pool, "acme", "inbox")

    shown = await inboxd("status", "--config", str(config), "--json")
    assert shown.code == 0, shown.stderr
    by_id = {(r["tenant_id"], r["mailbox_id"]): r for r in shown.json}
    assert by_id[("globex", "inbox")]["configured"] is False
    assert by_id[("acme", "support")]["configured"] is True
    assert by_id[("acme", "inbox")]["last_error_current"] is False
    assert by_id[("globex", "inbox")]["last_error_current"] is True
    table = (await inboxd("status", "--config", str(config))).stdout.splitlines()
    globex = next(line for line in table if line.startswith("globex"))
    assert "not configured" in globex
    inbox = next(line for line in table if line.startswith("acme    inbox"))
    assert "timeout" not in inbox
    # Without a configuration nothing is compared.
    plain = await inboxd("status", "--json")
    assert {r["configured"] for r in plain.json} == {None}


async def test_status_errors(inboxd, empty_db) -> None:
    bad = await inboxd("status", "--tenant", "Not Valid")
    assert bad.code == 2 and "invalid tenant id" in bad.error_lines[-1]
    down = await inboxd("status", dsn="postgresql://postgres@127.0.0.1:1/x")
    assert down.code == 1 and down.error_lines[-1].startswith("inboxd: error:")
    # a database of its own without the schema (the server's `postgres` database
    # may hold anything by now)
    no_schema = await inboxd("status", dsn=empty_db)
    assert no_schema.code == 1 and "inboxd migrate" in no_schema.error_lines[-1]


# --- sync cancel -------------------------------------------------------------------------


async def test_sync_cancel_sets_the_flag(inboxd, pool, mailboxes) -> None:
    result = await inboxd("sync", "cancel", "--mailbox", "support", "--json")
    assert result.code == 0, result.stderr
    assert result.json == {
        "command": "sync cancel",
        "status": "ok",
        "tenant": "acme",
        "mailbox": "support",
        "running": True,
        "lease_owner": "replica-1",
    }
    assert await leases.cancel_requested(pool, "acme", "support")
    assert not await leases.cancel_requested(pool, "acme", "inbox")


async def test_sync_cancel_with_nothing_running_says_so_and_sets_nothing(
    inboxd, pool, mailboxes
) -> None:
    plain = await inboxd("sync", "cancel", "--mailbox", "inbox", "--tenant", "globex")
    assert plain.code == 0, plain.stderr
    assert "no sync is running for globex/inbox: nothing to cancel" in plain.stdout
    assert not await leases.cancel_requested(pool, "globex", "inbox")
    as_json = await inboxd("sync", "cancel", "--mailbox", "inbox", "--tenant", "acme", "--json")
    assert as_json.json["running"] is False and as_json.json["lease_owner"] is None
    assert not await pool.fetchval("SELECT bool_or(cancel_requested) FROM mailboxes")
    # and the next run is not stopped by a flag left for it: none was left
    token = await leases.acquire_lease(pool, "globex", "inbox", "replica-2", LEASE_TTL_S)
    assert token is not None and not await leases.take_cancel(pool, "globex", "inbox")


async def test_a_cancel_never_outlives_the_run_it_was_meant_for(inboxd, pool, mailboxes) -> None:
    assert (await inboxd("sync", "cancel", "--mailbox", "support")).code == 0
    assert await leases.cancel_requested(pool, "acme", "support")
    token = await pool.fetchval(
        "SELECT lease_token FROM mailboxes WHERE tenant_id = 'acme' AND mailbox_id = 'support'"
    )
    await leases.release_lease(pool, "acme", "support", "replica-1", token)  # the run ended
    assert not await leases.cancel_requested(pool, "acme", "support")


async def test_sync_cancel_unknown_and_ambiguous_mailboxes(inboxd, pool, mailboxes) -> None:
    missing = await inboxd("sync", "cancel", "--mailbox", "nope")
    assert missing.code == 1
    assert missing.error_lines == ["inboxd: error: no mailbox nope in any tenant"]
    wrong_tenant = await inboxd("sync", "cancel", "--mailbox", "support", "--tenant", "globex")
    assert wrong_tenant.code == 1
    assert "no mailbox support in tenant globex" in wrong_tenant.error_lines[-1]
    ambiguous = await inboxd("sync", "cancel", "--mailbox", "inbox")
    assert ambiguous.code == 2
    assert "acme, globex" in ambiguous.error_lines[-1]
    assert "--tenant" in ambiguous.error_lines[-1]
    no_mailbox = await inboxd("sync", "cancel")
    assert no_mailbox.code == 2 and "--mailbox" in no_mailbox.error_lines[-1]
    assert not await pool.fetchval("SELECT bool_or(cancel_requested) FROM mailboxes")


# --- sync now ----------------------------------------------------------------------------


async def test_sync_now_rings_the_doorbell(inboxd, db_dsn, mailboxes) -> None:
    rung: list[str] = []
    arrived = anyio.Event()

    def on_notify(_conn: object, _pid: int, _channel: str, payload: str) -> None:
        rung.append(payload)
        arrived.set()

    listener = await asyncpg.connect(db_dsn)
    try:
        await listener.add_listener(DOORBELL_CHANNEL, on_notify)
        result = await inboxd("sync", "now", "--mailbox", "inbox", "--tenant", "globex", "--json")
        assert result.code == 0, result.stderr
        with anyio.fail_after(NOTIFY_DEADLINE_S):
            await arrived.wait()
    finally:
        await listener.close()
    assert [parse_doorbell(p) for p in rung] == [("globex", "inbox")]
    out = result.json
    assert (out["command"], out["tenant"], out["mailbox"], out["channel"]) == (
        "sync now",
        "globex",
        "inbox",
        DOORBELL_CHANNEL,
    )
    assert out["throttle_until"] is not None  # it failed just now: backing off


async def test_sync_now_for_a_missing_mailbox_rings_nothing(inboxd, db_dsn, mailboxes) -> None:
    rung: list[str] = []
    marker_arrived = anyio.Event()

    def on_notify(_conn: object, _pid: int, _channel: str, payload: str) -> None:
        rung.append(payload)
        if payload == "marker":
            marker_arrived.set()

    listener = await asyncpg.connect(db_dsn)
    try:
        await listener.add_listener(DOORBELL_CHANNEL, on_notify)
        missing = await inboxd("sync", "now", "--mailbox", "nope")
        ambiguous = await inboxd("sync", "now", "--mailbox", "inbox")
        # a marker rung after both commands: once it arrives, theirs would have too
        await listener.execute("SELECT pg_notify($1, 'marker')", DOORBELL_CHANNEL)
        with anyio.fail_after(NOTIFY_DEADLINE_S):
            await marker_arrived.wait()
    finally:
        await listener.close()
    assert (missing.code, ambiguous.code) == (1, 2)
    assert rung == ["marker"]


# --- inboxd events replay -----------------------------------------------------------------


async def _delivery_rows(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        await conn.execute("INSERT INTO tenants (tenant_id) VALUES ('acme')")
        await conn.execute(
            "INSERT INTO delivery_events (tenant_id, source, dedup_key, provider, provider_type, "
            "event_type, occurred_at, state, attempts, last_error) VALUES "
            "('acme', 'ses', 'id:1', 'ses', 'Bounce', 'bounced', now(), 'dead', 10, 'boom'), "
            "('acme', 'ses', 'id:2', 'ses', 'Delivery', 'delivered', now(), 'applied', 1, NULL), "
            "('acme', 'pm', 'id:3', 'postmark', 'Open', 'opened', now(), 'dead', 10, 'boom')"
        )


async def test_delivery_replay_requeues_dead_events(inboxd, pool: asyncpg.Pool) -> None:
    await _delivery_rows(pool)
    result = await inboxd("delivery", "replay", "--dead", "--source", "ses", "--json")
    assert result.code == 0, result.stderr
    assert result.json == {"command": "delivery replay", "status": "ok", "requeued": 1}
    async with pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT dedup_key, state, attempts, last_error FROM delivery_events ORDER BY dedup_key"
        )
    assert [tuple(r) for r in rows] == [
        ("id:1", "pending", 0, None),
        ("id:2", "applied", 1, None),
        ("id:3", "dead", 10, "boom"),
    ]
    result = await inboxd("delivery", "replay", "--since", "2000-01-01")
    assert result.code == 0 and "2 delivery events re-queued" in result.stdout


async def test_delivery_replay_refuses_a_bad_time(inboxd) -> None:
    result = await inboxd("delivery", "replay", "--since", "yesterday")
    assert result.code == 2 and "--since" in result.stderr


async def test_delivery_status_counts_by_source_and_state(inboxd, pool: asyncpg.Pool) -> None:
    await _delivery_rows(pool)
    result = await inboxd("delivery", "status", "--json")
    assert result.code == 0, result.stderr
    counts = {
        (r["source"], r["pending"], r["applied"], r["dead"], r["last_dead_error"])
        for r in result.json
    }
    assert counts == {("ses", 0, 1, 1, "boom"), ("pm", 0, 0, 1, "boom")}
    plain = await inboxd("delivery", "status")
    assert plain.code == 0 and "boom" in plain.stdout and "ses" in plain.stdout


async def test_the_old_events_command_still_works_with_a_note(inboxd, pool: asyncpg.Pool) -> None:
    await _delivery_rows(pool)
    result = await inboxd("events", "status", "--json")
    assert result.code == 0, result.stderr
    assert {r["source"] for r in result.json} == {"ses", "pm"}
    assert "'inboxd events' is now 'inboxd delivery'" in result.stderr
