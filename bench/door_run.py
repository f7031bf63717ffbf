"""A provider door under `inboxd run` against a fake provider in this process: the
machinery gmail.py and outlook.py share (a module of helpers, not a benchmark).

    FakeThread      the fake's aiohttp server on its own event loop in a thread of this
                    process, so its CPU is that thread's (/proc/self/task/TID/stat)
    Sampler         per tick: the daemon's main process, its event-loop thread and its
                    process tree (with its parse workers), the PostgreSQL backends of its
                    database, the fake's thread, this thread, and the whole machine from
                    /proc/stat (busy and stolen by the hypervisor: the machine is shared)
    CpuWindow       the CPU of each over one window of wall time, as % of one core, and
                    per stored message
    FreshServer     a fresh database `<prefix>_<pid>_<tag>` per scenario, all dropped
    drive_daemon    start `python -m inboxd.daemon.cli run`, sample until every mailbox
                    holds its messages and has a cursor, hand over to the benchmark's
                    `when_done` (figures, resync) while the daemon still runs, then
                    SIGTERM (exit 0 expected), count rows, copies and dead items, and
                    look for failures in the daemon log
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import asyncpg

# bench/ is sys.path[0] of every benchmark: the Maildir backfill bench's machinery.
from daemon_backfill import (
    FATAL_EVENTS,
    READY_TIMEOUT_S,
    STOP_TIMEOUT_S,
    TENANT,
    Server,
    Watch,
    _events,
    code_version,
    cpu_s,
    wait_exit,
)

from inboxd.pipeline.doorbell import ring
from inboxd.pipeline.mailbox.leases import CURSOR_RESET_EVENT

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"


# --------------------------------------------------------------------------- the fake


class Fake(Protocol):
    async def start(self) -> Any: ...
    async def close(self) -> None: ...


class FakeThread:
    """A fake provider on its own event loop in a thread of this process."""

    def __init__(self, fake: Fake, name: str) -> None:
        self.fake = fake
        self.loop = asyncio.new_event_loop()
        self.tid: int | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        self.tid = threading.get_native_id()
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(self) -> None:
        self._thread.start()
        self.call(self.fake.start())

    def stop(self) -> None:
        self.call(self.fake.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def call(self, coro: Coroutine[Any, Any, Any], timeout_s: float = 600.0) -> Any:
        """Run `coro` on the fake's loop and wait (blocks this thread: setup only)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def acall(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def cpu_s(self) -> float:
        return (cpu_s(self.tid) if self.tid is not None else None) or 0.0


class Plain:
    """A secret reference for the benchmark's own client (adapters take any reveal())."""

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value


# --------------------------------------------------------------------------- CPU


def machine_cpu_s() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine since boot, all cores: the first
    line of /proc/stat (user nice system idle iowait irq softirq steal ...)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return float("nan"), float("nan")
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq + steal) / tick, steal / tick


def thread_cpu_s(pid: int, tid: int) -> float:
    """utime + stime of one thread of a process (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as fh:
            fields = fh.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class CpuWindow:
    """CPU seconds of each party over one window of wall time."""

    wall_s: float = float("nan")
    daemon_main_s: float = float("nan")
    daemon_tree_s: float = float("nan")
    server_s: float | None = None
    fake_s: float = float("nan")
    bench_s: float = float("nan")
    machine_busy_s: float = float("nan")  # every process and the kernel, all cores
    machine_steal_s: float = float("nan")  # taken by the hypervisor for other guests
    fake_name: str = "fake"
    daemon_loop_s: float = float("nan")  # the main process's main thread: the event loop

    def pct(self, seconds: float | None) -> str:
        if seconds is None or not self.wall_s > 0:
            return "n/a"
        return f"{seconds:.1f} s = {100 * seconds / self.wall_s:.0f} %"

    @property
    def ours_s(self) -> float:
        """Daemon (with workers), PostgreSQL, fake and this thread together."""
        return self.daemon_tree_s + (self.server_s or 0.0) + self.fake_s + self.bench_s

    def line(self) -> str:
        return (
            f"CPU over the {self.wall_s:.1f} s window (% of one core): daemon main process "
            f"{self.pct(self.daemon_main_s)} (its event-loop thread "
            f"{self.pct(self.daemon_loop_s)}), with its parse workers "
            f"{self.pct(self.daemon_tree_s)}; PostgreSQL backends {self.pct(self.server_s)}; "
            f"{self.fake_name} thread {self.pct(self.fake_s)}; bench main thread "
            f"{self.pct(self.bench_s)}; all together {100 * self.ours_s / self.wall_s:.0f} % "
            f"(this machine: {os.cpu_count()} cores = {100 * (os.cpu_count() or 1)} %); "
            f"the whole machine (/proc/stat: every process and the kernel) busy "
            f"{self.pct(self.machine_busy_s)}, stolen by the hypervisor "
            f"{self.pct(self.machine_steal_s)}"
        )

    def per_message_line(self, stored: int) -> str:
        """The same CPU in milliseconds per stored message, split by who spends it."""

        def ms(seconds: float | None) -> str:
            return "n/a" if seconds is None or not stored else f"{1000 * seconds / stored:.3f}"

        parts = [
            ("daemon event loop", self.daemon_loop_s),
            ("daemon's other threads (object-store I/O)", self.daemon_main_s - self.daemon_loop_s),
            ("parse workers", self.daemon_tree_s - self.daemon_main_s),
            ("PostgreSQL", self.server_s),
            (self.fake_name, self.fake_s),
        ]
        total = sum(x for _, x in parts if x is not None)
        return (
            "CPU per stored message (ms): "
            + ", ".join(f"{name} {ms(x)}" for name, x in parts)
            + f"; together {ms(total)}"
        )


@dataclass
class Tick:
    t: float
    daemon_main: float
    daemon_tree: float
    server: float | None
    fake: float
    bench: float
    machine_busy: float
    machine_steal: float
    daemon_loop: float


class Sampler:
    """Watch (daemon tree, backends) plus the fake's and this thread's CPU, per tick."""

    def __init__(self, watch: Watch, pid: int, ft: FakeThread, fake_name: str) -> None:
        self.watch = watch
        self.pid = pid
        self.ft = ft
        self.fake_name = fake_name
        self.ticks: list[Tick] = []

    async def sample(self) -> None:
        await self.watch.sample()
        self.ticks.append(
            Tick(
                time.monotonic(),
                self.watch.proc_cpu.get(self.pid, 0.0),
                self.watch.client_cpu,
                self.watch.server_cpu,
                self.ft.cpu_s(),
                time.thread_time(),
                *machine_cpu_s(),
                thread_cpu_s(self.pid, self.pid),
            )
        )

    def window(self, start: float, end: float) -> CpuWindow:
        """CPU between the last ticks at or before `start` and `end`."""
        before = [k for k in self.ticks if k.t <= start] or self.ticks[:1]
        upto = [k for k in self.ticks if k.t <= end + 1e-3] or self.ticks[-1:]
        a, b = before[-1], upto[-1]
        server = None if a.server is None or b.server is None else b.server - a.server
        return CpuWindow(
            b.t - a.t,
            b.daemon_main - a.daemon_main,
            b.daemon_tree - a.daemon_tree,
            server,
            b.fake - a.fake,
            b.bench - a.bench,
            b.machine_busy - a.machine_busy,
            b.machine_steal - a.machine_steal,
            self.fake_name,
            b.daemon_loop - a.daemon_loop,
        )


# --------------------------------------------------------------------------- databases


class FreshServer(Server):
    """Server of daemon_backfill.py with the benchmark's own database names."""

    def __init__(self, dsn: str, keep: bool, prefix: str) -> None:
        super().__init__(dsn, keep)
        self.prefix = prefix

    async def fresh(self, tag: str) -> tuple[str, str]:
        name = f"{self.prefix}_{os.getpid()}_{tag}"
        admin = await asyncpg.connect(self.dsn)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            await admin.execute(f'CREATE DATABASE "{name}"')
            await admin.execute("CHECKPOINT")
        finally:
            await admin.close()
        self.created.append(name)
        return name, self.dsn_of(name)


# --------------------------------------------------------------------------- daemon runs


@dataclass
class DaemonRun:
    """One scenario: a daemon syncing `mailboxes` (id -> address) of `n_each` messages.
    `spent` is the provider's measure summed over the mailboxes (Gmail's quota units,
    Graph's requests); `rows` and `resync` are the benchmark's own."""

    label: str
    mailboxes: dict[str, str]
    n_each: int
    rows: list[Any] = field(default_factory=list)
    cpu: CpuWindow = field(default_factory=CpuWindow)
    spent: int = 0
    stored: int = 0
    copies: int = 0
    dead: int = 0
    exit_code: int | None = None
    ready_s: float | None = None
    resync: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def footer(self) -> list[str]:
        """The rows/exit line and the problems, as every benchmark prints them."""
        ready = self.ready_s if self.ready_s is not None else float("nan")
        lines = [
            f"  stored {self.stored:,} messages, {self.copies:,} copies, dead {self.dead}; "
            f"daemon ready after {ready:.1f} s; SIGTERM → exit {self.exit_code}"
        ]
        return lines + [f"  PROBLEM: {p}" for p in self.problems]


#: Called once every mailbox is done, while the daemon still runs: (sampler, monitor
#: connection, mailbox id -> monotonic time it was done).
WhenDone = Callable[[Sampler, asyncpg.Connection, dict[str, float]], Awaitable[None]]


async def drive_daemon(
    res: DaemonRun,
    *,
    server: Server,
    ft: FakeThread,
    fake_name: str,
    command: list[str],
    env: dict[str, str],
    dbname: str,
    dsn: str,
    log_path: Path,
    interval_s: float,
    timeout_s: float,
    when_done: WhenDone,
) -> None:
    """Run the daemon until every mailbox of `res` holds `res.n_each` copies and has a
    cursor (or a failure, or `timeout_s`), then `when_done`, then stop and count."""
    monitor = await asyncpg.connect(dsn)
    done_at: dict[str, float] = {}
    try:
        with log_path.open("wb") as log:
            started = time.monotonic()
            proc = await asyncio.create_subprocess_exec(
                *command,
                stdout=subprocess.DEVNULL,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env=env,
            )
            print(f"  daemon pid {proc.pid}, database {dbname}, log {log_path}", flush=True)
            sampler = Sampler(
                Watch(proc, dbname, monitor, started, server.local), proc.pid, ft, fake_name
            )
            try:
                await _wait_done(
                    res, proc, sampler, monitor, log_path, started, done_at, interval_s, timeout_s
                )
                await when_done(sampler, monitor, done_at)
            finally:
                if proc.returncode is None:
                    proc.send_signal(signal.SIGTERM)
                    if not await wait_exit(proc, STOP_TIMEOUT_S):
                        res.problems.append(f"no exit {STOP_TIMEOUT_S:g} s after SIGTERM; killed")
                        proc.kill()
                        await proc.wait()
                res.exit_code = proc.returncode
        if res.exit_code != 0:
            res.problems.append(f"exit code {res.exit_code} after SIGTERM (expected 0)")
        res.stored, res.copies, res.dead = await monitor.fetchrow(
            "SELECT (SELECT count(*) FROM messages), (SELECT count(*) FROM message_copies), "
            "(SELECT count(*) FROM dead_items)"
        )
        want = res.n_each * len(res.mailboxes)
        if res.stored != want or res.copies != want:
            res.problems.append(f"{res.stored} messages, {res.copies} copies; expected {want}")
        if res.dead:
            res.problems.append(f"{res.dead} dead items")
        kinds = Counter(str(e.get("event", "?")) for e in _events(log_path))
        for bad in ("sync_failed", "daemon_drain_abandoned"):
            if kinds.get(bad):
                res.problems.append(f"{kinds[bad]} × {bad} in the daemon log")
    finally:
        await monitor.close()


async def _wait_done(
    res: DaemonRun,
    proc: asyncio.subprocess.Process,
    sampler: Sampler,
    monitor: asyncpg.Connection,
    log_path: Path,
    started: float,
    done_at: dict[str, float],
    interval_s: float,
    timeout_s: float,
) -> None:
    log_pos = 0
    while True:
        await sampler.sample()
        now = time.monotonic()
        with log_path.open("rb") as fh:
            fh.seek(log_pos)
            chunk = fh.read()
        chunk = chunk[: chunk.rfind(b"\n") + 1]
        log_pos += len(chunk)
        if res.ready_s is None and b'"daemon_ready"' in chunk:
            res.ready_s = now - started
        fatal = [e.decode() for e in FATAL_EVENTS if b'"' + e + b'"' in chunk]
        if fatal:
            res.problems.append(f"{', '.join(fatal)} in the daemon log ({log_path})")
            return
        if proc.returncode is not None:
            res.problems.append(f"daemon exited early with {proc.returncode}")
            return
        if res.ready_s is None and now - started > READY_TIMEOUT_S:
            res.problems.append(f"no daemon_ready within {READY_TIMEOUT_S:g} s")
            return
        if await sampler.watch._has_messages():
            for r in await monitor.fetch(
                "SELECT m.mailbox_id, m.cursor IS NOT NULL AS synced, "
                "(SELECT count(*) FROM message_copies c WHERE c.tenant_id = "
                "m.tenant_id AND c.mailbox_id = m.mailbox_id) AS n "
                "FROM mailboxes m WHERE m.tenant_id = $1",
                TENANT,
            ):
                box = r["mailbox_id"]
                if box not in done_at and r["synced"] and r["n"] >= res.n_each:
                    done_at[box] = now
        if len(done_at) == len(res.mailboxes):
            return
        if now - started > timeout_s:
            res.problems.append(
                f"not done after {timeout_s:.0f} s "
                f"({len(done_at)} of {len(res.mailboxes)} mailboxes)"
            )
            return
        await asyncio.sleep(interval_s)


#: How long a resync (cursor reset, then a new cursor) may take.
RESYNC_TIMEOUT_S = 120.0


async def ring_and_wait_resync(
    monitor: asyncpg.Connection, box: str, interval_s: float, finished: str = "true"
) -> tuple[float, float] | None:
    """Ring `box`'s doorbell (its cursor was made stale in the fake), wait for the
    runner's cursor reset and then a new cursor for which the SQL condition `finished`
    (on the mailboxes row) holds: (reset → committed by the database's clock, doorbell
    → seen by polling), in seconds; None when not within the timeout."""
    rung = time.monotonic()
    await ring(monitor, TENANT, box)
    deadline = rung + RESYNC_TIMEOUT_S
    while time.monotonic() < deadline:
        reset_at = await monitor.fetchval(
            "SELECT max(created_at) FROM events WHERE tenant_id = $1 AND mailbox_id = $2 "
            "AND kind = $3",
            TENANT,
            box,
            CURSOR_RESET_EVENT,
        )
        if reset_at is not None:
            done_at = await monitor.fetchval(
                "SELECT cursor_updated_at FROM mailboxes WHERE tenant_id = $1 "
                "AND mailbox_id = $2 AND cursor IS NOT NULL AND cursor_updated_at > $3 "
                f"AND ({finished})",
                TENANT,
                box,
                reset_at,
            )
            if done_at is not None:
                return (done_at - reset_at).total_seconds(), time.monotonic() - rung
        await asyncio.sleep(min(interval_s, 0.05))
    return None


def changed_calls(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Calls by kind made between two views of the fake's counters."""
    return {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}


# --------------------------------------------------------------------------- output


def finite_positive(x: float | None) -> bool:
    return x is not None and math.isfinite(x) and x > 0


def header_line(work: Path) -> str:
    """The first line: the code measured, the machine and its load."""
    return (
        f"inboxd at {code_version()}; {os.cpu_count()} CPUs; load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; work directory {work}"
    )
