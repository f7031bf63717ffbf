"""Starting and stopping the embedded postmaster process.

`start_postmaster` runs `pg_ctl start` as the server's account (`run_as`) and waits
until the postmaster is ready. It listens on a unix socket inside the data directory
(or, when that path is too long for a socket address, in a private directory under
/tmp named after the cluster) and on no TCP address; if TCP is asked for (`tcp_port`),
on 127.0.0.1 only. `signal_fast_shutdown` and `wait_stopped` stop it: the only place
a live postmaster is ever signalled.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import signal
import tempfile
import time
from pathlib import Path

from inboxd.daemon.embedded_pg.binaries import PgBinaries
from inboxd.daemon.embedded_pg.data_dir import ENV_DATA_DIR
from inboxd.daemon.embedded_pg.errors import EmbeddedPostgresError
from inboxd.daemon.embedded_pg.pidfile import (
    POLL_INTERVAL_S,
    START_TIMEOUT_S,
    PidFile,
    is_our_postmaster,
    live_postmaster,
)
from inboxd.daemon.embedded_pg.run_as import RunAs, check_result, run_tool

STOP_TIMEOUT_S = 30  # a fast shutdown checkpoints; an idle embedded server stops in < 1 s

DEFAULT_PORT = 5432  # without TCP it only names the socket file, .s.PGSQL.5432
# sizeof(sockaddr_un.sun_path) is 108 on Linux and 104 on macOS/BSD, including the NUL.
SOCKET_PATH_MAX_BYTES = 103


def start_postmaster(
    pgdata: Path, bins: PgBinaries, run_as: RunAs, tcp_port: int | None
) -> PidFile:
    """Start the server on `pgdata` as `run_as` and return its pid file once it is ready.

    Call with the data directory's lock held and no postmaster running. Raises
    `EmbeddedPostgresError` (pointing at the startup log) when it does not come up.
    """
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
    running = live_postmaster(pgdata)
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


def signal_fast_shutdown(pid: int) -> bool:
    """Ask the postmaster `pid` for a fast shutdown. False when it had already exited;
    raises `EmbeddedPostgresError` when we may not signal it."""
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


def wait_stopped(pid: int, pgdata: Path) -> None:
    """Wait until the postmaster `pid` of `pgdata` has exited; raises
    `EmbeddedPostgresError` after `STOP_TIMEOUT_S`."""
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while is_our_postmaster(pid, pgdata):
        if time.monotonic() > deadline:
            raise EmbeddedPostgresError(
                f"embedded PostgreSQL (pid {pid}) did not stop within "
                f"{STOP_TIMEOUT_S} s; see {pgdata / 'log'}"
            )
        time.sleep(POLL_INTERVAL_S)
