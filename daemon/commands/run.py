"""`inboxd run --config FILE`: the long-running daemon (daemon/supervisor.py).

Start-up order: read and validate the whole configuration (any problem → every
problem printed with file and key, exit 2, nothing started); resolve the DSN
(embedded PostgreSQL when none is configured); apply the schema (idempotent);
open the object store; then run the supervisor until SIGTERM/SIGINT, exit 0.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import os
import sys

import structlog

from inboxd.adapters.objectstore import open_object_store
from inboxd.daemon.commands.common import (
    EXIT_OK,
    EXIT_USAGE,
    CommandError,
    open_pool,
    resolve,
)
from inboxd.daemon.commands.migrate import apply_with_deadline
from inboxd.daemon.config import ConfigError, load_main, load_tenants
from inboxd.daemon.logging import configure_logging
from inboxd.daemon.supervisor import Daemon
from inboxd.daemon.webhooks.esp_config import build_delivery_hooks
from inboxd.pipeline.delivery.intake import WRITERS as DELIVERY_WRITERS

log = structlog.get_logger(__name__)

# glibc malloc arenas for the daemon process (see cap_malloc_arenas).
MALLOC_ARENA_MAX = 2
_M_ARENA_MAX = -8  # mallopt(3) parameter number, glibc malloc.h

# Collector thresholds for the daemon (gen 0 allocations, gen 1 and gen 2 sweeps);
# see tune_gc.
GC_THRESHOLDS = (50_000, 50, 100)

# Connections: one per ingest worker, one per concurrently syncing mailbox's
# bookkeeping, a few for the listener's requests, the delivery intake's writers
# and the delivery worker.
POOL_EXTRA_CONNECTIONS = 6 + DELIVERY_WRITERS + 1


def register(subparsers: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "run",
        parents=[parent],
        help="run the daemon (sync mailboxes, serve HTTP)",
        description="Run inboxd: sync every configured mailbox, serve /healthz, /readyz, "
        "/metrics and the application API. SIGTERM/SIGINT stop gracefully, "
        "SIGHUP reloads tenant files, SIGUSR1 cancels running syncs.",
    )
    parser.set_defaults(handler=run)


def cap_malloc_arenas() -> None:
    """Limit glibc to MALLOC_ARENA_MAX malloc arenas in this process.

    glibc gives each thread that allocates its own arena (up to 8 per core);
    with file reads, object-store writes and DNS in worker threads, freed
    memory stayed spread over many arenas and RSS crept from 158 to 245 MB over
    a 100k-message Maildir backfill; capped at 2 it stayed flat around 130 MB
    (bench/README.md). MALLOC_ARENA_MAX in the environment takes precedence.
    """
    if os.environ.get("MALLOC_ARENA_MAX") or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(_M_ARENA_MAX, MALLOC_ARENA_MAX)
    except (OSError, AttributeError):  # not glibc (musl has no arenas to cap)
        return


def tune_gc() -> None:
    """Move everything loaded at start out of the collector's way, and collect less often.

    A long-running server allocates many short-lived objects per request; with
    the default thresholds (700, 10, 10) full collections walk every module,
    class and config object each time, and their pauses were the p99 of webhook
    requests: bench/webhooks.py measured p99 28 ms → 8 ms with `gc.freeze()`
    after start, and +15 % requests/s with gen-0 threshold 50,000 (bench/README.md).
    Cycles are still collected; memory held by garbage grows by a few MB at most.
    """
    gc.collect()  # garbage of the start-up must not be frozen in for the process's life
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


async def run(args: argparse.Namespace) -> int:
    cap_malloc_arenas()
    if args.config is None:
        raise CommandError("inboxd run needs --config FILE", EXIT_USAGE)
    try:
        main = load_main(args.config, check_secrets=True)
    except ConfigError as exc:
        _print_problems(exc)
        raise CommandError(
            f"{len(exc.problems)} configuration problem(s); not started", EXIT_USAGE
        ) from exc
    tenant_set = load_tenants(main, check_secrets=True)
    problems = tenant_set.problems + build_delivery_hooks(tenant_set.tenants)[1]
    if problems:
        _print_problems(ConfigError(problems))
        raise CommandError(f"{len(problems)} configuration problem(s); not started", EXIT_USAGE)
    configure_logging(
        None, level=args.log_level if args.log_level != "warning" else main.log_level, final=True
    )
    choice = await resolve(args, main.raw)
    pool_size = main.ingest_workers + POOL_EXTRA_CONNECTIONS
    async with open_pool(choice, max_size=pool_size) as pool:
        async with pool.acquire() as conn:
            await apply_with_deadline(conn)
        async with open_object_store(main.object_store) as store:
            daemon = Daemon(main, tenant_set.tenants, pool=pool, dsn=choice.dsn, store=store)
            tune_gc()  # after everything the daemon keeps for its lifetime is loaded
            await daemon.run()
    return EXIT_OK


def _print_problems(error: ConfigError) -> None:
    for problem in error.problems:
        print(problem, file=sys.stderr)  # the same lines as `inboxd check-config`
