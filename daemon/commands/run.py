"""`inboxd run --config FILE`: the long-running daemon (daemon/supervisor.py).

Start-up order: read and validate the whole configuration (any problem → every
problem printed with file and key, exit 2, nothing started); the open-file limit
raised to what the mailboxes need, or a warning (daemon/fd_limit.py); resolve the DSN
(embedded PostgreSQL when none is configured); apply the schema (idempotent);
log the database, data directory and every watched source (`daemon_starting`,
`source_watched`); open the object store; then run the supervisor until
SIGTERM/SIGINT, exit 0. A listener address that cannot be bound ends the
command with one line, ``listener HOST:PORT: address already in use`` (exit 1).

An embedded PostgreSQL that this command started (nothing was running in the data
directory) is stopped when the daemon ends, whatever ended it: Ctrl-C on `make run`
leaves no server behind. One that was running before is left running, and the last
line says so and how to stop it.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import errno
import gc
import os
import sys

import anyio
import structlog

from inboxd.adapters.objectstore import open_object_store
from inboxd.daemon.commands.common import (
    EXIT_OK,
    EXIT_USAGE,
    CommandError,
    Subparsers,
    global_options,
    open_pool,
    resolve,
    target_of,
)
from inboxd.daemon.commands.migrate import apply_with_deadline
from inboxd.daemon.config.main import ConfigError, MainConfig, load_main, load_tenants
from inboxd.daemon.config.tenant import TenantConfig
from inboxd.daemon.database import DsnChoice
from inboxd.daemon.embedded_pg.data_dir import data_dir_and_origin
from inboxd.daemon.fd_limit import ensure_fd_limit
from inboxd.daemon.logging import configure_logging
from inboxd.daemon.metrics.registry import Metrics
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


def register(subparsers: Subparsers, parent: argparse.ArgumentParser) -> None:
    del parent  # the shared options, but with --config required (and shown so in --help)
    parser = subparsers.add_parser(
        "run",
        parents=[global_options(config_required=True)],
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
    ensure_fd_limit(m for t in tenant_set.tenants.values() for m in t.mailboxes)
    was_running = await anyio.to_thread.run_sync(_embedded_running)
    choice = await resolve(args, main.raw)
    try:
        return await _serve(main, tenant_set.tenants, choice)
    finally:
        if choice.source == "embedded":
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(_leave_embedded, not was_running)


def _embedded_running() -> bool:
    from inboxd.daemon.embedded_pg.server import find_running

    return find_running(environ=os.environ) is not None


def _leave_embedded(started_here: bool) -> None:
    """Stop the embedded server this command started; say what happens to the other."""
    from inboxd.daemon.embedded_pg.errors import EmbeddedPostgresError
    from inboxd.daemon.embedded_pg.server import stop_embedded

    data_dir = data_dir_and_origin(os.environ)[0]
    if not started_here:
        print(
            f"inboxd: the embedded PostgreSQL in {data_dir} keeps running (it was running "
            "before this daemon started); 'inboxd db stop' stops it",
            file=sys.stderr,
        )
        return
    try:
        stop_embedded(environ=os.environ)
    except EmbeddedPostgresError as exc:
        print(f"inboxd: the embedded PostgreSQL in {data_dir} did not stop: {exc}", file=sys.stderr)
        return
    print(
        f"inboxd: the embedded PostgreSQL this daemon started in {data_dir} is stopped",
        file=sys.stderr,
    )


async def _serve(main: MainConfig, tenants: dict[str, TenantConfig], choice: DsnChoice) -> int:
    pool_size = main.ingest_workers + POOL_EXTRA_CONNECTIONS
    async with open_pool(choice, max_size=pool_size) as pool:
        async with pool.acquire() as conn:
            await apply_with_deadline(conn)
            database = await conn.fetchval("SELECT current_database()")
        _log_start(main, tenants, choice, database)
        metrics = Metrics()
        metrics.set_queue(0, capacity=main.queue_capacity)
        async with open_object_store(main.object_store, pool=pool) as store:
            daemon = Daemon(main, tenants, pool=pool, dsn=choice.dsn, store=store, metrics=metrics)
            tune_gc()  # after everything the daemon keeps for its lifetime is loaded
            try:
                await daemon.run()
            except BaseException as exc:
                if (bind := _bind_error(exc)) is not None:
                    raise CommandError(
                        f"listener {main.listen_host}:{main.listen_port}: {_bind_reason(bind)}"
                    ) from exc
                raise
    return EXIT_OK


def _log_start(
    main: MainConfig, tenants: dict[str, TenantConfig], choice: DsnChoice, database: str
) -> None:
    """What an operator checks first: which database, which data directory, which sources."""
    data_dir, data_dir_origin = data_dir_and_origin(os.environ)
    log.info(
        "daemon_starting",
        config=str(main.config_path),
        database=database,
        server=target_of(choice),
        dsn_source=choice.source,
        data_dir=str(data_dir),
        data_dir_origin=data_dir_origin,
        object_store=main.object_store.get("path") or main.object_store.get("bucket"),
        listener=f"{main.listen_host}:{main.listen_port}",
    )
    for tenant in sorted(tenants.values(), key=lambda t: t.tenant_id):
        for mailbox in tenant.mailboxes:
            path = mailbox.settings.get("path")
            log.info(
                "source_watched",
                tenant=mailbox.tenant_id,
                mailbox=mailbox.mailbox_id,
                provider=mailbox.provider,
                sync_mode=mailbox.sync_mode,
                path=None if path is None else str(path),
                runnable=mailbox.runnable,
            )


# errno values bind(2) answers for a listener address it cannot take.
_BIND_ERRNOS = (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES)


def _bind_error(exc: BaseException) -> OSError | None:
    """The listener's failed bind inside (nested groups of) `exc`, if that is what it is."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (found := _bind_error(inner)) is not None:
                return found
        return None
    # asyncio's create_server words it "error while attempting to bind on address ..."
    if isinstance(exc, OSError) and exc.errno in _BIND_ERRNOS and "bind" in str(exc):
        return exc
    return None


def _bind_reason(exc: OSError) -> str:
    # "[Errno 98] error while attempting to bind on address ('127.0.0.1', 8025): address
    # already in use" -> "address already in use": the address is already in our line.
    return str(exc).rpartition("): ")[2] or os.strerror(exc.errno or 0).lower()


def _print_problems(error: ConfigError) -> None:
    for problem in error.problems:
        print(problem, file=sys.stderr)  # the same lines as `inboxd check-config`
