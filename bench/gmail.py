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
              and units/s, and the daemon's CPU (main process and its event-loop
              thread, and with its parse workers), PostgreSQL's and the fake's, as % of
              one core over the window and in ms per stored message (what 1,000 msg/s
              on 2 cores has to fit in: 2 ms together).

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
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import asyncpg

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # FakeGmail is tests/fakes/gmail

# bench/ is sys.path[0]: the daemon machinery of the Maildir backfill bench, and
# what this benchmark shares with outlook.py.
from daemon_backfill import TENANT, code_version, write_daemon_config  # noqa: E402
from door_run import (  # noqa: E402
    DEFAULT_DSN,
    DaemonRun,
    FakeThread,
    FreshServer,
    Plain,
    Sampler,
    changed_calls,
    drive_daemon,
    finite_positive,
    header_line,
    ring_and_wait_resync,
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
    """The fake's quota, noting per user when units were first and last spent, and
    when the last listing or body download was (a spend of ≥ MESSAGES_GET_UNITS,
    with the units spent up to it). The sustained rate is measured up to that one:
    once a backfill's cursor is committed the runner may sync again (a history.list,
    2 units) seconds later, after the last pages were parsed and ingested, and that
    wait is the next sync's, not time the backfill left its quota unspent."""

    def __init__(self, units_per_s: float) -> None:
        super().__init__(units_per_s, DEFAULT_BURST_S, time.monotonic)
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.spent: Counter[str] = Counter()
        self.last_bulk: dict[str, float] = {}
        self.spent_to_bulk: dict[str, int] = {}

    def try_spend(self, user: str, units: int) -> int | None:
        wait_s = super().try_spend(user, units)
        if wait_s is None:
            now = time.monotonic()
            self.first.setdefault(user, now)
            self.last[user] = now
            self.spent[user] += units
            if units >= MESSAGES_GET_UNITS:
                self.last_bulk[user] = now
                self.spent_to_bulk[user] = self.spent[user]
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
    last_bulk: float | None
    units_to_bulk: int

    @property
    def window_s(self) -> float:
        """First spend to the last listing or download (StampedQuota)."""
        end = self.last_bulk if self.last_bulk is not None else self.last
        if self.first is None or end is None:
            return float("nan")
        return end - self.first


class GmailThread(FakeThread):
    """FakeGmail (with StampedQuota) on its own event loop in a thread of this process."""

    fake: FakeGmail

    def __init__(self, units_per_s: float) -> None:
        super().__init__(FakeGmail(quota_units_per_s=units_per_s), "fake-gmail")
        self.quota = StampedQuota(units_per_s)
        self.fake.quota = self.quota

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
                self.quota.last_bulk.get(u),
                self.quota.spent_to_bulk.get(u, 0),
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


# --------------------------------------------------------------------------- baselines


async def client_pass(
    ft: GmailThread, label: str, user: str, refresh: str, pacer_units_per_s: float
) -> Row:
    """A first sync's Gmail calls for `user` by this process's GmailClient."""
    fake = ft.fake
    settings = GmailSettings(
        client_id=fake.client_id,
        client_secret=Plain(fake.client_secret),
        api_url=fake.base_url,
        token_url=fake.token_url,
        certs_url=fake.certs_url,
    )
    mailbox = GmailMailbox(user, refresh_token=Plain(refresh), backfill="all")
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
        view.units_to_bulk,
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


async def run_daemon(
    args: argparse.Namespace,
    server: FreshServer,
    ft: GmailThread,
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
    expected_s = n_each * MESSAGES_GET_UNITS / args.quota_units_per_s
    users = list(mailboxes.values())

    async def when_done(
        sampler: Sampler, monitor: asyncpg.Connection, done_at: dict[str, float]
    ) -> None:
        views = await ft.view(users)
        _rows(res, views, done_at, args.quota_units_per_s)
        firsts = [v.first for v in views.values() if v.first is not None]
        if firsts and done_at:
            res.cpu = sampler.window(min(firsts), max(done_at.values()))
        if resync and len(done_at) == len(mailboxes):
            box, address = next(iter(mailboxes.items()))
            await _resync(res, ft, monitor, box, address, args.interval, views[address])

    await drive_daemon(
        res,
        server=server,
        ft=ft,
        fake_name="fake Gmail",
        command=daemon_command(config, dsn),
        env=dict(os.environ, **{SECRET_ENV: ft.fake.client_secret}),
        dbname=dbname,
        dsn=dsn,
        log_path=run_dir / "daemon.log",
        interval_s=args.interval,
        timeout_s=TIMEOUT_FACTOR * expected_s + TIMEOUT_SLACK_S,
        when_done=when_done,
    )
    return res


def _rows(
    res: DaemonRun, views: dict[str, UserView], done_at: dict[str, float], quota: float
) -> None:
    for box, address in res.mailboxes.items():
        v = views[address]
        res.spent += v.units
        end = done_at.get(box)
        wall = end - v.first if end is not None and v.first is not None else float("nan")
        calls = "calls: " + ", ".join(
            f"{m.removeprefix('users.')} ×{n:,}" for m, n in sorted(v.calls.items())
        )
        res.rows.append(
            Row(box, res.n_each, wall, v.units_to_bulk, v.window_s, v.rejected_429, calls)
        )
        if v.rejected_429:
            res.problems.append(f"{box}: {v.rejected_429} × 429 caused by our own pacing")


async def _resync(
    res: DaemonRun,
    ft: GmailThread,
    monitor: asyncpg.Connection,
    box: str,
    address: str,
    interval_s: float,
    before: UserView,
) -> None:
    """Expire the mailbox's history in the fake, ring, wait for the resync's cursor."""
    await ft.expire_history(address)
    timed = await ring_and_wait_resync(monitor, box, interval_s)
    after = (await ft.view([address]))[address]
    if timed is None:
        res.problems.append("resync: no cursor reset and new cursor within 120 s")
        return
    duration_s, seen_s = timed
    calls = changed_calls(before.calls, after.calls)
    res.resync = {
        "downloads": after.downloads - before.downloads,
        "units": after.units - before.units,
        "rejected_429": after.rejected_429 - before.rejected_429,
        "duration_s": duration_s,
        "seen_s": seen_s,
        "calls": calls,
    }
    if res.resync["downloads"]:
        res.problems.append(f"resync downloaded {res.resync['downloads']} bodies (must be 0)")
    if res.resync["rejected_429"]:
        res.problems.append(f"resync drew {res.resync['rejected_429']} × 429")


# --------------------------------------------------------------------------- output


def describe_run(run: DaemonRun, quota: float, baseline: Row | None) -> list[str]:
    lines = [ROW_HEADER]
    lines += [row_line(r, quota) for r in run.rows]
    rates = [r.rate for r in run.rows]
    shares = [r.units_per_s / quota for r in run.rows]
    per_msg = run.spent / run.stored if run.stored else float("nan")
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
    lines.append("  " + run.cpu.per_message_line(run.stored))
    lines.append(
        f"  quota units per stored message: {per_msg:.3f} ({run.spent:,} units, "
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
    return lines + run.footer()


# --------------------------------------------------------------------------- main


async def main(args: argparse.Namespace) -> int:
    only = set(args.only.split(","))
    quota = args.quota_units_per_s
    work = Path(tempfile.mkdtemp(prefix="bench_gmail_"))
    server = FreshServer(args.dsn, args.keep, "bench_gmail")
    print(header_line(work), flush=True)
    print(
        f"quota {quota:,.0f} units/s per user in the fake and in the daemon's pacers"
        + ("" if quota == GMAIL_USER_UNITS_PER_S else " (raised; daemon via the launcher)")
        + f"; pacer burst {DEFAULT_BURST_UNITS:g} units, fake bucket {DEFAULT_BURST_S:g} s",
        flush=True,
    )
    ft = GmailThread(quota)
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
            f"{one.spent / max(1, one.stored):.3f} units per stored message"
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
