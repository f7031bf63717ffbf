"""Who runs the embedded PostgreSQL's programs, and running them as that account.

initdb and postgres both refuse to run as root. inboxd never creates OS users: as root
it runs them as the existing account named by `INBOXD_EMBEDDED_PG_USER` (the cluster
directory is owned by that account) or refuses with `ROOT_REFUSAL`; as anyone else it
runs them as itself (`resolve_run_as`). `run_tool` runs one program as that account in
a clean environment; `check_result` turns its failure into a one-line
`EmbeddedPostgresError`.
"""

from __future__ import annotations

import os
import pwd
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inboxd.daemon.embedded_pg.errors import EmbeddedPostgresError

ENV_PG_USER = "INBOXD_EMBEDDED_PG_USER"

PROBE_TIMEOUT_S = 10  # `postgres --version`, `test -x`: instant unless the machine is stuck

ROOT_REFUSAL = (
    "embedded PostgreSQL cannot run as root: pass --dsn / INBOXD_DSN, "
    f"or set {ENV_PG_USER} to an existing unprivileged user (`make run` uses nobody)"
)


@dataclass(frozen=True)
class RunAs:
    """The OS account that runs initdb and the server."""

    uid: int
    gid: int
    name: str
    switch: bool  # True when we are root and run the server as `name`


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
