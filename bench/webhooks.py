#!/usr/bin/env python3
"""Delivery-event webhooks: verified + durably persisted events per second, and latency.

    .venv/bin/python bench/webhooks.py [--duration S] [--connections C]
        [--batch B] [--dsn ADMIN_DSN] [--only sw,sg] [--keep] [--load wrk|python|auto]
        [--smoke]

One run, one PostgreSQL server. A server process (this file, `_serve`) runs the
daemon's real listener (`daemon/http/server.py` + `daemon/webhooks/esp.py`) with
two sources of one tenant; a second process, wrk (Debian package `wrk`, C, one
thread), loads it over loopback with pre-signed requests — every request a new
event, so nothing is deduplicated away. Per scenario, two runs of the same
server code back to back:

  verify-only  the route with every check and the signature verification, but
               an intake that answers at once (no database): the ceiling of the
               HTTP + verification path in Python on this machine
  persisted    the real DeliveryIntake: group-committed INSERT … ON CONFLICT DO
               NOTHING, each request answered only after its COMMIT (fsync on)

Scenarios: `sw` Standard Webhooks (Resend shape), one event per request, HMAC;
`sg` SendGrid, `--batch` events per request, ECDSA P-256. The event workers do
not run (they apply events after the answer and are not part of this path).

Reported: requests/s and events/s from wrk's count and duration, events/s also
from the rows really committed (persisted runs), p50/p99 latency from wrk's
HdrHistogram, and non-2xx answers (must be 0: any, or events answered but not
committed, make the exit status 1). Ratios persisted/verify-only sit beside the
absolute figures because the machine is shared and noisy. Without wrk,
`--load python` (and `--smoke`, which picks it when wrk is missing) loads the
server with an aiohttp client: it checks the path, its rates are not figures.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import anyio
import asyncpg
import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TENANT = "bench"
SW_KEY = b"bench-standard-webhooks-key-0001"
LUA = Path(__file__).with_name("webhooks.lua")
#: Requests generated per run: more than wrk sends in --duration at 25k req/s,
#: so no request repeats (a repeat would be a cheap duplicate).
REQUESTS_PER_S_HEADROOM = 25_000
#: The same for the Python load generator, which tops out far lower.
PYTHON_LOAD_HEADROOM_REQ_S = 5_000
REQUEST_TIMEOUT_S = 10
SERVER_STOP_TIMEOUT_S = 30
#: --smoke (CI): every scenario and path at a size that takes ~15 s in all.
SMOKE_DURATION_S = 2
SMOKE_CONNECTIONS = 4
SMOKE_BATCH = 5


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """utime + stime of each of `pids` still alive, from /proc (Linux), in seconds."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def cpu_used(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two samples by the processes alive at the second."""
    return sum(spent - before.get(pid, 0.0) for pid, spent in after.items())


def postgres_pids() -> list[int]:
    """Every local postgres process (backends come and go; sampled per run)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() in ("postgres", "postmaster"):
                    out.append(int(entry.name))
            except OSError:
                continue
    return out


@dataclass
class Result:
    scenario: str
    mode: str
    requests: int
    seconds: float
    non_2xx: int
    p50_ms: float
    p99_ms: float
    events_per_request: int
    rows: int | None = None
    server_cpu_s: float = 0.0
    postgres_cpu_s: float = 0.0
    errors: int = 0
    first_failure: str = ""
    server_exit: int | None = 0

    @property
    def req_s(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    @property
    def events_s(self) -> float:
        return self.req_s * self.events_per_request

    @property
    def rows_s(self) -> float | None:
        return None if self.rows is None or self.seconds <= 0 else self.rows / self.seconds


# --- request generation ------------------------------------------------------------------


def standard_requests(n: int) -> list[tuple[dict[str, str], bytes]]:
    now = str(int(time.time()))
    out = []
    for i in range(n):
        body = orjson.dumps(
            {
                "type": "email.delivered",
                "created_at": "2026-11-30T09:00:00.000Z",
                "data": {
                    "email_id": f"em_{i}",
                    "to": [f"user{i % 5000}@example.com"],
                    "subject": "Your invoice",
                    "created_at": "2026-11-30T08:59:00.000Z",
                },
            }
        )
        msg_id = f"msg_{secrets.token_hex(8)}"
        mac = hmac.new(SW_KEY, f"{msg_id}.{now}.".encode() + body, hashlib.sha256).digest()
        out.append(
            (
                {
                    "webhook-id": msg_id,
                    "webhook-timestamp": now,
                    "webhook-signature": "v1," + base64.b64encode(mac).decode(),
                    "Content-Type": "application/json",
                },
                body,
            )
        )
    return out


def sendgrid_requests(n: int, batch: int, private_key) -> list[tuple[dict[str, str], bytes]]:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    now = str(int(time.time()))
    out = []
    for i in range(n):
        events = [
            {
                "email": f"user{(i * batch + j) % 5000}@example.com",
                "timestamp": int(time.time()),
                "event": "delivered",
                "sg_event_id": secrets.token_hex(11),
                "sg_message_id": f"{secrets.token_hex(11)}.filter0001.1.0",
                "smtp-id": f"<m{i}.{j}@app.example>",
                "response": "250 OK",
            }
            for j in range(batch)
        ]
        body = orjson.dumps(events)
        signature = private_key.sign(now.encode() + body, ec.ECDSA(hashes.SHA256()))
        out.append(
            (
                {
                    "X-Twilio-Email-Event-Webhook-Signature": base64.b64encode(signature).decode(),
                    "X-Twilio-Email-Event-Webhook-Timestamp": now,
                    "Content-Type": "application/json",
                },
                body,
            )
        )
    return out


def write_requests(path: Path, requests: list[tuple[dict[str, str], bytes]]) -> None:
    """One request per line: headers joined by \\x01, \\x02, the body (see webhooks.lua)."""
    with path.open("wb") as fh:
        for headers, body in requests:
            fh.write("\x01".join(f"{k}: {v}" for k, v in headers.items()).encode())
            fh.write(b"\x02" + body + b"\n")


# --- server process ------------------------------------------------------------------------


async def serve(args: argparse.Namespace) -> None:
    """`_serve`: the daemon's listener with the two bench sources, until stdin closes."""
    from inboxd.adapters.esp.registry import build_esp_receiver
    from inboxd.adapters.webhook_budgets import RateLimiter
    from inboxd.daemon.commands.run import tune_gc
    from inboxd.daemon.http import HttpState, TokenTable, serve_http
    from inboxd.daemon.logging import configure_logging
    from inboxd.daemon.metrics.registry import Metrics
    from inboxd.daemon.webhooks import Webhooks
    from inboxd.daemon.webhooks.esp import DeliveryHook, EspHooks, HookTable
    from inboxd.pipeline.delivery.intake import DeliveryIntake, SourcePolicy
    from inboxd.pipeline.objectstore.local import LocalDirectoryStore

    configure_logging(True, level="warning", final=True)  # as `inboxd run` does

    def source(source_id: str, table: dict) -> DeliveryHook:
        adapter = build_esp_receiver(source_id, {"id": source_id, **table}, str)
        return DeliveryHook(
            tenant_id=TENANT,
            source_id=source_id,
            receiver=adapter,
            policy=SourcePolicy(adapter.default_payload_fields),
            limiter=RateLimiter(1e9, 1e9),
        )

    table = HookTable(
        {
            (TENANT, "sw"): source(
                "sw", {"provider": "resend", "secret": "whsec_" + base64.b64encode(SW_KEY).decode()}
            ),
            (TENANT, "sg"): source("sg", {"provider": "sendgrid", "public_key": args.public_key}),
        }
    )
    pool = await asyncpg.create_pool(args.dsn, min_size=4, max_size=8)
    intake = (
        DeliveryIntake(pool, writers=args.writers)
        if args.mode == "persisted"
        else verify_only_intake(pool, args.writers)
    )

    async def ready() -> bool:
        return True

    state = HttpState(
        pool=pool,
        dsn=args.dsn,
        store=LocalDirectoryStore(Path(args.tmp)),
        metrics=Metrics(),
        tenant_for_token=TokenTable({}),
        ready=ready,
        webhooks=Webhooks(EspHooks(table, intake, _no_confirm)),
    )
    if not args.default_gc:
        tune_gc()  # as `inboxd run` does
    async with anyio.create_task_group() as tg:
        await tg.start(intake.run)
        port = await tg.start(serve_http, "127.0.0.1", 0, state)
        print(f"ready {port}", flush=True)
        await anyio.to_thread.run_sync(sys.stdin.read)  # the parent closes stdin to stop us
        tg.cancel_scope.cancel()
    await pool.close()


def verify_only_intake(pool: asyncpg.Pool, writers: int):
    """The real DeliveryIntake whose submit() answers at once: nothing is stored.

    It subclasses the real intake and checks every call against the real
    submit()'s signature, so a parameter added there (as `replay_scope` was)
    fails or passes here exactly as it does there, instead of every request
    answering 500 from a hand-copied parameter list. Its writers start with
    `run` and stay idle.
    """
    import inspect

    from inboxd.pipeline.delivery.intake import DeliveryIntake, Stored

    signature = inspect.signature(DeliveryIntake.submit)
    events_at = list(signature.parameters).index("events")  # counting `self`
    # Binding the signature on every request costs ~6 µs, about 7 % of this path;
    # the route calls with one shape, so each shape is bound once.
    events_by_name: dict[tuple[int, tuple[str, ...]], bool] = {}

    class VerifyOnly(DeliveryIntake):
        async def submit(self, *args, **kwargs) -> Stored:  # type: ignore[override]
            shape = (len(args), tuple(kwargs))
            if shape not in events_by_name:
                signature.bind(self, *args, **kwargs)  # TypeError as the real one raises
                events_by_name[shape] = "events" in kwargs
            events = kwargs["events"] if events_by_name[shape] else args[events_at - 1]
            return Stored(len(events), 0)

    return VerifyOnly(pool, writers=writers)


async def _no_confirm(_url: str) -> None:
    raise RuntimeError("no subscription confirmations in the bench")


# --- driver --------------------------------------------------------------------------------

_LATENCY = re.compile(r"^\s+(50|99)(?:\.0+)?%\s+([\d.]+)(us|ms|s)\s*$", re.M)
_UNITS_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0}


@dataclass
class Load:
    """What one load generator saw during one run."""

    requests: int
    seconds: float
    non_2xx: int
    p50_ms: float
    p99_ms: float
    errors: int = 0  # connection errors and timeouts: requests without an answer
    first_failure: str = ""  # the first non-2xx answer or error, to say what went wrong


def run_wrk(port: int, source: str, requests_file: Path, args: argparse.Namespace) -> Load:
    env = {**os.environ, "BENCH_REQUESTS": str(requests_file)}
    connections = args.connections if source == "sw" else args.sg_connections
    out = subprocess.run(
        [
            "wrk",
            "-t1",
            f"-c{connections}",
            f"-d{args.duration}s",
            "--latency",
            "--timeout",
            f"{REQUEST_TIMEOUT_S}s",
            "-s",
            str(LUA),
            f"http://127.0.0.1:{port}/hooks/esp/{TENANT}/{source}",
        ],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    match = re.search(r"(\d+) requests in ([\d.]+)(s|m)", out)
    if match is None:
        raise RuntimeError(f"unexpected wrk output:\n{out}")
    requests = int(match.group(1))
    seconds = float(match.group(2)) * (60 if match.group(3) == "m" else 1)
    non_2xx = int(m.group(1)) if (m := re.search(r"Non-2xx or 3xx responses: (\d+)", out)) else 0
    errors = re.search(r"Socket errors: .*", out)
    socket_errors = 0
    if errors:
        print("   wrk:", errors.group(0))
        socket_errors = sum(int(x) for x in re.findall(r"\d+", errors.group(0)))
    lat = {p: float(v) * _UNITS_MS[u] for p, v, u in _LATENCY.findall(out)}
    if "99" not in lat:
        raise RuntimeError(f"no latency distribution in wrk output:\n{out}")
    return Load(
        requests,
        seconds,
        non_2xx,
        lat["50"],
        lat["99"],
        socket_errors,
        errors.group(0) if errors else "wrk does not show the answers",
    )


async def run_python_load(
    port: int, source: str, requests: list[tuple[dict[str, str], bytes]], args
) -> Load:
    """wrk's job in aiohttp, for machines without wrk: closed loop, one request in flight
    per connection, each pre-signed request sent once. It shares this process's one
    core with nothing else, but it is much slower than wrk: its figures say that the
    path works, not how fast it is."""
    import aiohttp

    connections = args.connections if source == "sw" else args.sg_connections
    url = f"http://127.0.0.1:{port}/hooks/esp/{TENANT}/{source}"
    latencies: list[float] = []
    state = {"next": 0, "non_2xx": 0, "errors": 0, "first_failure": ""}
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    started = time.perf_counter()
    deadline = started + args.duration

    async def connection(session: aiohttp.ClientSession) -> None:
        while time.perf_counter() < deadline and state["next"] < len(requests):
            headers, body = requests[state["next"]]
            state["next"] += 1
            sent = time.perf_counter()
            try:
                async with session.post(url, data=body, headers=headers) as answer:
                    text = await answer.text()
                    status = answer.status
            except (aiohttp.ClientError, TimeoutError) as exc:
                state["errors"] += 1
                state["first_failure"] = state["first_failure"] or repr(exc)
                continue
            latencies.append((time.perf_counter() - sent) * 1000)
            if not 200 <= status < 300:
                state["non_2xx"] += 1
                state["first_failure"] = state["first_failure"] or f"{status} {text[:200]}"

    connector = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async with anyio.create_task_group() as tg:
            for _ in range(connections):
                tg.start_soon(connection, session)
    seconds = time.perf_counter() - started
    latencies.sort()

    def percentile(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else 0.0

    return Load(
        len(latencies),
        seconds,
        state["non_2xx"],
        percentile(0.50),
        percentile(0.99),
        state["errors"],
        state["first_failure"],
    )


async def fresh_database(admin_dsn: str, name: str) -> str:
    from urllib.parse import urlsplit, urlunsplit

    from inboxd.pipeline.schema import apply_schema
    from inboxd.pipeline.tenancy import ensure_tenants

    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    dsn = urlunsplit(urlsplit(admin_dsn)._replace(path="/" + name))
    conn = await asyncpg.connect(dsn)
    try:
        await apply_schema(conn)
        await ensure_tenants(conn, [TENANT])
    finally:
        await conn.close()
    return dsn


async def count_rows(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval("SELECT count(*) FROM delivery_events")
    finally:
        await conn.close()


async def drop_database(admin_dsn: str, name: str) -> None:
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


async def one_run(
    args,
    admin_dsn: str,
    scenario: str,
    mode: str,
    tmp: Path,
    public_key: str,
    requests: list[tuple[dict[str, str], bytes]],
    per_request: int,
) -> Result:
    name = f"bench_webhooks_{os.getpid()}_{scenario}_{mode}"
    try:
        dsn = await fresh_database(admin_dsn, name)
        return await _measure(args, dsn, scenario, mode, tmp, public_key, requests, per_request)
    finally:
        if not args.keep:
            await drop_database(admin_dsn, name)


async def _measure(args, dsn, scenario, mode, tmp, public_key, requests, per_request) -> Result:
    requests_file = tmp / f"{scenario}.requests"
    if args.load == "wrk":
        write_requests(requests_file, requests)
    command = [
        sys.executable,
        __file__,
        "_serve",
        "--mode",
        mode,
        "--dsn",
        dsn,
        "--tmp",
        str(tmp),
        "--public-key",
        public_key,
    ]
    if args.uvloop:
        command.append("--uvloop")
    if args.default_gc:
        command.append("--default-gc")
    command += ["--writers", str(args.writers)]
    if args.profile:
        # py-spy (pip install py-spy): collapsed stacks of the server, one file per run
        command = [
            "py-spy",
            "record",
            "--format",
            "raw",
            "--rate",
            "250",
            "-o",
            f"{args.profile}/{scenario}-{mode}.txt",
            "--",
            *command,
        ]
    # A plain Popen: the driver does nothing else while a run is on.
    server = subprocess.Popen(  # noqa: ASYNC220
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        line = server.stdout.readline()
        while line and not line.startswith("ready "):  # py-spy's own lines come first
            line = server.stdout.readline()
        if not line.startswith("ready "):
            raise RuntimeError(f"server did not start: {line!r}")
        port = int(line.split()[1])
        cpu_before = (cpu_seconds([server.pid]), cpu_seconds(postgres_pids()))
        if args.load == "wrk":
            load = await anyio.to_thread.run_sync(run_wrk, port, scenario, requests_file, args)
        else:
            load = await run_python_load(port, scenario, requests, args)
        server_cpu = cpu_used(cpu_before[0], cpu_seconds([server.pid]))
        postgres_cpu = cpu_used(cpu_before[1], cpu_seconds(postgres_pids()))
    finally:
        server.stdin.close()
        server.wait(timeout=SERVER_STOP_TIMEOUT_S)
    rows = await count_rows(dsn) if mode == "persisted" else None
    return Result(
        scenario,
        mode,
        load.requests,
        load.seconds,
        load.non_2xx,
        load.p50_ms,
        load.p99_ms,
        per_request,
        rows,
        server_cpu / load.seconds,
        postgres_cpu / load.seconds,
        errors=load.errors,
        first_failure=load.first_failure,
        server_exit=server.returncode,
    )


def problems_of(r: Result, load: str) -> list[str]:
    """Why the figures of one run are not figures: failed requests, nothing measured,
    or answered events that were not committed."""
    out = []
    if r.requests == 0 or r.seconds <= 0:
        out.append("no request answered")
    if r.non_2xx:
        out.append(f"{r.non_2xx} non-2xx answers (first: {r.first_failure})")
    if r.errors:
        out.append(f"{r.errors} requests without an answer (first: {r.first_failure})")
    if r.server_exit != 0:
        out.append(f"server exited with {r.server_exit}")
    if r.rows is not None:
        answered = (r.requests - r.non_2xx) * r.events_per_request
        # wrk stops counting with requests still in flight, which commit afterwards;
        # the Python generator waits for every answer, so its count is exact.
        if r.rows < answered or (load == "python" and r.rows != answered):
            out.append(f"{r.rows} rows committed for {answered} events answered 2xx")
    return out


async def drive(args: argparse.Namespace) -> int:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    if args.load == "auto":
        args.load = "wrk" if shutil.which("wrk") else "python"
        if args.load == "python":
            print("load generator: Python/aiohttp (wrk is not on PATH; the wrk path is skipped)")
    if args.load == "wrk" and shutil.which("wrk") is None:
        sys.exit("wrk not found: apt-get install wrk (or --load python)")
    private_key = ec.generate_private_key(ec.SECP256R1())
    public_key = base64.b64encode(
        private_key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    ).decode()
    results: list[Result] = []
    failures: list[str] = []
    headroom = REQUESTS_PER_S_HEADROOM if args.load == "wrk" else PYTHON_LOAD_HEADROOM_REQ_S
    with tempfile.TemporaryDirectory(prefix="bench-webhooks-") as tmp_name:
        tmp = Path(tmp_name)
        n = int(headroom * args.duration * 1.2)
        for scenario in args.only.split(","):
            per_request = 1 if scenario == "sw" else args.batch
            for mode in ("verify-only", "persisted"):
                # Fresh signatures per run: their timestamps must be within 5 minutes.
                generated = (
                    standard_requests(n)
                    if scenario == "sw"
                    else sendgrid_requests(max(1, n // per_request), per_request, private_key)
                )
                result = await one_run(
                    args, args.dsn, scenario, mode, tmp, public_key, generated, per_request
                )
                results.append(result)
                print(
                    f"  {scenario:3} {mode:12} {result.req_s:9,.0f} req/s "
                    f"{result.events_s:9,.0f} events/s  p50 {result.p50_ms:6.2f} ms  "
                    f"p99 {result.p99_ms:6.2f} ms  non-2xx {result.non_2xx}"
                    + (
                        f"  rows {result.rows:,} = {result.rows_s:,.0f}/s"
                        if result.rows is not None
                        else ""
                    )
                    + f"  cpu server {result.server_cpu_s:.2f} postgres "
                    f"{result.postgres_cpu_s:.2f}",
                    flush=True,
                )
                failures += [f"{scenario} {mode}: {p}" for p in problems_of(result, args.load)]
    print_table(results, args)
    if failures:
        print("\nFAILED: these figures are not measurements:", file=sys.stderr)
        for failure in failures:
            print(f"  {failure}", file=sys.stderr)
        return 1
    return 0


def print_table(results: list[Result], args: argparse.Namespace) -> None:
    generator = (
        f"wrk -t1 -c{args.connections} (sw) / -c{args.sg_connections} (sg)"
        if args.load == "wrk"
        else f"Python/aiohttp -c{args.connections} (sw) / -c{args.sg_connections} (sg)"
    )
    print(
        f"\n{generator} -d{args.duration}s, sg batches of {args.batch}, loopback, "
        f"{os.cpu_count()} cores, PostgreSQL synchronous_commit as configured\n"
    )
    print(
        "| scenario | path | requests/s | events/s | committed rows/s | p50 ms | p99 ms "
        "| non-2xx | server CPU (cores) | PostgreSQL CPU (cores) | persisted / verify-only |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    by_key = {(r.scenario, r.mode): r for r in results}
    for r in results:
        base = by_key.get((r.scenario, "verify-only"))
        ratio = (
            f"{r.events_s / base.events_s:.2f}"
            if r.mode == "persisted" and base and base.events_s
            else ""
        )
        rows = f"{r.rows_s:,.0f}" if r.rows_s is not None else ""
        print(
            f"| {r.scenario} | {r.mode} | {r.req_s:,.0f} | {r.events_s:,.0f} | {rows} "
            f"| {r.p50_ms:.2f} | {r.p99_ms:.2f} | {r.non_2xx} | {r.server_cpu_s:.2f} "
            f"| {r.postgres_cpu_s:.2f} | {ratio} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    serve_parser = sub.add_parser("_serve")
    serve_parser.add_argument("--mode", choices=["verify-only", "persisted"], required=True)
    serve_parser.add_argument("--dsn", required=True)
    serve_parser.add_argument("--tmp", required=True)
    serve_parser.add_argument("--public-key", required=True)
    serve_parser.add_argument("--uvloop", action="store_true")
    serve_parser.add_argument("--default-gc", action="store_true")
    serve_parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--duration", type=int, default=10, help="seconds per run")
    parser.add_argument(
        "--connections",
        type=int,
        default=32,
        help="concurrent connections for sw (one event per request)",
    )
    parser.add_argument(
        "--sg-connections", type=int, default=8, help="concurrent connections for sg (batches)"
    )
    parser.add_argument("--batch", type=int, default=25, help="events per SendGrid request")
    parser.add_argument("--only", default="sw,sg", help="scenarios: sw, sg")
    parser.add_argument(
        "--dsn",
        default="postgresql://postgres@127.0.0.1:5432/postgres",
        help="admin DSN; bench databases are created and dropped",
    )
    parser.add_argument("--keep", action="store_true", help="keep the bench databases")
    parser.add_argument("--uvloop", action="store_true", help="serve on uvloop")
    parser.add_argument(
        "--writers", type=int, default=2, help="DeliveryIntake writers of the persisted server"
    )
    parser.add_argument(
        "--default-gc",
        action="store_true",
        help="keep Python's default collector settings (no tune_gc)",
    )
    parser.add_argument(
        "--profile", metavar="DIR", help="record the server with py-spy into DIR (slower runs)"
    )
    parser.add_argument(
        "--load",
        choices=["wrk", "python", "auto"],
        default="wrk",
        help="load generator: wrk (the recorded figures), python (aiohttp, far slower: "
        "checks the path, does not measure it), auto (wrk when on PATH)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help=f"CI size: {SMOKE_DURATION_S} s runs, few connections, small batches, "
        "--load auto; exit 1 when any request failed",
    )
    args = parser.parse_args()
    if args.command == "_serve":
        anyio.run(serve, args, backend_options={"use_uvloop": args.uvloop})
        return 0
    if args.smoke:
        args.duration = SMOKE_DURATION_S
        args.connections = SMOKE_CONNECTIONS
        args.sg_connections = SMOKE_CONNECTIONS
        args.batch = SMOKE_BATCH
        args.load = "auto"
    return anyio.run(drive, args)


if __name__ == "__main__":
    sys.exit(main())
