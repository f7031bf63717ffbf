"""The installable package: a wheel built from the tree, installed into a fresh virtual
environment (not editable), creates the schema of an empty database and says its version.

The fresh environment gets inboxd from the wheel alone; its dependencies come from the
test environment's site-packages through a path file, which adds that folder to sys.path
without running its own path files, so the editable install of the tree stays out of
sight and every `inboxd` module is the wheel's.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# What a wheel is built from: the packages, the schema and the project metadata.
TREE = ("daemon", "adapters", "pipeline", "schema.sql", "pyproject.toml", "README.md")
# Building fetches setuptools into an isolated environment (pip caches it); installing
# and migrating take seconds. Generous for a busy machine.
BUILD_TIMEOUT_S = 300.0
COMMAND_TIMEOUT_S = 120.0
# A test's own limit covers its commands' deadlines (a build and at most six
# commands): under pytest-timeout's default (120 s) the wheel test was stopped inside
# its build or install beside a suite (122-126 s, two suites at once), never by them.
TEST_TIMEOUT_S = BUILD_TIMEOUT_S + 6 * COMMAND_TIMEOUT_S

pytestmark = [pytest.mark.slow, pytest.mark.timeout(TEST_TIMEOUT_S)]


def _run(*argv: str | Path, cwd: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def _build_wheel(tmp_path: Path) -> Path:
    source = tmp_path / "source"
    source.mkdir()
    for name in TREE:
        origin = REPO / name
        if origin.is_dir():
            shutil.copytree(origin, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(origin, source / name)
    out = tmp_path / "dist"
    built = _run(
        sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", out, ".",
        cwd=source,
        timeout_s=BUILD_TIMEOUT_S,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = out.glob("inboxd-*.whl")
    return wheel


def _fresh_venv(tmp_path: Path, wheel: Path) -> Path:
    venv = tmp_path / "fresh"
    made = _run(sys.executable, "-m", "venv", venv, cwd=tmp_path, timeout_s=COMMAND_TIMEOUT_S)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    installed = _run(
        python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel,
        cwd=tmp_path,
        timeout_s=COMMAND_TIMEOUT_S,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr[-2000:]
    site = _run(
        python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        cwd=tmp_path,
        timeout_s=COMMAND_TIMEOUT_S,
    ).stdout.strip()  # fmt: skip
    (Path(site) / "test-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def test_a_wheel_installed_into_a_fresh_environment_migrates_an_empty_database(
    tmp_path: Path, empty_db: str
) -> None:
    venv = _fresh_venv(tmp_path, _build_wheel(tmp_path))
    where = _run(
        venv / "bin" / "python", "-c", "import inboxd.pipeline.schema as s; print(s.SCHEMA_PATH)",
        cwd=tmp_path,
        timeout_s=COMMAND_TIMEOUT_S,
    )  # fmt: skip
    schema = Path(where.stdout.strip())
    assert schema.is_relative_to(venv) and schema.is_file() and not schema.is_symlink()

    version = _run(venv / "bin" / "inboxd", "--version", cwd=tmp_path, timeout_s=COMMAND_TIMEOUT_S)
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert (version.returncode, version.stdout.strip()) == (0, f"inboxd {declared}")

    migrated = _run(
        venv / "bin" / "inboxd", "migrate", "--dsn", empty_db,
        cwd=tmp_path,
        timeout_s=COMMAND_TIMEOUT_S,
    )  # fmt: skip
    assert migrated.returncode == 0, migrated.stderr
    assert migrated.stdout.startswith("schema applied to database ")


def test_the_wheel_schema_is_the_repository_schema() -> None:
    """The link in pipeline/ and the design card's top-level schema.sql are one file."""
    from inboxd.pipeline.schema import SCHEMA_PATH, schema_sql

    assert SCHEMA_PATH.resolve() == (REPO / "schema.sql").resolve()
    assert schema_sql() == (REPO / "schema.sql").read_text(encoding="utf-8")
