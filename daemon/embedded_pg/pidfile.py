"""Which postmaster runs on a cluster: reading `<pgdata>/postmaster.pid`.

`live_postmaster` returns the postmaster running on a cluster once it is ready, waits
for one that is starting up or shutting down, and clears a stale pid file:

    no pid file --> None
    pid file, pid not our postmaster --stale file and socket lock removed--> None
    pid file, our postmaster, status "starting"/"stopping" --poll--> ... --> ready
    pid file, our postmaster, status "ready" --> its pid, port, socket directory

`postmaster.pid` is believed only when its pid is alive, not a zombie, a postgres
process, and working in this data directory (`is_our_postmaster`). Containers restart
with the same low pids, and postgres refuses to start over a pid file whose pid now
belongs to someone else; such a file (and the socket lock beside it) is stale and
removed. A live postmaster's files are never touched. Call with the data directory's
start lock held (`embedded_pg`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path

from inboxd.daemon.embedded_pg.errors import EmbeddedPostgresError

START_TIMEOUT_S = 60  # initdb+start on a cold 2-core VM takes ~1 s (0.75 s measured)
POLL_INTERVAL_S = 0.05  # re-check a lock or a postmaster we do not own (not our child)


@dataclass(frozen=True)
class PidFile:
    """What `postmaster.pid` says. `listen` is empty without TCP."""

    pid: int
    port: int | None
    socket_dir: Path | None
    listen: str
    status: str


def _read_pid_file(pgdata: Path) -> PidFile | None:
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
        return PidFile(pid=0, port=None, socket_dir=None, listen="", status="")
    return PidFile(
        pid=pid,
        port=int(lines[3]) if lines[3].strip().isdigit() else None,
        socket_dir=Path(lines[4].strip()) if lines[4].strip() else None,
        listen=lines[5].strip(),
        status=lines[7].strip(),
    )


def is_our_postmaster(pid: int, pgdata: Path) -> bool:
    """True when `pid` is a live (not zombie) postgres working in `pgdata`, or when that
    cannot be told (no procfs, no permission): a possibly live postmaster is never
    treated as stale."""
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


def live_postmaster(pgdata: Path) -> PidFile | None:
    """The postmaster running on `pgdata` once it is ready, or None after clearing a
    stale pid file. Waits (up to START_TIMEOUT_S) for one that is starting up or
    shutting down."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        info = _read_pid_file(pgdata)
        if info is None:
            return None
        if not is_our_postmaster(info.pid, pgdata):
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


def _remove_stale(pgdata: Path, info: PidFile) -> None:
    (pgdata / "postmaster.pid").unlink(missing_ok=True)
    if info.socket_dir is not None and info.port is not None:
        # Its socket lock names the same dead (or reused) pid and blocks the next start.
        for name in (f".s.PGSQL.{info.port}.lock", f".s.PGSQL.{info.port}"):
            with contextlib.suppress(FileNotFoundError):
                (info.socket_dir / name).unlink()
