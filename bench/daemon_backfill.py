#!/usr/bin/env python3
"""A Maildir backfill through the running daemon, next to `inboxd import` of the same files.

    .venv/bin/python bench/daemon_backfill.py [--messages N] [--dsn ADMIN_DSN]
        [--batch-size B] [--rounds R] [--only daemon,import] [--interval S]
        [--gen-workers W] [--seed S] [--workdir DIR] [--keep]
        [--daemon-env KEY=VALUE ...] [--daemon-python-args ARGS] [--import-args ARGS]
        [--before-stop CMD] [--run-timeout-s S] [--smoke]

Defaults: N=100,000, batch 500, one round (daemon, then import), ~5 min on 2 cores
including ~1 min of generation. The last four options are for investigations
(e.g. `--daemon-env MALLOC_ARENA_MAX=8`, `--before-stop 'py-spy dump --pid {pid}'`,
`--import-args '--parse-in thread'`); leave them out for the recorded figures.

Data (generated once, not timed): N distinct RFC 5322 messages of 1-8 KB (target
size uniform over 1-8 KB): plain text (UTF-8 as quoted-printable, base64 or 8bit),
multipart/alternative text + HTML, multipart/mixed with a small PDF-like
attachment, and legacy charsets (iso-8859-1 and windows-1252 QP, iso-2022-jp 7bit,
koi8-r base64, RFC 2047 headers in the same charsets); Received/Return-Path/
Delivered-To headers like a local MTA writes them; threads of 1-5 messages with
In-Reply-To/References. Every message has its own Message-ID and its own text.
They are delivered like an MTA does (write in tmp/, rename into new/) into a spool
Maildir; each measurement gets its own copy of it (hard links, tmp/ then new/, not
timed), and `inboxd import` reads a directory of NAME.eml hard links to the same
files.

Measured, each on a fresh database (created empty; both commands apply schema.sql
themselves) on the admin DSN's server, after a CHECKPOINT:

  daemon  `inboxd run --config main.toml --dsn DB` as a subprocess (main TOML + one
          tenant file with one maildir mailbox, as tests/daemon/harness.py writes
          them; listener port 0, local object store in the work directory,
          [workers] batch_size B). Timed from the spawn until every message is a
          row (`SELECT count(*) FROM messages`, polled every --interval s) and
          every file is in cur/. Then SIGTERM; the exit code must be 0.
  import  `inboxd import --tenant t --mailbox m --json DIR` (same object-store
          kind, its own directory), timed from the spawn to its exit.

Every --interval s the script samples VmRSS (/proc/PID/status) of the command
and of its child processes (parse workers), the row count, and the
CPU seconds of the command's processes and of the PostgreSQL backends serving its
database (/proc/PID/stat; n/a when the server is not local). The daemon's RSS is
reported at its peak and at every 10 % of the rows: flat means memory does not
depend on the backlog (the summary says "flat" when RSS at 90 % is within 10 MB of
RSS at 10 %).

Targets: daemon ÷ import messages/s ≥ 0.70; daemon peak RSS < 200 MB, and flat.
The machine is shared and noisy: compare the ratio of one run, and use --rounds
(daemon and import alternate) to see the spread. Databases are named
bench_daemon_<pid>_<x> and dropped at the end, and the work directory is removed
(unless --keep; with --workdir the generated messages stay there and the next run
with the same N and seed reuses them). Ctrl-C stops the command being measured
and drops the databases too.

The first line printed names the commit of the code measured (it is printed again
at the end: other work lands while a benchmark runs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.charset import BASE64, QP, Charset
from email.header import Header
from email.mime.application import MIMEApplication
from email.mime.multipart import MIMEMultipart
from email.mime.text import MIMEText
from email.utils import format_datetime, formataddr
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import orjson

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
TENANT = "t"
MAILBOX = "m"
TARGET_RATIO = 0.70
TARGET_RSS_MB = 200.0
# A run that has not finished after this long is reported as failed.
RUN_TIMEOUT_S = 3600.0
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 120.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024
PROGRESS_POINTS = (0.10, 0.50, 0.90)
#: --smoke (CI): both commands over a few pages of a small backlog, ~20 s in all.
SMOKE_MESSAGES = 300
SMOKE_BATCH = 100
SMOKE_INTERVAL_S = 0.2
SMOKE_IDLE_S = 0.5
#: A stuck smoke run fails in minutes instead of the hour a real run may take.
SMOKE_RUN_TIMEOUT_S = 120.0
# Daemon log events after which the backfill will not finish at full speed.
FATAL_EVENTS = (b"sync_crashed", b"sync_needs_attention", b"ingest_worker_batch_crashed")
GEN_CHUNK = 2_000
MAX_SIZE = 8 * 1024
MIN_SIZE = 1024
# Written into the spool Maildir once generation finished: "N seed".
STAMP = ".generated"

# --------------------------------------------------------------------------- data

from vocabulary import (  # noqa: E402 - bench/ is sys.path[0]
    _DOMAINS,
    _FIRST,
    _LAST,
    _LEGACY,
    _NAME_SUFFIX,
    _WORDS,
)

_MAILERS = (
    "Microsoft Outlook 16.0",
    "Apple Mail (2.3731.700.6)",
    "Thunderbird 115.8.1",
    "Roundcube Webmail/1.6.5",
    "K-9 Mail for Android",
    None,
    None,
)
_OWNER = ("Acme Support", "support@acme-widgets.example")
# kind: weight (percent of messages)
_KINDS = {"plain": 40, "alternative": 30, "attachment": 12, "legacy": 18}


def _charset(name: str, body_encoding: int | None) -> Charset:
    cs = Charset(name)
    cs.body_encoding = body_encoding
    return cs


def _sentence(rng: random.Random) -> str:
    words = rng.choices(_WORDS, k=rng.randint(6, 18))
    return " ".join(words).capitalize() + rng.choice(".....?!")


def _text(rng: random.Random, size: int, serial: int, signer: str) -> tuple[str, list[str]]:
    """About `size` characters of prose in paragraphs; unique through the reference."""
    paras = [f"Reference {serial:08d}/{rng.getrandbits(32):08x}."]
    total = len(paras[0])
    while total < size:
        para = " ".join(_sentence(rng) for _ in range(rng.randint(1, 5)))
        paras.append(para)
        total += len(para) + 2
    return "\n\n".join(paras) + f"\n\nBest regards,\n{signer}\n", paras


def _html(paras: list[str]) -> str:
    body = "".join(f"<p>{p}</p>\n" for p in paras)
    return (
        '<html><head><meta charset="utf-8"><style>p{margin:0 0 1em}</style></head>'
        '<body><div style="font-family:Arial,sans-serif;font-size:14px">\n'
        f'{body}<p>--<br><a href="https://acme-widgets.example/help">Help centre</a>'
        "</p></div></body></html>"
    )


def _person(rng: random.Random, i: int) -> tuple[str, str]:
    first, last = rng.choice(_FIRST), rng.choice(_LAST)
    return f"{first.title()} {last.title()}", f"{first}.{last}{i}@{rng.choice(_DOMAINS)}"


def _one(
    rng: random.Random,
    serial: int,
    kind: str,
    target: int,
    sender: tuple[str, str],
    rcpt: tuple[str, str],
    cc: tuple[str, str] | None,
    subject: str,
    sent: datetime,
    received: datetime,
    refs: list[str],
    scale: float = 1.0,
) -> tuple[bytes, str]:
    """One message of roughly `target` bytes; returns (raw, Message-ID)."""
    headers_est = 1100 if kind == "legacy" else 950
    room = max(200, int((target - headers_est) * scale))
    header_cs = "utf-8"
    if kind == "legacy":
        cs_name = rng.choice(tuple(_LEGACY))
        extra, enc = _LEGACY[cs_name]
        share = 0.72 if enc == BASE64 else 0.9
        text, _ = _text(rng, max(100, int(room * share) - 2 * len(extra)), serial, sender[0])
        msg = MIMEText(extra + "\n\n" + text + "\n" + extra + "\n", "plain", _charset(cs_name, enc))  # type: ignore[arg-type]
        header_cs = cs_name
        subj = f"{extra[:24]} {subject}"
    else:
        enc = rng.choice((QP, BASE64, None))  # None = 8bit UTF-8
        utf8 = _charset("utf-8", enc)
        text_share = {"plain": 1.0, "alternative": 0.42, "attachment": 0.42}[kind]
        att_size = 0
        if kind == "attachment":
            att_size = rng.randint(500, max(600, min(3000, room // 2)))
            room -= int(att_size * 1.37) + 250
        size = int(max(100, room) * text_share * (0.74 if enc == BASE64 else 1.0))
        text, paras = _text(rng, size, serial, sender[0])
        if rng.random() < 0.3:
            text = "Grüße – naïve café, ½ price ✓\n\n" + text
        plain = MIMEText(text, "plain", utf8)  # type: ignore[arg-type]
        if kind == "plain":
            msg = plain
        else:
            alt = MIMEMultipart("alternative")
            alt.attach(plain)
            alt.attach(MIMEText(_html(paras), "html", _charset("utf-8", QP)))  # type: ignore[arg-type]
            msg = alt
            if kind == "attachment":
                mixed = MIMEMultipart("mixed")
                mixed.attach(alt)
                att = MIMEApplication(b"%PDF-1.4\n" + rng.randbytes(att_size), "pdf")
                att.add_header(
                    "Content-Disposition", "attachment", filename=f"invoice-{serial}.pdf"
                )
                mixed.attach(att)
                msg = mixed
        subj = subject
    if refs:
        subj = rng.choice(("Re: ", "RE: ", "AW: ")) + subj
    sender_domain = sender[1].rpartition("@")[2]
    mid = f"{rng.getrandbits(64):016x}.{serial}@{sender_domain}"
    # Trace headers first, as a local MTA prepends them.
    msg["Return-Path"] = f"<{sender[1]}>"
    msg["Delivered-To"] = _OWNER[1]
    msg["Received"] = (
        f"from mx.acme-widgets.example (mx.acme-widgets.example [10.0.0.25])"
        f" by mail.acme-widgets.example (Postfix) with ESMTPS id "
        f"{rng.getrandbits(40):010X}; {format_datetime(received)}"
    )
    msg["Received"] = (
        f"from smtp.{sender_domain} (smtp.{sender_domain} "
        f"[198.51.100.{serial % 250 + 1}]) by mx.acme-widgets.example "
        f"(Postfix) with ESMTPS id {rng.getrandbits(40):010X}; "
        f"{format_datetime(received - timedelta(seconds=2))}"
    )
    msg["Subject"] = Header(subj, header_cs) if not subj.isascii() else subj  # type: ignore[assignment]
    msg["From"] = formataddr(
        (f"{sender[0]} {_NAME_SUFFIX[header_cs]}".strip(), sender[1]), charset=header_cs
    )
    msg["To"] = formataddr(rcpt)
    if cc is not None:
        msg["Cc"] = formataddr(cc)
    msg["Date"] = format_datetime(sent)
    msg["Message-ID"] = f"<{mid}>"
    if refs:
        msg["In-Reply-To"] = f"<{refs[-1]}>"
        msg["References"] = " ".join(f"<{r}>" for r in refs)
    msg["MIME-Version"] = "1.0"
    mailer = rng.choice(_MAILERS)
    if mailer:
        msg["X-Mailer"] = mailer
    return msg.as_bytes(), mid


def gen_chunk(job: tuple[int, int, int, int, str]) -> list[tuple[int, str]]:
    """Generate `count` messages (serials start..) into the Maildir at `root`, like an
    MTA: written in tmp/, renamed into new/. Returns (size, kind) per message."""
    chunk, start, count, seed, root = job
    rng = random.Random(seed * 1_000_003 + chunk)
    crowd = [_person(rng, chunk * 1000 + i) for i in range(200)]
    base = datetime(2024, 3, 1, tzinfo=UTC) + timedelta(hours=6 * chunk)
    tmp, new = Path(root) / "tmp", Path(root) / "new"
    kinds, weights = list(_KINDS), list(_KINDS.values())
    out: list[tuple[int, str]] = []
    serial = start
    while serial < start + count:
        size = min(rng.randint(1, 5), start + count - serial)
        subject = " ".join(rng.choices(_WORDS, k=rng.randint(3, 8))).capitalize()
        customer, other = rng.sample(crowd, 2)
        sent = base + timedelta(seconds=rng.uniform(0, 6 * 3600))
        refs: list[str] = []
        for j in range(size):
            sender, rcpt = (customer, _OWNER) if j % 2 == 0 else (_OWNER, customer)
            kind = rng.choices(kinds, weights)[0]
            target = rng.randint(MIN_SIZE + 100, MAX_SIZE - 150)
            cc = other if rng.random() < 0.3 else None
            received = sent + timedelta(seconds=rng.uniform(1, 90))
            state = rng.getstate()
            scale = 1.0
            for _ in range(4):  # resize towards the target when far off
                rng.setstate(state)
                raw, mid = _one(
                    rng,
                    serial,
                    kind,
                    target,
                    sender,
                    rcpt,
                    cc,
                    subject,
                    sent,
                    received,
                    refs,
                    scale,
                )
                if MIN_SIZE <= len(raw) <= MAX_SIZE and abs(len(raw) - target) < 0.35 * target:
                    break
                scale *= max(0.3, min(3.0, target / len(raw)))
            stamp = received.timestamp()
            name = f"{int(stamp)}.M{int(stamp % 1 * 1e6):06d}P{serial}Q1.mail.acme-widgets.example"
            (tmp / name).write_bytes(raw)
            os.rename(tmp / name, new / name)
            out.append((len(raw), kind))
            refs.append(mid)
            serial += 1
            sent = received + timedelta(seconds=rng.uniform(60, 4 * 3600))
    return out


def generate(root: Path, n: int, seed: int, workers: int) -> list[tuple[int, str]]:
    for sub in ("cur", "new", "tmp"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    jobs = [
        (c, s, min(GEN_CHUNK, n - s), seed, str(root)) for c, s in enumerate(range(0, n, GEN_CHUNK))
    ]
    if workers <= 1:
        parts = [gen_chunk(j) for j in jobs]
    else:
        with ProcessPoolExecutor(workers) as pool:
            parts = list(pool.map(gen_chunk, jobs))
    return [x for p in parts for x in p]


def spool_ready(spool: Path, n: int, seed: int) -> bool:
    """True when `spool` holds the messages of an earlier run with the same N and seed."""
    try:
        return (spool / STAMP).read_text().split() == [str(n), str(seed)]
    except OSError:
        return False


def link_maildir(spool: Path, dest: Path) -> int:
    """A Maildir copy of spool/new as hard links (in tmp/, then renamed into new/)."""
    for sub in ("cur", "new", "tmp"):
        (dest / sub).mkdir(parents=True, exist_ok=True)
    names = os.listdir(spool / "new")
    for name in names:
        os.link(spool / "new" / name, dest / "tmp" / name)
        os.rename(dest / "tmp" / name, dest / "new" / name)
    return len(names)


def link_eml(spool: Path, dest: Path) -> int:
    """A flat directory of NAME.eml hard links to spool/new (what import reads)."""
    dest.mkdir(parents=True, exist_ok=True)
    names = os.listdir(spool / "new")
    for name in names:
        os.link(spool / "new" / name, dest / (name.replace(":", "_") + ".eml"))
    return len(names)


# --------------------------------------------------------------------------- /proc


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as fh:
                    out.extend(int(x) for x in fh.read().split())
            except OSError:
                continue
    except OSError:
        pass
    return out


def tree(pid: int) -> list[int]:
    """pid and all its descendants (alive now)."""
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        todo.extend(_children(p))
    return pids


def rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def cpu_s(pid: int) -> float | None:
    """utime + stime of one process (its threads included)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


# --------------------------------------------------------------------------- runs


@dataclass
class Sample:
    t: float
    rows: int
    rss_main_kb: int
    rss_tree_kb: int
    procs: int


@dataclass
class Result:
    label: str
    n: int
    wall_s: float = float("nan")
    ready_s: float | None = None  # daemon: spawn -> daemon_ready
    command_elapsed_s: float | None = None  # import: its own --json elapsed_s
    samples: list[Sample] = field(default_factory=list)
    client_cpu_s: float = 0.0
    server_cpu_s: float | None = None
    exit_code: int | None = None
    stop_s: float | None = None
    rows: int = 0
    copies: int = 0
    dead: int = 0
    files_in_cur: int | None = None
    outcomes: dict | None = None
    problems: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.n / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def peak_main_mb(self) -> float:
        return max((s.rss_main_kb for s in self.samples), default=0) / 1024

    @property
    def peak_tree_mb(self) -> float:
        return max((s.rss_tree_kb for s in self.samples), default=0) / 1024

    def rss_at(self, fraction: float) -> Sample | None:
        want = fraction * self.n
        return next((s for s in self.samples if s.rows >= want and s.procs), None)


class Server:
    """Fresh databases on one server; all dropped at the end."""

    def __init__(self, dsn: str, keep: bool) -> None:
        self.dsn = dsn
        self.keep = keep
        self.created: list[str] = []
        host = urlsplit(dsn).hostname
        self.local = host in (None, "", "127.0.0.1", "localhost", "::1") or host.startswith("/")

    def dsn_of(self, name: str) -> str:
        return urlunsplit(urlsplit(self.dsn)._replace(path="/" + name))

    async def fresh(self, tag: str) -> tuple[str, str]:
        name = f"bench_daemon_{os.getpid()}_{tag}"
        admin = await asyncpg.connect(self.dsn)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            await admin.execute(f'CREATE DATABASE "{name}"')
            await admin.execute("CHECKPOINT")
        finally:
            await admin.close()
        self.created.append(name)
        return name, self.dsn_of(name)

    async def drop_all(self) -> None:
        if self.keep:
            print(f"kept databases: {', '.join(self.created)}")
            return
        admin = await asyncpg.connect(self.dsn)
        try:
            for name in self.created:
                await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()


class Watch:
    """Samples one command (process tree RSS + CPU, rows, backend CPU) every interval."""

    def __init__(
        self,
        proc: asyncio.subprocess.Process,
        dbname: str,
        monitor: asyncpg.Connection,
        started: float,
        server_local: bool,
    ) -> None:
        self.proc = proc
        self.dbname = dbname
        self.monitor = monitor
        self.started = started
        self.server_local = server_local
        self.samples: list[Sample] = []
        self.proc_cpu: dict[int, float] = {}
        self.backend_cpu: dict[int, float] = {}
        self.monitor_pid: int | None = None

    async def sample(self) -> Sample:
        if self.monitor_pid is None:
            self.monitor_pid = await self.monitor.fetchval("SELECT pg_backend_pid()")
            self.monitor_cpu0 = cpu_s(self.monitor_pid) if self.server_local else None
        pids = tree(self.proc.pid) if self.proc.returncode is None else []
        rss = [rss_kb(p) for p in pids]
        for p in pids:
            c = cpu_s(p)
            if c is not None:
                self.proc_cpu[p] = max(c, self.proc_cpu.get(p, 0.0))
        rows = (
            await self.monitor.fetchval("SELECT count(*) FROM messages")
            if await self._has_messages()
            else 0
        )
        if self.server_local:
            backends = await self.monitor.fetch(
                "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND pid <> $2",
                self.dbname,
                self.monitor_pid,
            )
            for r in backends:
                c = cpu_s(r["pid"])
                if c is not None:
                    self.backend_cpu[r["pid"]] = max(c, self.backend_cpu.get(r["pid"], 0.0))
        s = Sample(
            time.monotonic() - self.started, int(rows), rss[0] if rss else 0, sum(rss), len(pids)
        )
        self.samples.append(s)
        return s

    _schema_seen = False

    async def _has_messages(self) -> bool:
        if not self._schema_seen:
            self._schema_seen = bool(
                await self.monitor.fetchval("SELECT to_regclass('public.messages') IS NOT NULL")
            )
        return self._schema_seen

    monitor_cpu0: float | None = None

    @property
    def monitor_cpu(self) -> float | None:
        """CPU seconds the polling itself cost the server (count(*) grows with the table)."""
        if self.monitor_pid is None or self.monitor_cpu0 is None:
            return None
        now = cpu_s(self.monitor_pid)
        return None if now is None else now - self.monitor_cpu0

    @property
    def client_cpu(self) -> float:
        return sum(self.proc_cpu.values())

    @property
    def server_cpu(self) -> float | None:
        return sum(self.backend_cpu.values()) if self.server_local else None


def _events(log_path: Path) -> list[dict]:
    out = []
    for line in log_path.read_bytes().splitlines():
        try:
            out.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            continue
    return out


def write_daemon_config(work: Path, maildir: Path, objects: Path, batch_size: int) -> Path:
    """tests/daemon/harness.py style: main TOML + one tenant file, one maildir mailbox."""
    tenants = work / "tenants"
    tenants.mkdir(parents=True, exist_ok=True)
    (tenants / f"{TENANT}.toml").write_text(f"""id = "{TENANT}"
name = "Bench"

[[mailboxes]]
id = "{MAILBOX}"
provider = "maildir"
address = "{_OWNER[1]}"
sync_mode = "poll"
poll_interval_s = 0.5
path = "{maildir}"
""")
    main = work / "inboxd.toml"
    main.write_text(f"""
[listener]
host = "127.0.0.1"
port = 0

[object_store]
kind = "local"
path = "{objects}"

[queue]
capacity = 2000

[workers]
ingest = 2
batch_size = {batch_size}

[shutdown]
deadline_s = 60

[sync]
lease_ttl_s = 10
poll_scan_interval_s = 0.5

[tenants]
dir = "tenants"
""")
    return main


async def wait_exit(proc: asyncio.subprocess.Process, timeout_s: float) -> bool:
    """Wait up to timeout_s for the process to exit; True when it has."""
    if proc.returncode is not None:
        return True
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(proc.wait(), max(0.0, timeout_s))
    return proc.returncode is not None


def _env(pairs: list[str]) -> dict[str, str]:
    env = dict(os.environ)
    for pair in pairs:
        key, _, value = pair.partition("=")
        env[key] = value
    return env


def _progress(s: Sample, extra: str = "") -> None:
    print(
        f"    t={s.t:7.1f}s rows={s.rows:>8,} rss={s.rss_tree_kb / 1024:6.1f} MB{extra}", flush=True
    )


async def run_daemon(
    args: argparse.Namespace, server: Server, work: Path, spool: Path, tag: str
) -> Result:
    res = Result("daemon", args.messages)
    run_dir = work / f"daemon_{tag}"
    shutil.rmtree(run_dir, ignore_errors=True)
    maildir = run_dir / "maildir"
    linked = link_maildir(spool, maildir)
    assert linked == args.messages, (linked, args.messages)
    config = write_daemon_config(run_dir, maildir, run_dir / "objects", args.batch_size)
    dbname, dsn = await server.fresh(f"d{tag}")
    log_path = run_dir / "daemon.log"
    monitor = await asyncpg.connect(dsn)
    try:
        with log_path.open("wb") as log:
            started = time.monotonic()
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                *shlex.split(args.daemon_python_args),
                "-m",
                "inboxd.daemon.cli",
                "run",
                "--config",
                str(config),
                "--dsn",
                dsn,
                "--log-level",
                "info",
                stdout=subprocess.DEVNULL,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env=_env(args.daemon_env),
            )
            res.extra["pid"] = proc.pid
            print(f"  daemon pid {proc.pid}, database {dbname}, log {log_path}", flush=True)
            watch = Watch(proc, dbname, monitor, started, server.local)
            log_pos = 0
            tick = started
            done_at = None
            last_print = started
            try:
                while True:
                    s = await watch.sample()
                    with log_path.open("rb") as fh:
                        fh.seek(log_pos)
                        chunk = fh.read()
                    chunk = chunk[: chunk.rfind(b"\n") + 1]  # whole lines only
                    log_pos += len(chunk)
                    if res.ready_s is None and b'"daemon_ready"' in chunk:
                        res.ready_s = s.t
                    fatal = [e.decode() for e in FATAL_EVENTS if b'"' + e + b'"' in chunk]
                    if fatal:  # a crashed sync backs off for 30 s or more: not a throughput
                        res.problems.append(
                            f"{', '.join(fatal)} in the daemon log (see "
                            f"{log_path}); stopped waiting"
                        )
                        break
                    if proc.returncode is not None:
                        res.problems.append(f"daemon exited early with {proc.returncode}")
                        break
                    if res.ready_s is None and s.t > READY_TIMEOUT_S:
                        res.problems.append(f"no daemon_ready within {READY_TIMEOUT_S:g} s")
                        break
                    # Rows first; the renames into cur/ follow each page's commit.
                    if s.rows >= args.messages and not any(os.scandir(maildir / "new")):
                        done_at = time.monotonic()
                        s.t = done_at - started
                        break
                    if s.t > args.run_timeout_s:
                        res.problems.append(f"not done after {args.run_timeout_s:g} s")
                        break
                    if time.monotonic() - last_print >= args.print_every:
                        last_print = time.monotonic()
                        _progress(s)
                    tick += args.interval
                    await asyncio.sleep(max(0.0, tick - time.monotonic()))
                if done_at is not None:
                    res.wall_s = done_at - started
                # Idle after the backlog: a few more samples (memory after the work).
                idle_until = time.monotonic() + args.idle_s
                while proc.returncode is None and time.monotonic() < idle_until:
                    await asyncio.sleep(args.interval)
                    await watch.sample()
                res.extra["rss_idle_kb"] = watch.samples[-1].rss_tree_kb
                res.client_cpu_s = watch.client_cpu
                res.server_cpu_s = watch.server_cpu
                res.extra["monitor_cpu_s"] = watch.monitor_cpu
                res.samples = watch.samples
                if args.before_stop and proc.returncode is None:
                    hook = await asyncio.create_subprocess_exec(
                        *shlex.split(args.before_stop.replace("{pid}", str(proc.pid)))
                    )
                    await hook.wait()
            finally:
                if proc.returncode is None:
                    stop_started = time.monotonic()
                    proc.send_signal(signal.SIGTERM)
                    if await wait_exit(proc, STOP_TIMEOUT_S):
                        res.stop_s = time.monotonic() - stop_started
                    else:
                        res.problems.append(f"no exit {STOP_TIMEOUT_S:g} s after SIGTERM; killed")
                        proc.kill()
                        await proc.wait()
                res.exit_code = proc.returncode
        if res.exit_code != 0:
            res.problems.append(f"exit code {res.exit_code} after SIGTERM (expected 0)")
        await _check_rows(monitor, res)
        res.files_in_cur = sum(1 for _ in os.scandir(maildir / "cur"))
        if res.files_in_cur != args.messages:
            res.problems.append(f"{res.files_in_cur} files in cur/, expected {args.messages}")
        kinds: dict[str, int] = {}
        for e in _events(log_path):
            kinds[e.get("event", "?")] = kinds.get(e.get("event", "?"), 0) + 1
        res.extra["log_events"] = kinds
        for bad in ("sync_failed", "daemon_drain_abandoned"):
            if kinds.get(bad):
                res.problems.append(f"{kinds[bad]} × {bad} in the daemon log")
    finally:
        await monitor.close()
    return res


async def _check_rows(conn: asyncpg.Connection, res: Result) -> None:
    res.rows, res.copies, res.dead = await conn.fetchrow(
        "SELECT (SELECT count(*) FROM messages), (SELECT count(*) FROM message_copies), "
        "(SELECT count(*) FROM dead_items)"
    )
    if res.rows != res.n:
        res.problems.append(f"{res.rows} message rows, expected {res.n}")
    if res.copies != res.n:
        res.problems.append(f"{res.copies} message_copies rows, expected {res.n}")
    if res.dead:
        res.problems.append(f"{res.dead} dead items")


async def run_import(
    args: argparse.Namespace, server: Server, work: Path, eml_dir: Path, tag: str
) -> Result:
    res = Result("import", args.messages)
    run_dir = work / f"import_{tag}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    config = run_dir / "import.toml"
    config.write_text(f'[object_store]\nkind = "local"\npath = "{run_dir / "objects"}"\n')
    dbname, dsn = await server.fresh(f"i{tag}")
    log_path, out_path = run_dir / "import.log", run_dir / "import.json"
    monitor = await asyncpg.connect(dsn)
    try:
        with log_path.open("wb") as log, out_path.open("wb") as out:
            started = time.monotonic()
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
                "--log-level",
                "info",
                "--tenant",
                TENANT,
                "--mailbox",
                MAILBOX,
                *shlex.split(args.import_args),
                str(eml_dir),
                stdout=out,
                stderr=log,
                stdin=subprocess.DEVNULL,
            )
            print(f"  import pid {proc.pid}, database {dbname}, log {log_path}", flush=True)
            watch = Watch(proc, dbname, monitor, started, server.local)
            tick = started
            last_print = started
            try:
                while True:
                    s = await watch.sample()
                    if proc.returncode is not None:
                        break
                    if s.t > args.run_timeout_s:
                        res.problems.append(f"not done after {args.run_timeout_s:g} s")
                        break
                    if time.monotonic() - last_print >= args.print_every:
                        last_print = time.monotonic()
                        _progress(s, f" ({s.procs} processes)")
                    tick += args.interval
                    if await wait_exit(proc, tick - time.monotonic()):
                        break  # wall time = the exit, not the next tick
                res.wall_s = time.monotonic() - started
                await watch.sample()  # rows after the exit
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            res.exit_code = proc.returncode
            res.samples = watch.samples
            res.client_cpu_s = watch.client_cpu
            res.server_cpu_s = watch.server_cpu
            res.extra["monitor_cpu_s"] = watch.monitor_cpu
        if res.exit_code != 0:
            res.problems.append(f"import exit code {res.exit_code}")
        try:
            summary = orjson.loads(out_path.read_bytes().strip().splitlines()[-1])
            res.command_elapsed_s = summary.get("elapsed_s")
            res.outcomes = summary.get("outcomes")
        except (IndexError, orjson.JSONDecodeError):
            res.problems.append("no JSON summary from import")
        await _check_rows(monitor, res)
    finally:
        await monitor.close()
    return res


# --------------------------------------------------------------------------- output


def fmt_mb(kb: float) -> str:
    return f"{kb / 1024:,.1f}"


def describe(res: Result) -> list[str]:
    server = f"{res.server_cpu_s:8.1f}s" if res.server_cpu_s is not None else "     n/a"
    lines = [
        f"  {res.label:<8} {res.n:>8,} {res.wall_s:>9.1f} {res.rate:>8,.0f}  "
        f"{res.client_cpu_s:>8.1f}s {server}  {res.peak_tree_mb:>8.1f} "
        f"{res.peak_main_mb:>8.1f}"
    ]
    curve = []
    for p in PROGRESS_POINTS:
        s = res.rss_at(p)
        curve.append(
            f"{int(p * 100)} %: {fmt_mb(s.rss_tree_kb)} MB at {s.t:.0f} s"
            if s
            else f"{int(p * 100)} %: –"
        )
    lines.append(f"           RSS (process tree) at {', '.join(curve)}")
    details = []
    if res.ready_s is not None:
        at_ready = next((x for x in res.samples if x.t >= res.ready_s), None)
        if at_ready is not None:
            details.append(f"RSS at ready {fmt_mb(at_ready.rss_tree_kb)} MB")
        details.append(
            f"ready after {res.ready_s:.1f} s, "
            f"{res.n / (res.wall_s - res.ready_s):,.0f} msg/s from ready"
        )
    if res.command_elapsed_s is not None:
        details.append(
            f"import's own elapsed_s {res.command_elapsed_s:.1f} "
            f"({res.n / res.command_elapsed_s:,.0f} msg/s)"
        )
    if "rss_idle_kb" in res.extra:
        details.append(f"idle after the backlog {fmt_mb(res.extra['rss_idle_kb'])} MB")
    if res.stop_s is not None:
        details.append(f"SIGTERM → exit {res.exit_code} in {res.stop_s:.1f} s")
    if res.files_in_cur is not None:
        details.append(f"{res.files_in_cur:,} files in cur/")
    details.append(f"rows {res.rows:,}, copies {res.copies:,}, dead {res.dead}")
    if res.extra.get("monitor_cpu_s") is not None:
        details.append(
            f"polling cost the server {res.extra['monitor_cpu_s']:.1f} s CPU (not in 'server CPU')"
        )
    if res.outcomes:
        counted = ", ".join(f"{k}: {v}" for k, v in res.outcomes.items() if v)
        details.append(f"outcomes {{{counted}}}")
    lines.append("           " + "; ".join(details))
    for p in res.problems:
        lines.append(f"           PROBLEM: {p}")
    return lines


def curve_table(res: Result, steps: int = 10) -> list[str]:
    """RSS at every 10 % of progress (process tree and main process)."""
    out = []
    for i in range(steps + 1):
        s = res.rss_at(i / steps) if i else res.rss_at(1 / res.n)
        if s is None:
            continue
        label = f"{i * 100 // steps:>4} %" if i else " 1st"
        out.append(
            f"{label} {s.t:7.1f}s {fmt_mb(s.rss_tree_kb):>7} MB (main {fmt_mb(s.rss_main_kb):>6})"
        )
    return out


# --------------------------------------------------------------------------- main


def code_version() -> str:
    """The commit the measured code is at (other work lands while benchmarks run)."""
    repo = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            [
                "git",
                "-C",
                str(repo),
                "status",
                "--porcelain",
                "--",
                "daemon",
                "adapters",
                "pipeline",
                "schema.sql",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown commit"
    return head + (" + uncommitted changes" if dirty.strip() else "")


async def main(args: argparse.Namespace) -> int:
    only = set(args.only.split(","))
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_daemon_"))
    work.mkdir(parents=True, exist_ok=True)
    server = Server(args.dsn, args.keep)
    spool = work / "spool"
    print(
        f"inboxd at {code_version()}; work directory {work}; {os.cpu_count()} CPUs; "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        flush=True,
    )
    results: list[Result] = []
    try:
        t0 = time.monotonic()
        reuse = spool_ready(spool, args.messages, args.seed)
        if reuse:
            print(f"reusing the {args.messages:,} messages of {spool}/new", flush=True)
        else:
            shutil.rmtree(spool, ignore_errors=True)
            meta = generate(spool, args.messages, args.seed, args.gen_workers)
            (spool / STAMP).write_text(f"{args.messages} {args.seed}\n")
            sizes = [s for s, _ in meta]
            kinds: dict[str, int] = {}
            for _, k in meta:
                kinds[k] = kinds.get(k, 0) + 1
            print(
                f"generated {len(sizes):,} messages into {spool}/new in "
                f"{time.monotonic() - t0:.1f} s (not timed): {sum(sizes) / 1e6:,.1f} MB, "
                f"size min {min(sizes):,} / median {statistics.median(sizes):,.0f} / mean "
                f"{statistics.fmean(sizes):,.0f} / max {max(sizes):,} bytes; "
                + ", ".join(f"{k} {v * 100 / len(meta):.0f} %" for k, v in kinds.items()),
                flush=True,
            )
        eml_dir = work / "eml"
        if "import" in only and not (reuse and eml_dir.is_dir()):
            shutil.rmtree(eml_dir, ignore_errors=True)
            link_eml(spool, eml_dir)
        for r in range(args.rounds):
            order = ("daemon", "import") if r % 2 == 0 else ("import", "daemon")
            for what in order:
                if what not in only:
                    continue
                print(f"round {r + 1}: {what} …", flush=True)
                if what == "daemon":
                    res = await run_daemon(args, server, work, spool, str(r))
                else:
                    res = await run_import(args, server, work, eml_dir, str(r))
                results.append(res)
                for line in describe(res):
                    print(line, flush=True)
    finally:
        await server.drop_all()
        if args.keep:
            print(f"kept work directory {work}")
        elif args.workdir:  # keep the generated messages for the next run
            for run_dir in work.glob("*_[0-9]*"):
                shutil.rmtree(run_dir, ignore_errors=True)
            print(f"kept the generated messages in {spool}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    for res in results:
        if not res.problems and not 0 < res.rate < float("inf"):
            res.problems.append(f"no throughput ({res.rate} msg/s)")
    print()
    print(f"inboxd at {code_version()} (at the end of the run)")
    print(
        f"Maildir backfill of {args.messages:,} messages, [workers] batch_size "
        f"{args.batch_size}; every run on a fresh database; RSS sampled every "
        f"{args.interval:g} s (process tree = command + its child processes)"
    )
    print(
        f"  {'':<8} {'msgs':>8} {'wall s':>9} {'msg/s':>8}  {'client CPU':>9} "
        f"{'server CPU':>9}  {'peak RSS':>8} {'main RSS':>8}   (MB)"
    )
    for res in results:
        for line in describe(res):
            print(line)
    daemons = [r for r in results if r.label == "daemon"]
    imports = [r for r in results if r.label == "import"]
    for res in daemons:
        print(f"  daemon RSS curve (round {daemons.index(res) + 1}):")
        for line in curve_table(res):
            print("    " + line)
    failed = any(r.problems for r in results)
    if daemons and imports:
        d = statistics.median(r.rate for r in daemons)
        i = statistics.median(r.rate for r in imports)
        ratio = d / i
        peak = max(r.peak_tree_mb for r in daemons)
        flat = []
        for r in daemons:
            pts = [r.rss_at(p) for p in PROGRESS_POINTS]
            if all(pts):
                flat.append((pts[-1].rss_tree_kb - pts[0].rss_tree_kb) / 1024)  # type: ignore[union-attr]
        growth = max(flat) if flat else float("nan")
        rounds = f" (median of {len(daemons)} and {len(imports)})" if args.rounds > 1 else ""
        print()
        print(
            f"  daemon {d:,.0f} msg/s, import {i:,.0f} msg/s{rounds}: ratio daemon/import = "
            f"{ratio:.2f} (target ≥ {TARGET_RATIO:g}: "
            f"{'ok' if ratio >= TARGET_RATIO else 'MISSED'})"
        )
        print(
            f"  daemon peak RSS {peak:,.1f} MB (target < {TARGET_RSS_MB:g} MB: "
            f"{'ok' if peak < TARGET_RSS_MB else 'MISSED'}); growth 10 % → 90 % of the "
            f"backlog {growth:+.1f} MB ({'flat' if abs(growth) < 10 else 'NOT flat'})"
        )
    return 1 if failed else 0


def cli() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--dsn", default=DEFAULT_DSN, help="admin DSN (creates bench_* databases)")
    parser.add_argument("--batch-size", type=int, default=500, help="[workers] batch_size")
    parser.add_argument(
        "--rounds", type=int, default=1, help="repeat daemon and import, alternating their order"
    )
    parser.add_argument("--only", default="daemon,import")
    parser.add_argument("--interval", type=float, default=0.5, help="sampling interval, s")
    parser.add_argument(
        "--idle-s",
        type=float,
        default=2.0,
        help="keep sampling the daemon this long after the backlog",
    )
    parser.add_argument(
        "--print-every", type=float, default=15.0, help="progress line every this many seconds"
    )
    parser.add_argument("--gen-workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=20240501)
    parser.add_argument(
        "--workdir",
        help="work directory (default: a new one under $TMPDIR, removed at the "
        "end); when given, the generated messages are kept there and "
        "reused by the next run with the same --messages and --seed",
    )
    parser.add_argument(
        "--before-stop",
        default="",
        help="command run before the daemon's SIGTERM ({pid} = its pid), "
        "e.g. 'py-spy dump --pid {pid}'",
    )
    parser.add_argument(
        "--daemon-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment of the daemon (repeatable), e.g. MALLOC_ARENA_MAX=2",
    )
    parser.add_argument(
        "--daemon-python-args",
        default="",
        help="interpreter options of the daemon, e.g. '-X importtime'",
    )
    parser.add_argument(
        "--import-args", default="", help="extra options of inboxd import, e.g. '--parse-in thread'"
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the databases and the work directory"
    )
    parser.add_argument(
        "--run-timeout-s",
        type=float,
        default=RUN_TIMEOUT_S,
        help="a run not finished after this long is reported as failed",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help=f"CI size: {SMOKE_MESSAGES} messages, pages of {SMOKE_BATCH}, one round; "
        "exit 1 on any problem",
    )
    args = parser.parse_args()
    if args.smoke:
        args.messages, args.batch_size, args.rounds = SMOKE_MESSAGES, SMOKE_BATCH, 1
        args.interval, args.idle_s = SMOKE_INTERVAL_S, SMOKE_IDLE_S
        args.run_timeout_s = min(args.run_timeout_s, SMOKE_RUN_TIMEOUT_S)
    return asyncio.run(main(args))


if __name__ == "__main__":
    sys.exit(cli())
