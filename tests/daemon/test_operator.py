"""An operator's first hour: what `make run` + a second shell, a busy port, a typo'd DSN,
/metrics and the deployment files show.

The daemon is `inboxd run` as a subprocess (harness.DaemonProcess); the embedded server
runs in a data directory under /tmp that the unprivileged account reaches (as root it
runs as INBOXD_EMBEDDED_PG_USER, like `make run`).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import anyio
import asyncpg
import orjson
import pytest
from harness import DaemonProcess, write_config
from helpers import cli_argv, cli_env, eventually, run_cli, run_cli_async, wait_for
from helpers.accounts import unprivileged_user

from inboxd.daemon.embedded_pg.binaries import find_binaries
from inboxd.daemon.embedded_pg.server import stop_embedded
from inboxd.daemon.metrics.attention import refresh_attention
from inboxd.daemon.metrics.registry import Metrics
from inboxd.pipeline.mailbox import scheduling
from inboxd.pipeline.tenancy import ensure_tenants

REPO = Path(__file__).resolve().parents[2]
IS_ROOT = os.geteuid() == 0
METRICS_TIMEOUT_S = 10.0


async def _metrics_text(port: int) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.get(
            f"http://127.0.0.1:{port}/metrics",
            timeout=aiohttp.ClientTimeout(total=METRICS_TIMEOUT_S),
        ) as response:
            assert response.status == 200
            return await response.text()


# --- the command line --------------------------------------------------------------------


def test_run_help_shows_config_as_required(tmp_path: Path) -> None:
    shown = run_cli("run", "--help", env=cli_env(tmp_path))
    assert shown.code == 0
    usage = " ".join(shown.stdout.split("\n\n")[0].split())
    assert " --config FILE " in usage and "[--config" not in usage
    missing = run_cli("run", env=cli_env(tmp_path))
    assert missing.code == 2
    assert missing.error_lines == [
        "inboxd: error: the following arguments are required: --config (see 'inboxd run --help')"
    ]


@pytest.mark.parametrize(
    "dsn", ["postgresql://[bad", "postgresql://u@h:notaport/db", "mysql://u@h/db"]
)
def test_malformed_dsn_is_a_usage_error(tmp_path: Path, dsn: str) -> None:
    result = run_cli("migrate", "--dsn", dsn, env=cli_env(tmp_path))
    assert result.code == 2
    assert len(result.error_lines) == 1
    assert result.error_lines[0].startswith("inboxd: error: invalid DSN ")
    assert "unexpected" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
async def test_import_object_store_path_is_relative_to_the_config_file(
    tmp_path: Path, db_dsn: str, corpus: Path
) -> None:
    config_dir = tmp_path / "etc"
    config_dir.mkdir()
    config = config_dir / "inboxd.toml"
    # database_max_bytes = 0: every object a file, so the directory's place shows
    config.write_text('[object_store]\nkind = "local"\npath = "objects"\ndatabase_max_bytes = 0\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    message = corpus / "mime" / "axllent-mailpit" / "plain-text.eml"

    result = await run_cli_async(
        "import", "--create", "--config", "../etc/inboxd.toml", "--dsn", db_dsn,
        "--tenant", "acme", "--mailbox", "files", message,
        env=cli_env(tmp_path / "data"), cwd=elsewhere,
    )  # fmt: skip

    assert result.code == 0, result.stderr
    assert any(p.is_file() for p in (config_dir / "objects").rglob("*"))
    assert not (elsewhere / "objects").exists()


# --- the daemon ----------------------------------------------------------------------------


@pytest.mark.slow
async def test_port_in_use_is_one_line(tmp_path: Path, db_dsn: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = write_config(tmp_path, port=port)
        result = await run_cli_async(
            "run", "--config", config, "--dsn", db_dsn, env=cli_env(tmp_path / "data")
        )
    assert result.code == 1
    assert result.error_lines == [
        f"inboxd: error: listener 127.0.0.1:{port}: address already in use"
    ]
    assert "Traceback" not in result.stderr and "asyncio" not in result.stderr


@pytest.mark.own_database  # a daemon subprocess
@pytest.mark.slow
async def test_daemon_reports_capacity_tenant_name_and_what_it_watches(
    tmp_path: Path, db_dsn: str
) -> None:
    config = write_config(tmp_path)  # [queue] capacity = 1000; tenant acme, name "Acme"
    daemon = DaemonProcess(config, db_dsn, tmp_path / "daemon.log")
    try:
        port = daemon.wait_ready()
        text = await _metrics_text(port)
        assert re.search(r"^inboxd_queue_capacity 1000\.0$", text, re.M), text
        assert 'inboxd_mailbox_needs_attention{mailbox="inbox",tenant="acme"} 0.0' in text

        conn = await asyncpg.connect(db_dsn)
        try:
            assert await conn.fetchval("SELECT name FROM tenants WHERE tenant_id = 'acme'") == (
                "Acme"
            )
        finally:
            await conn.close()

        events = daemon.events()
        starting = next(e for e in events if e.get("event") == "daemon_starting")
        assert starting["database"] == db_dsn.rsplit("/", 1)[1]
        assert starting["dsn_source"] == "cli"
        assert starting["data_dir"] and starting["server"] == "127.0.0.1:5432"
        watched = [e for e in events if e.get("event") == "source_watched"]
        assert [(e["tenant"], e["mailbox"], e["path"]) for e in watched] == [
            ("acme", "inbox", str(tmp_path / "maildirs" / "acme" / "inbox"))
        ]
    finally:
        daemon.kill()


async def test_needs_attention_gauge_follows_the_mailboxes_table(
    pool: asyncpg.Pool, make_mailbox
) -> None:
    await make_mailbox("acme", "inbox")
    metrics = Metrics()
    metrics.watch_mailbox("acme", "inbox")
    line = 'inboxd_mailbox_needs_attention{mailbox="inbox",tenant="acme"} '
    async with anyio.create_task_group() as tg:
        await tg.start(refresh_attention, pool, metrics)
        assert line + "0.0" in metrics.render().decode()
        await pool.execute("UPDATE mailboxes SET sync_state = 'needs_attention'")
        # The refresher re-reads every ATTENTION_REFRESH_INTERVAL_S; restart it to read now.
        tg.cancel_scope.cancel()
    async with anyio.create_task_group() as tg:
        await tg.start(refresh_attention, pool, metrics)
        await eventually(lambda: line + "1.0" in metrics.render().decode(), 10, what="gauge at 1")
        tg.cancel_scope.cancel()


async def test_tenant_names_follow_the_tenant_file(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        await ensure_tenants(conn, ["acme"])  # bare ids, as the mailbox upsert does
        await ensure_tenants(conn, {"acme": "Acme Ltd", "beta": "Beta"})
        await ensure_tenants(conn, ["acme"])  # ids alone never blank a name
        await ensure_tenants(conn, {"acme": "Acme Group"})  # renamed in the file
        rows = await conn.fetch("SELECT tenant_id, name FROM tenants ORDER BY 1")
    assert [tuple(r) for r in rows] == [("acme", "Acme Group"), ("beta", "Beta")]


# --- the embedded server from a second shell -------------------------------------------------


@pytest.fixture
def pg_data_dir() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="inboxd-optest-"))
    base.chmod(0o755)  # the server's account must traverse it
    data = base / "data"
    try:
        yield data
    finally:
        try:
            environ = {"PATH": os.defpath}
            if IS_ROOT:
                environ["INBOXD_EMBEDDED_PG_USER"] = unprivileged_user()
            stop_embedded(data, environ=environ)
        finally:
            shutil.rmtree(base)


@pytest.mark.slow
@pytest.mark.skipif(not find_binaries(), reason="no PostgreSQL server binaries")
async def test_db_url_and_stop_from_a_second_shell(pg_data_dir: Path) -> None:
    make_env = cli_env(pg_data_dir)  # what `make run` exports
    if IS_ROOT:
        make_env["INBOXD_EMBEDDED_PG_USER"] = unprivileged_user()
    # The other shell: INBOXD_DATA_DIR pointing at it, nothing else.
    shell_env = {k: v for k, v in make_env.items() if k != "INBOXD_EMBEDDED_PG_USER"}

    # Read-only commands never start a server: they say how to start one.
    for argv in (("db", "url"), ("status",), ("extract", "list", "--tenant", "acme")):
        refused = await run_cli_async(*argv, env=make_env)
        assert refused.code == 1, (argv, refused.stderr)
        [line] = refused.error_lines
        assert line.startswith("inboxd: error: no database is running: the embedded "), line
        assert str(pg_data_dir) in line and "'inboxd run'" in line, line
        assert not (pg_data_dir / "pg" / "postmaster.pid").exists()

    migrated = await run_cli_async("migrate", env=make_env)  # starts the server
    assert migrated.code == 0, migrated.stderr
    started = await run_cli_async("db", "url", env=shell_env)
    assert started.code == 0, started.stderr
    dsn = started.stdout.strip()
    assert dsn == f"postgresql://inboxd@/inboxd?host={pg_data_dir / 'pg'}&port=5432"
    described = await run_cli_async("db", "url", "--json", env=shell_env)
    assert described.code == 0, described.stderr
    info = orjson.loads(described.stdout)
    assert (info["dsn"], info["source"], info["data_dir"]) == (dsn, "embedded", str(pg_data_dir))
    assert info["psql"].endswith(f"'{dsn}'")
    conn = await asyncpg.connect(dsn)
    try:
        assert await conn.fetchval("SELECT count(*) FROM inboxd_schema_version") == 1
    finally:
        await conn.close()

    stopped = await run_cli_async("db", "stop", env=shell_env)
    assert (stopped.code, stopped.stdout.strip()) == (
        0,
        f"embedded PostgreSQL in {pg_data_dir} stopped",
    )
    assert not (pg_data_dir / "pg" / "postmaster.pid").exists()
    again = await run_cli_async("db", "stop", env=shell_env)
    assert again.code == 0 and again.stdout.startswith("no embedded PostgreSQL running")
    # `db stop` then `status`: one clear line, as root too, and nothing started.
    after = await run_cli_async("status", env=shell_env)
    assert after.code == 1 and len(after.error_lines) == 1, after.stderr
    assert "no database is running" in after.error_lines[0]
    assert not (pg_data_dir / "pg" / "postmaster.pid").exists()

    if IS_ROOT:  # nothing running, nobody named to start it: say what picks the database
        refused = await run_cli_async("migrate", env=shell_env)
        assert refused.code == 1
        [line] = refused.error_lines
        assert str(pg_data_dir) in line and "INBOXD_DATA_DIR" in line
        assert "inboxd db url" in line and "INBOXD_EMBEDDED_PG_USER" in line


def test_unreachable_database_message_names_the_data_dir_and_db_url(tmp_path: Path) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: connections are refused
        result = run_cli(
            "migrate", "--dsn", f"postgresql://u@127.0.0.1:{port}/x", env=cli_env(tmp_path)
        )
    assert result.code == 1
    [line] = result.error_lines
    assert "DSN from --dsn" in line and "INBOXD_DATA_DIR" in line and "inboxd db url" in line


# --- deployment files -----------------------------------------------------------------------


def _exported_metric_names() -> set[str]:
    """Every series name /metrics can show: counters with _total, histograms' parts."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    names: set[str] = set()
    for family in Metrics().registry.collect():
        names |= {family.name + s for s in suffixes.get(family.type, ("",))}
    return names


def _metric_names_in(expr: str) -> set[str]:
    return set(re.findall(r"\binboxd_[a-z0-9_]+", expr))


def _yaml_subset(text: str) -> object:
    """A loader for the YAML the rules file uses (block mappings and lists of them,
    plain or double-quoted scalars); anything else fails the test. PyYAML is not a
    dependency, and promtool is not installed here."""
    lines = [
        (len(raw) - len(raw.lstrip(" ")), raw.strip())
        for raw in text.splitlines()
        if raw.strip() and not raw.lstrip().startswith("#")
    ]

    def scalar(value: str) -> object:
        if value.startswith('"'):
            return orjson.loads(value)  # a double-quoted YAML scalar without escapes is JSON
        assert not value.startswith(("'", "|", ">", "{", "[")), f"unsupported: {value}"
        return value

    def block(i: int, indent: int) -> tuple[object, int]:
        if lines[i][1].startswith("- "):
            items: list[object] = []
            while i < len(lines) and lines[i][0] == indent and lines[i][1].startswith("- "):
                lines[i] = (indent + 2, lines[i][1][2:])
                item, i = block(i, indent + 2)
                items.append(item)
            return items, i
        mapping: dict[str, object] = {}
        while i < len(lines) and lines[i][0] == indent and not lines[i][1].startswith("- "):
            key, sep, value = lines[i][1].partition(":")
            assert sep, f"not a mapping line: {lines[i][1]}"
            value = value.strip()
            if value:
                mapping[key] = scalar(value)
                i += 1
            else:
                mapping[key], i = block(i + 1, lines[i + 1][0])
        return mapping, i

    parsed, end = block(0, lines[0][0])
    assert end == len(lines), f"unparsed from line {lines[end]}"
    return parsed


def test_alert_rules_use_only_exported_metrics() -> None:
    exported = _exported_metric_names()
    rules = _yaml_subset((REPO / "deploy" / "prometheus" / "inboxd-alerts.yml").read_text())
    assert isinstance(rules, dict)
    [group] = rules["groups"]
    alerts = {rule["alert"]: rule for rule in group["rules"]}
    used: set[str] = set()
    for name, rule in alerts.items():
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, name
        assert rule["labels"]["severity"] in ("page", "warning")
        assert rule["annotations"]["summary"]
        used |= _metric_names_in(rule["expr"])
    assert used <= exported, used - exported
    for topic in ("needs_attention", "cursor_lag", "dead_items", "webhook_verification"):
        assert any(topic in name for name in used), topic


def test_dashboard_uses_only_exported_metrics() -> None:
    dashboard = orjson.loads((REPO / "deploy" / "grafana" / "inboxd.json").read_bytes())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = set().union(*map(_metric_names_in, exprs))
    exported = _exported_metric_names()
    assert used <= exported, used - exported
    # every metric the daemon exports has a panel (histograms through their buckets)
    shown = {re.sub(r"_(bucket|sum|count)$", "", n) for n in used}
    assert {re.sub(r"_(bucket|sum|count)$", "", n) for n in exported} <= shown
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_production_config_writes_only_inside_read_write_paths() -> None:
    unit = (REPO / "systemd" / "inboxd.service").read_text()
    writable = [
        Path(p)
        for line in unit.splitlines()
        if line.startswith("ReadWritePaths=")
        for p in line.partition("=")[2].split()
    ]
    config = tomllib.loads((REPO / "deploy" / "inboxd.production.toml").read_text())
    store = Path(config["object_store"]["path"])
    assert store.is_absolute() and any(store.is_relative_to(w) for w in writable)
    assert "/opt/inboxd/.venv" in unit and "/etc/inboxd/inboxd.toml" in unit
    assert "deploy/inboxd.production.toml" in unit  # where /etc/inboxd/inboxd.toml comes from


def test_container_listens_on_all_interfaces() -> None:
    containerfile = (REPO / "Containerfile").read_text()
    [cmd] = [line for line in containerfile.splitlines() if line.startswith("CMD ")]
    config_path = Path(orjson.loads(cmd[4:])[-1])
    assert config_path.is_relative_to("/opt/inboxd")  # shipped in the image (COPY . /opt/inboxd)
    config = tomllib.loads((REPO / config_path.relative_to("/opt/inboxd")).read_text())
    assert config["listener"]["host"] == "0.0.0.0"  # noqa: S104 - what the test checks
    ignored = (REPO / ".containerignore").read_text().split()
    assert {".git", ".venv", "var"} <= set(ignored)


def test_licence_is_an_spdx_string() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"


async def test_needs_connect_gauge_follows_the_mailboxes_table(
    pool: asyncpg.Pool, make_mailbox
) -> None:
    await make_mailbox("acme", "inbox", provider="gmail")
    async with pool.acquire() as conn:
        await scheduling.record_needs_connect(conn, "acme", "inbox", "not connected: run …")
    metrics = Metrics()  # no runner watches it: an unconnected mailbox has none
    async with anyio.create_task_group() as tg:
        await tg.start(refresh_attention, pool, metrics)
        text = await eventually(
            lambda: metrics.render().decode(), 10, what="a reading", until=lambda t: "acme" in t
        )
        tg.cancel_scope.cancel()
    assert 'inboxd_mailbox_needs_connect{mailbox="inbox",tenant="acme"} 1.0' in text
    assert 'inboxd_mailbox_needs_attention{mailbox="inbox",tenant="acme"}' not in text


def _run_until_ready_then_interrupt(
    config: Path, env: dict[str, str], log: Path
) -> tuple[int, str]:
    """`inboxd run` on the embedded server (no DSN anywhere), Ctrl-C once it is ready;
    (exit code, its last stderr line)."""
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            cli_argv("run", "--config", config), stdout=subprocess.DEVNULL, stderr=sink, env=env
        )
        try:
            wait_for(
                lambda: b'"daemon_ready"' in log.read_bytes(),
                120,
                what="daemon_ready",
                abort=lambda: None if proc.poll() is None else f"exited {proc.returncode}",
                context=lambda: log.read_text(errors="replace")[-2000:],
            )
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    return code, log.read_text().strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.skipif(not find_binaries(), reason="no PostgreSQL server binaries")
def test_ctrl_c_on_run_stops_the_embedded_server_it_started(
    pg_data_dir: Path, tmp_path: Path
) -> None:
    env = cli_env(pg_data_dir)
    if IS_ROOT:
        env["INBOXD_EMBEDDED_PG_USER"] = unprivileged_user()
    config = write_config(tmp_path)
    pidfile = pg_data_dir / "pg" / "postmaster.pid"

    code, last = _run_until_ready_then_interrupt(config, env, tmp_path / "first.log")
    assert code == 0
    assert (
        last == f"inboxd: the embedded PostgreSQL this daemon started in {pg_data_dir} is stopped"
    )
    assert not pidfile.exists()

    # A server that was running before (another shell's) is left running, and said so.
    assert run_cli("migrate", env=env).code == 0
    code, last = _run_until_ready_then_interrupt(config, env, tmp_path / "second.log")
    assert code == 0 and pidfile.exists()
    assert last == (
        f"inboxd: the embedded PostgreSQL in {pg_data_dir} keeps running (it was running "
        "before this daemon started); 'inboxd db stop' stops it"
    )
