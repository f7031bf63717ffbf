"""The PostgreSQL inboxd starts for itself when no DSN is configured: its life cycle.

`ensure_embedded` takes a data directory's server through these states, all under an
flock on `<data_dir>/pg.lock`, so two commands launched together never initdb twice or
start two postmasters on one directory (`stop_embedded` takes the same lock):

    no cluster --initdb--> stopped --pg_ctl start--> starting --> ready (reused as is)
    stale postmaster.pid --removed--> stopped
    ready --stop_embedded (SIGINT)--> shutting down --> stopped

The steps of a first start, each in its own module and each raising
`errors.EmbeddedPostgresError` with a one-line message:

1. `run_as.resolve_run_as`: who runs initdb and postgres (as root, the existing
   unprivileged account `INBOXD_EMBEDDED_PG_USER`, or refusal).
2. `data_dir.make_data_dir`: the inboxd data directory, created and reachable by that
   account.
3. `cluster.read_cluster_version`, `cluster.check_owner`: the cluster in
   `<data_dir>/pg`, owned by that account.
4. `pidfile.live_postmaster`: a postmaster already running on it is reused.
5. `binaries.pick_binaries`: binaries of the cluster's major version.
6. `cluster.init_cluster`, when there is no cluster yet.
7. `postmaster.start_postmaster`.

Steps 3 to 7 run under the lock.

- A running server is reused without asking who may start one (`find_running`): as
  root, `inboxd status` in a shell reaches the server `make run` started as
  `INBOXD_EMBEDDED_PG_USER` without that variable being set there.
- The server outlives the command that started it. `inboxd migrate`, `inboxd run` and
  `inboxd status` run one after another; each finds the running postmaster through
  `postmaster.pid` and reuses it, so only the first pays for initdb and start, and a
  crash or restart of the daemon does not take its database down with it. It stops on
  `stop_embedded()`, at shutdown, or when systemd stops the unit whose cgroup it is in.
- A live postmaster is never signalled or its files touched, except by
  `stop_embedded()`.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import anyio.to_thread

from inboxd.daemon.embedded_pg.binaries import pick_binaries
from inboxd.daemon.embedded_pg.cluster import (
    DB_NAME,
    DB_USER,
    INITDB_TIMEOUT_S,
    check_owner,
    init_cluster,
    read_cluster_version,
)
from inboxd.daemon.embedded_pg.data_dir import make_data_dir, resolve_data_dir
from inboxd.daemon.embedded_pg.errors import EmbeddedPostgresError
from inboxd.daemon.embedded_pg.pidfile import (
    POLL_INTERVAL_S,
    START_TIMEOUT_S,
    PidFile,
    live_postmaster,
)
from inboxd.daemon.embedded_pg.postmaster import (
    signal_fast_shutdown,
    start_postmaster,
    wait_stopped,
)
from inboxd.daemon.embedded_pg.run_as import resolve_run_as

LOCK_TIMEOUT_S = INITDB_TIMEOUT_S + START_TIMEOUT_S + 10  # the holder's worst case, then give up


@dataclass(frozen=True)
class EmbeddedServer:
    """A running embedded server. `started` is False when an existing one was reused."""

    dsn: str
    pgdata: Path
    pid: int
    socket_dir: Path
    port: int
    tcp: bool
    major_version: int
    bin_dir: Path | None  # None when an already running server was reused
    started: bool


def ensure_embedded(
    data_dir: Path | str | None = None,
    *,
    tcp_port: int | None = None,
    environ: Mapping[str, str] = os.environ,
) -> EmbeddedServer:
    """Start the embedded server, or reuse the one already running on this data directory.

    Blocks up to about `INITDB_TIMEOUT_S + START_TIMEOUT_S` on a first start (and waits
    for another process holding the start lock). `tcp_port` additionally listens on
    127.0.0.1; it only applies when this call starts the server. Raises
    `EmbeddedPostgresError` (with `ROOT_REFUSAL` as root without `INBOXD_EMBEDDED_PG_USER`).
    """
    data_dir = resolve_data_dir(data_dir, environ)
    pgdata = data_dir / "pg"
    # A running server is reused by whoever may connect to it: root's shell after
    # `make run` has no INBOXD_EMBEDDED_PG_USER, and needs none to connect.
    if (reused := find_running(data_dir, environ=environ)) is not None:
        _check_listening(pgdata, reused.port, reused.tcp, tcp_port)
        return reused
    run_as = resolve_run_as(environ)
    make_data_dir(data_dir, run_as)
    with _locked(data_dir / "pg.lock"):
        existing = read_cluster_version(pgdata)
        if existing is not None:
            check_owner(pgdata, run_as)
        running = live_postmaster(pgdata)
        if running is not None:
            _check_listening(pgdata, running.port, bool(running.listen), tcp_port)
            assert existing is not None  # a live postmaster means an initialised cluster
            return _server(pgdata, running, existing, None, started=False)

        bins = pick_binaries(existing, run_as, environ)
        if existing is None:
            init_cluster(pgdata, bins, run_as)
        pidfile = start_postmaster(pgdata, bins, run_as, tcp_port)
        return _server(pgdata, pidfile, bins.major_version, bins.bin_dir, started=True)


def find_running(
    data_dir: Path | str | None = None, *, environ: Mapping[str, str] = os.environ
) -> EmbeddedServer | None:
    """The server already running on `data_dir`, or None. Starts nothing, and needs no
    `INBOXD_EMBEDDED_PG_USER`: connecting to a running server switches no user.

    A stale pid file is cleaned up (under the start lock) on the way.
    """
    data_dir = resolve_data_dir(data_dir, environ)
    pgdata = data_dir / "pg"
    try:
        if not (pgdata / "postmaster.pid").exists():  # the common case, without the lock
            return None
    except PermissionError:  # another account's cluster: nothing we could connect to
        return None
    with _locked(data_dir / "pg.lock"):
        running = live_postmaster(pgdata)
        if running is None:
            return None
        major = read_cluster_version(pgdata) or 0
        return _server(pgdata, running, major, None, started=False)


async def start_embedded(
    data_dir: Path | str | None = None,
    *,
    tcp_port: int | None = None,
    environ: Mapping[str, str] = os.environ,
) -> EmbeddedServer:
    """`ensure_embedded` in a worker thread; a cancellation waits for it to finish."""
    call = functools.partial(ensure_embedded, data_dir, tcp_port=tcp_port, environ=environ)
    return await anyio.to_thread.run_sync(call)


def stop_embedded(
    data_dir: Path | str | None = None, *, environ: Mapping[str, str] = os.environ
) -> bool:
    """Fast-shutdown the embedded server of `data_dir` and wait until it has exited.

    Returns False when none was running (a stale pid file is cleaned up). Raises
    `EmbeddedPostgresError` if it is still running after `STOP_TIMEOUT_S`.
    """
    data_dir = resolve_data_dir(data_dir, environ)
    pgdata = data_dir / "pg"
    if not data_dir.is_dir():
        return False
    with _locked(data_dir / "pg.lock"):
        running = live_postmaster(pgdata)
        if running is None:
            return False
        if signal_fast_shutdown(running.pid):
            wait_stopped(running.pid, pgdata)
        return True


def _check_listening(pgdata: Path, port: int | None, tcp: bool, tcp_port: int | None) -> None:
    if tcp_port is not None and (not tcp or port != tcp_port):
        now = f"on TCP port {port}" if tcp else "without TCP"
        raise EmbeddedPostgresError(
            f"embedded PostgreSQL in {pgdata} is already running {now}, not on TCP port "
            f"{tcp_port}: stop it first to change how it listens"
        )


def _server(
    pgdata: Path, pidfile: PidFile, major: int, bin_dir: Path | None, *, started: bool
) -> EmbeddedServer:
    if pidfile.socket_dir is None or pidfile.port is None:
        raise EmbeddedPostgresError(
            f"embedded PostgreSQL in {pgdata} (pid {pidfile.pid}) has no unix socket"
        )
    host = quote(str(pidfile.socket_dir), safe="/")
    dsn = f"postgresql://{DB_USER}@/{DB_NAME}?host={host}&port={pidfile.port}"
    return EmbeddedServer(
        dsn=dsn,
        pgdata=pgdata,
        pid=pidfile.pid,
        socket_dir=pidfile.socket_dir,
        port=pidfile.port,
        tcp=bool(pidfile.listen),
        major_version=major,
        bin_dir=bin_dir,
        started=started,
    )


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise EmbeddedPostgresError(
                        f"another inboxd process holds {path} for more than {LOCK_TIMEOUT_S} s"
                    ) from None
                time.sleep(POLL_INTERVAL_S)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the flock
