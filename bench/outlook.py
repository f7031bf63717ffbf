#!/usr/bin/env python3
"""The Outlook door under `inboxd run` against FakeGraph with Graph's limits enforced.

    .venv/bin/python bench/outlook.py [--messages N] [--mailboxes M] [--messages-each K]
        [--budget-per-10-min B] [--many-budget-per-10-min BM] [--baseline-messages C]
        [--service-latency-ms L] [--only one,many,models] [--dsn ADMIN_DSN]
        [--interval S] [--keep] [--smoke]

Defaults: N=10,000, B=100,000 (scaled, see below), M=20 mailboxes of K=1,000 at
BM=10,000 (Graph's own budget), C=2,000, L=0; about 4 minutes on 2 cores.

Graph's Outlook limits are per app and mailbox: 10,000 requests in a sliding 10-minute
window, and 4 concurrent requests. FakeGraph (tests/fakes/graph) enforces both, counts
every 429 it answers per user, every $value download, and the most requests in flight.
It runs in this process, in a thread with its own event loop, so its CPU is that
thread's and is printed beside the daemon's. Each mailbox's messages are FakeGraph's
`add_generated` ones (2 KB text/plain, in the inbox), seeded before the daemon starts.

Scaled budget. At Graph's real 10,000 requests per 10 minutes a backfill of 10,000
messages (≈ 10,600 requests) takes ≈ 11 minutes. `--budget-per-10-min B` raises the
budget on both sides by f = B / 10,000: the tenant's `[outlook] requests_per_10_min =
B` (the door paces at 95 % of B / 600 s) and the fake's limit, which stays 10,000
requests per window while its window shrinks to 600 s / f (and its service latency to
L / f). Time is compressed by f, nothing else changes: the window holds the same
10,000 requests, the door's burst (200 requests) is the same share of it, and a
10,000-message run still spans ≈ 1.1 windows, so the window's limit binds as it would
at Graph (a 600 s window with B requests would never fill in a 1-minute run, and a
door that sent everything at once would draw no 429). Every "× budget" figure is a
ratio to B / 600 requests per second. The 20-mailbox run uses BM, by default Graph's
real budget (then the fake is Graph's 600 s window, unscaled).

Requests are counted as the fake's throttle counts them: each delta page and each
inner request of a $batch (Graph: "Requests in a batch are evaluated individually
against the applicable throttling limits"); the $batch envelope is not a mailbox
request. The door's pacer charges a $batch of n bodies n + 1 requests (transport.py),
so its own units are printed too.

Measured, in this order, each daemon on a fresh database (bench_outlook_<pid>_<x>,
dropped at the end):

  baselines   this process's own GraphTransport + GraphClient (the door's paced,
              raw request path and its Graph calls) making a first sync's calls —
              delta pages of 100, then each page's bodies by $batch of 20 $value —
              for C messages, without database, parsing or daemon:
              (1) fake capacity: no limits in the fake, a pacer of 10⁹ requests/s;
              (2) paced client: budget B on both sides.
  models      CPU per message of the SDK's models against the door's raw path, on
              answers the fake served to the paced client (captured: delta pages of
              100 messages, $batch answers of 20 base64 $value bodies): kiota's
              JsonParseNode into DeltaGetResponse (Message models) and msgraph-core's
              BatchResponseContent (+ base64) vs orjson + the door's own readers
              (client._delta_page, client._body_bytes); the first models parse of
              the process (lazy imports of the generated models) apart.
  one         `python -m inboxd.daemon.cli run` with one Outlook mailbox of N
              messages (app-only, poll mode, interval 1 h, backfill "all", folders
              inbox + sentitems, no notification_url so no subscriptions), timed from
              the fake's first admitted request for that user to N rows and a cursor;
              the door's CPU per stored message (daemon with workers ÷ N); then the
              inbox's delta tokens are expired in the fake and the doorbell rung: the
              deltaLink answers 410, the cursor is reset, and the inbox's fresh round
              must download no body (every id is stored).
  many        the same with M mailboxes of K messages at once, budget BM each: each
              mailbox's msg/s and requests/s vs the budget, and the daemon's CPU
              (main process, and with its parse workers), PostgreSQL's, the fake's and
              the whole machine's busy %.

Exit 1 when a figure is not a measurement: a 429 (nobody else uses these mailboxes, so
every 429 is the door's own), a body downloaded twice or by the resync, a stored count
that is not the seeded one, a dead item, a daemon that failed or did not exit 0 on
SIGTERM, a rate or CPU figure that is not a positive number. Missed targets are results.
`--smoke` (CI): 400 messages, 3 mailboxes of 200, C=300, B=BM=100,000, in ≈ 25 s.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import aiohttp
import asyncpg
import orjson
from aiohttp import web

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # FakeGraph is tests/fakes/graph

# bench/ is sys.path[0]: the daemon machinery shared with gmail.py.
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
from fakes.graph import FakeGraph  # noqa: E402
from fakes.graph.throttle import WINDOW_S, Throttle  # noqa: E402

from inboxd.adapters.outlook.auth import GraphTokens  # noqa: E402
from inboxd.adapters.outlook.client import (  # noqa: E402
    DELTA_PAGE_SIZE,
    GRAPH_BATCH_SIZE,
    GraphClient,
    _body_bytes,
    _delta_page,
)
from inboxd.adapters.outlook.config import (  # noqa: E402
    GRAPH_CONCURRENT_REQUESTS,
    GRAPH_REQUESTS_PER_10_MIN,
    OutlookMailbox,
    OutlookSettings,
)
from inboxd.adapters.outlook.transport import (  # noqa: E402
    BUDGET_SHARE,
    BURST_REQUESTS,
    Answer,
    GraphTransport,
)
from inboxd.adapters.pacing import TokenBucket  # noqa: E402

DOMAIN = "bench.example"
SECRET_ENV = "BENCH_GRAPH_CLIENT_SECRET"  # noqa: S105 - a variable name
#: The issue's target: a one-mailbox backfill sustains this share of the budget.
TARGET_BUDGET_SHARE = 0.90
#: The tenant key's ceiling (config.py: at most 10 × Graph's 10,000).
MAX_BUDGET_PER_10_MIN = 10 * GRAPH_REQUESTS_PER_10_MIN
DEFAULT_BUDGET_PER_10_MIN = MAX_BUDGET_PER_10_MIN
#: Pacer rate and depth of the capacity baseline: never the limit.
UNPACED_REQUESTS_PER_S = 1e9
#: Poll interval of the benchmark's mailboxes: no poll inside a run (the first sync
#: is rung at start, the resync by the benchmark).
POLL_INTERVAL_S = 3600
#: A daemon scenario gets this much longer than the budget alone needs, plus slack.
TIMEOUT_FACTOR = 3.0
TIMEOUT_SLACK_S = 120.0
#: Answers kept from the paced client for the models figure (delta pages of 100,
#: $batch answers of 20), and timed passes over them: the models take ~16 ms a message.
CAPTURED_DELTA_PAGES = 2
CAPTURED_BATCHES = 5
MODEL_PASSES = 3
#: --smoke (CI)
SMOKE_MESSAGES = 400
SMOKE_MESSAGES_EACH = 300  # > the pacer's burst (190 requests), so a rate remains
SMOKE_MAILBOXES = 3
SMOKE_BASELINE = 300
SMOKE_INTERVAL_S = 0.1
#: A cursor whose inbox is at a deltaLink (cursor.py's format): a round is over.
RESYNC_FINISHED = "(cursor::jsonb -> 'folders' -> 'inbox' ->> 'link') LIKE '%$deltatoken=%'"
_BATCH_USER = re.compile(rb'"/users/([^/"]+)/')


def door_units(requests: int, batches: int) -> int:
    """The door's pacer charge for `requests` as Graph counts them in `batches` $batch
    envelopes (a $batch of n costs n + 1)."""
    return requests + batches


def burst_requests(budget: int) -> float:
    """The door pacer's initial burst (transport.py), in requests as Graph counts them:
    spent on $batch of 20, 21 pacer units carry 20 Graph requests."""
    units = min(BURST_REQUESTS, budget / 50)
    return units * GRAPH_BATCH_SIZE / (GRAPH_BATCH_SIZE + 1)


# --------------------------------------------------------------------------- the fake


class StampedThrottle(Throttle):
    """The fake's throttle, noting per user every admitted request's time, and with
    users it does not limit (the capacity baseline)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.admitted: Counter[str] = Counter()
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.unlimited: set[str] = set()

    @asynccontextmanager
    async def slot(self, user: str) -> AsyncIterator[Answer | None]:
        if user in self.unlimited:
            self._stamp(user)
            yield None
            return
        async with super().slot(user) as refusal:
            if refusal is None:
                self._stamp(user)
            yield refusal

    def _stamp(self, user: str) -> None:
        now = time.monotonic()
        self.admitted[user] += 1
        self.first.setdefault(user, now)
        self.last[user] = now


class BenchGraph(FakeGraph):
    """FakeGraph counting $batch envelopes per user (the door's pacer pays for them)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.throttle = StampedThrottle(
            self.counters,
            requests_per_window=kwargs["requests_per_10_min"],
            window_s=kwargs["window_s"],
            concurrent_per_mailbox=kwargs["concurrent_per_mailbox"],
        )
        self.batches: Counter[str] = Counter()

    async def _batch(self, request: web.Request) -> web.Response:
        body = await request.read()
        found = _BATCH_USER.search(body)
        self.batches[unquote(found.group(1).decode()).lower() if found else "?"] += 1
        return await super()._batch(_Replay(request, body))


class _Replay:
    """The request again for FakeGraph._batch, its body already read."""

    def __init__(self, request: web.Request, body: bytes) -> None:
        self.headers = request.headers
        self._body = body

    async def read(self) -> bytes:
        return self._body


@dataclass
class UserView:
    """What the fake saw of one user, copied on the fake's loop."""

    requests: int
    batches: int
    downloads: int
    downloaded_twice: int
    throttled: int
    max_concurrency: int
    calls: dict[str, int]
    first: float | None
    last: float | None

    @property
    def window_s(self) -> float:
        if self.first is None or self.last is None:
            return float("nan")
        return self.last - self.first


class GraphThread(FakeThread):
    """BenchGraph on its own event loop in a thread of this process."""

    fake: BenchGraph

    def __init__(self, scale: float, service_latency_s: float) -> None:
        super().__init__(
            BenchGraph(
                requests_per_10_min=GRAPH_REQUESTS_PER_10_MIN,
                concurrent_per_mailbox=GRAPH_CONCURRENT_REQUESTS,
                window_s=WINDOW_S / scale,
                service_latency_s=service_latency_s / scale,
            ),
            "fake-graph",
        )

    def rescale(self, scale: float, service_latency_s: float) -> None:
        """Another budget for the next scenario (new users only: windows are per user)."""

        async def set_scale() -> None:
            self.fake.throttle.window_s = WINDOW_S / scale
            self.fake.service_latency_s = service_latency_s / scale

        self.call(set_scale())

    def seed(self, user: str, count: int) -> None:
        async def seed() -> None:
            self.fake.add_user(user).add_generated(count)

        self.call(seed())

    def unlimit(self, user: str) -> None:
        async def unlimit() -> None:
            self.fake.throttle.unlimited.add(user.lower())

        self.call(unlimit())

    async def view(self, users: list[str]) -> dict[str, UserView]:
        async def view() -> dict[str, UserView]:
            c, t = self.fake.counters, self.fake.throttle
            out = {}
            for address in users:
                u = self.fake.mailbox(address).address
                got = [n for (cu, _m), n in c.raw_downloads.items() if cu == u]
                out[address] = UserView(
                    t.admitted[u],
                    self.fake.batches[u.lower()],
                    sum(got),
                    sum(1 for n in got if n > 1),
                    c.throttled[u],
                    c.max_concurrency[u],
                    {k: n for (cu, k), n in c.calls.items() if cu == u},
                    t.first.get(u),
                    t.last.get(u),
                )
            return out

        return dict(await self.acall(view()))

    async def expire_delta(self, user: str, folder: str) -> None:
        async def expire() -> None:
            self.fake.mailbox(user).expire_delta_tokens(folder)

        await self.acall(expire())


# --------------------------------------------------------------------------- results


@dataclass
class Row:
    """One measured pass: `n` messages of one mailbox over `wall_s`; `requests` as
    Graph counts them over `requests_window_s` (first to last admitted request)."""

    label: str
    n: int
    wall_s: float
    requests: int
    batches: int
    requests_window_s: float
    throttled: int
    burst: float
    extra: str = ""

    @property
    def rate(self) -> float:
        return self.n / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def requests_per_s(self) -> float:
        """Sustained: requests beyond the pacer's initial burst over the window (a
        pacer at rate r lets through at most burst + r × window)."""
        w = self.requests_window_s
        return (self.requests - self.burst) / w if w > 0 else float("nan")

    @property
    def units_per_s(self) -> float:
        """The same in the door's pacer units ($batch = n + 1)."""
        w = self.requests_window_s
        units = door_units(self.requests, self.batches)
        burst = self.burst * (GRAPH_BATCH_SIZE + 1) / GRAPH_BATCH_SIZE
        return (units - burst) / w if w > 0 else float("nan")


ROW_HEADER = (
    f"  {'':<38} {'msgs':>7} {'wall s':>8} {'msg/s':>8} {'req/s':>8} {'×budget':>7} "
    f"{'429':>4}  {'pacer u/s':>9} {'×0.95 B':>7}"
)


def row_line(row: Row, budget_per_s: float) -> str:
    return (
        f"  {row.label:<38} {row.n:>7,} {row.wall_s:>8.2f} {row.rate:>8,.1f} "
        f"{row.requests_per_s:>8,.1f} {row.requests_per_s / budget_per_s:>7.3f} "
        f"{row.throttled:>4}  {row.units_per_s:>9,.1f} "
        f"{row.units_per_s / (BUDGET_SHARE * budget_per_s):>7.3f}  {row.extra}"
    ).rstrip()


def calls_text(view: UserView) -> str:
    named = {"message.delta": "delta", "message.value": "$value"}
    parts = [f"{named.get(k, k)} ×{n:,}" for k, n in sorted(view.calls.items())]
    return f"calls: {', '.join(parts)} in {view.batches:,} $batch; most in flight " + str(
        view.max_concurrency
    )


# --------------------------------------------------------------------------- baselines


class RecordingTransport(GraphTransport):
    """The door's transport, keeping the first answers of each kind of call."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kept: dict[str, list[bytes]] = {"delta": [], "$batch": []}

    async def send(self, what: str, info: Any, *, cost: int = 1, slots: int = 1) -> Answer:
        answer = await super().send(what, info, cost=cost, slots=slots)
        kind = "$batch" if what == "$batch $value" else "delta" if what.endswith("delta") else None
        wanted = CAPTURED_BATCHES if kind == "$batch" else CAPTURED_DELTA_PAGES
        if kind and answer.status == 200 and len(self.kept[kind]) < wanted:
            self.kept[kind].append(answer.body)
        return answer


def graph_settings(fake: FakeGraph, budget: int) -> OutlookSettings:
    return OutlookSettings(
        directory_id=fake.directory_id,
        client_id=fake.client_id,
        client_secret=Plain(fake.client_secret),
        graph_url=fake.graph_url,
        authority_url=fake.authority_url,
        requests_per_10_min=budget,
        concurrent_requests=GRAPH_CONCURRENT_REQUESTS,
    )


async def client_pass(
    ft: GraphThread, label: str, user: str, budget: int, paced: bool
) -> tuple[Row, dict[str, list[bytes]]]:
    """A first sync's Graph calls for `user` by this process's GraphClient: delta pages
    of 100 over the inbox, each page's bodies by $batch."""
    settings = graph_settings(ft.fake, budget)
    mailbox = OutlookMailbox(user, backfill="all")
    fetched = 0
    async with aiohttp.ClientSession() as session:
        pacer = None if paced else TokenBucket(UNPACED_REQUESTS_PER_S, UNPACED_REQUESTS_PER_S)
        transport = RecordingTransport(
            settings, GraphTokens(settings, mailbox, session), pacer=pacer
        )
        client = GraphClient(transport, user)
        try:
            await transport.tokens.token()  # not timed: the token endpoint
            fake0, bench0 = ft.cpu_s(), time.thread_time()
            started = time.monotonic()
            link: str | None = None
            while True:
                page = await client.delta_page("inbox", link, None)
                batch = await client.get_raw_batch([item.id for item in page.items])
                fetched += len(batch.raw)
                if page.delta_link is not None:
                    break
                link = page.next_link
            wall = time.monotonic() - started
            fake_cpu, bench_cpu = ft.cpu_s() - fake0, time.thread_time() - bench0
        finally:
            await transport.aclose()
    view = (await ft.view([user]))[user]
    row = Row(
        label,
        fetched,
        wall,
        view.requests,
        view.batches,
        view.window_s,
        view.throttled,
        burst_requests(budget) if paced else 0.0,
        f"fake {100 * fake_cpu / wall:.0f} %, client {100 * bench_cpu / wall:.0f} % of a "
        f"core; {calls_text(view)}",
    )
    return row, transport.kept


# --------------------------------------------------------------------------- models


@dataclass
class ModelFigures:
    delta_pages: int = 0
    delta_messages: int = 0
    batch_bodies: int = 0
    first_models_ms: float = float("nan")  # the process's first DeltaGetResponse parse
    models_delta_ms: float = float("nan")  # per message, best pass
    raw_delta_ms: float = float("nan")
    models_batch_ms: float = float("nan")  # per body
    raw_batch_ms: float = float("nan")
    same: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def models_ms(self) -> float:
        return self.models_delta_ms + self.models_batch_ms

    @property
    def raw_ms(self) -> float:
        return self.raw_delta_ms + self.raw_batch_ms


def _cpu_ms(fn: Callable[[], Any], passes: int) -> float:
    """Best of `passes` of fn(), CPU ms of this thread."""
    best = math.inf
    for _ in range(passes):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return 1000 * best


class _BatchItem:
    """msgraph-core's BatchResponseItem, restated: its module imports `deprecated`, a
    package msgraph-core does not declare (and this venv does not have). Same field
    deserialisers; kiota's get_bytes_value base64-decodes the body."""

    def __init__(self) -> None:
        self.id: str | None = None
        self.status: int | None = None
        self.headers: Any = None
        self.body: bytes | None = None

    @staticmethod
    def create_from_discriminator_value(parse_node: Any = None) -> _BatchItem:
        return _BatchItem()

    def get_field_deserializers(self) -> dict[str, Callable[[Any], None]]:
        return {
            "id": lambda n: setattr(self, "id", n.get_str_value()),
            "status": lambda n: setattr(self, "status", n.get_int_value()),
            "headers": lambda n: setattr(self, "headers", n.try_get_anything(n._json_node)),
            "body": lambda n: setattr(self, "body", n.get_bytes_value()),
        }


class _BatchContent:
    """msgraph-core's BatchResponseContent, restated (see _BatchItem)."""

    def __init__(self) -> None:
        self.responses: list[_BatchItem] = []

    @staticmethod
    def create_from_discriminator_value(parse_node: Any = None) -> _BatchContent:
        return _BatchContent()

    def get_field_deserializers(self) -> dict[str, Callable[[Any], None]]:
        def responses(n: Any) -> None:
            self.responses = n.get_collection_of_object_values(_BatchItem) or []

        return {"responses": responses}


def model_figures(kept: dict[str, list[bytes]], passes: int) -> ModelFigures:
    """The SDK's models vs the door's raw path on the captured answers (this thread)."""
    with warnings.catch_warnings():
        # kiota_abstractions and the generated builders warn at import: not ours.
        warnings.simplefilter("ignore", DeprecationWarning)
        from kiota_serialization_json.json_parse_node_factory import JsonParseNodeFactory
        from msgraph.generated.users.item.mail_folders.item.messages.delta.delta_get_response import (  # noqa: E501
            DeltaGetResponse,
        )
    out = ModelFigures()
    deltas, batches = kept["delta"], kept["$batch"]
    if not deltas or not batches:
        out.problems.append("no delta page or $batch answer captured")
        return out
    factory = JsonParseNodeFactory()
    mime = "application/json"

    def models_delta() -> list[Any]:
        return [
            factory.get_root_parse_node(mime, body).get_object_value(DeltaGetResponse)
            for body in deltas
        ]

    def raw_delta() -> list[Any]:
        return [_delta_page(orjson.loads(body)) for body in deltas]

    def models_batch() -> list[list[bytes]]:
        pages = []
        for body in batches:
            content = factory.get_root_parse_node(mime, body).get_object_value(_BatchContent)
            pages.append([item.body or b"" for item in content.responses])
        return pages

    def raw_batch() -> list[list[bytes]]:
        return [
            [_body_bytes(part.get("body")) or b"" for part in orjson.loads(body)["responses"]]
            for body in batches
        ]

    t0 = time.thread_time()
    factory.get_root_parse_node(mime, deltas[0]).get_object_value(DeltaGetResponse)
    out.first_models_ms = 1000 * (time.thread_time() - t0)
    model_pages = models_delta()
    raw_pages = raw_delta()
    out.delta_pages = len(raw_pages)
    out.delta_messages = sum(len(p.items) for p in raw_pages)
    out.batch_bodies = sum(len(b) for b in raw_batch())
    out.same = [[m.id for m in p.value] for p in model_pages] == [
        [i.id for i in p.items] for p in raw_pages
    ] and sorted(map(sorted, models_batch())) == sorted(map(sorted, raw_batch()))
    if not out.same:
        out.problems.append("models and raw path read different ids or bodies")
    if not out.delta_messages or not out.batch_bodies:
        out.problems.append("captured answers hold no message")
        return out
    out.models_delta_ms = _cpu_ms(models_delta, passes) / out.delta_messages
    out.raw_delta_ms = _cpu_ms(raw_delta, passes) / out.delta_messages
    out.models_batch_ms = _cpu_ms(models_batch, passes) / out.batch_bodies
    out.raw_batch_ms = _cpu_ms(raw_batch, passes) / out.batch_bodies
    return out


def model_lines(m: ModelFigures, passes: int) -> list[str]:
    return [
        f"  captured from the paced client: {m.delta_messages:,} messages in delta pages, "
        f"{m.batch_bodies:,} $value bodies in $batch answers; CPU ms per message, best of "
        f"{passes}, this thread:",
        f"  {'':<44} {'models':>9} {'raw':>9} {'models/raw':>10}",
        f"  {'delta page (DeltaGetResponse / orjson)':<44} {m.models_delta_ms:>9.4f} "
        f"{m.raw_delta_ms:>9.4f} {m.models_delta_ms / m.raw_delta_ms:>10.1f}",
        f"  {'$batch body (BatchResponseContent / orjson)':<44} {m.models_batch_ms:>9.4f} "
        f"{m.raw_batch_ms:>9.4f} {m.models_batch_ms / m.raw_batch_ms:>10.1f}",
        f"  {'per stored message (both)':<44} {m.models_ms:>9.4f} {m.raw_ms:>9.4f} "
        f"{m.models_ms / m.raw_ms:>10.1f}",
        f"  the process's first models parse (imports the generated models): "
        f"{m.first_models_ms:,.0f} ms for one delta page of 100 ({m.delta_pages} captured); "
        f"same ids and bodies on both paths: {'yes' if m.same else 'NO'}",
    ]


# --------------------------------------------------------------------------- daemon runs


def tenant_file(fake: FakeGraph, mailboxes: dict[str, str], budget: int) -> str:
    boxes = "".join(
        f"""
[[mailboxes]]
id = "{box}"
provider = "outlook"
address = "{address}"
sync_mode = "poll"
poll_interval_s = {POLL_INTERVAL_S}
backfill = "all"
"""
        for box, address in mailboxes.items()
    )
    return f"""id = "{TENANT}"
name = "Bench"

[outlook]
directory_id = "{fake.directory_id}"
client_id = "{fake.client_id}"
client_secret = "env:{SECRET_ENV}"
graph_url = "{fake.graph_url}"
authority_url = "{fake.authority_url}"
requests_per_10_min = {budget}
concurrent_requests = {GRAPH_CONCURRENT_REQUESTS}
{boxes}"""


def daemon_command(config: Path, dsn: str) -> list[str]:
    run = ["run", "--config", str(config), "--dsn", dsn, "--log-level", "info"]
    return [sys.executable, "-m", "inboxd.daemon.cli", *run]


@dataclass
class OutlookRun(DaemonRun):
    budget: int = GRAPH_REQUESTS_PER_10_MIN
    batches: int = 0
    downloaded_twice: int = 0

    @property
    def budget_per_s(self) -> float:
        return self.budget / 600.0


async def run_daemon(
    args: argparse.Namespace,
    server: FreshServer,
    ft: GraphThread,
    work: Path,
    label: str,
    mailboxes: dict[str, str],
    n_each: int,
    budget: int,
    resync: bool,
) -> OutlookRun:
    res = OutlookRun(label, mailboxes, n_each, budget=budget)
    run_dir = work / label
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    for address in mailboxes.values():
        ft.seed(address, n_each)
    print(
        f"  seeded {len(mailboxes)} × {n_each:,} messages in {time.monotonic() - t0:.1f} s "
        "(not timed)",
        flush=True,
    )
    # The main TOML of the Maildir bench ([workers], [queue], [sync] …); its tenant
    # file is replaced by one with the Outlook mailboxes.
    config = write_daemon_config(run_dir, run_dir / "unused", run_dir / "objects", 500)
    (run_dir / "tenants" / f"{TENANT}.toml").write_text(tenant_file(ft.fake, mailboxes, budget))
    dbname, dsn = await server.fresh(label)
    per_box = n_each * (1 + 1 / GRAPH_BATCH_SIZE + 1 / DELTA_PAGE_SIZE)
    expected_s = per_box / (BUDGET_SHARE * res.budget_per_s)
    users = list(mailboxes.values())

    async def when_done(
        sampler: Sampler, monitor: asyncpg.Connection, done_at: dict[str, float]
    ) -> None:
        views = await ft.view(users)
        _rows(res, views, done_at)
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
        fake_name="fake Graph",
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


def _rows(res: OutlookRun, views: dict[str, UserView], done_at: dict[str, float]) -> None:
    for box, address in res.mailboxes.items():
        v = views[address]
        res.spent += v.requests
        res.batches += v.batches
        res.downloaded_twice += v.downloaded_twice
        end = done_at.get(box)
        wall = end - v.first if end is not None and v.first is not None else float("nan")
        res.rows.append(
            Row(
                box,
                res.n_each,
                wall,
                v.requests,
                v.batches,
                v.window_s,
                v.throttled,
                burst_requests(res.budget),
                calls_text(v),
            )
        )
        if v.throttled:
            res.problems.append(f"{box}: {v.throttled} × 429 drawn by the door itself")
        if v.downloaded_twice:
            res.problems.append(f"{box}: {v.downloaded_twice} bodies downloaded twice")


async def _resync(
    res: OutlookRun,
    ft: GraphThread,
    monitor: asyncpg.Connection,
    box: str,
    address: str,
    interval_s: float,
    before: UserView,
) -> None:
    """Expire the inbox's delta tokens in the fake, ring, wait for the resync's cursor."""
    await ft.expire_delta(address, "inbox")
    # The cursor moves after every page: the resync is over when the inbox's fresh round
    # has reached its deltaLink, not at its first page.
    timed = await ring_and_wait_resync(monitor, box, interval_s, RESYNC_FINISHED)
    after = (await ft.view([address]))[address]
    if timed is None:
        res.problems.append("resync: no cursor reset and new cursor within 120 s")
        return
    duration_s, seen_s = timed
    calls = changed_calls(before.calls, after.calls)
    res.resync = {
        "downloads": after.downloads - before.downloads,
        "requests": after.requests - before.requests,
        "batches": after.batches - before.batches,
        "throttled": after.throttled - before.throttled,
        "duration_s": duration_s,
        "seen_s": seen_s,
        "calls": calls,
    }
    if res.resync["downloads"]:
        res.problems.append(f"resync downloaded {res.resync['downloads']} bodies (must be 0)")
    if res.resync["throttled"]:
        res.problems.append(f"resync drew {res.resync['throttled']} × 429")


# --------------------------------------------------------------------------- output


def describe_run(run: OutlookRun, baseline: Row | None) -> list[str]:
    per_s = run.budget_per_s
    lines = [ROW_HEADER]
    lines += [row_line(r, per_s) for r in run.rows]
    rates = [r.rate for r in run.rows]
    shares = [r.requests_per_s / per_s for r in run.rows]
    # per stored message, a mailbox's whole run: requests, bodies, delta pages
    per_msg = run.spent / run.stored if run.stored else float("nan")
    allowed = BUDGET_SHARE * per_s / (1 + 1 / GRAPH_BATCH_SIZE + 1 / DELTA_PAGE_SIZE)
    if len(run.rows) > 1:
        total = run.n_each * len(run.rows)
        wall = run.cpu.wall_s
        lines.append(
            f"  {len(run.rows)} mailboxes: msg/s per mailbox min {min(rates):,.1f} / median "
            f"{statistics.median(rates):,.1f} / max {max(rates):,.1f} (the door's pacing "
            f"allows {allowed:,.1f}); requests/s ÷ budget min {min(shares):.3f} / median "
            f"{statistics.median(shares):.3f} / max {max(shares):.3f}; all {total:,} messages "
            f"in {wall:.1f} s = {total / wall:,.0f} msg/s (the pacing allows "
            f"{len(run.rows) * allowed:,.0f})"
        )
    lines.append("  " + run.cpu.line())
    tree_ms = 1000 * run.cpu.daemon_tree_s / run.stored if run.stored else float("nan")
    main_ms = 1000 * run.cpu.daemon_main_s / run.stored if run.stored else float("nan")
    lines.append(
        f"  door's CPU per stored message: {tree_ms:.2f} ms (daemon with its parse workers; "
        f"main process alone {main_ms:.2f} ms); requests per stored message {per_msg:.3f} "
        f"({run.spent:,} requests as Graph counts them, + {run.batches:,} $batch envelopes "
        f"the pacer also pays for); bodies downloaded twice: {run.downloaded_twice}"
    )
    if baseline is not None and run.rows:
        med = statistics.median(r.requests_per_s for r in run.rows)
        lines.append(
            f"  ratios, same run: daemon requests/s ÷ budget = {med / per_s:.3f} (target ≥ "
            f"{TARGET_BUDGET_SHARE:.2f}: "
            f"{'ok' if med / per_s >= TARGET_BUDGET_SHARE else 'MISSED'}); ÷ paced client's "
            f"= {med / baseline.requests_per_s:.3f}"
        )
    if run.resync:
        rs = run.resync
        calls = ", ".join(f"{k} ×{n:,}" for k, n in sorted(rs["calls"].items()))
        lines.append(
            f"  resync after a 410 (inbox delta tokens expired, doorbell rung): body downloads "
            f"{rs['downloads']} (must be 0); {rs['duration_s']:.3f} s from cursor reset to "
            f"cursor committed ({rs['seen_s']:.2f} s from the doorbell, seen by polling); "
            f"{rs['requests']:,} requests ({calls}), {rs['batches']} $batch; "
            f"429 {rs['throttled']}"
        )
    return lines + run.footer()


def budget_text(budget: int, latency_ms: float) -> str:
    scale = budget / GRAPH_REQUESTS_PER_10_MIN
    text = f"{budget:,} requests per 10 min per mailbox = {budget / 600:,.2f}/s"
    if scale == 1:
        text += " (Graph's own; the fake's window 600 s"
    else:
        text += (
            f" (SCALED ×{scale:g} from Graph's 10,000: the fake allows 10,000 per "
            f"{WINDOW_S / scale:g} s window instead of 600 s"
        )
    return text + (
        f", 4 concurrent; service latency {latency_ms / scale:g} ms); the door paces at "
        f"{BUDGET_SHARE:g} × {budget / 600:,.2f}/s = {BUDGET_SHARE * budget / 600:,.2f} "
        f"pacer units/s, burst {min(BURST_REQUESTS, budget / 50):g}"
    )


# --------------------------------------------------------------------------- main


async def main(args: argparse.Namespace) -> int:
    only = set(args.only.split(","))
    budget, many_budget = args.budget_per_10_min, args.many_budget_per_10_min
    work = Path(tempfile.mkdtemp(prefix="bench_outlook_"))
    server = FreshServer(args.dsn, args.keep, "bench_outlook")
    print(header_line(work), flush=True)
    print(f"budget: {budget_text(budget, args.service_latency_ms)}", flush=True)
    scale = budget / GRAPH_REQUESTS_PER_10_MIN
    ft = GraphThread(scale, args.service_latency_ms / 1000)
    ft.start()
    problems: list[str] = []
    baseline: Row | None = None
    runs: list[OutlookRun] = []
    base_rows: list[Row] = []
    models: ModelFigures | None = None
    try:
        print(
            f"baselines: this process's GraphTransport + GraphClient, a first sync's calls "
            f"for {args.baseline_messages:,} messages (no database, no parsing):",
            flush=True,
        )
        cap_user, paced_user = f"capacity@{DOMAIN}", f"paced@{DOMAIN}"
        ft.seed(cap_user, args.baseline_messages)
        ft.unlimit(cap_user)
        ft.seed(paced_user, args.baseline_messages)
        cap, _ = await client_pass(
            ft, "fake capacity: no limits, no pacing", cap_user, budget, False
        )
        baseline, kept = await client_pass(
            ft, "paced client at the budget", paced_user, budget, True
        )
        base_rows += [cap, baseline]
        print(ROW_HEADER)
        for row in base_rows:
            print(row_line(row, budget / 600), flush=True)
        if baseline.throttled or cap.throttled:
            problems.append(f"baselines: {baseline.throttled + cap.throttled} × 429")
        for row in base_rows:
            if row.n != args.baseline_messages:
                problems.append(f"{row.label}: {row.n} messages, expected {args.baseline_messages}")
        if "models" in only:
            print("models: the SDK's models vs the door's raw path (request adapter + orjson):")
            if args.smoke:  # one delta page: the models take ~1.6 s a page
                kept["delta"] = kept["delta"][:1]
            models = model_figures(kept, args.model_passes)
            for line in model_lines(models, args.model_passes):
                print(line, flush=True)
            problems += [f"models: {p}" for p in models.problems]
        if "one" in only:
            print(f"one mailbox: daemon backfill of {args.messages:,} messages …", flush=True)
            run = await run_daemon(
                args,
                server,
                ft,
                work,
                "one",
                {"one": f"one@{DOMAIN}"},
                args.messages,
                budget,
                True,
            )
            runs.append(run)
            for line in describe_run(run, baseline):
                print(line, flush=True)
        if "many" in only:
            ft.rescale(many_budget / GRAPH_REQUESTS_PER_10_MIN, args.service_latency_ms / 1000)
            boxes = {f"m{i:02d}": f"m{i:02d}@{DOMAIN}" for i in range(1, args.mailboxes + 1)}
            print(
                f"{args.mailboxes} mailboxes at once: daemon backfill of "
                f"{args.messages_each:,} messages each; budget "
                f"{budget_text(many_budget, args.service_latency_ms)} …",
                flush=True,
            )
            run = await run_daemon(
                args, server, ft, work, "many", boxes, args.messages_each, many_budget, False
            )
            runs.append(run)
            for line in describe_run(run, None):
                print(line, flush=True)
    finally:
        ft.stop()
        await server.drop_all()
        if args.keep:
            print(f"kept work directory {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    for row in base_rows:
        if not (finite_positive(row.rate) and finite_positive(row.requests_per_s)):
            problems.append(f"{row.label}: not a measurement ({row.rate} msg/s)")
    for run in runs:
        problems += [f"{run.label}: {p}" for p in run.problems]
        for row in run.rows:
            if not (finite_positive(row.rate) and finite_positive(row.requests_per_s)):
                problems.append(f"{run.label}/{row.label}: not a measurement ({row.rate} msg/s)")
        if not finite_positive(run.cpu.daemon_main_s) or not finite_positive(run.cpu.wall_s):
            problems.append(f"{run.label}: no CPU figure")
        if run.label == "one" and not run.resync:
            problems.append("one: no resync figure")
    if models is not None and not all(
        finite_positive(x) for x in (models.models_ms, models.raw_ms)
    ):
        problems.append("models: no CPU figure")

    print()
    print(
        f"inboxd at {code_version()} (at the end of the run); load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    summary(runs, base_rows, models, budget)
    for p in problems:
        print(f"PROBLEM: {p}")
    return 1 if problems else 0


def summary(
    runs: list[OutlookRun], base_rows: list[Row], models: ModelFigures | None, budget: int
) -> None:
    one = next((r for r in runs if r.label == "one"), None)
    many = next((r for r in runs if r.label == "many"), None)
    print("summary:")
    if one is not None and one.rows and len(base_rows) > 1:
        r, paced = one.rows[0], base_rows[1]
        busy = one.cpu.machine_busy_s / one.cpu.wall_s / (os.cpu_count() or 1)
        print(
            f"  1. one mailbox, {r.n:,} messages, budget {budget:,}/10 min"
            f"{' (scaled)' if budget != GRAPH_REQUESTS_PER_10_MIN else ''}: "
            f"{r.requests_per_s:,.1f} requests/s = {r.requests_per_s / one.budget_per_s:.3f} × "
            f"budget (target ≥ {TARGET_BUDGET_SHARE:.2f}; paced client "
            f"{paced.requests_per_s / one.budget_per_s:.3f}); pacer units "
            f"{r.units_per_s / (BUDGET_SHARE * one.budget_per_s):.3f} × its 0.95 share; "
            f"{r.rate:,.1f} msg/s; 429 {r.throttled}; machine busy {100 * busy:.0f} %"
        )
    if many is not None and many.rows:
        rates = [r.rate for r in many.rows]
        shares = [r.requests_per_s / many.budget_per_s for r in many.rows]
        c = many.cpu
        print(
            f"  2. {len(many.rows)} mailboxes × {many.n_each:,}, budget {many.budget:,}/10 min "
            f"each: median {statistics.median(rates):,.1f} msg/s per mailbox, requests/s ÷ "
            f"budget median {statistics.median(shares):.3f} (min {min(shares):.3f}); 429 "
            f"{sum(r.throttled for r in many.rows)}; CPU (% of one core): daemon main "
            f"{100 * c.daemon_main_s / c.wall_s:.0f} %, with workers "
            f"{100 * c.daemon_tree_s / c.wall_s:.0f} %, PostgreSQL "
            f"{100 * (c.server_s or 0) / c.wall_s:.0f} %, fake {100 * c.fake_s / c.wall_s:.0f} "
            f"%, machine busy {100 * c.machine_busy_s / c.wall_s:.0f} % of "
            f"{100 * (os.cpu_count() or 1)} %: "
            + (
                "bounded by Graph's limits"
                if min(shares) >= TARGET_BUDGET_SHARE
                else "NOT bounded by Graph's limits (see the CPU figures)"
            )
        )
    if models is not None and math.isfinite(models.raw_ms):
        print(
            f"  3. CPU per stored message: SDK models {models.models_ms:.4f} ms, raw path "
            f"{models.raw_ms:.4f} ms ({models.models_ms / models.raw_ms:.0f}×; first models "
            f"parse {models.first_models_ms:,.0f} ms)"
            + (
                f"; the door's whole CPU {1000 * one.cpu.daemon_tree_s / one.stored:.2f} ms "
                "per stored message (daemon with workers)"
                if one is not None and one.stored
                else ""
            )
        )
    if one is not None and one.resync:
        print(
            f"  4. resync after 410: {one.resync['downloads']} body downloads, "
            f"{one.resync['duration_s']:.3f} s, {one.resync['requests']:,} requests"
        )
    if base_rows:
        cap = base_rows[0]
        boxes = len(many.rows) if many else 1
        top = max([budget / 600] + ([many.budget_per_s * boxes] if many else []))
        print(
            f"  fake capacity {cap.rate:,.0f} msg/s ({cap.requests_per_s:,.0f} requests/s) "
            f"against {top:,.0f} requests/s the largest scenario's budgets allow: "
            f"{cap.requests_per_s / top:.1f}×"
        )


def cli() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=10_000, help="one-mailbox backfill")
    parser.add_argument("--mailboxes", type=int, default=20, help="mailboxes at once")
    parser.add_argument("--messages-each", type=int, default=1_000, help="per mailbox (many)")
    parser.add_argument(
        "--budget-per-10-min",
        type=int,
        default=DEFAULT_BUDGET_PER_10_MIN,
        help="requests per 10 min per mailbox of the tenant and the fake, for the "
        "baselines and the one-mailbox run (Graph: 10,000; the default is scaled ×10)",
    )
    parser.add_argument(
        "--many-budget-per-10-min",
        type=int,
        default=GRAPH_REQUESTS_PER_10_MIN,
        help="the same for the many-mailbox run (default: Graph's own 10,000)",
    )
    parser.add_argument("--baseline-messages", type=int, default=2_000)
    parser.add_argument(
        "--service-latency-ms",
        type=float,
        default=0.0,
        help="the fake's time per request at Graph's real budget (scaled with it)",
    )
    parser.add_argument("--model-passes", type=int, default=MODEL_PASSES)
    parser.add_argument("--only", default="models,one,many")
    parser.add_argument("--dsn", default=DEFAULT_DSN, help="admin DSN (creates bench_* databases)")
    parser.add_argument("--interval", type=float, default=0.25, help="sampling interval, s")
    parser.add_argument("--keep", action="store_true", help="keep the databases and work dir")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help=f"CI size: {SMOKE_MESSAGES} messages, {SMOKE_MAILBOXES} mailboxes of "
        f"{SMOKE_MESSAGES_EACH}, budgets {MAX_BUDGET_PER_10_MIN:,}",
    )
    args = parser.parse_args()
    if args.smoke:
        args.messages = SMOKE_MESSAGES
        args.messages_each = SMOKE_MESSAGES_EACH
        args.baseline_messages = SMOKE_BASELINE
        args.mailboxes = SMOKE_MAILBOXES
        args.budget_per_10_min = args.many_budget_per_10_min = MAX_BUDGET_PER_10_MIN
        args.interval = SMOKE_INTERVAL_S
        args.model_passes = 1
    for name in ("budget_per_10_min", "many_budget_per_10_min"):
        value = getattr(args, name)
        if not GRAPH_REQUESTS_PER_10_MIN <= value <= MAX_BUDGET_PER_10_MIN:
            parser.error(
                f"--{name.replace('_', '-')}: from {GRAPH_REQUESTS_PER_10_MIN:,} (Graph's) to "
                f"{MAX_BUDGET_PER_10_MIN:,} (the tenant key's ceiling)"
            )
    return asyncio.run(main(args))


if __name__ == "__main__":
    sys.exit(cli())
