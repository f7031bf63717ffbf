"""Run the `inboxd` command line in a subprocess: the one CLI runner of the suite.

`run_cli` (sync) and `run_cli_async` run `python -m inboxd.daemon.cli ARGS`, or
the installed console script with `script=True`, with a deadline, and return a
`CliResult`. `cli_env` is the clean environment most tests want: nothing
INBOXD_* or PG* from outside, a data directory of the test's own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import anyio
import orjson

# The console script installed next to the interpreter running the tests.
INBOXD = Path(sys.executable).with_name("inboxd")
# Interpreter start plus the CLI's imports take about a second, a small import a
# few; a loaded CI runner may be several times slower. Past this the command hangs.
CLI_TIMEOUT_S = 60.0


def cli_argv(*args: str | Path, script: bool = False) -> list[str]:
    """argv of the CLI: the console script (`script=True`) or `python -m inboxd.daemon.cli`."""
    head = [str(INBOXD)] if script else [sys.executable, "-m", "inboxd.daemon.cli"]
    return [*head, *map(str, args)]


def cli_env(data_dir: Path, **extra: str) -> dict[str, str]:
    """os.environ without INBOXD_* and PG*, INBOXD_DATA_DIR=data_dir, then `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INBOXD_", "PG"))}
    env["INBOXD_DATA_DIR"] = str(data_dir)
    return env | extra


@dataclass(frozen=True)
class CliResult:
    code: int
    stdout: str
    stderr: str

    @classmethod
    def of(cls, code: int, stdout: bytes | str, stderr: bytes | str) -> CliResult:
        def text(out: bytes | str) -> str:
            return out.decode() if isinstance(out, bytes) else out

        return cls(code, text(stdout), text(stderr))

    @property
    def json(self) -> object:
        return orjson.loads(self.stdout)

    @property
    def error_lines(self) -> list[str]:
        """stderr lines that are not JSON log lines."""
        return [line for line in self.stderr.splitlines() if not line.startswith("{")]


def run_cli(
    *args: str | Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    script: bool = False,
    timeout_s: float = CLI_TIMEOUT_S,
) -> CliResult:
    """Run the CLI to completion (env None: this process's environment)."""
    proc = subprocess.run(
        cli_argv(*args, script=script),
        capture_output=True,
        env=None if env is None else dict(env),
        cwd=cwd,
        timeout=timeout_s,
        check=False,
    )
    return CliResult.of(proc.returncode, proc.stdout, proc.stderr)


async def run_cli_async(
    *args: str | Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    script: bool = False,
    timeout_s: float = CLI_TIMEOUT_S,
) -> CliResult:
    """`run_cli` for async tests: the event loop keeps running while the command does."""
    with anyio.fail_after(timeout_s):
        proc = await anyio.run_process(
            cli_argv(*args, script=script),
            check=False,
            env=None if env is None else dict(env),
            cwd=cwd,
        )
    return CliResult.of(proc.returncode, proc.stdout, proc.stderr)
