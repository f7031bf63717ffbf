#!/usr/bin/env python3
"""`inboxd import` of a corpus that is already stored: files/s, next to reading and
hashing the same files in this process.

    .venv/bin/python bench/reimport.py [--messages N] [--dsn ADMIN_DSN] [--seed S]
        [--gen-workers W] [--again R] [--keep] [--smoke]

Data (generated once, not timed): bench/daemon_backfill.py's N messages of 1-8 KB,
one `NAME.eml` file each. On a fresh database (the command applies schema.sql):

  first    `inboxd import --json DIR` (every message new): msg/s, for scale;
  again    the same command again, R times (default 3): every file is a duplicate.
           Issue 15's target is ≥ 20,000 files/s (hashing and one query per page,
           no parsing), taken on the command's own `elapsed_s` (from its start to
           its summary: listing the files, database connection and schema check
           included), the median of the R runs, printed beside the wall time of
           the process (interpreter start-up included) and the runs' range;
  baseline this process reading and sha256-hashing every file (one thread): what
           the re-import cannot beat on this machine, in the same run;
  listing  this process listing and checking the same files as the command does
           before it reads any (`plan_import`): the part of `elapsed_s` that comes
           before the first page.

Each re-import is followed by one baseline and one listing, and each row is the
median of its R runs, so all three meet the same moments of a shared machine.
Figures taken before --again and the listing row existed (bench/README.md at
ea67d39) are single runs. Ratios are printed because the machine is shared:
re-import ÷ read+hash. The database is named bench_reimport_<pid> and dropped at
the end (unless --keep).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import asyncpg
import orjson
from daemon_backfill import generate, link_eml  # bench/ is sys.path[0]

from inboxd.adapters.files import plan_import

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
TENANT = "t"
MAILBOX = "m"
TARGET_FILES_PER_S = 20_000.0
SMOKE_MESSAGES = 300
# Re-imports per run: one is at the mercy of a neighbour's burst on 2 shared cores
# (1.2-1.5 s between consecutive single runs at ea67d39); the median of 3 is not.
DEFAULT_AGAIN = 3
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


def listing(directory: Path) -> tuple[int, float]:
    """(files, s) of `plan_import`, what `inboxd import` does before reading."""
    started = time.perf_counter()
    plan = plan_import([directory])
    return len(plan.files), time.perf_counter() - started


def row(line: str) -> None:
    print(line.rstrip())


def spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}" if len(values) > 1 else ""


async def run_import(dsn: str, config: Path, eml_dir: Path) -> tuple[float, dict, str]:
    """(wall s, the JSON summary, stderr) of one `inboxd import --json`."""
    started = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "inboxd.daemon.cli",
        "import",
        "--create",
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
        again_s: list[float] = []
        again_walls: list[float] = []
        hash_times: list[float] = []
        list_times: list[float] = []
        for _ in range(args.again):
            again_wall, again, _ = await run_import(dsn, config, eml_dir)
            if again["outcomes"]["duplicate"] != n or again["messages"] != n:
                problems.append(f"re-import: {again['outcomes']} (expected {n:,} duplicate)")
            again_s.append(again["elapsed_s"])
            again_walls.append(again_wall)
            hashed, hash_s = read_and_hash(eml_dir)
            listed, list_s = listing(eml_dir)
            hash_times.append(hash_s)
            list_times.append(list_s)
            if hashed != n or listed != n:
                problems.append(f"read+hash saw {hashed:,} files, listing {listed:,}")

        if first["outcomes"]["new"] != n:
            problems.append(f"first import: {first['outcomes']} (expected {n:,} new)")
        again_elapsed = statistics.median(again_s)
        hash_elapsed = statistics.median(hash_times)
        list_elapsed = statistics.median(list_times)
        again_rate = n / again_elapsed
        hash_rate = n / hash_elapsed
        runs = f"median of {args.again}" if args.again > 1 else ""
        row(
            f"{'':<42} {'files':>7} {'elapsed s':>10} {'files/s':>9} {'wall s':>8}"
            f"  {'range s' if runs else ''}"
        )
        row(
            f"  {'first import (all new)':<40} {n:>7,} {first['elapsed_s']:>10.2f} "
            f"{n / first['elapsed_s']:>9,.0f} {first_wall:>8.2f}"
        )
        row(
            f"  {'re-import (all duplicate)':<40} {n:>7,} {again_elapsed:>10.2f} "
            f"{again_rate:>9,.0f} {statistics.median(again_walls):>8.2f}  {spread(again_s)}"
        )
        row(
            f"  {'baseline: read + sha256 in this process':<40} {n:>7,} {hash_elapsed:>10.2f} "
            f"{hash_rate:>9,.0f} {'':>8}  {spread(hash_times)}"
        )
        row(
            f"  {'listing: plan_import in this process':<40} {n:>7,} {list_elapsed:>10.2f} "
            f"{n / list_elapsed:>9,.0f} {'':>8}  {spread(list_times)}"
        )
        if runs:
            print(f"  (re-import, baseline and listing rows: {runs} runs, interleaved)")
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
    p.add_argument(
        "--again", type=int, default=DEFAULT_AGAIN, help="re-imports; rows are their median"
    )
    p.add_argument("--keep", action="store_true")
    p.add_argument("--smoke", action="store_true", help=f"{SMOKE_MESSAGES} messages, 1 re-import")
    args = p.parse_args()
    if args.smoke:
        args.messages = SMOKE_MESSAGES
        args.again = 1
    if args.again < 1:
        p.error("--again must be at least 1")
    return asyncio.run(main(args))


if __name__ == "__main__":
    sys.exit(cli())
