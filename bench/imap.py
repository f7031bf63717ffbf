#!/usr/bin/env python3
"""The IMAP door (Dovecot → rows) under `inboxd run`, next to bare UID FETCH loops
against the same server and to `inboxd import` of the same files, all in one run.

    .venv/bin/python bench/imap.py [--messages N] [--window W] [--dsn ADMIN_DSN]
        [--only fetch,daemon,import] [--interval S] [--gen-workers W] [--seed S]
        [--keep] [--smoke]

Defaults: N=10,000, windows of adapters/imap/source.py's IMAP_WINDOW (100); a few
minutes on 2 cores.

Data (not timed): N distinct RFC 5322 messages of 1-8 KB from daemon_backfill.py's
generator (plain, multipart/alternative, a PDF attachment, legacy charsets; threads
with In-Reply-To/References), written into the INBOX of a fresh user of a private
Dovecot (tests/helpers/dovecot.py: the suite's server, plain IMAP on a loopback port)
with `deliver_many` (Maildir files, in name order, so UIDs follow it), then a
`doveadm mailbox status` so Dovecot has numbered them before any clock starts. The
same files, as NAME.eml hard links, are what `inboxd import` reads. The files have
bare LF line endings; IMAP serves them with CRLF, so the two databases hold the
same messages (compared by Message-ID) but not the same raw bytes.

Measured, in this order, one after the other (nothing else of ours running):

  bare fetch   the protocol's ceiling here: a client in this process, logged in
               (not timed), then EXAMINE INBOX, UID SEARCH ALL and UID FETCH
               (UID BODY.PEEK[]) of every UID, timed from EXAMINE to the last answer:
               aioimaplib in windows of W UIDs (as the door fetches), aioimaplib
               with one `UID FETCH 1:*`, the stdlib's imaplib in windows of W (in a
               thread of this process), and the door's own client
               (adapters/imap/client.py ImapConnection.fetch_raw, windows of W).
               Every UID must come back once with a literal.
  source       the door without the database: ImapSource.pages(None) of a
               backfill = "all" mailbox in this process, every page drained
               (UID FETCH windows, then parse_in_workers in worker processes).
  daemon       `inboxd run` (fresh database; main TOML as bench/ses.py's; one tenant
               file with one imap mailbox: security = "none", password = "env:…",
               backfill = "all", poll mode, idle and max_connections as default).
               Timed from the spawn until N message rows and N copies exist and the
               mailbox has a cursor (bench/door_run.py drive_daemon), RSS and CPU
               sampled every --interval s; then SIGTERM, exit code 0 expected.
  import       `inboxd import` of the same files into a fresh database
               (daemon_backfill.py's run_import), timed from spawn to exit.

Printed: msg/s and MB/s of each; the ratios daemon / import, daemon / bare fetch
(aioimaplib, windows of W) and daemon / source; where the CPU went during each bare
fetch (this client, Dovecot) and during the daemon's run (daemon main process, its
parse workers, the PostgreSQL backends of its database, Dovecot — every process of
the private server — this script, the whole machine from /proc/stat), as % of one
core and ms per message; the daemon's RSS at every 10 % of the rows.

The machine is shared and noisy: compare the ratios of one run. Databases are named
bench_imap_<pid>_<x> and dropped at the end; the work directory and the Dovecot's
files are removed too (unless --keep). The first line printed names the commit of
the code measured (printed again at the end). Exit 1 when a figure is not a
measurement (bench/README.md): a fetch that misses or repeats a UID, rows or copies
other than N, dead items, a daemon failure or a non-zero exit.
"""

from __future__ import annotations

import argparse
import asyncio
import imaplib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aioimaplib
import asyncpg

# bench/ is sys.path[0]: the Maildir backfill bench's and the door benches' machinery.
from daemon_backfill import (
    _OWNER,
    CLK_TCK,
    MAILBOX,
    PROGRESS_POINTS,
    TENANT,
    Result,
    code_version,
    curve_table,
    describe,
    generate,
    link_eml,
    run_import,
    tree,
)
from door_run import (
    DaemonRun,
    FreshServer,
    Plain,
    Sampler,
    drive_daemon,
    finite_positive,
    machine_cpu_s,
)

# tests/helpers: the suite's private Dovecot (pyproject's pytest pythonpath has tests/).
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers.dovecot import DovecotServer

from inboxd.adapters.imap.client import ImapConnection
from inboxd.adapters.imap.config import ImapMailbox
from inboxd.adapters.imap.source import IMAP_WINDOW, ImapSource
from inboxd.pipeline.message import MessageData

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
FOLDER = "INBOX"
# The daemon's password reference (`password = "env:…"` in the tenant file).
PASSWORD_ENV = "INBOXD_BENCH_IMAP_PASSWORD"  # noqa: S105 - a variable name
# Silence on one command in the bare loops (aioimaplib restarts it on every line it
# reads): a window of 100 messages (~0.5 MB) takes milliseconds on loopback; past
# this the server hangs.
COMMAND_TIMEOUT_S = 300.0
RUN_TIMEOUT_S = 1800.0
# The daemon's RSS is "flat" when it grew less than this from 10 % to 90 % of the rows.
FLAT_MB = 10.0
#: --smoke (CI): every figure at a tiny size, ~20-30 s.
SMOKE_MESSAGES = 300
SMOKE_INTERVAL_S = 0.2
SMOKE_RUN_TIMEOUT_S = 90.0


# --------------------------------------------------------------------------- Dovecot


def _cpu_with_children_s(pid: int) -> float:
    """utime + stime of `pid` and of its children it has reaped (cutime + cstime)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / CLK_TCK


class DovecotCpu:
    """CPU seconds of every process of the private Dovecot: its process tree (the
    reaper, the master, login, auth, imap processes), each with its reaped children,
    so short-lived processes count too. Quacks like door_run.FakeThread for Sampler."""

    def __init__(self, server: DovecotServer) -> None:
        self.server = server

    def cpu_s(self) -> float:
        root = self.server.pgid
        return 0.0 if root is None else sum(_cpu_with_children_s(p) for p in tree(root))


def _schedstat_s(pid: int, tid: int) -> tuple[float, float]:
    """(on a CPU, runnable but waiting for one) seconds of one thread since it started:
    /proc/PID/task/TID/schedstat (ns), the kernel's run-queue accounting."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
            on_ns, wait_ns = (int(x) for x in fh.read().split()[:2])
    except (OSError, ValueError):
        return float("nan"), float("nan")
    return on_ns / 1e9, wait_ns / 1e9


def _process_sched_s(pid: int) -> tuple[float, float]:
    """The same summed over the threads of `pid` alive now."""
    on = wait = 0.0
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return float("nan"), float("nan")
    for tid in tids:
        a, b = _schedstat_s(pid, tid)
        if a == a:  # not NaN
            on, wait = on + a, wait + b
    return on, wait


def sched_lines(daemon_pid: int) -> list[str]:
    """Run-queue time of the daemon since its spawn (read once every message is a row):
    how long its event-loop thread and its parse workers were on a CPU and how long
    they were ready to run but waiting for one — on a shared machine, the second."""
    parts = []
    loop_on, loop_wait = _schedstat_s(daemon_pid, daemon_pid)
    parts.append(f"event-loop thread on a CPU {loop_on:.1f} s, waiting for one {loop_wait:.1f} s")
    on, wait = _process_sched_s(daemon_pid)
    parts.append(f"all its live threads {on:.1f} s / {wait:.1f} s")
    for child in tree(daemon_pid)[1:]:
        on, wait = _process_sched_s(child)
        parts.append(f"parse worker {child} {on:.1f} s / {wait:.1f} s")
    return parts


def parse_workers(server: DovecotServer) -> list[int]:
    """This process's descendants but the Dovecot it started: the parse workers."""
    dovecot = set(tree(server.pgid)) if server.pgid is not None else set()
    return [p for p in tree(os.getpid())[1:] if p not in dovecot]


def this_tree_cpu_s(server: DovecotServer) -> float:
    """This process and its parse workers (the source row)."""
    return sum(_cpu_with_children_s(p) for p in [os.getpid(), *parse_workers(server)])


# --------------------------------------------------------------------------- bare fetch


@dataclass
class Reference:
    """One bare fetch (or the source alone): what came back and what it cost."""

    label: str
    n: int
    wall_s: float = float("nan")
    messages: int = 0
    nbytes: int = 0
    commands: int = 0
    client_cpu_s: float = float("nan")
    dovecot_cpu_s: float = float("nan")
    machine_busy_s: float = float("nan")
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.n / self.wall_s if self.wall_s > 0 else float("nan")

    def lines(self) -> list[str]:
        return [self.line()] + [f"    {note}" for note in self.notes]

    def line(self) -> str:
        def pct(x: float) -> str:
            return f"{x:6.1f} s {100 * x / self.wall_s:4.0f} % {1000 * x / self.n:5.2f} ms"

        return (
            f"  {self.label:<44} {self.n:>7,} {self.wall_s:>8.2f} {self.rate:>8,.0f} "
            f"{self.nbytes / 1e6 / self.wall_s:>7.1f}  {pct(self.client_cpu_s)}  "
            f"{pct(self.dovecot_cpu_s)}  {100 * self.machine_busy_s / self.wall_s:4.0f} %   "
            f"{self.commands:,} FETCH commands, {self.messages:,} messages, "
            f"{self.nbytes / 1e6:,.1f} MB"
        )


def windows(uids: list[int], size: int) -> list[str]:
    """UID sets of `size` UIDs each (a:b when contiguous), or `1:*` for size 0."""
    if size <= 0:
        return ["1:*"]
    out = []
    for start in range(0, len(uids), size):
        part = uids[start : start + size]
        contiguous = part[-1] - part[0] == len(part) - 1
        out.append(f"{part[0]}:{part[-1]}" if contiguous else ",".join(map(str, part)))
    return out


def _search_uids(lines: list[Any]) -> list[int]:
    uids: set[int] = set()
    for line in lines[:-1]:  # aioimaplib: `* SEARCH 1 2 3` as b"1 2 3" (or with its name)
        if isinstance(line, bytes):
            uids.update(int(t) for t in line.removeprefix(b"SEARCH").split() if t.isdigit())
    return sorted(uids)


async def _timed(
    ref: Reference,
    dovecot: DovecotCpu,
    work: Callable[[], Awaitable[None]],
    client_cpu: Callable[[], float] = time.thread_time,
) -> None:
    d0, m0, c0, t0 = dovecot.cpu_s(), machine_cpu_s()[0], client_cpu(), time.monotonic()
    try:
        await work()
    except Exception as exc:  # a figure that is not a measurement
        ref.problems.append(f"{type(exc).__name__}: {exc}")
    ref.wall_s = time.monotonic() - t0
    ref.client_cpu_s = client_cpu() - c0
    ref.dovecot_cpu_s = dovecot.cpu_s() - d0
    ref.machine_busy_s = machine_cpu_s()[0] - m0


def _check(ref: Reference, seen: Counter[int], expected: list[int]) -> None:
    ref.messages = sum(seen.values())
    missing = len(set(expected) - set(seen))
    twice = sum(1 for n in seen.values() if n > 1)
    if missing or twice or ref.messages != ref.n:
        ref.problems.append(
            f"{ref.messages} messages for {ref.n} UIDs ({missing} missing, {twice} twice)"
        )


async def bare_aioimaplib(
    server: DovecotServer, user: str, password: str, n: int, window: int
) -> Reference:
    what = f"windows of {window}" if window > 0 else "one UID FETCH 1:*"
    ref = Reference(f"bare fetch, aioimaplib, {what}", n)
    client = aioimaplib.IMAP4(server.host, server.plain_port, timeout=COMMAND_TIMEOUT_S)
    await client.wait_hello_from_server()
    answer = await client.login(user, password)
    if answer.result != "OK":
        ref.problems.append(f"LOGIN {answer.result}")
        return ref
    seen: Counter[int] = Counter()
    uids: list[int] = []

    async def work() -> None:
        nonlocal uids
        answer = await client.examine(FOLDER)
        if answer.result != "OK":
            raise RuntimeError(f"EXAMINE {answer.result}")
        # aioimaplib moves to SELECTED only for its select() (adapters/imap/client.py)
        client.protocol.state = aioimaplib.SELECTED
        uids = _search_uids((await client.uid_search("ALL", charset=None)).lines)
        for uid_set in windows(uids, window):
            answer = await client.uid("fetch", uid_set, "(UID BODY.PEEK[])")
            ref.commands += 1
            if answer.result != "OK":
                raise RuntimeError(f"UID FETCH {uid_set}: {answer.result}")
            uid = None
            for line in answer.lines:
                if isinstance(line, bytearray):
                    ref.nbytes += len(line)
                    if uid is not None:
                        seen[uid] += 1
                    uid = None
                elif isinstance(line, bytes) and b"FETCH (" in line:
                    # `* n FETCH (UID u BODY[] {size}`: the literal follows
                    parts = line.split()
                    uid = int(parts[parts.index(b"(UID") + 1]) if b"(UID" in parts else None

    try:
        await _timed(ref, DovecotCpu(server), work)
    finally:
        await client.logout()
    _check(ref, seen, uids)
    return ref


async def bare_imaplib(
    server: DovecotServer, user: str, password: str, n: int, window: int
) -> Reference:
    ref = Reference(f"bare fetch, stdlib imaplib, windows of {window}", n)
    seen: Counter[int] = Counter()
    uids: list[int] = []
    conn = imaplib.IMAP4(server.host, server.plain_port, timeout=COMMAND_TIMEOUT_S)
    conn.login(user, password)

    def fetch_all() -> float:
        nonlocal uids
        cpu0 = time.thread_time()
        typ, _ = conn.select(FOLDER, readonly=True)  # = EXAMINE
        if typ != "OK":
            raise RuntimeError(f"EXAMINE {typ}")
        typ, data = conn.uid("SEARCH", "ALL")
        uids = sorted(int(x) for x in data[0].split())
        for uid_set in windows(uids, window):
            typ, data = conn.uid("FETCH", uid_set, "(UID BODY.PEEK[])")
            ref.commands += 1
            if typ != "OK":
                raise RuntimeError(f"UID FETCH {uid_set}: {typ}")
            for item in data:
                if isinstance(item, tuple):
                    head, literal = item
                    parts = head.split()
                    seen[int(parts[parts.index(b"(UID") + 1])] += 1
                    ref.nbytes += len(literal)
        return time.thread_time() - cpu0

    cpu = 0.0

    async def work() -> None:
        nonlocal cpu
        cpu = await asyncio.to_thread(fetch_all)

    try:
        await _timed(ref, DovecotCpu(server), work, client_cpu=lambda: 0.0)
        ref.client_cpu_s = cpu  # the thread's own CPU
    finally:
        conn.logout()
    _check(ref, seen, uids)
    return ref


def _mailbox(server: DovecotServer, user: str, password: str) -> ImapMailbox:
    return ImapMailbox(
        host=server.host,
        port=server.plain_port,
        security="none",
        username=user,
        password=Plain(password),  # type: ignore[arg-type]
        backfill="all",
    )


async def bare_door_client(
    server: DovecotServer, user: str, password: str, n: int, window: int
) -> Reference:
    ref = Reference(f"door's client (fetch_raw), windows of {window}", n)
    connection = await ImapConnection.open(_mailbox(server, user, password))
    seen: Counter[int] = Counter()
    uids: list[int] = []

    async def work() -> None:
        nonlocal uids
        await connection.examine(FOLDER)
        uids = await connection.search_uids("ALL")
        for start in range(0, len(uids), window):
            raws, ok = await connection.fetch_raw(uids[start : start + window])
            ref.commands += 1
            if not ok:
                raise RuntimeError(f"UID FETCH of window {start // window}: not OK")
            seen.update(raws.keys())
            ref.nbytes += sum(len(r) for r in raws.values())

    try:
        await _timed(ref, DovecotCpu(server), work)
    finally:
        await connection.close()
    _check(ref, seen, uids)
    return ref


async def source_alone(server: DovecotServer, user: str, password: str, n: int) -> Reference:
    ref = Reference("source alone: ImapSource.pages, no database", n)
    source = ImapSource(TENANT, MAILBOX, _mailbox(server, user, password))
    seen: Counter[int] = Counter()
    dead = 0

    async def work() -> None:
        nonlocal dead
        async for page in source.pages(None):
            ref.commands += 1 if page.items else 0
            for item in page.items:
                if isinstance(item, MessageData) and item.raw is not None:
                    ref.nbytes += len(item.raw)
                    seen[int(item.external_id.rsplit(":", 1)[1])] += 1
                else:
                    dead += 1

    me = threading.get_native_id()
    on0, wait0 = _schedstat_s(os.getpid(), me)
    try:
        # the parse workers are child processes of this one: the tree's CPU
        await _timed(ref, DovecotCpu(server), work, client_cpu=lambda: this_tree_cpu_s(server))
    finally:
        await source.aclose()
    on1, wait1 = _schedstat_s(os.getpid(), me)
    sched = [f"event-loop thread on a CPU {on1 - on0:.1f} s, waiting for one {wait1 - wait0:.1f} s"]
    for child in parse_workers(server):  # started by this row (their first use)
        on, wait = _process_sched_s(child)
        sched.append(f"parse worker {on:.1f} s / {wait:.1f} s")
    ref.notes.append("run queue (schedstat): " + "; ".join(sched))
    if dead:
        ref.problems.append(f"{dead} dead items or items without raw bytes")
    _check(ref, seen, sorted(seen) if not ref.problems else [])
    return ref


# --------------------------------------------------------------------------- the daemon


def write_config(run_dir: Path, server: DovecotServer, user: str) -> Path:
    """Main TOML (as bench/ses.py's: config.example.toml's [queue]/[workers]) and one
    tenant file with one imap mailbox on the private Dovecot."""
    tenants = run_dir / "tenants"
    tenants.mkdir(parents=True, exist_ok=True)
    (tenants / f"{TENANT}.toml").write_text(f"""id = "{TENANT}"
name = "Bench"

[[mailboxes]]
id = "{MAILBOX}"
provider = "imap"
address = "{_OWNER[1]}"
sync_mode = "poll"
poll_interval_s = 60
host = "{server.host}"
port = {server.plain_port}
security = "none"
username = "{user}"
password = "env:{PASSWORD_ENV}"
folders = ["{FOLDER}"]
backfill = "all"
""")
    main = run_dir / "inboxd.toml"
    main.write_text(f"""
[listener]
host = "127.0.0.1"
port = 0

[object_store]
kind = "local"
path = "{run_dir / "objects"}"

[queue]
capacity = 2000

[workers]
ingest = 2
batch_size = 500

[shutdown]
deadline_s = 60

[tenants]
dir = "tenants"
""")
    return main


async def run_daemon(
    args: argparse.Namespace,
    server: FreshServer,
    dovecot: DovecotServer,
    work: Path,
    user: str,
    password: str,
) -> tuple[Result, DaemonRun, Sampler | None]:
    res = Result("daemon", args.messages)
    run = DaemonRun("daemon", {MAILBOX: _OWNER[1]}, args.messages)
    run_dir = work / "daemon"
    run_dir.mkdir(parents=True, exist_ok=True)
    config = write_config(run_dir, dovecot, user)
    dbname, dsn = await server.fresh("d")
    res.extra["dsn"] = dsn
    got: dict[str, Any] = {}

    async def when_done(
        sampler: Sampler, monitor: asyncpg.Connection, done_at: dict[str, float]
    ) -> None:
        got["sampler"] = sampler
        got["done_at"] = done_at.get(MAILBOX)
        res.extra["sched"] = sched_lines(sampler.pid)
        idle_until = time.monotonic() + args.idle_s  # memory once the work is done
        while time.monotonic() < idle_until:
            await asyncio.sleep(args.interval)
            await sampler.sample()

    await drive_daemon(
        run,
        server=server,
        ft=DovecotCpu(dovecot),  # type: ignore[arg-type]
        fake_name="Dovecot",
        command=[
            sys.executable,
            "-m",
            "inboxd.daemon.cli",
            "run",
            "--config",
            str(config),
            "--dsn",
            dsn,
            "--log-level",
            "info",
        ],
        env={**os.environ, PASSWORD_ENV: password},
        dbname=dbname,
        dsn=dsn,
        log_path=run_dir / "daemon.log",
        interval_s=args.interval,
        timeout_s=args.run_timeout_s,
        when_done=when_done,
    )
    sampler: Sampler | None = got.get("sampler")
    res.problems += run.problems
    res.ready_s, res.exit_code = run.ready_s, run.exit_code
    res.rows, res.copies, res.dead = run.stored, run.copies, run.dead
    if sampler is not None:
        watch = sampler.watch
        res.samples = watch.samples
        res.client_cpu_s = watch.client_cpu
        res.server_cpu_s = watch.server_cpu
        res.extra["monitor_cpu_s"] = watch.monitor_cpu
        res.extra["rss_idle_kb"] = watch.samples[-1].rss_tree_kb
        if got.get("done_at") is not None:
            res.wall_s = got["done_at"] - watch.started
            res.extra["done_at"] = got["done_at"]
    conn = await asyncpg.connect(dsn)
    try:
        res.extra["mids"] = await _message_ids(conn)
    finally:
        await conn.close()
    return res, run, sampler


async def _message_ids(conn: asyncpg.Connection) -> set[str]:
    return {r[0] for r in await conn.fetch("SELECT message_id_norm FROM messages")}


# --------------------------------------------------------------------------- output


def cpu_lines(res: Result, sampler: Sampler | None) -> list[str]:
    """Where the CPU went: spawn → done, and daemon_ready → done per stored message."""
    done_at = res.extra.get("done_at")
    if sampler is None or not sampler.ticks or done_at is None or not finite_positive(res.wall_s):
        return ["  CPU: n/a (the daemon run did not finish)"]
    t0 = sampler.watch.started
    cores = os.cpu_count() or 1
    lines = [f"  CPU, % of one core ({cores} cores = {100 * cores} %), and ms per stored message:"]
    windows_ = [("spawn → done", t0, res.n)]
    if res.ready_s is not None and res.ready_s < res.wall_s:
        at_ready = next((x for x in res.samples if x.t >= res.ready_s), None)
        rows = at_ready.rows if at_ready is not None else 0
        windows_.append(("daemon_ready → done", t0 + res.ready_s, res.n - rows))
    for name, start, n in windows_:
        w = sampler.window(start, done_at)
        parts = [
            ("daemon main", w.daemon_main_s),
            ("parse workers", w.daemon_tree_s - w.daemon_main_s),
            ("PostgreSQL", w.server_s),
            ("Dovecot", w.fake_s),
            ("this script", w.bench_s),
        ]
        shown = [
            f"{k} n/a"
            if x is None
            else f"{k} {100 * x / w.wall_s:.0f} % ({1000 * x / max(n, 1):.2f} ms)"
            for k, x in parts
        ]
        ours = sum(x for _, x in parts if x is not None)
        lines.append(
            f"    {name} ({w.wall_s:.1f} s, {n:,} messages, {n / w.wall_s:,.0f} msg/s): "
            + "; ".join(shown)
            + f"; all of these {100 * ours / w.wall_s:.0f} %; the whole machine "
            f"{100 * w.machine_busy_s / w.wall_s:.0f} % (stolen "
            f"{100 * w.machine_steal_s / w.wall_s:.0f} %)"
        )
    return lines


def growth_mb(res: Result) -> float:
    pts = [res.rss_at(p) for p in PROGRESS_POINTS]
    if not all(pts):
        return float("nan")
    return (pts[-1].rss_tree_kb - pts[0].rss_tree_kb) / 1024  # type: ignore[union-attr]


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# --------------------------------------------------------------------------- main


async def main(args: argparse.Namespace) -> int:
    only = set(args.only.split(","))
    work = Path(tempfile.mkdtemp(prefix="bench_imap_"))
    server = FreshServer(args.dsn, args.keep, "bench_imap")
    print(
        f"inboxd at {code_version()}; work directory {work}; {os.cpu_count()} CPUs; "
        f"load average {load()}",
        flush=True,
    )
    refs: list[Reference] = []
    daemon: Result | None = None
    run: DaemonRun | None = None
    sampler: Sampler | None = None
    imported: Result | None = None
    same: bool | None = None
    problems: list[str] = []
    dovecot = DovecotServer()
    try:
        t0 = time.monotonic()
        dovecot.start()
        account = dovecot.new_user("bench")
        user, password = account.username, account.password
        print(
            f"Dovecot on {dovecot.host}:{dovecot.plain_port} (plain IMAP) ready after "
            f"{time.monotonic() - t0:.1f} s; user {user}",
            flush=True,
        )
        t0 = time.monotonic()
        spool = work / "spool"
        meta = generate(spool, args.messages, args.seed, args.gen_workers)
        sizes = [s for s, _ in meta]
        kinds = Counter(k for _, k in meta)
        print(
            f"generated {len(sizes):,} messages in {time.monotonic() - t0:.1f} s (not timed): "
            f"{sum(sizes) / 1e6:,.1f} MB, size median {statistics.median(sizes):,.0f} / mean "
            f"{statistics.fmean(sizes):,.0f} / max {max(sizes):,} bytes; "
            + ", ".join(f"{k} {v * 100 / len(meta):.0f} %" for k, v in kinds.items()),
            flush=True,
        )
        t0 = time.monotonic()
        names = sorted(os.listdir(spool / "new"))
        delivered = dovecot.deliver_many(
            user, FOLDER, ((spool / "new" / name).read_bytes() for name in names)
        )
        status = dovecot.status(user, FOLDER)  # Dovecot numbers the new files now
        print(
            f"delivered {delivered:,} messages into {FOLDER} of {user} in "
            f"{time.monotonic() - t0:.1f} s (not timed): {status.messages:,} messages, "
            f"UIDNEXT {status.uidnext:,}",
            flush=True,
        )
        if status.messages != args.messages:
            problems.append(f"{status.messages} messages in {FOLDER}, expected {args.messages}")
        eml_dir = work / "eml"
        link_eml(spool, eml_dir)

        if "fetch" in only:
            print(
                f"  {'':<44} {'msgs':>7} {'wall s':>8} {'msg/s':>8} {'MB/s':>7}  "
                f"{'client CPU, per msg':>22}  {'Dovecot CPU, per msg':>22}  machine",
                flush=True,
            )
            n, w = args.messages, args.window
            for make in (
                lambda: bare_aioimaplib(dovecot, user, password, n, w),
                lambda: bare_aioimaplib(dovecot, user, password, n, 0),
                lambda: bare_imaplib(dovecot, user, password, n, w),
                lambda: bare_door_client(dovecot, user, password, n, w),
                lambda: source_alone(dovecot, user, password, n),
            ):
                ref = await make()
                refs.append(ref)
                print("\n".join(ref.lines()), flush=True)
                for p in ref.problems:
                    print(f"    PROBLEM: {p}", flush=True)
        if "daemon" in only:
            print(f"daemon (load average {load()}) …", flush=True)
            daemon, run, sampler = await run_daemon(args, server, dovecot, work, user, password)
            for line in describe(daemon):
                print(line, flush=True)
            after = dovecot.flags(user, FOLDER)
            seen = sum(1 for f in after.values() if "\\Seen" in f)
            daemon.extra["seen"] = seen
            if seen:
                daemon.problems.append(f"{seen} messages marked \\Seen on the server")
        if "import" in only:
            print(f"import (load average {load()}) …", flush=True)
            imported = await run_import(args, server, work, eml_dir, "0")
            for line in describe(imported):
                print(line, flush=True)
            if daemon is not None:
                conn = await asyncpg.connect(server.dsn_of(server.created[-1]))
                try:
                    same = await _message_ids(conn) == daemon.extra.get("mids")
                finally:
                    await conn.close()
    except Exception as exc:  # report it below with whatever was measured
        problems.append(f"{type(exc).__name__}: {exc}")
    finally:
        await server.drop_all()
        if args.keep:
            dovecot.stop()
            print(f"kept work directory {work} and Dovecot's files in {dovecot.root}")
        else:
            dovecot.close()
            shutil.rmtree(work, ignore_errors=True)

    print()
    print(f"inboxd at {code_version()} (at the end of the run)")
    print(
        f"IMAP door, {args.messages:,} messages in one Dovecot INBOX (plain IMAP on "
        f"loopback), UID windows of {args.window}; load average now {load()}"
    )
    if refs:
        print(
            f"  {'':<44} {'msgs':>7} {'wall s':>8} {'msg/s':>8} {'MB/s':>7}  "
            f"{'client CPU, per msg':>22}  {'Dovecot CPU, per msg':>22}  machine"
        )
    for ref in refs:
        print("\n".join(ref.lines()))
        problems += [f"{ref.label}: {p}" for p in ref.problems]
        if not finite_positive(ref.rate) and not ref.problems:
            problems.append(f"{ref.label}: no throughput")
    if daemon is not None or imported is not None:
        print(
            f"  {'':<8} {'msgs':>8} {'wall s':>9} {'msg/s':>8}  {'client CPU':>9} "
            f"{'server CPU':>9}  {'peak RSS':>8} {'main RSS':>8}   (MB)"
        )
    for res in (daemon, imported):
        if res is None:
            continue
        for line in describe(res):
            print(line)
        problems += [f"{res.label}: {p}" for p in res.problems]
        if not finite_positive(res.rate) and not res.problems:
            problems.append(f"{res.label}: no throughput ({res.rate} msg/s)")
    if daemon is not None and run is not None:
        print(run.footer()[0])  # rows, copies, dead, ready, SIGTERM → exit code
        print(f"  messages marked \\Seen on the server after the daemon: {daemon.extra['seen']}")
        print("  daemon RSS curve (process tree = daemon + parse workers):")
        for line in curve_table(daemon):
            print("    " + line)
        for line in cpu_lines(daemon, sampler):
            print(line)
        if daemon.extra.get("sched"):
            print(
                "  run queue, spawn → done (/proc/PID/task/TID/schedstat): "
                + "; ".join(daemon.extra["sched"])
            )
    if same is not None:
        print(f"  same messages in both databases (Message-IDs): {'yes' if same else 'NO'}")
        if not same:
            problems.append("the daemon's and the import's databases hold different messages")
    if daemon is not None and finite_positive(daemon.rate):
        ratios = []
        if imported is not None and finite_positive(imported.rate):
            ratios.append(f"daemon / import = {daemon.rate / imported.rate:.3f}")
        for ref in refs:
            if finite_positive(ref.rate):
                ratios.append(f"daemon / {ref.label} = {daemon.rate / ref.rate:.3f}")
        print("  ratios, same run: " + "; ".join(ratios))
        g = growth_mb(daemon)
        print(
            f"  daemon peak RSS {daemon.peak_tree_mb:,.1f} MB (main {daemon.peak_main_mb:,.1f}); "
            f"growth 10 % → 90 % of the rows {g:+.1f} MB "
            f"({'flat' if abs(g) < FLAT_MB else 'NOT flat'})"
        )
    for p in problems:
        print(f"PROBLEM: {p}")
    return 1 if problems else 0


def cli() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument(
        "--window", type=int, default=IMAP_WINDOW, help="UIDs per UID FETCH in the bare loops"
    )
    parser.add_argument(
        "--dsn", default=DEFAULT_DSN, help="admin DSN (creates bench_imap_* databases)"
    )
    parser.add_argument("--only", default="fetch,daemon,import")
    parser.add_argument("--interval", type=float, default=0.5, help="sampling interval, s")
    parser.add_argument(
        "--idle-s", type=float, default=2.0, help="keep sampling the daemon this long after"
    )
    parser.add_argument("--print-every", type=float, default=15.0, help="progress line every … s")
    parser.add_argument("--gen-workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=20261206)
    parser.add_argument(
        "--keep", action="store_true", help="keep the databases, work directory and Dovecot files"
    )
    parser.add_argument("--run-timeout-s", type=float, default=RUN_TIMEOUT_S)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help=f"CI size: {SMOKE_MESSAGES} messages; exit 1 on any problem",
    )
    args = parser.parse_args()
    args.import_args = ""  # daemon_backfill.run_import's options
    if args.smoke:
        args.messages = SMOKE_MESSAGES
        args.interval, args.idle_s = SMOKE_INTERVAL_S, 0.5
        args.run_timeout_s = min(args.run_timeout_s, SMOKE_RUN_TIMEOUT_S)
    return asyncio.run(main(args))


if __name__ == "__main__":
    sys.exit(cli())
