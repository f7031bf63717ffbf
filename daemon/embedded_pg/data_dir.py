"""Where the inboxd data directory is, and making it ready for the embedded server.

It holds the embedded PostgreSQL cluster (`<data_dir>/pg`, with its start lock
`<data_dir>/pg.lock`) and the local object store unless one is configured. It is the
`data_dir` argument, else `$INBOXD_DATA_DIR`, else `<checkout>/var` when inboxd runs
from a source checkout (an editable install, what `make run` uses), else
`$XDG_DATA_HOME/inboxd`, else `~/.local/share/inboxd` (`default_data_dir`,
`resolve_data_dir`). `make_data_dir` creates it and checks that the account running
the server (`run_as`) can reach it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from inboxd.daemon.embedded_pg.errors import EmbeddedPostgresError
from inboxd.daemon.embedded_pg.run_as import PROBE_TIMEOUT_S, RunAs, run_tool

ENV_DATA_DIR = "INBOXD_DATA_DIR"

# The source checkout inboxd runs from, when it runs from one (`pip install -e .`,
# which `make run` does): the directory holding pyproject.toml above daemon/.
# Installed as a wheel, this module sits in site-packages/inboxd/daemon/embedded_pg: no
# checkout.
_SOURCE_ROOT = Path(__file__).resolve().parents[2]  # daemon/embedded_pg/data_dir.py
CHECKOUT: Path | None = _SOURCE_ROOT if (_SOURCE_ROOT / "pyproject.toml").is_file() else None
# Inside a checkout, the data directory `make run` uses (the Makefile's
# INBOXD_DATA_DIR), so a shell command reaches the server `make run` started.
CHECKOUT_DATA_DIR = "var"


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


def resolve_data_dir(data_dir: Path | str | None, environ: Mapping[str, str]) -> Path:
    """`data_dir` made absolute, else `default_data_dir`."""
    return Path(data_dir).expanduser().absolute() if data_dir else default_data_dir(environ)


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
