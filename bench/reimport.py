#!/usr/bin/env python3
"""`inboxd import` of a corpus that is already stored: files/s, next to reading and
hashing the same files in this process.

    .venv/bin/python bench/reimport.py [--messages N] [--dsn ADMIN_DSN] [--seed S]
        [--gen-workers W] [--keep] [--smoke]

Data (generated once, not timed): bench/daemon_backfill.py's N messages of 1-8 KB,
one `NAME.eml` file each. On a fresh database (the command applies schema.sql):

  first    `inboxd import --json DIR` (every message new): msg/s, for scale;
  again    the same command again: every file is a duplicate. Issue 15's target is
           ≥ 20,000 files/s (hashing and one query per page, no parsing), taken on
           the command's own `elapsed_s` (from its start to its summary: listing
           the files, database connection and schema check included) and printed
           beside the wall time of the process (interpreter start-up included);
  baseline this process reading and sha256-hashing every file (one thread): what
           the re-import cannot beat on this machine, in the same run.

Ratios are printed because the machine is shared: re-import ÷ read+hash. The
database is named bench_reimport_<pid> and dropped at the end (unless --keep).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import asyncpg
import orjson
from daemon_backfill import generate, link_eml  # bench/ is sys.path[0]

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
TENANT = "t"
MAILBOX = "m"
TARGET_FILES_PER_S = 20_000.0
SMOKE_MESSAGES = 300
#: a command that has not finished after this long is a failure
RUN_TIMEOUT_S = 1800.0


def read_and_hash(directory: Path) -> tuple[int, float]:
    started = time.perf_counter()
    count = 0
    for entry in os.scandir(directory):
        with open(entry.path, "rb") as fh:
            hashlib.sha256(fh.read()).hexdigest()
        count += 1
    return count, time.perf_counter() - started


async def run_import(dsn: str, config: Path, eml_dir: Path) -> tuple[float, dict, str]:
    """(wall s, the JSON summary, stderr) of one `inboxd import --json`."""
    started = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "inboxd.daemon.cli",
        "import",
        "--config",
        str(config),
        "--dsn",
        dsn,
        "--json",
        "--tenant",
        TENANT,
        "--mailbox",
        MAILBOX,
        str(eml_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    out, err = await asyncio.wait_for(proc.communicate(), RUN_TIMEOUT_S)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"import exited {proc.returncode}: {err.decode()[-2000:]}")
    return wall, orjson.loads(out.strip().splitlines()[-1]), err.decode()


async def main(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="bench_reimport_"))
    name = f"bench_reimport_{os.getpid()}"
    admin = await asyncpg.connect(args.dsn)
    problems: list[str] = []
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        dsn = args.dsn.rsplit("/", 1)[0] + "/" + name
        t0 = time.perf_counter()
        generate(work / "spool", args.messages, args.seed, args.gen_workers)
        eml_dir = work / "eml"
        n = link_eml(work / "spool", eml_dir)
        print(f"generated {n:,} messages ({time.perf_counter() - t0:.1f} s, not timed)")
        config = work / "import.toml"
        config.write_text(f'[object_store]\nkind = "local"\npath = "{work / "objects"}"\n')

        first_wall, first, _ = await run_import(dsn, config, eml_dir)
        await admin.execute("CHECKPOINT")
        again_wall, again, _ = await run_import(dsn, config, eml_dir)
        hashed, hash_s = read_and_hash(eml_dir)

        if first["outcomes"]["new"] != n:
            problems.append(f"first import: {first['outcomes']} (expected {n:,} new)")
        if again["outcomes"]["duplicate"] != n or again["messages"] != n:
            problems.append(f"re-import: {again['outcomes']} (expected {n:,} duplicate)")
        if hashed != n:
            problems.append(f"read+hash saw {hashed:,} files")
        again_rate = n / again["elapsed_s"]
        hash_rate = n / hash_s
        print(f"{'':<42} {'files':>7} {'elapsed s':>10} {'files/s':>9} {'wall s':>8}")
        print(
            f"  {'first import (all new)':<40} {n:>7,} {first['elapsed_s']:>10.2f} "
            f"{n / first['elapsed_s']:>9,.0f} {first_wall:>8.2f}"
        )
        print(
            f"  {'re-import (all duplicate)':<40} {n:>7,} {again['elapsed_s']:>10.2f} "
            f"{again_rate:>9,.0f} {again_wall:>8.2f}"
        )
        print(
            f"  {'baseline: read + sha256 in this process':<40} {n:>7,} {hash_s:>10.2f} "
            f"{hash_rate:>9,.0f}"
        )
        verdict = "ok" if again_rate >= TARGET_FILES_PER_S else "MISSED"
        print(
            f"\n  re-import {again_rate:,.0f} files/s (target ≥ {TARGET_FILES_PER_S:,.0f}: "
            f"{verdict}); ÷ read+hash = {again_rate / hash_rate:.2f}; "
            f"÷ first import = {again_rate / (n / first['elapsed_s']):.1f}"
        )
    finally:
        if not args.keep:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept database {name} and {work}")
        await admin.close()
    for problem in problems:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    return 1 if problems else 0


def cli() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=20_000)
    p.add_argument("--dsn", default=os.environ.get("INBOXD_TEST_DSN", DEFAULT_DSN))
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--gen-workers", type=int, default=2)
    p.add_argument("--keep", action="store_true")
    p.add_argument("--smoke", action="store_true", help=f"{SMOKE_MESSAGES} messages")
    args = p.parse_args()
    if args.smoke:
        args.messages = SMOKE_MESSAGES
    return asyncio.run(main(args))


if __name__ == "__main__":
    sys.exit(cli())
