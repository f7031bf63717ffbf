"""Preparing the embedded PostgreSQL cluster in `<data_dir>/pg`.

One cluster per data directory, owned by the account that runs the server
(`check_owner`). Its `PG_VERSION` names the major version whose binaries must run it
(`read_cluster_version`; None when there is no cluster yet).

`init_cluster`, when there is no cluster yet, creates one database and superuser, both
`inboxd`. It is built in a temporary sibling directory and renamed to `pg` only once it
is complete, so an interrupted initdb never leaves a directory that looks usable. Local
connections use trust: the cluster directory is 0700, so its permissions are the access
control. TCP logins need the scram password initdb was given (kept in
`<pgdata>/inboxd.password`, 0600).

All of this runs under `embedded_pg`'s lock, so two commands never initdb together.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
from pathlib import Path

from inboxd.daemon.embedded_pg.binaries import PgBinaries
from inboxd.daemon.embedded_pg.errors import EmbeddedPostgresError
from inboxd.daemon.embedded_pg.run_as import ENV_PG_USER, RunAs, check_result, run_tool

INITDB_TIMEOUT_S = 120  # initdb fsyncs the whole new cluster; slow disks take tens of seconds

DB_NAME = "inboxd"
DB_USER = "inboxd"
PASSWORD_FILE = "inboxd.password"  # noqa: S105 (a file name)


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
