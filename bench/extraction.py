#!/usr/bin/env python3
"""The extraction stage (issue 14): builtin extractions/s beside the ingest cascade's
new-mail rate, a re-run that is all linked, and the http backend against an endpoint
that answers in 50 ms.

    .venv/bin/python bench/extraction.py [--messages N] [--http-messages M]
        [--concurrency C] [--latency-ms L] [--dsn ADMIN_DSN] [--smoke]

Data (generated and parsed once, not timed): bench/daemon_backfill.py's N messages
of 1-8 KB. On a fresh database, in one run:

  (a) ingest  N pre-parsed new messages through IngestStage, pages of 500 on two
              workers (the daemon's defaults), small objects in PostgreSQL, each
              tenant with a processor, so ingest also hands the rows to extraction
              (extraction_inbox): the cascade's new-mail rate;
  (b) extract the ExtractionStage of `inboxd run` with a builtin processor (four
              rules) until every job is completed: feeder, claims, raw bytes read
              back (a header rule reads them; no rule reads attachment bytes, so
              nothing is parsed again), rules, schema, fenced commits with events.
              Target: (b) ÷ (a) ≥ 0.50;
  (c) re-run  the same N messages queued again (`inboxd extract backfill`'s
              batches): all linked, nothing extracted. Target ≥ 20,000 msg/s;
  (d) http    M more messages through an http processor (concurrency C) whose
              endpoint, in a process of its own, answers after L ms: throughput
              from the first call to the last commit ÷ (C / L). Target 1 ± 0.10.
  (d0)        baseline: the same M requests from a bare aiohttp client, C at once.

Ratios are printed because the machine is shared. The database is named
bench_extraction_<pid> and dropped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import asyncpg
import orjson
from aiohttp import web
from daemon_backfill import generate  # bench/ is sys.path[0]

from inboxd.adapters.extraction import matches_fields, parse_processor
from inboxd.daemon.commands.extract_backfill import BACKFILL_BATCH_SIZE
from inboxd.daemon.config.tenant import TenantConfig
from inboxd.daemon.extraction.stage import ExtractionStage
from inboxd.daemon.metrics.registry import Metrics
from inboxd.pipeline.extraction.backfill import BackfillScope, backfill_batch
from inboxd.pipeline.extraction.inbox import HandOff
from inboxd.pipeline.ingest.stage import IngestBatch, IngestStage
from inboxd.pipeline.message import MessageData
from inboxd.pipeline.mime.workers import parse_in_workers
from inboxd.pipeline.objectstore.database_tier import DEFAULT_MAX_BYTES, DatabaseTierStore
from inboxd.pipeline.objectstore.local import LocalDirectoryStore
from inboxd.pipeline.schema import apply_schema
from inboxd.pipeline.tenancy import ensure_mailbox

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
TENANT = "t"
MAILBOX = "m"
HTTP_MAILBOX = "h"
PAGE = 500  # the daemon's [workers] batch_size default
INGEST_WORKERS = 2  # the daemon's [workers] ingest default
BACKFILL_BATCH = BACKFILL_BATCH_SIZE  # `inboxd extract backfill`'s batches
TARGET_B_OVER_A = 0.50
TARGET_C = 20_000.0
TARGET_D_TOLERANCE = 0.10
SMOKE_MESSAGES = 300
SMOKE_HTTP_MESSAGES = 60
WAIT_POLL_S = 0.05
WAIT_TIMEOUT_S = 1800.0
SCHEMA = {
    "type": "object",
    "properties": {
        "subject_word": {"type": "string"},
        "sender_domain": {"type": "string"},
        "attachments": {"type": "integer"},
        "recipients": {"type": "array", "items": {"type": "string"}},
        "message_id": {"type": "string"},
    },
    "required": ["attachments"],
}
RULES = {
    "subject_word": {"regex": r"(?P<value>\w{4,})", "in": "subject"},
    "sender_domain": {"address": "from.domain"},
    "attachments": {"attachment": "count"},
    "recipients": {"address": "to.emails"},
    "message_id": {"header": "Message-ID"},  # a header rule: the raw bytes are read
}

PROBLEMS: list[str] = []


def processors(http_url: str | None, concurrency: int, base: Path) -> list[Any]:
    out = [
        parse_processor(
            {
                "id": "rules",
                "backend": "builtin",
                "mailboxes": [MAILBOX],
                "schema": SCHEMA,
                "schema_version": 1,
                "rules": RULES,
            },
            base,
        )
    ]
    if http_url is not None:
        out.append(
            parse_processor(
                {
                    "id": "api",
                    "backend": "http",
                    "mailboxes": [HTTP_MAILBOX],
                    "url": http_url,
                    "token": "env:BENCH_PARSE_TOKEN",
                    "schema": {"type": "object"},
                    "schema_version": 1,
                    "concurrency": concurrency,
                },
                base,
            )
        )
    return out


class SlowEndpoint:
    """A parse API answering `{"ok": true}` after `latency_s`, in a process of its own
    (in a thread of this one it shared the GIL with the stage it measures)."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        context = multiprocessing.get_context("spawn")
        self._calls = context.Value("i", 0)
        self._first_call = context.Value("d", 0.0)  # time.time() of the first request
        self._port = context.Value("i", 0)
        self._stop = context.Event()
        self._process = context.Process(
            target=serve_slowly,
            args=(latency_s, self._calls, self._first_call, self._port, self._stop),
            daemon=True,
        )
        self.url = ""

    def __enter__(self) -> SlowEndpoint:
        self._process.start()
        deadline = time.monotonic() + 60
        while not self._port.value:
            if time.monotonic() > deadline or not self._process.is_alive():
                raise SystemExit("the slow endpoint did not start")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self._port.value}/parse"
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()

    def reset(self) -> None:
        with self._calls.get_lock():
            self._calls.value = 0
            self._first_call.value = 0.0

    @property
    def calls(self) -> int:
        return int(self._calls.value)

    @property
    def first_call(self) -> float | None:
        """The first request's time.time(), None before it."""
        return float(self._first_call.value) or None


def serve_slowly(latency_s: float, calls: Any, first_call: Any, port: Any, stop: Any) -> None:
    """SlowEndpoint's process: an aiohttp server on 127.0.0.1 until `stop` is set."""

    async def parse(request: web.Request) -> web.Response:
        await request.read()
        with calls.get_lock():
            if not calls.value:
                first_call.value = time.time()
            calls.value += 1
        await asyncio.sleep(latency_s)
        return web.Response(body=b'{"ok": true}', content_type="application/json")

    async def serve() -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/parse", parse)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port.value = runner.addresses[0][1]
        # a multiprocessing.Event has no awaitable form
        while not stop.is_set():  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        await runner.cleanup()

    asyncio.run(serve())


async def bare_posts(url: str, raws: list[bytes], concurrency: int) -> float:
    """Seconds for a bare aiohttp client to POST each raw message as the http backend
    would (base64 JSON, bearer token), `concurrency` at once: the transport's cost,
    the baseline of (d)."""
    bodies = [
        orjson.dumps({"raw_mime": base64.b64encode(raw).decode(), "schema": {"type": "object"}})
        for raw in raws
    ]
    headers = {"Content-Type": "application/json", "Authorization": "Bearer bench"}
    pending = iter(bodies)
    async with aiohttp.ClientSession() as session:

        async def client() -> None:
            for body in pending:
                async with session.post(url, data=body, headers=headers) as response:
                    orjson.loads(await response.read())

        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(concurrency):
                tg.start_soon(client)
        return time.perf_counter() - started


async def parse_all(raws: list[bytes], mailbox: str) -> list[MessageData]:
    items = await parse_in_workers(raws, TENANT, mailbox, "maildir")
    out = [i for i in items if isinstance(i, MessageData)]
    if len(out) != len(raws):
        PROBLEMS.append(f"{len(raws) - len(out)} generated messages did not parse")
    for i, item in enumerate(out):
        item.external_id = f"{mailbox}-{i}"
    return out


async def ingest(stage: IngestStage, items: list[MessageData], mailbox: str) -> float:
    pages = [items[i : i + PAGE] for i in range(0, len(items), PAGE)]
    queue = iter(pages)
    new = 0

    async def worker() -> None:
        nonlocal new
        for page in queue:
            results = await stage.ingest(IngestBatch(TENANT, mailbox, page))
            new += sum(r.outcome.value == "new" for r in results)

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(INGEST_WORKERS):
            tg.start_soon(worker)
    elapsed = time.perf_counter() - started
    if new != len(items):
        PROBLEMS.append(f"ingest of {mailbox}: {new} new of {len(items)}")
    return elapsed


async def wait_completed(pool: asyncpg.Pool, processor: str, n: int) -> float:
    """Seconds until `n` jobs of `processor` are completed (or fail the run)."""
    started = time.perf_counter()
    while True:
        row = await pool.fetchrow(
            "SELECT count(*) FILTER (WHERE state = 'completed') AS done, "
            "count(*) FILTER (WHERE state = 'needs_review') AS review "
            "FROM extraction_jobs WHERE processor_id = $1",
            processor,
        )
        if row["done"] + row["review"] >= n:
            if row["review"]:
                PROBLEMS.append(f"{processor}: {row['review']} jobs in needs_review")
            return time.perf_counter() - started
        if time.perf_counter() - started > WAIT_TIMEOUT_S:
            PROBLEMS.append(f"{processor}: {row['done']} of {n} completed before the deadline")
            return time.perf_counter() - started
        await anyio.sleep(WAIT_POLL_S)


async def rerun(pool: asyncpg.Pool, config: Any) -> tuple[float, int]:
    scope = BackfillScope(TENANT, config.id, str(config.schema_version), MAILBOX)
    linked = 0
    after = 0
    started = time.perf_counter()
    while True:
        report = await backfill_batch(
            pool, scope, after, BACKFILL_BATCH, lambda f: matches_fields(config, f)
        )
        if report.examined == 0:
            break
        linked += report.linked
        if report.queued or report.conflicts:
            PROBLEMS.append(f"re-run queued {report.queued}, conflicts {report.conflicts}")
        after = report.last_message_id or after
    return time.perf_counter() - started, linked


def row(label: str, n: int, seconds: float) -> None:
    print(f"  {label:<50} {n:>7,} {seconds:>7.2f} {n / seconds:>9,.1f}")


def verdict(good: bool) -> str:
    return "ok" if good else "MISSED"


async def main(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="bench_extraction_"))
    name = f"bench_extraction_{os.getpid()}"
    admin = await asyncpg.connect(args.dsn)
    os.environ.setdefault("BENCH_PARSE_TOKEN", "bench-token")
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        dsn = args.dsn.rsplit("/", 1)[0] + "/" + name
        total = args.messages + args.http_messages
        t0 = time.perf_counter()
        generate(work / "spool", total, args.seed, 2)
        names = sorted(os.listdir(work / "spool" / "new"))
        raws = [(work / "spool" / "new" / n).read_bytes() for n in names]
        builtin_items = await parse_all(raws[: args.messages], MAILBOX)
        http_items = await parse_all(raws[args.messages :], HTTP_MAILBOX)
        print(
            f"generated and parsed {total:,} messages ({time.perf_counter() - t0:.1f} s, not timed)"
        )

        pool = await asyncpg.create_pool(dsn, min_size=2, max_size=10)
        async with pool.acquire() as conn:
            await apply_schema(conn)
            for mailbox in (MAILBOX, HTTP_MAILBOX):
                await ensure_mailbox(conn, TENANT, mailbox, provider="maildir")
        store = DatabaseTierStore(
            pool, LocalDirectoryStore(str(work / "objects")), max_bytes=DEFAULT_MAX_BYTES
        )
        with SlowEndpoint(args.latency_ms / 1000) as endpoint:
            configs = processors(endpoint.url, args.concurrency, work)
            tenants = {
                TENANT: TenantConfig(TENANT, "Bench", work / "t.toml", processors=tuple(configs))
            }
            # (d0) the transport alone, before anything else loads the machine
            bare_s = await bare_posts(endpoint.url, raws[args.messages :], args.concurrency)
            endpoint.reset()
            # (a) ingest, with the hand-off a daemon with processors makes
            stage = IngestStage(pool, store, extraction=HandOff(wants=lambda t: True))
            ingest_s = await ingest(stage, builtin_items, MAILBOX)
            await admin.execute("CHECKPOINT")
            # (b) extraction of everything (a) handed over
            extraction = ExtractionStage(
                pool, store, tenants, owner="bench", lease_s=60.0, metrics=Metrics()
            )
            async with anyio.create_task_group() as tg:
                await tg.start(extraction.run)
                extract_s = await wait_completed(pool, "rules", len(builtin_items))
                # (d) http: ingest M more (not timed), then wait for the endpoint's work
                started = time.time()
                await ingest(
                    IngestStage(pool, store, extraction=extraction.handoff),
                    http_items,
                    HTTP_MAILBOX,
                )
                await wait_completed(pool, "api", len(http_items))
                http_end = time.time()
                tg.cancel_scope.cancel()
            http_s = http_end - (endpoint.first_call or started)
            calls = endpoint.calls
        # (c) re-run of (a)'s messages: all linked
        rerun_s, linked = await rerun(pool, configs[0])
        await pool.close()

        n, m = len(builtin_items), len(http_items)
        if linked != n:
            PROBLEMS.append(f"re-run linked {linked} of {n}")
        if calls != m:
            PROBLEMS.append(f"http endpoint called {calls} times for {m} messages")
        rate_a, rate_b, rate_c = n / ingest_s, n / extract_s, n / rerun_s
        rate_d, rate_d0 = m / http_s, m / bare_s
        ideal_d = args.concurrency / (args.latency_ms / 1000)
        print(f"{'':<52} {'msgs':>7} {'s':>7} {'msg/s':>9}")
        row("(a) ingest, new mail (cascade + hand-off)", n, ingest_s)
        row("(b) builtin extraction, all new", n, extract_s)
        row("(c) re-run of the same messages, all linked", n, rerun_s)
        row(f"(d) http, concurrency {args.concurrency}, {args.latency_ms:g} ms endpoint", m, http_s)
        row("(d0) baseline: bare aiohttp POSTs, same endpoint", m, bare_s)
        b_over_a = rate_b / rate_a
        d_ratio = rate_d / ideal_d
        print(
            f"\n  (b) ÷ (a) = {b_over_a:.2f} "
            f"(target ≥ {TARGET_B_OVER_A:.2f}: {verdict(b_over_a >= TARGET_B_OVER_A)})"
        )
        print(
            f"  (c) {rate_c:,.0f} msg/s (target ≥ {TARGET_C:,.0f}: {verdict(rate_c >= TARGET_C)})"
        )
        print(
            f"  (d) ÷ concurrency/latency ({ideal_d:,.1f}/s) = {d_ratio:.2f} (target 1 ± "
            f"{TARGET_D_TOLERANCE:.2f}: {verdict(abs(d_ratio - 1) <= TARGET_D_TOLERANCE)}); "
            f"÷ (d0) = {rate_d / rate_d0:.2f}, (d0) ÷ concurrency/latency = {rate_d0 / ideal_d:.2f}"
        )
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
        shutil.rmtree(work, ignore_errors=True)
    for problem in PROBLEMS:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    return 1 if PROBLEMS else 0


def cli() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=20_000)
    p.add_argument("--http-messages", type=int, default=1_000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--latency-ms", type=float, default=50.0)
    p.add_argument("--dsn", default=os.environ.get("INBOXD_TEST_DSN", DEFAULT_DSN))
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--smoke", action="store_true", help=f"{SMOKE_MESSAGES} messages")
    args = p.parse_args()
    if args.smoke:
        args.messages, args.http_messages = SMOKE_MESSAGES, SMOKE_HTTP_MESSAGES
    return anyio.run(main, args)


if __name__ == "__main__":
    sys.exit(cli())
