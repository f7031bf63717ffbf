#!/usr/bin/env python3
"""The Gmail door under `inboxd run` against FakeGmail with the per-user quota enforced.

    .venv/bin/python bench/gmail.py [--messages N] [--mailboxes M] [--messages-each K]
        [--quota-units-per-s Q] [--baseline-messages B] [--only one,many]
        [--dsn ADMIN_DSN] [--interval S] [--keep] [--smoke]

Defaults: N=10,000, M=20 mailboxes of K=1,000, Q=250 (Gmail's per-user rate),
B=2,000; about 5 minutes on 2 cores, of which the one-mailbox backfill is ≥ 200 s
(10,000 × 5 units at 250 units/s).

FakeGmail (tests/fakes/gmail) runs in this process, in a thread with its own event
loop, so its CPU is that thread's (/proc/self/task/TID/stat) and is printed beside
the daemon's. Every user has its own quota bucket of Q units/s (one second deep);
a call past it answers 429 with Retry-After. Each mailbox's messages are
`add_generated` ones: 2 KB text/plain, seeded before the daemon starts (not timed).

Measured, in this order, each daemon on a fresh database (bench_gmail_<pid>_<x>,
dropped at the end):

  baselines   this process's own GmailClient (the door's client, pacer and token
              source) making the same calls as a first sync — getProfile,
              messages.list pages of 500, messages.get format=raw in batches of 20 —
              for B messages, without database, parsing or daemon:
              (1) fake capacity: no quota and a pacer of 10⁹ units/s — what the fake
                  serves at most (sharing the GIL with the client);
              (2) paced client: quota Q on both sides — what pacing alone achieves.
  one         `python -m inboxd.daemon.cli run` with one Gmail mailbox of N messages
              (poll mode, interval 1 h: the first sync at start is the backfill),
              timed from the fake's first quota spend for that user to N rows and a
              cursor; then history is expired in the fake and the doorbell rung:
              the next sync's history.list answers 404, the cursor is reset and a
              full resync runs (one message is marked read first: a history record
              after the cursor, so the cursor is older than the history kept); its
              duration is cursor reset → cursor committed
              (both `cursor_updated_at`, the database clock), and its body
              downloads must be 0 (the ids are known).
  many        the same with M mailboxes of K messages at once: each mailbox's msg/s
              and units/s, and the daemon's CPU (main process, and with its parse
              workers), PostgreSQL's and the fake's, as % of one core over the window.

Figures: quota units/s spent by each user over its window (first to last spend;
the pacer's initial burst of 150 units left out, so a pacer at rate Q shows ≤ Q),
beside Q (ratio) and beside the paced client's (ratio); 429 answers (must be 0:
nobody else uses these users' quota, so any 429 is our pacing's); msg/s; CPU;
units per stored message (≈ 5: messages.get, plus one messages.list per 500 and
a getProfile).

`--quota-units-per-s` raises the quota of the fake and of the daemon's pacers (the
tenant's `[gmail] quota_units_per_s`); the daemon is `python -m inboxd.daemon.cli run`.

Exit 1 when a figure is not a measurement: a 429 from our pacing, a body downloaded
by the resync, a stored count that is not the seeded one, a dead item, a daemon
that failed or did not exit 0 on SIGTERM, a rate that is not a positive number.
`--smoke` (CI): 200 messages, 3 mailboxes of 200, B=200, Q=2,500, in 20-40 s.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # FakeGmail is tests/fakes/gmail

# bench/ is sys.path[0]: the daemon machinery of the Maildir backfill bench.
from daemon_backfill import (  # noqa: E402
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
    write_daemon_config,
)
from fakes.gmail import FakeGmail, Quota  # noqa: E402
from fakes.gmail.quota import DEFAULT_BURST_S  # noqa: E402

from inboxd.adapters.gmail.auth import AccessTokens  # noqa: E402
from inboxd.adapters.gmail.client import GmailClient  # noqa: E402
from inboxd.adapters.gmail.config import GmailMailbox, GmailSettings  # noqa: E402
from inboxd.adapters.gmail.pacer import (  # noqa: E402
    DEFAULT_BURST_UNITS,
    GMAIL_USER_UNITS_PER_S,
    MESSAGES_GET_UNITS,
    QuotaPacer,
)
from inboxd.pipeline.doorbell import ring  # noqa: E402
from inboxd.pipeline.leases import CURSOR_RESET_EVENT  # noqa: E402

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
DOMAIN = "bench.example"
SECRET_ENV = "BENCH_GMAIL_CLIENT_SECRET"  # noqa: S105 - a variable name
#: The issue's target: a one-mailbox backfill sustains this share of the quota.
TARGET_QUOTA_SHARE = 0.90
#: Pacer rate of the capacity baseline: never the limit.
UNPACED_UNITS_PER_S = 1e9
#: Poll interval of the benchmark's mailboxes: no poll inside a run (the first sync
#: is rung at start, the resync by the benchmark).
POLL_INTERVAL_S = 3600
#: A daemon scenario gets this much longer than the quota alone needs, plus slack.
TIMEOUT_FACTOR = 3.0
TIMEOUT_SLACK_S = 120.0
#: --smoke (CI)
SMOKE_MESSAGES = 200
SMOKE_MAILBOXES = 3
SMOKE_QUOTA = 2_500.0
SMOKE_INTERVAL_S = 0.1


# --------------------------------------------------------------------------- the fake


class StampedQuota(Quota):
    """The fake's quota, noting per user when units were first and last spent."""

    def __init__(self, units_per_s: float) -> None:
        super().__init__(units_per_s, DEFAULT_BURST_S, time.monotonic)
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}

    def try_spend(self, user: str, units: int) -> int | None:
        wait_s = super().try_spend(user, units)
        if wait_s is None:
            now = time.monotonic()
            self.first.setdefault(user, now)
            self.last[user] = now
        return wait_s


@dataclass
class UserView:
    """What the fake saw of one user, copied on the fake's loop."""

    units: int
    downloads: int
    rejected_429: int
    calls: dict[str, int]
    first: float | None
    last: float | None

    @property
    def window_s(self) -> float:
        if self.first is None or self.last is None:
            return float("nan")
        return self.last - self.first


class FakeThread:
    """FakeGmail on its own event loop in a thread of this process."""

    def __init__(self, units_per_s: float) -> None:
        self.fake = FakeGmail(quota_units_per_s=units_per_s)
        self.quota = StampedQuota(units_per_s)
        self.fake.quota = self.quota
        self.loop = asyncio.new_event_loop()
        self.tid: int | None = None
        self._thread = threading.Thread(target=self._run, name="fake-gmail", daemon=True)

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

    async def _seed(self, user: str, count: int) -> str:
        self.fake.add_user(user).add_generated(count)
        return self.fake.issue_refresh_token(user)

    def seed(self, user: str, count: int) -> str:
        """A mailbox of `count` generated messages; returns its refresh token."""
        return str(self.call(self._seed(user, count)))

    async def _view(self, users: list[str]) -> dict[str, UserView]:
        c = self.fake.counters
        downloads: Counter[str] = Counter()
        wanted = set(users)
        for (u, _m), n in c.raw_downloads.items():
            if u in wanted:
                downloads[u] += n
        out = {}
        for u in users:
            calls = {m: n for (cu, m), n in c.calls.items() if cu == u}
            out[u] = UserView(
                c.units[u],
                downloads[u],
                c.rejected(429, u),
                calls,
                self.quota.first.get(u),
                self.quota.last.get(u),
            )
        return out

    async def view(self, users: list[str]) -> dict[str, UserView]:
        return dict(await self.acall(self._view(users)))

    async def _expire(self, user: str) -> None:
        box = self.fake.mailbox(user)
        # One message read (a history record after the daemon's cursor), then every
        # record forgotten: the cursor is older than the history kept, so 404.
        box.modify_labels(next(iter(box.messages)), remove=["UNREAD"])
        box.expire_history()

    async def expire_history(self, user: str) -> None:
        await self.acall(self._expire(user))

    async def _unlimit(self, user: str) -> None:
        self.fake.quota.set_rate(user, None)

    def unlimit(self, user: str) -> None:
        self.call(self._unlimit(user))


class _Plain:
    """A secret reference for the benchmark's own client (adapters take any reveal())."""

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value


# --------------------------------------------------------------------------- results


@dataclass
class Row:
    """One measured pass: `n` messages for one user over `wall_s`."""

    label: str
    n: int
    wall_s: float
    units: float
    units_window_s: float
    rejected_429: int
    extra: str = ""

    @property
    def rate(self) -> float:
        return self.n / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def units_per_s(self) -> float:
        """Sustained: units beyond the pacer's initial burst over the spending window
        (a pacer lets through at most burst + rate × window, so this is ≤ its rate)."""
        w = self.units_window_s
        return (self.units - DEFAULT_BURST_UNITS) / w if w > 0 else float("nan")


def row_line(row: Row, quota: float) -> str:
    share = row.units_per_s / quota
    return (
        f"  {row.label:<38} {row.n:>7,} {row.wall_s:>8.2f} {row.rate:>8,.1f} "
        f"{row.units_per_s:>9,.1f} {share:>7.2f} {row.rejected_429:>4}  {row.extra}"
    ).rstrip()


ROW_HEADER = (
    f"  {'':<38} {'msgs':>7} {'wall s':>8} {'msg/s':>8} {'units/s':>9} {'×quota':>7} {'429':>4}"
)


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

    def pct(self, seconds: float | None) -> str:
        if seconds is None or not self.wall_s > 0:
            return "n/a"
        return f"{seconds:.1f} s = {100 * seconds / self.wall_s:.0f} %"

    def line(self) -> str:
        total = self.daemon_tree_s + (self.server_s or 0.0) + self.fake_s + self.bench_s
        return (
            f"CPU over the {self.wall_s:.1f} s window (% of one core): daemon main process "
            f"{self.pct(self.daemon_main_s)}, with its parse workers "
            f"{self.pct(self.daemon_tree_s)}; PostgreSQL backends {self.pct(self.server_s)}; "
            f"fake Gmail thread {self.pct(self.fake_s)}; bench main thread "
            f"{self.pct(self.bench_s)}; all together {100 * total / self.wall_s:.0f} % "
            f"(this machine: {os.cpu_count()} cores = {100 * (os.cpu_count() or 1)} %); "
            f"the whole machine (/proc/stat: every process and the kernel) busy "
            f"{self.pct(self.machine_busy_s)}, stolen by the hypervisor "
            f"{self.pct(self.machine_steal_s)}"
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


@dataclass
class DaemonRun:
    label: str
    mailboxes: dict[str, str]  # mailbox id -> address
    n_each: int
    rows: list[Row] = field(default_factory=list)
    cpu: CpuWindow = field(default_factory=CpuWindow)
    units_total: int = 0
    stored: int = 0
    copies: int = 0
    dead: int = 0
    exit_code: int | None = None
    ready_s: float | None = None
    resync: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- baselines


async def client_pass(
    ft: FakeThread, label: str, user: str, refresh: str, pacer_units_per_s: float
) -> Row:
    """A first sync's Gmail calls for `user` by this process's GmailClient."""
    fake = ft.fake
    settings = GmailSettings(
        client_id=fake.client_id,
        client_secret=_Plain(fake.client_secret),
        api_url=fake.base_url,
        token_url=fake.token_url,
        certs_url=fake.certs_url,
    )
    mailbox = GmailMailbox(user, refresh_token=_Plain(refresh), backfill="all")
    fetched = 0
    async with aiohttp.ClientSession() as session:
        pacer = QuotaPacer(pacer_units_per_s)
        client = GmailClient(
            settings, mailbox, session, pacer, AccessTokens(settings, mailbox, session)
        )
        fake0, bench0 = ft.cpu_s(), time.thread_time()
        started = time.monotonic()
        await client.get_profile()
        token: str | None = None
        while True:
            page = await client.list_messages(["INBOX"], None, token)
            batch = await client.get_raw_batch([m.id for m in page.messages])
            fetched += len(batch.raw)
            token = page.next_page_token
            if token is None:
                break
        wall = time.monotonic() - started
        fake_cpu, bench_cpu = ft.cpu_s() - fake0, time.thread_time() - bench0
    view = (await ft.view([user]))[user]
    return Row(
        label,
        fetched,
        wall,
        view.units,
        view.window_s,
        view.rejected_429,
        f"fake {100 * fake_cpu / wall:.0f} %, client {100 * bench_cpu / wall:.0f} % of a core",
    )


# --------------------------------------------------------------------------- daemon runs


def tenant_file(
    fake: FakeGmail, tokens: dict[str, Path], mailboxes: dict[str, str], quota: float
) -> str:
    boxes = "".join(
        f"""
[[mailboxes]]
id = "{box}"
provider = "gmail"
address = "{address}"
sync_mode = "poll"
poll_interval_s = {POLL_INTERVAL_S}
refresh_token = "file:{tokens[box]}"
backfill = "all"
"""
        for box, address in mailboxes.items()
    )
    return f"""id = "{TENANT}"
name = "Bench"

[gmail]
client_id = "{fake.client_id}"
client_secret = "env:{SECRET_ENV}"
api_url = "{fake.base_url}"
token_url = "{fake.token_url}"
certs_url = "{fake.certs_url}"
quota_units_per_s = {quota}
{boxes}"""


def daemon_command(config: Path, dsn: str) -> list[str]:
    run = ["run", "--config", str(config), "--dsn", dsn, "--log-level", "info"]
    return [sys.executable, "-m", "inboxd.daemon.cli", *run]


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


class Sampler:
    """Watch (daemon tree, backends) plus the fake's and this thread's CPU, per tick."""

    def __init__(self, watch: Watch, pid: int, ft: FakeThread) -> None:
        self.watch = watch
        self.pid = pid
        self.ft = ft
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
        )


async def run_daemon(
    args: argparse.Namespace,
    server: Server,
    ft: FakeThread,
    work: Path,
    label: str,
    mailboxes: dict[str, str],
    n_each: int,
    resync: bool,
) -> DaemonRun:
    res = DaemonRun(label, mailboxes, n_each)
    run_dir = work / label
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    tokens: dict[str, Path] = {}
    for box, address in mailboxes.items():
        tokens[box] = run_dir / f"{box}.refresh-token"
        tokens[box].write_text(ft.seed(address, n_each) + "\n")
    print(
        f"  seeded {len(mailboxes)} × {n_each:,} messages in {time.monotonic() - t0:.1f} s "
        "(not timed)",
        flush=True,
    )
    # The main TOML of the Maildir bench ([workers], [queue], [sync] …); its
    # tenant file is replaced by one with the Gmail mailboxes.
    config = write_daemon_config(run_dir, run_dir / "unused", run_dir / "objects", 500)
    (run_dir / "tenants" / f"{TENANT}.toml").write_text(
        tenant_file(ft.fake, tokens, mailboxes, args.quota_units_per_s)
    )
    dbname, dsn = await server.fresh(label)
    log_path = run_dir / "daemon.log"
    expected_s = n_each * MESSAGES_GET_UNITS / args.quota_units_per_s
    timeout_s = TIMEOUT_FACTOR * expected_s + TIMEOUT_SLACK_S
    monitor = await asyncpg.connect(dsn)
    env = dict(os.environ, **{SECRET_ENV: ft.fake.client_secret})
    users = list(mailboxes.values())
    done_at: dict[str, float] = {}
    try:
        with log_path.open("wb") as log:
            started = time.monotonic()
            proc = await asyncio.create_subprocess_exec(
                *daemon_command(config, dsn),
                stdout=subprocess.DEVNULL,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env=env,
            )
            print(f"  daemon pid {proc.pid}, database {dbname}, log {log_path}", flush=True)
            sampler = Sampler(Watch(proc, dbname, monitor, started, server.local), proc.pid, ft)
            log_pos = 0
            try:
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
                        break
                    if proc.returncode is not None:
                        res.problems.append(f"daemon exited early with {proc.returncode}")
                        break
                    if res.ready_s is None and now - started > READY_TIMEOUT_S:
                        res.problems.append(f"no daemon_ready within {READY_TIMEOUT_S:g} s")
                        break
                    if await sampler.watch._has_messages():
                        for r in await monitor.fetch(
                            "SELECT m.mailbox_id, m.cursor IS NOT NULL AS synced, "
                            "(SELECT count(*) FROM message_copies c WHERE c.tenant_id = "
                            "m.tenant_id AND c.mailbox_id = m.mailbox_id) AS n "
                            "FROM mailboxes m WHERE m.tenant_id = $1",
                            TENANT,
                        ):
                            box = r["mailbox_id"]
                            if box not in done_at and r["synced"] and r["n"] >= n_each:
                                done_at[box] = now
                    if len(done_at) == len(mailboxes):
                        break
                    if now - started > timeout_s:
                        res.problems.append(
                            f"not done after {timeout_s:.0f} s "
                            f"({len(done_at)} of {len(mailboxes)} mailboxes)"
                        )
                        break
                    await asyncio.sleep(args.interval)
                views = await ft.view(users)
                _rows(res, views, done_at, args.quota_units_per_s)
                firsts = [v.first for v in views.values() if v.first is not None]
                if firsts and done_at:
                    res.cpu = sampler.window(min(firsts), max(done_at.values()))
                if resync and len(done_at) == len(mailboxes):
                    box, address = next(iter(mailboxes.items()))
                    await _resync(res, ft, monitor, box, address, args.interval, views[address])
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
        want = n_each * len(mailboxes)
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
    return res


def _rows(
    res: DaemonRun, views: dict[str, UserView], done_at: dict[str, float], quota: float
) -> None:
    for box, address in res.mailboxes.items():
        v = views[address]
        res.units_total += v.units
        end = done_at.get(box)
        wall = end - v.first if end is not None and v.first is not None else float("nan")
        calls = ", ".join(f"{m.removeprefix('users.')} ×{n:,}" for m, n in sorted(v.calls.items()))
        res.rows.append(
            Row(box, res.n_each, wall, v.units, v.window_s, v.rejected_429, f"calls: {calls}")
        )
        if v.rejected_429:
            res.problems.append(f"{box}: {v.rejected_429} × 429 caused by our own pacing")


async def _resync(
    res: DaemonRun,
    ft: FakeThread,
    monitor: asyncpg.Connection,
    box: str,
    address: str,
    interval_s: float,
    before: UserView,
) -> None:
    """Expire the mailbox's history in the fake, ring, wait for the resync's cursor."""
    await ft.expire_history(address)
    rung = time.monotonic()
    await ring(monitor, TENANT, box)
    deadline = rung + 120.0
    reset_at = done_at = None
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
                "AND mailbox_id = $2 AND cursor IS NOT NULL AND cursor_updated_at > $3",
                TENANT,
                box,
                reset_at,
            )
            if done_at is not None:
                break
        await asyncio.sleep(min(interval_s, 0.05))
    seen = time.monotonic() - rung
    after = (await ft.view([address]))[address]
    if reset_at is None or done_at is None:
        res.problems.append("resync: no cursor reset and new cursor within 120 s")
        return
    calls = {
        m: after.calls.get(m, 0) - before.calls.get(m, 0)
        for m in after.calls
        if after.calls.get(m, 0) != before.calls.get(m, 0)
    }
    res.resync = {
        "downloads": after.downloads - before.downloads,
        "units": after.units - before.units,
        "rejected_429": after.rejected_429 - before.rejected_429,
        "duration_s": (done_at - reset_at).total_seconds(),
        "seen_s": seen,
        "calls": calls,
    }
    if res.resync["downloads"]:
        res.problems.append(f"resync downloaded {res.resync['downloads']} bodies (must be 0)")
    if res.resync["rejected_429"]:
        res.problems.append(f"resync drew {res.resync['rejected_429']} × 429")


# --------------------------------------------------------------------------- output


def finite_positive(x: float | None) -> bool:
    return x is not None and math.isfinite(x) and x > 0


def describe_run(run: DaemonRun, quota: float, baseline: Row | None) -> list[str]:
    lines = [ROW_HEADER]
    lines += [row_line(r, quota) for r in run.rows]
    rates = [r.rate for r in run.rows]
    shares = [r.units_per_s / quota for r in run.rows]
    per_msg = run.units_total / run.stored if run.stored else float("nan")
    if len(run.rows) > 1:
        total = run.n_each * len(run.rows)
        starts = [r for r in run.rows if math.isfinite(r.wall_s)]
        wall = run.cpu.wall_s
        lines.append(
            f"  {len(run.rows)} mailboxes: msg/s per mailbox min {min(rates):,.1f} / median "
            f"{statistics.median(rates):,.1f} / max {max(rates):,.1f} (the quota allows "
            f"{quota / MESSAGES_GET_UNITS:,.1f}); units/s ÷ quota min {min(shares):.2f} / "
            f"median {statistics.median(shares):.2f} / max {max(shares):.2f}; all "
            f"{total:,} messages in {wall:.1f} s = {total / wall:,.0f} msg/s "
            f"(the quota allows {len(starts) * quota / MESSAGES_GET_UNITS:,.0f})"
        )
    lines.append("  " + run.cpu.line())
    lines.append(
        f"  quota units per stored message: {per_msg:.3f} ({run.units_total:,} units, "
        f"{run.stored:,} messages; messages.get alone is {MESSAGES_GET_UNITS})"
    )
    if baseline is not None and run.rows:
        med = statistics.median(r.units_per_s for r in run.rows)
        lines.append(
            f"  ratios, same run: daemon units/s ÷ quota = {med / quota:.2f} (target ≥ "
            f"{TARGET_QUOTA_SHARE:.2f}: {'ok' if med / quota >= TARGET_QUOTA_SHARE else 'MISSED'}"
            f"); ÷ paced client's = {med / baseline.units_per_s:.2f}"
        )
    if run.resync:
        rs = run.resync
        calls = ", ".join(
            f"{m.removeprefix('users.')} ×{n}" for m, n in sorted(rs["calls"].items())
        )
        lines.append(
            f"  resync after a 404 (history expired, doorbell rung): body downloads "
            f"{rs['downloads']} (must be 0); {rs['duration_s']:.3f} s from cursor reset to "
            f"cursor committed ({rs['seen_s']:.2f} s from the doorbell, seen by polling); "
            f"{rs['units']} units: {calls}; 429 {rs['rejected_429']}"
        )
    lines.append(
        f"  stored {run.stored:,} messages, {run.copies:,} copies, dead {run.dead}; daemon "
        f"ready after {run.ready_s if run.ready_s is not None else float('nan'):.1f} s; "
        f"SIGTERM → exit {run.exit_code}"
    )
    for p in run.problems:
        lines.append(f"  PROBLEM: {p}")
    return lines


# --------------------------------------------------------------------------- main


async def main(args: argparse.Namespace) -> int:
    only = set(args.only.split(","))
    quota = args.quota_units_per_s
    work = Path(tempfile.mkdtemp(prefix="bench_gmail_"))
    server = GmailServer(args.dsn, args.keep)
    print(
        f"inboxd at {code_version()}; {os.cpu_count()} CPUs; load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; work directory {work}",
        flush=True,
    )
    print(
        f"quota {quota:,.0f} units/s per user in the fake and in the daemon's pacers"
        + ("" if quota == GMAIL_USER_UNITS_PER_S else " (raised; daemon via the launcher)")
        + f"; pacer burst {DEFAULT_BURST_UNITS:g} units, fake bucket {DEFAULT_BURST_S:g} s",
        flush=True,
    )
    ft = FakeThread(quota)
    ft.start()
    problems: list[str] = []
    baseline: Row | None = None
    runs: list[DaemonRun] = []
    base_rows: list[Row] = []
    try:
        print(
            f"baselines: this process's GmailClient, a first sync's calls for "
            f"{args.baseline_messages:,} messages (no database, no parsing):",
            flush=True,
        )
        cap_user, paced_user = f"capacity@{DOMAIN}", f"paced@{DOMAIN}"
        cap_token = ft.seed(cap_user, args.baseline_messages)
        ft.unlimit(cap_user)
        paced_token = ft.seed(paced_user, args.baseline_messages)
        base_rows.append(
            await client_pass(
                ft, "fake capacity: no quota, no pacing", cap_user, cap_token, UNPACED_UNITS_PER_S
            )
        )
        baseline = await client_pass(
            ft, "paced client at the quota", paced_user, paced_token, quota
        )
        base_rows.append(baseline)
        print(ROW_HEADER)
        for row in base_rows:
            print(row_line(row, quota), flush=True)
        if baseline.rejected_429:
            problems.append(f"paced client: {baseline.rejected_429} × 429")
        for row in base_rows:
            if row.n != args.baseline_messages:
                problems.append(f"{row.label}: {row.n} messages, expected {args.baseline_messages}")
        if "one" in only:
            print(f"one mailbox: daemon backfill of {args.messages:,} messages …", flush=True)
            run = await run_daemon(
                args, server, ft, work, "one", {"one": f"one@{DOMAIN}"}, args.messages, True
            )
            runs.append(run)
            for line in describe_run(run, quota, baseline):
                print(line, flush=True)
        if "many" in only:
            boxes = {f"m{i:02d}": f"m{i:02d}@{DOMAIN}" for i in range(1, args.mailboxes + 1)}
            print(
                f"{args.mailboxes} mailboxes at once: daemon backfill of "
                f"{args.messages_each:,} messages each …",
                flush=True,
            )
            run = await run_daemon(args, server, ft, work, "many", boxes, args.messages_each, False)
            runs.append(run)
            for line in describe_run(run, quota, baseline):
                print(line, flush=True)
    finally:
        ft.stop()
        await server.drop_all()
        if args.keep:
            print(f"kept work directory {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    for row in base_rows:
        if not (finite_positive(row.rate) and finite_positive(row.units_per_s)):
            problems.append(f"{row.label}: not a measurement ({row.rate} msg/s)")
    for run in runs:
        problems += [f"{run.label}: {p}" for p in run.problems]
        for row in run.rows:
            if not (finite_positive(row.rate) and finite_positive(row.units_per_s)):
                problems.append(f"{run.label}/{row.label}: not a measurement ({row.rate} msg/s)")
        if not finite_positive(run.cpu.daemon_main_s) or not finite_positive(run.cpu.wall_s):
            problems.append(f"{run.label}: no CPU figure")
        if run.label == "one" and not run.resync:
            problems.append("one: no resync figure")

    print()
    print(f"inboxd at {code_version()} (at the end of the run)")
    one = next((r for r in runs if r.label == "one"), None)
    many = next((r for r in runs if r.label == "many"), None)
    cap = base_rows[0] if base_rows else None
    print(f"summary (quota {quota:,.0f} units/s per mailbox):")
    if one is not None and one.rows and baseline is not None:
        r = one.rows[0]
        print(
            f"  one mailbox, {r.n:,} messages: {r.units_per_s:,.1f} units/s = "
            f"{r.units_per_s / quota:.2f} × quota (paced client {baseline.units_per_s / quota:.2f}"
            f" × quota; daemon/paced client {r.units_per_s / baseline.units_per_s:.2f}); "
            f"{r.rate:,.1f} msg/s; 429 {r.rejected_429}; daemon main "
            f"{one.cpu.pct(one.cpu.daemon_main_s)} of a core; "
            f"{one.units_total / max(1, one.stored):.3f} units per stored message"
        )
        if one.resync:
            print(
                f"  resync after 404: {one.resync['downloads']} body downloads, "
                f"{one.resync['duration_s']:.3f} s, {one.resync['units']} units"
            )
    if many is not None and many.rows:
        rates = [r.rate for r in many.rows]
        shares = [r.units_per_s / quota for r in many.rows]
        bound = min(shares) >= TARGET_QUOTA_SHARE
        print(
            f"  {len(many.rows)} mailboxes × {many.n_each:,}: median "
            f"{statistics.median(rates):,.1f} msg/s per mailbox, units/s ÷ quota median "
            f"{statistics.median(shares):.2f} (min "
            f"{min(shares):.2f}); 429 {sum(r.rejected_429 for r in many.rows)}; daemon main "
            f"{many.cpu.pct(many.cpu.daemon_main_s)} of a core, fake "
            f"{many.cpu.pct(many.cpu.fake_s)}, PostgreSQL {many.cpu.pct(many.cpu.server_s)}: "
            + (
                "bounded by the quota"
                if bound
                else "NOT bounded by the quota (see the CPU figures for what was)"
            )
        )
    if cap is not None:
        need = quota / MESSAGES_GET_UNITS * (len(many.rows) if many else 1)
        print(
            f"  fake capacity {cap.rate:,.0f} msg/s ({cap.units_per_s:,.0f} units/s) against "
            f"{need:,.0f} msg/s the quota lets the largest scenario ask for: "
            f"{cap.rate / need:.1f}×"
        )
    for p in problems:
        print(f"PROBLEM: {p}")
    return 1 if problems else 0


class GmailServer(Server):
    """Server of daemon_backfill.py with this benchmark's database names."""

    async def fresh(self, tag: str) -> tuple[str, str]:
        name = f"bench_gmail_{os.getpid()}_{tag}"
        admin = await asyncpg.connect(self.dsn)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            await admin.execute(f'CREATE DATABASE "{name}"')
            await admin.execute("CHECKPOINT")
        finally:
            await admin.close()
        self.created.append(name)
        return name, self.dsn_of(name)


def cli() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=10_000, help="one-mailbox backfill")
    parser.add_argument("--mailboxes", type=int, default=20, help="mailboxes at once")
    parser.add_argument("--messages-each", type=int, default=1_000, help="per mailbox (many)")
    parser.add_argument(
        "--quota-units-per-s",
        type=float,
        default=GMAIL_USER_UNITS_PER_S,
        help="per-user quota of the fake and of the daemon's pacers (Gmail: 250)",
    )
    parser.add_argument("--baseline-messages", type=int, default=2_000)
    parser.add_argument("--only", default="one,many")
    parser.add_argument("--dsn", default=DEFAULT_DSN, help="admin DSN (creates bench_* databases)")
    parser.add_argument("--interval", type=float, default=0.25, help="sampling interval, s")
    parser.add_argument("--keep", action="store_true", help="keep the databases and work dir")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help=f"CI size: {SMOKE_MESSAGES} messages, {SMOKE_MAILBOXES} mailboxes of "
        f"{SMOKE_MESSAGES}, quota {SMOKE_QUOTA:g}",
    )
    args = parser.parse_args()
    if args.smoke:
        args.messages = args.messages_each = args.baseline_messages = SMOKE_MESSAGES
        args.mailboxes = SMOKE_MAILBOXES
        args.quota_units_per_s = SMOKE_QUOTA
        args.interval = SMOKE_INTERVAL_S
    if not (math.isfinite(args.quota_units_per_s) and args.quota_units_per_s > 0):
        parser.error("--quota-units-per-s must be a positive number")
    return asyncio.run(main(args))


if __name__ == "__main__":
    sys.exit(cli())
