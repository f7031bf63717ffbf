"""The PostgreSQL inboxd starts for itself when no DSN is configured: running its server.

`pg_cluster` finds the binaries, the OS user and the data directory and runs initdb; this
module starts the postmaster, reuses a running one, and stops it. Both raise
`pg_cluster.EmbeddedPostgresError`.

`ensure_embedded` moves a data directory's server through these states, all under an
flock on `<data_dir>/pg.lock`, so two commands launched together never initdb twice or
start two postmasters on one directory (`stop_embedded` takes the same lock):

    no cluster --initdb--> stopped --pg_ctl start--> starting --> ready (reused as is)
    stale postmaster.pid --removed--> stopped
    ready --stop_embedded (SIGINT)--> shutting down --> stopped

- A running server is reused without asking who may start one (`find_running`): as
  root, `inboxd status` in a shell reaches the server `make run` started as
  `INBOXD_EMBEDDED_PG_USER` without that variable being set there.
- The server outlives the command that started it. `inboxd migrate`, `inboxd run` and
  `inboxd status` run one after another; each finds the running postmaster through
  `postmaster.pid` and reuses it, so only the first pays for initdb and start, and a
  crash or restart of the daemon does not take its database down with it. It stops on
  `stop_embedded()`, at shutdown, or when systemd stops the unit whose cgroup it is in.
- `postmaster.pid` is believed only when its pid is alive, not a zombie, a postgres
  process, and working in this data directory. Containers restart with the same low
  pids, and postgres refuses to start over a pid file whose pid now belongs to someone
  else; such a file (and the socket lock beside it) is stale and removed. A live
  postmaster is never signalled or its files touched, except by `stop_embedded()`.
- It listens on a unix socket inside the data directory and on no TCP address. If TCP
  is asked for (`tcp_port`), it listens on 127.0.0.1 only.
- An existing cluster is always run by binaries of the major version that created it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import os
import shlex
import signal
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import anyio.to_thread

from .pg_cluster import (
    DB_NAME,
    DB_USER,
    ENV_DATA_DIR,
    INITDB_TIMEOUT_S,
    EmbeddedPostgresError,
    PgBinaries,
    RunAs,
    check_owner,
    check_result,
    default_data_dir,
    init_cluster,
    make_data_dir,
    pick_binaries,
    read_cluster_version,
    resolve_run_as,
    run_tool,
)

START_TIMEOUT_S = 60  # initdb+start on a cold 2-core VM takes ~1 s (0.75 s measured)
STOP_TIMEOUT_S = 30  # a fast shutdown checkpoints; an idle embedded server stops in < 1 s
LOCK_TIMEOUT_S = INITDB_TIMEOUT_S + START_TIMEOUT_S + 10  # the holder's worst case, then give up
POLL_INTERVAL_S = 0.05  # re-check a lock or a postmaster we do not own (not our child)

DEFAULT_PORT = 5432  # without TCP it only names the socket file, .s.PGSQL.5432
# sizeof(sockaddr_un.sun_path) is 108 on Linux and 104 on macOS/BSD, including the NUL.
SOCKET_PATH_MAX_BYTES = 103


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


@dataclass(frozen=True)
class _PidFile:
    pid: int
    port: int | None
    socket_dir: Path | None
    listen: str
    status: str


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
    data_dir = _resolve_data_dir(data_dir, environ)
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
        running = _live_postmaster(pgdata)
        if running is not None:
            _check_listening(pgdata, running.port, bool(running.listen), tcp_port)
            assert existing is not None  # a live postmaster means an initialised cluster
            return _server(pgdata, running, existing, None, started=False)

        bins = pick_binaries(existing, run_as, environ)
        if existing is None:
            init_cluster(pgdata, bins, run_as)
        pidfile = _start(pgdata, bins, run_as, tcp_port)
        return _server(pgdata, pidfile, bins.major_version, bins.bin_dir, started=True)


def find_running(
    data_dir: Path | str | None = None, *, environ: Mapping[str, str] = os.environ
) -> EmbeddedServer | None:
    """The server already running on `data_dir`, or None. Starts nothing, and needs no
    `INBOXD_EMBEDDED_PG_USER`: connecting to a running server switches no user.

    A stale pid file is cleaned up (under the start lock) on the way.
    """
    data_dir = _resolve_data_dir(data_dir, environ)
    pgdata = data_dir / "pg"
    try:
        if not (pgdata / "postmaster.pid").exists():  # the common case, without the lock
            return None
    except PermissionError:  # another account's cluster: nothing we could connect to
        return None
    with _locked(data_dir / "pg.lock"):
        running = _live_postmaster(pgdata)
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
    data_dir = _resolve_data_dir(data_dir, environ)
    pgdata = data_dir / "pg"
    if not data_dir.is_dir():
        return False
    with _locked(data_dir / "pg.lock"):
        running = _live_postmaster(pgdata)
        if running is None:
            return False
        if _signal_fast_shutdown(running.pid):
            _wait_stopped(running.pid, pgdata)
        return True


def _resolve_data_dir(data_dir: Path | str | None, environ: Mapping[str, str]) -> Path:
    return Path(data_dir).expanduser().absolute() if data_dir else default_data_dir(environ)


def _check_listening(pgdata: Path, port: int | None, tcp: bool, tcp_port: int | None) -> None:
    if tcp_port is not None and (not tcp or port != tcp_port):
        now = f"on TCP port {port}" if tcp else "without TCP"
        raise EmbeddedPostgresError(
            f"embedded PostgreSQL in {pgdata} is already running {now}, not on TCP port "
            f"{tcp_port}: stop it first to change how it listens"
        )


def _signal_fast_shutdown(pid: int) -> bool:
    """False when the postmaster had already exited."""
    # SIGINT is PostgreSQL's "fast" shutdown: roll back sessions, checkpoint, exit.
    # Signalling needs no binaries of the cluster's version and no user switch.
    try:
        os.kill(pid, signal.SIGINT)
    except ProcessLookupError:
        return False
    except PermissionError as exc:
        raise EmbeddedPostgresError(
            f"not allowed to stop embedded PostgreSQL (pid {pid}): {exc}"
        ) from exc
    return True


def _wait_stopped(pid: int, pgdata: Path) -> None:
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while _is_our_postmaster(pid, pgdata):
        if time.monotonic() > deadline:
            raise EmbeddedPostgresError(
                f"embedded PostgreSQL (pid {pid}) did not stop within "
                f"{STOP_TIMEOUT_S} s; see {pgdata / 'log'}"
            )
        time.sleep(POLL_INTERVAL_S)


def _server(
    pgdata: Path, pidfile: _PidFile, major: int, bin_dir: Path | None, *, started: bool
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


# --- lock, socket directory ----------------------------------------------------------


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


def _socket_dir(pgdata: Path, port: int, run_as: RunAs) -> Path:
    if len(os.fsencode(pgdata / f".s.PGSQL.{port}")) <= SOCKET_PATH_MAX_BYTES:
        return pgdata
    # Too long for a unix socket address: use a short private directory, named after the
    # cluster so the next start finds the same one.
    digest = hashlib.sha256(os.fsencode(pgdata)).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"inboxd-pg-{digest}"
    try:
        path.mkdir(mode=0o700)
        if run_as.switch:
            os.chown(path, run_as.uid, run_as.gid)
    except FileExistsError:
        pass
    st = path.lstat()
    # Shared /tmp: refuse a directory someone else prepared for us.
    if not path.is_dir() or path.is_symlink() or st.st_uid != run_as.uid or st.st_mode & 0o077:
        raise EmbeddedPostgresError(
            f"{path} is not a private directory of {run_as.name}: remove it, or use a "
            f"shorter {ENV_DATA_DIR} so the socket fits inside the data directory"
        )
    return path


# --- server process ------------------------------------------------------------------


def _start(pgdata: Path, bins: PgBinaries, run_as: RunAs, tcp_port: int | None) -> _PidFile:
    port = tcp_port or DEFAULT_PORT
    options = _server_options(port, _socket_dir(pgdata, port, run_as), tcp=bool(tcp_port))
    startup_log = pgdata / "startup.log"
    result = run_tool(
        [
            str(bins.bin_dir / "pg_ctl"),
            "start",
            "--wait",
            f"--timeout={START_TIMEOUT_S}",
            f"--pgdata={pgdata}",
            f"--log={startup_log}",
            # pg_ctl hands the options to /bin/sh, so they are quoted for the shell.
            f"--options={shlex.join(options)}",
        ],
        run_as,
        timeout_s=START_TIMEOUT_S + 10,
        cwd=pgdata.parent,
    )
    hint = f" (see {startup_log} and {pgdata / 'log'})"
    check_result(result, "starting embedded PostgreSQL", hint)
    running = _live_postmaster(pgdata)
    if running is None or running.status != "ready":
        raise EmbeddedPostgresError(
            f"embedded PostgreSQL in {pgdata} exited right after starting; see {startup_log}"
        )
    return running


def _server_options(port: int, socket_dir: Path, *, tcp: bool) -> list[str]:
    return [
        f"--port={port}",
        f"--unix_socket_directories={socket_dir}",
        f"--listen_addresses={'127.0.0.1' if tcp else ''}",
        # A week of daily logs that overwrite themselves: an embedded server nobody
        # watches must not fill the disk.
        "--logging_collector=on",
        "--log_directory=log",
        "--log_filename=postgresql-%a.log",
        "--log_truncate_on_rotation=on",
        "--log_rotation_age=1d",
        "--log_rotation_size=0",
    ]


# --- postmaster.pid ------------------------------------------------------------------


def _read_pid_file(pgdata: Path) -> _PidFile | None:
    try:
        lines = (pgdata / "postmaster.pid").read_text().splitlines()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise EmbeddedPostgresError(f"cannot read {pgdata / 'postmaster.pid'}: {exc}") from exc
    # Lines (PostgreSQL >= 10, pidfile.h): pid, data dir, start time, port, first socket
    # dir, first listen address, shared memory key, status. Written in steps at startup.
    lines += [""] * (8 - len(lines))
    try:
        pid = int(lines[0])
    except ValueError:
        return _PidFile(pid=0, port=None, socket_dir=None, listen="", status="")
    return _PidFile(
        pid=pid,
        port=int(lines[3]) if lines[3].strip().isdigit() else None,
        socket_dir=Path(lines[4].strip()) if lines[4].strip() else None,
        listen=lines[5].strip(),
        status=lines[7].strip(),
    )


def _is_our_postmaster(pid: int, pgdata: Path) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's: fall through to what /proc can tell
    proc = Path(f"/proc/{pid}")
    if not proc.is_dir():  # no procfs (macOS): a live pid is all we can know
        return True
    try:
        stat = (proc / "stat").read_text()
        # A zombie keeps its pid and name until reaped; a container's PID 1 may never reap.
        if stat.rpartition(")")[2].split()[0] == "Z":
            return False
        if (proc / "comm").read_text().strip() not in ("postgres", "postmaster"):
            return False
        # postgres chdirs into its data directory.
        return Path(os.readlink(proc / "cwd")) == pgdata.resolve()
    except FileNotFoundError:
        return False  # exited while we looked
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM):
            return True  # cannot tell; never treat a possibly live postmaster as stale
        raise


def _live_postmaster(pgdata: Path) -> _PidFile | None:
    """The postmaster running on `pgdata` once it is ready, or None after clearing a
    stale pid file. Waits (up to START_TIMEOUT_S) for one that is starting up or
    shutting down."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        info = _read_pid_file(pgdata)
        if info is None:
            return None
        if not _is_our_postmaster(info.pid, pgdata):
            # Re-read: the file may have been replaced by a postmaster that started since.
            if _read_pid_file(pgdata) == info:
                _remove_stale(pgdata, info)
                return None
        elif info.status == "ready":
            return info
        if time.monotonic() > deadline:
            raise EmbeddedPostgresError(
                f"embedded PostgreSQL (pid {info.pid}) in {pgdata} stayed "
                f"{info.status or 'starting'!r} for {START_TIMEOUT_S} s"
            )
        # A postmaster we did not start (another command's, or one shutting down) is not
        # our child: there is nothing to wait on but its pid file.
        time.sleep(POLL_INTERVAL_S)


def _remove_stale(pgdata: Path, info: _PidFile) -> None:
    (pgdata / "postmaster.pid").unlink(missing_ok=True)
    if info.socket_dir is not None and info.port is not None:
        # Its socket lock names the same dead (or reused) pid and blocks the next start.
        for name in (f".s.PGSQL.{info.port}.lock", f".s.PGSQL.{info.port}"):
            with contextlib.suppress(FileNotFoundError):
                (info.socket_dir / name).unlink()
