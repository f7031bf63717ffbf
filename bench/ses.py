#!/usr/bin/env python3
"""The SES door (SES → S3 → SQS → rows) under `inboxd run`, against moto's server or an
in-memory S3/SQS stand-in with a latency per call, next to that server alone and to
`inboxd import` of the same raw files, all in one run.

    .venv/bin/python bench/ses.py [--aws moto|standin] [--latency-ms L]
        [--messages N] [--pollers P] [--more-loops M]
        [--backlog B] [--wait-time-s W] [--dsn ADMIN_DSN] [--interval S]
        [--gen-workers W] [--seed S] [--keep] [--smoke]

`--aws standin` (issue 25): instead of moto, tests/fakes/ses_aws.py in a process of
its own — SQS (receive, long poll, visibility, delete, send, counts) and S3 (put,
get, delete) in memory, every request answered after L ms (default 10, about what
AWS's SQS and S3 take from inside their region) and otherwise at once, so neither
the queue's CPU (moto's, below) nor the store bounds the run: what is left is the
round trips, the client and the database. Its queue is O(1) per message, so the
pointers are all sent before the clock (a burst; --backlog B to feed it as for
moto). Everything below says "moto"; with the stand-in, read "the stand-in".

Defaults: N=5,000; the daemon's default `[ses] pollers` (2), then moto alone and the
daemon again with 8 loops; a backlog of 40. ~10 min on 2 quiet cores (2 of them
to generate and upload the data), twice that on a busy machine.

Data (not timed): N distinct RFC 5322 messages of 1-8 KB from daemon_backfill.py's
generator (plain, multipart/alternative, a PDF attachment, legacy charsets; threads
with In-Reply-To/References) to the support address, each uploaded once to a bucket
on moto's server (`python -m moto.server`, a subprocess on a free loopback port,
fake credentials) and announced by inboxd's versioned pointer `{"version": 1,
"provider": "ses", "sesMessageId", "s3Bucket", "s3Key", "recipients": [support
address], "receivedAt"}`.

Every measurement gets a fresh queue and the same N pointers. moto's ReceiveMessage
and SendMessage scan the whole queue for every message they handle (~0.14 ms of CPU
per message per message in the queue, see BACKLOG), so all N sent up front would
measure that scan. A feeder in this script therefore sends B pointers before the
clock starts and then tops the queue up to B visible messages every 50 ms until all
N are sent (GetQueueAttributes + SendMessageBatch, the same in every run);
--backlog 0 sends all N before the clock instead.

Measured, in this order: moto alone and the daemon with P loops, the same with M
loops, then import:

  moto alone   moto's own ceiling, no inboxd: `loops` concurrent loops in this
               process doing what a daemon poller does with the network, through the
               door's own client (adapters/ses/aws.py: the same aiobotocore stack and
               settings): ReceiveMessage (MaxNumberOfMessages 10, WaitTimeSeconds W),
               then DeleteMessageBatch of what it received. Two references:
               receive+delete alone, and receive+get+delete (an S3 GetObject of each
               message's object, a batch's all at once, as the poller fetches them).
               Each with P loops, then with --more-loops. Timed from the first
               receive until every message was deleted.
  daemon       after the references of the same loop count: `inboxd run` with
               `[ses] pollers` = that count (fresh database; main TOML with `[ses]` on
               the queue and config.example.toml's [queue]/[workers]; one tenant file
               with one ses mailbox whose `addresses` is the support address). Timed
               from the spawn until N message rows exist and nothing is left in the
               queue (GetQueueAttributes, visible and in flight). Then SIGTERM, exit
               code 0 expected; the poller's totals (its `ses_poller_stopped` log line)
               must say N stored, every received message deleted, nothing left, dead
               or released.
  import       `inboxd import` of the same raw files (NAME.eml hard links) into a
               fresh database: daemon_backfill.py's run_import, timed from spawn to
               exit. Every daemon's database must hold the same raw_sha256 values.

moto's server runs under the tests' launcher (tests/helpers/moto_consistent.py),
which serialises its SQS calls: plain moto has no lock around a queue's messages (two
concurrent receives hand out one message twice, two concurrent DeleteMessageBatch
bring a deleted message back, a send racing a delete loses what it sent). SQS
delivers at least once all the same, so redelivery is not an error here: a message
handed out twice must be stored once (`duplicate`); messages back in flight after
every row exists end the daemon's clock after LEFTOVER_GRACE_S without change; lost
messages are sent again by the feeder; a 500 is tried again (moto alone) or backed
off by the daemon's own poller, whose visibility heartbeat may also find a handle
gone stale (a message handed out again). Each is counted and printed.

Printed: msg/s of each; the ratios daemon / moto alone (receive+get+delete with as
many loops as pollers: the network work the daemon cannot avoid; receive+delete too)
and daemon / import; the daemon's RSS (process tree: daemon and parse workers) at every
10 % of the rows, sampled every --interval s ("flat" when RSS at 90 % is within 10 MB
of RSS at 10 %, as in daemon_backfill.py); where the CPU went (daemon main process,
its parse workers, the PostgreSQL backends of its database, moto, this script, the
whole machine from /proc/stat), as % of one core and ms per stored message.

The machine is shared and noisy: compare the ratios of one run. Databases are named
bench_ses_<pid>_<x> and dropped at the end with the work directory (unless --keep).
The first line printed names the commit of the code measured (it is printed again
at the end). Exit 1 when a figure is not a measurement (bench/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import dataclasses
import http.client
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import aioboto3
import asyncpg
import orjson

# bench/ is sys.path[0]: the Maildir backfill bench's and the door benches' machinery.
from daemon_backfill import (
    _OWNER,
    FATAL_EVENTS,
    MAILBOX,
    PROGRESS_POINTS,
    READY_TIMEOUT_S,
    STOP_TIMEOUT_S,
    TENANT,
    Result,
    Watch,
    _check_rows,
    _events,
    _progress,
    code_version,
    cpu_s,
    curve_table,
    describe,
    generate,
    link_eml,
    run_import,
    tree,
    wait_exit,
)
from door_run import FreshServer, Sampler, finite_positive, machine_cpu_s

from inboxd.adapters.ses import AwsClients, SesSettings
from inboxd.adapters.ses.errors import SesTransient
from inboxd.adapters.ses.pointers import Pointer, parse_pointers

T = TypeVar("T")

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
REGION = "us-east-1"
ADDRESS = _OWNER[1]
# The receive long poll: small, so loops that find the queue empty at the end come
#: moto.server with its SQS operations serialised (tests/helpers/moto_consistent.py).
MOTO_LAUNCHER = Path(__file__).resolve().parents[1] / "tests" / "helpers" / "moto_consistent.py"
#: the in-memory S3/SQS stand-in with a latency per call (--aws standin).
STANDIN = Path(__file__).resolve().parents[1] / "tests" / "fakes" / "ses_aws.py"
LATENCY_MS = 10.0
# What the figures name the S3/SQS server: "moto" or "stand-in" (set by main).
SERVER = {"label": "moto"}

# back quickly (with a full queue moto answers at once, whatever the wait).
WAIT_TIME_S = 1
# Uploads and sends: concurrent requests to moto.
SETUP_CONCURRENCY = 16
# moto's ReceiveMessage and SendMessage scan the whole queue for every message they
# handle (its retention check computes every queue attribute, each a pass over all
# messages): measured here, ~0.14 ms of moto CPU per message per message in the
# queue. With all 5,000 pointers sent up front a run would measure that scan
# (minutes per thousand messages), not inboxd; so a feeder keeps the queue at
# BACKLOG visible messages, topping it up every FEED_INTERVAL_S, in every run alike.
BACKLOG = 40
FEED_INTERVAL_S = 0.05
# Calls of moto alone that answered 500 are tried again this often (and a receive is
# not backed off as the daemon does: this is the ceiling).
MOTO_ATTEMPTS = 5
# moto's queue has no lock (module docstring). A SendMessageBatch racing a
# DeleteMessageBatch can lose the messages it sent (the delete writes back the list it
# read before the send appended to it): when nothing is visible and fewer messages are
# settled or in flight than were sent, the feeder sends the unsettled ones again
# (printed as "lost by moto, sent again").
# After the last row, messages still in flight that stay so this long were deleted by
# the consumer and brought back by moto's delete (two concurrent DeleteMessageBatch
# can undo one another's removal the same way).
LEFTOVER_GRACE_S = 3.0
# SendMessageBatch takes at most 10 entries (SQS API reference).
SQS_BATCH = 10
MOTO_START_TIMEOUT_S = 60.0
MOTO_STOP_TIMEOUT_S = 10.0
RUN_TIMEOUT_S = 1800.0
# The daemon's RSS is "flat" when it grew less than this from 10 % to 90 % of the rows.
FLAT_MB = 10.0
# Log events after which the run is not a throughput figure.
SES_FATAL_EVENTS = (*FATAL_EVENTS, b"ses_batch_crashed")
# Log events that must not appear in a clean run (counted at the end). A failed
# receive (ses_receive_failed) and a heartbeat that could not extend a message
# (ses_visibility_lost: its receipt handle is stale once moto handed the message out
# again) are moto's doing here: counted and printed, not failures.
SES_NOTED_EVENTS = ("ses_receive_failed", "ses_visibility_lost", "ses_visibility_not_extended")
SES_BAD_EVENTS = (
    "ses_unrouted",
    "ses_object_not_deleted",
    "sync_failed",
    "daemon_drain_abandoned",
)
#: --smoke (CI): every figure at a tiny size, ~20-40 s.
SMOKE_MESSAGES = 100
SMOKE_MORE_LOOPS = 4
SMOKE_INTERVAL_S = 0.2
SMOKE_IDLE_S = 0.5
SMOKE_RUN_TIMEOUT_S = 90.0


# --------------------------------------------------------------------------- moto


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# Loaded here, in the parent: the child only calls it between fork and exec.
try:
    _LIBC: ctypes.CDLL | None = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:
    _LIBC = None
PR_SET_PDEATHSIG = 1  # prctl(2)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when this script dies (PR_SET_PDEATHSIG), so a
    benchmark killed by a deadline leaves no moto server and no daemon behind (the
    daemon stops on SIGTERM as it should). No allocation or import here: the parent
    may have threads."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def fake_aws_env() -> None:
    """Fake credentials for moto, set for this process and every child (the daemon),
    and no profile or endpoint override of the user's (tests/helpers/moto_server.py)."""
    fake = "testing"  # what moto accepts; no real credential is looked for
    os.environ.update(
        {
            "AWS_ACCESS_KEY_ID": fake,
            "AWS_SECRET_ACCESS_KEY": fake,
            "AWS_SECURITY_TOKEN": fake,
            "AWS_SESSION_TOKEN": fake,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_CONFIG_FILE": "/nonexistent/inboxd-bench-aws-config",
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/inboxd-bench-aws-credentials",
        }
    )
    for name in (
        "AWS_PROFILE",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_ENDPOINT_URL_SQS",
        "AWS_REGION",
    ):
        os.environ.pop(name, None)


class Moto:
    """moto's server as a subprocess; its CPU is the process's (all its threads)."""

    # The tests' launcher (SQS calls serialised, as real SQS is consistent): plain moto
    # lost or revived messages under the baseline's concurrent loops and, on a loaded
    # machine, left "moto alone" short of its messages (92 of 100 after 90 s in CI).

    label = "moto"

    def __init__(self, log_path: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.what = "moto server"
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
            )

    def command(self) -> list[str]:
        return [sys.executable, str(MOTO_LAUNCHER), "-H", "127.0.0.1", "-p", str(self.port)]

    async def ready(self) -> float:
        started = time.monotonic()
        while time.monotonic() - started < MOTO_START_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.label} exited with {self.proc.returncode}: {self.log_path}"
                )
            if await asyncio.to_thread(self._probe):
                return time.monotonic() - started
            await asyncio.sleep(0.1)
        raise RuntimeError(f"{self.label} not answering after {MOTO_START_TIMEOUT_S:g} s")

    def _probe(self) -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=1.0)
        try:
            conn.request("GET", "/moto-api/data.json")
            return self._answered(conn.getresponse().status)
        except OSError:
            return False
        finally:
            conn.close()

    @staticmethod
    def _answered(status: int) -> bool:
        return status == 200

    def cpu_s(self) -> float:
        return sum(cpu_s(p) or 0.0 for p in tree(self.proc.pid))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(MOTO_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class StandIn(Moto):
    """tests/fakes/ses_aws.py as a subprocess: S3 and SQS in memory, `latency_ms` a call."""

    label = "stand-in"

    def __init__(self, log_path: Path, latency_ms: float) -> None:
        self.latency_ms = latency_ms
        super().__init__(log_path)
        self.what = f"S3/SQS stand-in ({latency_ms:g} ms a call)"

    def command(self) -> list[str]:
        return [
            sys.executable,
            str(STANDIN),
            "--port",
            str(self.port),
            "--latency-ms",
            str(self.latency_ms),
        ]

    @staticmethod
    def _answered(status: int) -> bool:
        return status > 0  # any answer (its S3 says NoSuchBucket)


class Aws:
    """This script's own aioboto3 clients for the setup (uploads, queues, sends, counts)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._stack = contextlib.AsyncExitStack()
        self.s3: Any = None
        self.sqs: Any = None

    async def __aenter__(self) -> Aws:
        session = aioboto3.Session()
        kw = {"endpoint_url": self.endpoint, "region_name": REGION}
        self.s3 = await self._stack.enter_async_context(session.client("s3", **kw))
        self.sqs = await self._stack.enter_async_context(session.client("sqs", **kw))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def new_queue(self, label: str) -> str:
        name = f"bench-{label}-{uuid.uuid4().hex[:8]}"
        return str((await self.sqs.create_queue(QueueName=name))["QueueUrl"])

    async def counts(self, queue_url: str) -> tuple[int, int]:
        """(visible, in flight) messages of the queue."""
        attrs = (
            await self.sqs.get_queue_attributes(
                QueueUrl=queue_url,
                AttributeNames=[
                    "ApproximateNumberOfMessages",
                    "ApproximateNumberOfMessagesNotVisible",
                ],
            )
        )["Attributes"]
        return (
            int(attrs["ApproximateNumberOfMessages"]),
            int(attrs["ApproximateNumberOfMessagesNotVisible"]),
        )

    async def upload(self, bucket: str, files: list[tuple[str, Path]]) -> None:
        await self.s3.create_bucket(Bucket=bucket)
        gate = asyncio.Semaphore(SETUP_CONCURRENCY)

        async def put(key: str, path: Path) -> None:
            async with gate:
                body = await asyncio.to_thread(path.read_bytes)
                await self.s3.put_object(Bucket=bucket, Key=key, Body=body)

        await asyncio.gather(*(put(k, p) for k, p in files))

    async def send(self, queue_url: str, bodies: list[bytes]) -> None:
        """Send these pointers (SendMessageBatch in tens, a few at once)."""
        gate = asyncio.Semaphore(SETUP_CONCURRENCY)

        async def batch(start: int) -> None:
            entries = [
                {"Id": str(i), "MessageBody": b.decode()}
                for i, b in enumerate(bodies[start : start + SQS_BATCH])
            ]
            async with gate:
                answer = await self.sqs.send_message_batch(QueueUrl=queue_url, Entries=entries)
            if answer.get("Failed"):
                raise RuntimeError(f"SendMessageBatch failed: {answer['Failed'][:2]}")

        await asyncio.gather(*(batch(s) for s in range(0, len(bodies), SQS_BATCH)))


class Feeder:
    """The pointers of one run into its queue: `backlog` of them before the clock starts,
    then the rest as the queue drains, keeping `backlog` visible (BACKLOG's comment);
    backlog 0 sends them all before the clock starts."""

    def __init__(self, aws: Aws, queue_url: str, bodies: list[bytes], backlog: int) -> None:
        self.aws = aws
        self.queue_url = queue_url
        self.bodies = bodies
        self.backlog = backlog or len(bodies)
        self.sent = 0
        self.polls = 0
        self.resent = 0  # lost by moto, sent again
        self._short = 0  # consecutive looks that found messages lost

    @property
    def done(self) -> bool:
        return self.sent >= len(self.bodies)

    async def resend_lost(
        self,
        settled: Callable[[], Awaitable[int]],
        unsettled: Callable[[], Awaitable[list[bytes]]],
    ) -> int:
        """Once everything is sent: when nothing is visible and the messages in flight
        plus those settled (stored, deleted: counted after the queue) are fewer than all
        of them, twice in a row, moto lost some (the comment above LEFTOVER_GRACE_S):
        send the unsettled ones again. Answers how many were sent again this time."""
        if not self.done:
            return 0
        visible, in_flight = await self.aws.counts(self.queue_url)
        if visible or await settled() + in_flight >= len(self.bodies):
            self._short = 0
            return 0
        self._short += 1
        if self._short < 2:
            return 0
        self._short = 0
        again = await unsettled()
        if again:
            await self.aws.send(self.queue_url, again)
            self.resent += len(again)
        return len(again)

    async def prime(self) -> int:
        """The first `backlog` (not timed); answers the visible count."""
        await self._send(self.backlog)
        visible, _ = await self.aws.counts(self.queue_url)
        return visible

    async def run(self) -> None:
        while self.sent < len(self.bodies):
            await asyncio.sleep(FEED_INTERVAL_S)
            visible, _ = await self.aws.counts(self.queue_url)
            self.polls += 1
            await self._send(self.backlog - visible)

    async def _send(self, n: int) -> None:
        chunk = self.bodies[self.sent : self.sent + max(0, n)]
        if chunk:
            await self.aws.send(self.queue_url, chunk)
            self.sent += len(chunk)


def pointers(names: list[str], bucket: str) -> tuple[list[tuple[str, str]], list[bytes]]:
    """(S3 key, file name) and the versioned pointer of each message (module docstring)."""
    keys, bodies = [], []
    for i, name in enumerate(sorted(names)):
        key = f"inbound/{name}"
        stamp = datetime.fromtimestamp(int(name.split(".", 1)[0]), UTC)
        keys.append((key, name))
        bodies.append(
            orjson.dumps(
                {
                    "version": 1,
                    "provider": "ses",
                    "sesMessageId": f"{i:08x}-{uuid.uuid4().hex}",
                    "s3Bucket": bucket,
                    "s3Key": key,
                    "recipients": [ADDRESS],
                    "receivedAt": stamp.isoformat().replace("+00:00", "Z"),
                }
            )
        )
    return keys, bodies


# --------------------------------------------------------------------------- moto alone


@dataclass
class Reference:
    label: str
    loops: int
    get: bool
    n: int
    wall_s: float = float("nan")
    received: int = 0
    deleted: set[str] = field(default_factory=set)  # bodies (pointers) deleted
    resent: int = 0
    fetched: int = 0
    fetched_bytes: int = 0
    receives: int = 0
    empty_receives: int = 0
    errors: int = 0  # moto's 500s, each tried again
    left_in_flight: int = 0
    client_cpu_s: float = float("nan")
    moto_cpu_s: float = float("nan")
    machine_busy_s: float = float("nan")
    problems: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.n / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def name(self) -> str:
        return f"{self.label}, {self.loops} loops"

    def line(self) -> str:
        def pct(x: float) -> str:
            return f"{x:6.1f} s {100 * x / self.wall_s:4.0f} % {1000 * x / self.n:5.2f} ms"

        extra = [
            f"{self.receives:,} receives ({self.empty_receives} empty)",
            f"{self.received:,} received",
            f"{len(self.deleted):,} deleted",
        ]
        if self.get:
            extra.append(f"{self.fetched:,} objects ({self.fetched_bytes / 1e6:.1f} MB)")
        if self.errors:
            extra.append(f"{self.errors} moto errors (tried again)")
        if self.resent:
            extra.append(f"{self.resent} lost by moto, sent again")
        if self.left_in_flight:
            extra.append(f"{self.left_in_flight} back in flight after their delete (moto)")
        return (
            f"  {SERVER['label'] + ' alone: ' + self.name:<42} {self.n:>7,} {self.wall_s:>8.2f} "
            f"{self.rate:>8,.0f}  "
            f"{pct(self.client_cpu_s)}  {pct(self.moto_cpu_s)}  "
            f"{100 * self.machine_busy_s / self.wall_s:4.0f} %   " + ", ".join(extra)
        )


async def run_reference(
    args: argparse.Namespace,
    aws: Aws,
    moto: Moto,
    base: SesSettings,
    bodies: list[bytes],
    loops: int,
    get: bool,
) -> Reference:
    what = "receive+get+delete" if get else "receive+delete"
    ref = Reference(what, loops, get, len(bodies))
    queue_url = await aws.new_queue(f"ref{loops}{'g' if get else ''}")
    feeder = Feeder(aws, queue_url, bodies, args.backlog)
    visible = await feeder.prime()
    if visible != feeder.sent:
        ref.problems.append(f"{visible} messages visible after sending {feeder.sent}")
    settings = dataclasses.replace(base, queue_url=queue_url, pollers=loops)
    done = asyncio.Event()
    async with AwsClients(settings) as client:

        async def again(call: Callable[[], Awaitable[T]]) -> T:
            """moto answers 500 now and then (module docstring): try again at once."""
            for _ in range(MOTO_ATTEMPTS - 1):
                try:
                    return await call()
                except SesTransient:
                    ref.errors += 1
            return await call()

        async def fetch(p: Pointer) -> bytes:
            return await again(
                lambda: client.fetch(p.bucket, p.key, max_bytes=settings.max_message_bytes)
            )

        async def loop() -> None:
            while not done.is_set():
                messages = await again(client.receive)
                ref.receives += 1
                if not messages:
                    ref.empty_receives += 1
                    continue
                ref.received += len(messages)
                if get:
                    raws = await asyncio.gather(
                        *(fetch(parse_pointers(m.body)[0]) for m in messages)
                    )
                    ref.fetched += len(raws)
                    ref.fetched_bytes += sum(len(r) for r in raws)
                left = list(messages)
                for _ in range(MOTO_ATTEMPTS):  # aws.py retried each batch 4 times already
                    stale = {m.receipt_handle for m in await client.delete(left)}
                    ref.deleted.update(m.body for m in left if m.receipt_handle not in stale)
                    left = [m for m in left if m.receipt_handle in stale]
                    if not left:
                        break
                    ref.errors += len(left)
                if len(ref.deleted) >= ref.n and not done.is_set():
                    ref.wall_s = time.monotonic() - started
                    done.set()

        moto0, busy0, cpu0 = moto.cpu_s(), machine_cpu_s()[0], time.process_time()
        started = time.monotonic()
        tasks = [asyncio.create_task(loop()) for _ in range(loops)]
        tasks.append(asyncio.create_task(feeder.run()))
        waiter = asyncio.create_task(done.wait())
        try:
            pending: set[asyncio.Task[Any]] = {waiter, *tasks}

            async def settled() -> int:
                return len(ref.deleted)

            async def unsettled() -> list[bytes]:
                return [b for b in bodies if b.decode() not in ref.deleted]

            while True:
                if time.monotonic() - started > args.run_timeout_s:
                    ref.problems.append(
                        f"not done after {args.run_timeout_s:g} s ({len(ref.deleted)} deleted)"
                    )
                    break
                finished, pending = await asyncio.wait(
                    pending, timeout=args.interval, return_when=asyncio.FIRST_COMPLETED
                )
                failed = [t for t in finished if t is not waiter and t.exception()]
                for t in failed:
                    exc = t.exception()
                    ref.problems.append(f"a loop failed: {type(exc).__name__}: {exc}")
                if failed or waiter in finished:
                    break
                ref.resent += await feeder.resend_lost(settled, unsettled)
            ref.client_cpu_s = time.process_time() - cpu0
            ref.moto_cpu_s = moto.cpu_s() - moto0
            ref.machine_busy_s = machine_cpu_s()[0] - busy0
        finally:
            for t in [*tasks, waiter]:
                t.cancel()
            await asyncio.gather(*tasks, waiter, return_exceptions=True)
    if not done.is_set():
        ref.problems.append(f"{len(ref.deleted):,} of {ref.n:,} messages deleted")
    visible, ref.left_in_flight = await aws.counts(queue_url)
    if visible:
        ref.problems.append(f"{visible} messages still visible after the run")
    if get and ref.fetched != ref.received:
        ref.problems.append(f"{ref.fetched} objects fetched for {ref.received} messages")
    return ref


# --------------------------------------------------------------------------- the daemon


def write_config(run_dir: Path, settings: SesSettings) -> Path:
    """Main TOML (config.example.toml's [queue]/[workers], [ses] on the queue) and one
    tenant file with one ses mailbox for the support address."""
    tenants = run_dir / "tenants"
    tenants.mkdir(parents=True, exist_ok=True)
    (tenants / f"{TENANT}.toml").write_text(f"""id = "{TENANT}"
name = "Bench"

[[mailboxes]]
id = "{MAILBOX}"
provider = "ses"
addresses = ["{ADDRESS}"]
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

[ses]
queue_url = "{settings.queue_url}"
endpoint_url = "{settings.endpoint_url}"
region = "{settings.region}"
wait_time_s = {settings.wait_time_s}
pollers = {settings.pollers}
""")
    return main


async def run_daemon(
    args: argparse.Namespace,
    aws: Aws,
    moto: Moto,
    server: FreshServer,
    work: Path,
    base: SesSettings,
    bodies: list[bytes],
    pollers: int,
) -> tuple[Result, Sampler | None]:
    res = Result(f"daemon {pollers}", len(bodies))
    res.extra["pollers"] = pollers
    run_dir = work / f"daemon_{pollers}"
    run_dir.mkdir(parents=True, exist_ok=True)
    queue_url = await aws.new_queue(f"daemon{pollers}")
    feeder = Feeder(aws, queue_url, bodies, args.backlog)
    visible = await feeder.prime()
    if visible != feeder.sent:
        res.problems.append(f"{visible} messages visible after sending {feeder.sent}")
    settings = dataclasses.replace(base, queue_url=queue_url, pollers=pollers)
    config = write_config(run_dir, settings)
    dbname, dsn = await server.fresh(f"d{pollers}")
    res.extra["dsn"] = dsn
    log_path = run_dir / "daemon.log"
    monitor = await asyncpg.connect(dsn)
    sampler = None
    try:
        with log_path.open("wb") as log:
            started = time.monotonic()
            proc = await asyncio.create_subprocess_exec(
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
                stdout=subprocess.DEVNULL,
                stderr=log,
                stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
            )
            print(f"  daemon pid {proc.pid}, database {dbname}, log {log_path}", flush=True)
            watch = Watch(proc, dbname, monitor, started, server.local)
            sampler = Sampler(watch, proc.pid, moto, SERVER["label"])  # type: ignore[arg-type]
            feeding = asyncio.create_task(feeder.run())
            log_pos, tick, last_print = 0, started, started
            # (time, in flight) since every row exists and nothing is visible
            tail: tuple[float, int] | None = None
            try:
                while True:
                    await sampler.sample()
                    s = watch.samples[-1]
                    with log_path.open("rb") as fh:
                        fh.seek(log_pos)
                        chunk = fh.read()
                    chunk = chunk[: chunk.rfind(b"\n") + 1]
                    log_pos += len(chunk)
                    if res.ready_s is None and b'"daemon_ready"' in chunk:
                        res.ready_s = s.t
                    fatal = [e.decode() for e in SES_FATAL_EVENTS if b'"' + e + b'"' in chunk]
                    if fatal:
                        res.problems.append(f"{', '.join(fatal)} in the daemon log ({log_path})")
                        break
                    if proc.returncode is not None:
                        res.problems.append(f"daemon exited early with {proc.returncode}")
                        break
                    if res.ready_s is None and s.t > READY_TIMEOUT_S:
                        res.problems.append(f"no daemon_ready within {READY_TIMEOUT_S:g} s")
                        break
                    if feeding.done() and feeding.exception() is not None:
                        res.problems.append(f"the feeder failed: {feeding.exception()!r}")
                        break
                    if s.rows < res.n and feeder.done:

                        async def settled() -> int:
                            return int(await monitor.fetchval("SELECT count(*) FROM messages"))

                        async def unsettled() -> list[bytes]:
                            stored = {
                                r[0]
                                for r in await monitor.fetch(
                                    "SELECT external_id FROM message_copies"
                                )
                            }
                            return [b for b in bodies if _ses_id(b) not in stored]

                        await feeder.resend_lost(settled, unsettled)
                    # Rows first; the DeleteMessageBatch follows each batch's commit.
                    if s.rows >= res.n and feeding.done():
                        now = time.monotonic()
                        visible, in_flight = await aws.counts(queue_url)
                        if visible or (tail is not None and tail[1] != in_flight):
                            tail = None
                        if not visible and tail is None:
                            tail = (now, in_flight)
                        if tail is not None and (
                            in_flight == 0 or now - tail[0] >= LEFTOVER_GRACE_S
                        ):
                            res.wall_s = tail[0] - started
                            res.extra["left_in_flight"] = in_flight
                            break
                    if s.t > args.run_timeout_s:
                        res.problems.append(f"not done after {args.run_timeout_s:g} s")
                        break
                    if time.monotonic() - last_print >= args.print_every:
                        last_print = time.monotonic()
                        visible, in_flight = await aws.counts(queue_url)
                        _progress(s, f" queue: {visible:,} visible, {in_flight:,} in flight")
                    tick += args.interval
                    await asyncio.sleep(max(0.0, tick - time.monotonic()))
                res.extra["done_at"] = started + res.wall_s
                res.extra["resent"] = feeder.resent
                # Idle after the backlog: memory once the work is done.
                idle_until = time.monotonic() + args.idle_s
                while proc.returncode is None and time.monotonic() < idle_until:
                    await asyncio.sleep(args.interval)
                    await sampler.sample()
                res.extra["rss_idle_kb"] = watch.samples[-1].rss_tree_kb
                res.client_cpu_s = watch.client_cpu
                res.server_cpu_s = watch.server_cpu
                res.extra["monitor_cpu_s"] = watch.monitor_cpu
                res.samples = watch.samples
            finally:
                feeding.cancel()
                await asyncio.gather(feeding, return_exceptions=True)
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
        res.extra["sha"] = await _raw_shas(monitor)
    finally:
        await monitor.close()
    events = _events(log_path)
    kinds = Counter(str(e.get("event", "?")) for e in events)
    for bad in SES_BAD_EVENTS:
        if kinds.get(bad):
            res.problems.append(f"{kinds[bad]} × {bad} in the daemon log ({log_path})")
    res.extra["noted"] = {k: kinds[k] for k in SES_NOTED_EVENTS if kinds.get(k)}
    stopped = [e for e in events if e.get("event") == "ses_poller_stopped"]
    totals = {k: v for k, v in (stopped[-1] if stopped else {}).items() if isinstance(v, int)}
    res.extra["totals"] = totals
    if not stopped:
        res.problems.append("no ses_poller_stopped line in the daemon log")
    else:
        # moto's ReceiveMessage has no lock either: two concurrent receives can hand out
        # one message twice (SQS itself delivers at least once). The second copy must
        # be a `duplicate`, and be deleted too; but handing it out again makes the first
        # copy's receipt handle stale, and a stale handle's delete is not counted
        # (poller.py _finish). The message is gone either way: what is left on the
        # queue is checked on the queue itself.
        received, twice = totals.get("received", 0), totals.get("duplicate", 0)
        want = {"stored": res.n, "received": res.n + twice}
        for key, n in want.items():
            if totals.get(key, 0) != n:
                res.problems.append(f"poller {key} {totals.get(key, 0)}, expected {n}")
        deleted = totals.get("deleted", 0)
        if not received - twice <= deleted <= received:
            res.problems.append(
                f"poller deleted {deleted}, expected {received - twice}..{received}"
            )
        for key in ("dead", "unrouted", "poison", "left", "released"):
            if totals.get(key):
                res.problems.append(f"poller {key} {totals[key]}, expected 0")
    return res, sampler


def _ses_id(body: bytes) -> str:
    return str(orjson.loads(body)["sesMessageId"])


async def _raw_shas(conn: asyncpg.Connection) -> set[str]:
    return {r[0] for r in await conn.fetch("SELECT raw_sha256 FROM messages")}


# --------------------------------------------------------------------------- output


def cpu_lines(res: Result, sampler: Sampler | None) -> list[str]:
    """Where the CPU went: spawn → done, and daemon_ready → done per stored message."""
    done_at = res.extra.get("done_at")
    if sampler is None or not sampler.ticks or done_at is None or not finite_positive(res.wall_s):
        return ["  CPU: n/a (the daemon run did not finish)"]
    t0 = sampler.ticks[0].t
    cores = os.cpu_count() or 1
    lines = [
        f"  {res.label}: CPU, % of one core ({cores} cores = {100 * cores} %), and ms per "
        "stored message:"
    ]
    windows = [("spawn → done", t0, res.n)]
    if res.ready_s is not None and res.ready_s < res.wall_s:
        at_ready = next((x for x in res.samples if x.t >= res.ready_s), None)
        rows = at_ready.rows if at_ready is not None else 0
        windows.append(("daemon_ready → done", t0 + res.ready_s, res.n - rows))
    for name, start, n in windows:
        w = sampler.window(start, done_at)
        parts = [
            ("daemon main", w.daemon_main_s),
            ("parse workers", w.daemon_tree_s - w.daemon_main_s),
            ("PostgreSQL", w.server_s),
            (SERVER["label"], w.fake_s),
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


# --------------------------------------------------------------------------- main


def daemon_lines(res: Result, sampler: Sampler | None) -> list[str]:
    """The poller's totals, the RSS curve and the CPU of one daemon run."""
    totals = res.extra.get("totals", {})
    notes = []
    if totals.get("duplicate"):
        notes.append(f"{totals['duplicate']} handed out twice by moto's receive, stored once")
    for event, count in res.extra.get("noted", {}).items():
        notes.append(f"{count} × {event} in the log (moto's doing: module docstring)")
    if res.extra.get("resent"):
        notes.append(f"{res.extra['resent']} lost by moto, sent again")
    if res.extra.get("left_in_flight"):
        notes.append(
            f"{res.extra['left_in_flight']} deleted messages back in flight in moto after the "
            "run (its racy delete)"
        )
    lines = [
        f"  {res.label}: poller totals "
        + ", ".join(
            f"{k} {totals.get(k, 0):,}"
            for k in ("received", "stored", "deleted", "duplicate", "dead", "left", "released")
        )
        + "".join(f"; {n}" for n in notes),
        f"  {res.label}: RSS curve (process tree = daemon + parse workers):",
    ]
    lines += ["    " + line for line in curve_table(res)]
    return lines + cpu_lines(res, sampler)


async def main(args: argparse.Namespace) -> int:
    fake_aws_env()
    work = Path(tempfile.mkdtemp(prefix="bench_ses_"))
    moto = (
        StandIn(work / "standin.log", args.latency_ms)
        if args.aws == "standin"
        else Moto(work / "moto.log")
    )
    SERVER["label"] = moto.label
    server = FreshServer(args.dsn, args.keep, "bench_ses")
    base = SesSettings(
        queue_url="", region=REGION, endpoint_url=moto.url, wait_time_s=args.wait_time_s
    )
    print(
        f"inboxd at {code_version()}; work directory {work}; {os.cpu_count()} CPUs; "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        flush=True,
    )
    loops = [args.pollers] + ([args.more_loops] if args.more_loops else [])
    refs: list[Reference] = []
    daemons: list[tuple[Result, Sampler | None]] = []
    imported: Result | None = None
    same: dict[str, bool] = {}
    problems: list[str] = []
    try:
        print(f"{moto.what} on {moto.url} ready after {await moto.ready():.1f} s", flush=True)
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
        eml_dir = work / "eml"
        link_eml(spool, eml_dir)
        bucket = f"bench-ses-{uuid.uuid4().hex[:8]}"
        names = os.listdir(spool / "new")
        keys, bodies = pointers(names, bucket)
        async with Aws(moto.url) as aws:
            t0 = time.monotonic()
            await aws.upload(bucket, [(k, spool / "new" / name) for k, name in keys])
            print(
                f"uploaded {len(keys):,} objects to s3://{bucket} in {time.monotonic() - t0:.1f} s "
                f"(not timed); every run below gets a fresh queue and the same {len(bodies):,} "
                + (
                    f"pointers, {args.backlog} before its clock starts and the rest as the "
                    f"queue drains (kept at {args.backlog} visible)"
                    if args.backlog
                    else "pointers, all sent before its clock starts"
                ),
                flush=True,
            )
            for n_loops in loops:
                for get in (False, True):
                    ref = await run_reference(args, aws, moto, base, bodies, n_loops, get)
                    refs.append(ref)
                    print(ref.line(), flush=True)
                    for p in ref.problems:
                        print(f"    PROBLEM: {p}", flush=True)
                print(f"daemon, [ses] pollers = {n_loops} …", flush=True)
                res, sampler = await run_daemon(
                    args, aws, moto, server, work, base, bodies, n_loops
                )
                daemons.append((res, sampler))
                for line in describe(res):
                    print(line, flush=True)
        print("import …", flush=True)
        imported = await run_import(args, server, work, eml_dir, "0")
        for line in describe(imported):
            print(line, flush=True)
        conn = await asyncpg.connect(server.dsn_of(server.created[-1]))
        try:
            shas = await _raw_shas(conn)
        finally:
            await conn.close()
        same = {res.label: res.extra.get("sha") == shas for res, _ in daemons}
    except Exception as exc:  # report it below with whatever was measured
        problems.append(f"{type(exc).__name__}: {exc}")
    finally:
        moto.stop()
        await server.drop_all()
        if args.keep:
            print(f"kept work directory {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    print()
    print(f"inboxd at {code_version()} (at the end of the run)")
    print(
        f"SES door, {args.messages:,} forwarded messages (versioned pointers, objects on "
        f"the {moto.what}, a backlog of {args.backlog or 'all'}); [ses] pollers "
        f"{' and '.join(map(str, loops))}, wait_time_s {args.wait_time_s}, max_messages "
        f"{base.max_messages}; load average now {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(
        f"  {'':<42} {'msgs':>7} {'wall s':>8} {'msg/s':>8}  {'client CPU, per msg':>22}  "
        f"{moto.label + ' CPU, per msg':>22}  machine"
    )
    for ref in refs:
        print(ref.line())
        problems += [f"{moto.label} alone, {ref.name}: {p}" for p in ref.problems]
        if not ref.problems and not finite_positive(ref.rate):
            problems.append(f"{moto.label} alone, {ref.name}: no throughput")
    print(
        f"  {'':<8} {'msgs':>8} {'wall s':>9} {'msg/s':>8}  {'client CPU':>9} "
        f"{'server CPU':>9}  {'peak RSS':>8} {'main RSS':>8}   (MB)"
    )
    for res in [r for r, _ in daemons] + ([imported] if imported is not None else []):
        for line in describe(res):
            print(line)
        problems += [f"{res.label}: {p}" for p in res.problems]
        if not finite_positive(res.rate) and not res.problems:
            problems.append(f"{res.label}: no throughput ({res.rate} msg/s)")
    for res, sampler in daemons:
        for line in daemon_lines(res, sampler):
            print(line)
    for label, equal in same.items():
        print(
            f"  same raw files in the {label} and import databases (raw_sha256): "
            f"{'yes' if equal else 'NO'}"
        )
        if not equal:
            problems.append(f"the {label} and import databases hold different raw files")
    for res, _ in daemons:
        pollers = res.extra["pollers"]
        ratios = [
            f"{res.label} / {moto.label} alone {r.name} = {res.rate / r.rate:.3f}"
            for r in refs
            if r.loops == pollers
        ]
        if imported is not None:
            ratios.append(f"{res.label} / import = {res.rate / imported.rate:.3f}")
        print(f"  ratios, same run: {'; '.join(ratios)}")
        if res.ready_s is not None and finite_positive(res.wall_s - res.ready_s):
            # start-up left out on both sides: the door's queue → rows, import's own time
            warm = res.n / (res.wall_s - res.ready_s)
            ratios = [
                f"{res.label} from ready / {moto.label} alone {r.name} = {warm / r.rate:.3f}"
                for r in refs
                if r.loops == pollers and r.get
            ]
            if imported is not None and imported.command_elapsed_s:
                own = imported.n / imported.command_elapsed_s
                ratios.append(f"{res.label} from ready / import's own elapsed = {warm / own:.3f}")
            print(f"  ratios without start-up: {'; '.join(ratios)}")
        g = growth_mb(res)
        print(
            f"  {res.label}: peak RSS {res.peak_tree_mb:,.1f} MB (main {res.peak_main_mb:,.1f}); "
            f"growth 10 % → 90 % of the rows {g:+.1f} MB "
            f"({'flat' if abs(g) < FLAT_MB else 'NOT flat'})"
        )
    for p in problems:
        print(f"PROBLEM: {p}")
    return 1 if problems else 0


def cli() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=5_000)
    parser.add_argument(
        "--pollers", type=int, default=2, help="[ses] pollers, and the reference's loops"
    )
    parser.add_argument(
        "--more-loops",
        type=int,
        default=8,
        help="moto alone and the daemon again with this many loops (0: not measured)",
    )
    parser.add_argument(
        "--dsn", default=DEFAULT_DSN, help="admin DSN (creates bench_ses_* databases)"
    )
    parser.add_argument(
        "--backlog",
        type=int,
        default=None,
        help="visible messages the feeder keeps in each queue (0: send all before the clock; "
        f"default {BACKLOG} with moto, 0 with the stand-in)",
    )
    parser.add_argument(
        "--aws",
        choices=("moto", "standin"),
        default="moto",
        help="S3/SQS: moto's server, or the in-memory stand-in with --latency-ms a call",
    )
    parser.add_argument(
        "--latency-ms",
        type=float,
        default=LATENCY_MS,
        help="the stand-in's latency per request (--aws standin)",
    )
    parser.add_argument("--wait-time-s", type=int, default=WAIT_TIME_S, help="[ses] wait_time_s")
    parser.add_argument("--interval", type=float, default=0.5, help="sampling interval, s")
    parser.add_argument(
        "--idle-s", type=float, default=2.0, help="keep sampling the daemon this long after"
    )
    parser.add_argument("--print-every", type=float, default=15.0, help="progress line every … s")
    parser.add_argument("--gen-workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument(
        "--keep", action="store_true", help="keep the databases and the work directory"
    )
    parser.add_argument("--run-timeout-s", type=float, default=RUN_TIMEOUT_S)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help=f"CI size: {SMOKE_MESSAGES} messages, more loops {SMOKE_MORE_LOOPS}; "
        "exit 1 on any problem",
    )
    args = parser.parse_args()
    args.import_args = ""  # daemon_backfill.run_import's options
    if args.backlog is None:
        args.backlog = 0 if args.aws == "standin" else BACKLOG
    if args.smoke:
        args.messages, args.more_loops = SMOKE_MESSAGES, SMOKE_MORE_LOOPS
        args.interval, args.idle_s = SMOKE_INTERVAL_S, SMOKE_IDLE_S
        args.run_timeout_s = min(args.run_timeout_s, SMOKE_RUN_TIMEOUT_S)
    return asyncio.run(main(args))


if __name__ == "__main__":
    sys.exit(cli())
