"""`inboxd import`: .eml files, mbox files and Maildirs into one mailbox.

The import drives the daemon's own path (docs/architecture.md):

    plan       adapters.files.plan_import: every path checked, nothing read yet
    set up     DSN → pool → schema.sql (idempotent) → tenant/mailbox rows → object store
    pages      adapters.files.ImportSource: raw messages read and hashed in a worker
               thread, those this mailbox does not store yet parsed off the loop
               (pipeline.mime.workers, its limiter), one page ahead
               (daemon.sync.pages.read_ahead)
    ingest     the bounded queue and its worker (daemon.sync.queue) → IngestStage,
               one transaction per page; items that come back retriable_failure
               are retried through the queue with backoff, BATCH_ATTEMPTS times
    report     counts by outcome, dead items, skipped files, messages/s
               (daemon.commands.import_report: progress bar, summary, --json)

Messages are content-addressed (external id = raw sha256), so re-running an
import, complete or not, only adds what is missing: the rest is reported as
duplicate, without being parsed again.

States and stopping:
- setting up: a first SIGINT/SIGTERM aborts at once (nothing written yet).
- importing: a first signal stops intake; the page being ingested finishes
  (its transaction commits or rolls back, never half of it), then the partial
  summary is printed and the exit code is 130. A second signal cancels that
  page too (rolled back) and exits 130.
- a page still failing after its retries (database gone, object store full)
  ends the run: committed pages stay, the summary says how many messages were
  not imported, exit code 1.
- a file deleted between planning and reading is skipped and listed with the
  skipped files; one that cannot be read otherwise ends the run once every
  message read before it is stored (status failed, exit code 1). So does a parse
  worker process that dies (the OOM killer); one that a stop signal to the whole
  process group reached while it started is part of that stop (exit code 130).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import anyio
import asyncpg
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream

from inboxd.adapters.base import Page
from inboxd.adapters.files import ImportPlan, ImportSource, PageRefs, SourceError, plan_import
from inboxd.adapters.objectstore import open_object_store
from inboxd.daemon.commands.common import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    CommandError,
    Subparsers,
    configured_mailboxes,
    database_error,
    load_config,
    object_store_spec,
    open_pool,
    resolve,
    target_of,
)
from inboxd.daemon.commands.import_pages import PageSettler, Unsettled
from inboxd.daemon.commands.import_report import ImportSummary, ProgressBar, print_report
from inboxd.daemon.commands.migrate import apply_with_deadline
from inboxd.daemon.commands.stopping import StopSignals
from inboxd.daemon.metrics.registry import Metrics
from inboxd.daemon.sync.pages import read_ahead, unwrap_single
from inboxd.daemon.sync.queue import IngestQueue
from inboxd.pipeline.copies import settled_copies
from inboxd.pipeline.errors import DATABASE_ERRORS
from inboxd.pipeline.extraction.inbox import HandOff
from inboxd.pipeline.ingest.stage import IngestStage
from inboxd.pipeline.tenancy import ensure_mailbox, mailbox_exists, validate_id

log = structlog.get_logger(__name__)

# A database that answers at all answers `SELECT 1` (or two small upserts) at once.
PROBE_TIMEOUT_S = 5.0
# Pages queued for the ingest worker: the import has one producer, which waits for
# each page's results before the next, so one page is all the queue ever holds.
IMPORT_QUEUE_PAGES = 1

ParseMode = Literal["auto", "thread", "process"]
# Measured on 2 shared cores, fresh database: the whole corpus (394 messages, one
# batch, 15 MB) imports faster parsing in a thread (worker start-up is not
# repaid); 5,000 generated messages run at 1,645 msg/s with a worker process
# against 1,061 in a thread (bench/ingest.py (e)), since parsing then overlaps
# the database and object-store work instead of sharing the GIL with it.
DEFAULT_PARSE_MODE: ParseMode = "auto"
# "auto" parses in worker processes when the input is at least this large.
PROCESS_PARSE_MIN_BYTES = 32 * 1024 * 1024


def register(subparsers: Subparsers, parent: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "import",
        parents=[parent],
        help="import .eml files, mbox files and Maildirs into a mailbox",
        description=(
            "Import mail from local files into MAILBOX of TENANT: a mailbox the "
            "configuration's tenant files name (--config) or the database has already; "
            "--create makes a new one (a typo'd id would otherwise start a mailbox "
            "nobody reads). "
            "PATH may be an .eml file, an mbox file (first line starts with 'From '), a "
            "Maildir (cur/ new/ tmp/), or a directory searched recursively for .eml and "
            ".mbox files and Maildirs; other files there are skipped and counted. "
            "The schema is applied first (like `inboxd migrate`), so this works on an "
            "empty database. Re-running is safe: messages already stored are reported "
            "as duplicate. Exit codes: 0 done (dead items included), 1 operational "
            "failure, 2 usage error, 130 interrupted."
        ),
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="files or directories")
    parser.add_argument("--tenant", required=True, help="tenant id (a-z 0-9 . _ -)")
    parser.add_argument("--mailbox", required=True, help="mailbox id (a-z 0-9 . _ -)")
    parser.add_argument(
        "--create",
        action="store_true",
        help="create TENANT and MAILBOX when neither the configuration nor the database has them",
    )
    parser.add_argument(
        "--backfill",
        action="store_true",
        help="write one mailbox.sync_completed event per batch instead of one event per "
        "message (for large historical imports the application need not react to)",
    )
    parser.add_argument(
        "--parse-in",
        choices=("auto", "thread", "process"),
        default=DEFAULT_PARSE_MODE,
        help="parse MIME in a worker thread or in worker processes, one per CPU; auto "
        "uses processes for inputs of 32 MB or more (default: %(default)s)",
    )
    parser.set_defaults(handler=run)


# --- the run ----------------------------------------------------------------------------


class _Importer:
    def __init__(self, args: argparse.Namespace, plan: ImportPlan, *, started: float) -> None:
        self.args = args
        self.plan = plan
        self.started = started  # time.monotonic() before planning: elapsed_s includes it
        self.tenant: str = args.tenant
        self.mailbox: str = args.mailbox
        self.summary = ImportSummary(
            self.tenant, self.mailbox, len(plan.files), [str(p) for p in plan.skipped]
        )
        self.signals = StopSignals("import", on_stop=self._stop_waiting)
        # cancelled by a first signal while the import waits for the next page
        self.waiting_scope: anyio.CancelScope | None = None
        self.progress = ProgressBar()
        self.read_source: ImportSource | None = None  # its read_error and vanished files
        self.settler = PageSettler(self.summary, self.signals.stop)

    # signals ---------------------------------------------------------------------------

    def _stop_waiting(self) -> None:
        if self.waiting_scope is not None:
            self.waiting_scope.cancel()

    # pages -----------------------------------------------------------------------------

    def source(self, pool: asyncpg.Pool) -> ImportSource:
        mode = self.args.parse_in
        if mode == "auto":
            mode = "process" if self.plan.total_bytes >= PROCESS_PARSE_MIN_BYTES else "thread"

        async def known(ids: Sequence[str]) -> set[str]:
            return await settled_copies(pool, self.tenant, self.mailbox, ids)

        return ImportSource(
            self.tenant,
            self.mailbox,
            self.plan,
            parse_in_thread=mode == "thread",
            backfill=self.args.backfill,
            known=known,
        )

    async def ingest_pages(self, source: ImportSource, queue: IngestQueue) -> None:
        """Every page through the queue, settled or retried, until done or stopped."""
        async with read_ahead(source, None) as pages:
            while not self.signals.stop.is_set():
                page: Page | None = None
                with anyio.CancelScope() as self.waiting_scope:
                    page = await _next(pages)
                self.waiting_scope = None
                if page is None:  # no more pages, or a stop signal while waiting
                    return
                page_started = time.monotonic()
                await self.settler.ingest(queue, source, page)
                refs = page.context
                assert isinstance(refs, PageRefs)
                log.info(
                    "import_batch_committed",
                    tenant=self.tenant,
                    mailbox=self.mailbox,
                    size=len(page.items),
                    total=self.summary.messages,
                    ingest_s=round(time.monotonic() - page_started, 3),
                )
                self.progress.advance(refs.span_bytes, self.summary.messages)

    # the whole run ---------------------------------------------------------------------

    async def _refuse_unknown(self, conn: asyncpg.Connection) -> None:
        """Usage error when neither the configuration nor the database knows the
        mailbox (without --create): the import would start a mailbox nobody reads."""
        configured = await anyio.to_thread.run_sync(configured_mailboxes, self.args.config)
        if configured is not None and (self.tenant, self.mailbox) in configured:
            return
        if await mailbox_exists(conn, self.tenant, self.mailbox):
            return
        where = (
            f"the tenant files of {self.args.config}"
            if configured is not None
            else "any configuration"
        )
        raise CommandError(
            f"mailbox {self.mailbox!r} of tenant {self.tenant!r} is not in {where} nor in the "
            "database: check the ids ('inboxd status' lists the mailboxes), or pass --create "
            "to make it",
            EXIT_USAGE,
        )

    async def run(self) -> int:
        try:
            await self.signals.run(self._run)
        finally:
            self.summary.elapsed_s = time.monotonic() - self.started
        return self._finish()

    async def _run(self) -> None:
        config = load_config(self.args.config)
        spec = object_store_spec(config, self.args.config)
        choice = await resolve(self.args, config)
        async with open_pool(choice) as pool, open_object_store(spec, pool=pool) as store:
            try:
                async with pool.acquire() as conn:
                    await apply_with_deadline(conn)
                    with anyio.fail_after(PROBE_TIMEOUT_S):
                        if not self.args.create:
                            await self._refuse_unknown(conn)
                        await ensure_mailbox(conn, self.tenant, self.mailbox, provider="import")
            except DATABASE_ERRORS as exc:
                raise database_error(exc, choice) from exc
            handoff = extraction_handoff(self.args.config, config, self.tenant)
            queue = IngestQueue(
                IngestStage(pool, store, extraction=handoff),
                Metrics(),
                capacity_pages=IMPORT_QUEUE_PAGES,
            )
            source = self.read_source = self.source(pool)
            log.info(
                "import_started",
                tenant=self.tenant,
                mailbox=self.mailbox,
                files=len(self.plan.files),
                bytes=self.plan.total_bytes,
            )
            self.signals.working = True
            with self.progress.open(self.plan.total_bytes):
                async with anyio.create_task_group() as workers:
                    await workers.start(queue.run_worker)
                    try:
                        await unwrap_single(self.ingest_pages(source, queue))
                    except Unsettled:
                        self.summary.status = "incomplete"
                        self.summary.unread_input = True
                        self.summary.error = await _explain(
                            pool, target_of(choice), self.summary.error
                        )
                    except anyio.BrokenWorkerProcess as exc:  # after the pages before it
                        self.summary.status = "failed"
                        self.summary.unread_input = True
                        self.summary.error = str(exc)
                    finally:
                        queue.close()

    def _finish(self) -> int:
        exit_code = self._settle()
        rolled_back = self.signals.aborted and self.signals.working
        print_report(self.summary, as_json=self.args.json, rolled_back=rolled_back)
        return exit_code

    def _settle(self) -> int:
        """Set the summary's final status from how the run ended; returns the exit code."""
        s = self.summary
        source = self.read_source
        read_error = source.read_error if source is not None else None
        if source is not None:  # gone before they were read: skipped, not imported
            s.skipped.extend(source.vanished)
            s.files -= len(source.vanished)
        if self.signals.stop.is_set():
            s.status = "interrupted"
            s.unread_input = True
            return EXIT_INTERRUPTED
        if s.status in ("incomplete", "failed"):
            return EXIT_FAILURE
        if read_error is not None:
            s.status = "failed"
            s.unread_input = True
            s.error = str(read_error)
            return EXIT_FAILURE
        return EXIT_OK


def extraction_handoff(path: Path | None, config: dict[str, Any], tenant_id: str) -> HandOff | None:
    """Imported mail reaches the tenant's processors like any door's: new rows go to
    extraction_inbox in the ingest transaction, for a running daemon's feeder (it
    looks every few seconds). Only when the main file names tenant files (`[tenants]`)
    and the tenant's has `[[processors]]`; the tenant files are read only then (an
    import without them starts as fast as before). A tenant file with problems is
    reported and the import goes on without the hand-off: `inboxd extract backfill`
    queues the mail later."""
    if path is None or "tenants" not in config:
        return None
    from inboxd.daemon.config.main import ConfigError, load_main, load_tenants

    try:
        tenants = load_tenants(load_main(path))
    except ConfigError as exc:
        log.warning("import_tenant_config_unusable", error=str(exc))
        return None
    tenant = tenants.tenants.get(tenant_id)
    if tenant is None:
        if tenants.problems:
            log.warning(
                "import_without_extraction",
                tenant=tenant_id,
                reason="tenant files have problems",
                problems=[str(p) for p in tenants.problems],
            )
        return None
    if not tenant.processors:
        return None
    return HandOff(wants=lambda t: t == tenant_id)


async def _next(pages: MemoryObjectReceiveStream[Page]) -> Page | None:
    """The next page; None when there are no more."""
    try:
        return await pages.receive()
    except anyio.EndOfStream:
        return None


async def _explain(pool: asyncpg.Pool, target: str, detail: str | None) -> str:
    """Why a batch stayed unsettled: the database when it does not answer, else `detail`."""
    try:
        with anyio.fail_after(PROBE_TIMEOUT_S):
            await pool.fetchval("SELECT 1")
    except DATABASE_ERRORS as exc:
        cause = " ".join(str(exc).split()) or type(exc).__name__
        return f"database at {target} did not answer: {cause}"
    return detail or "retriable failure"


async def run(args: argparse.Namespace) -> int:
    for kind, value in (("tenant", args.tenant), ("mailbox", args.mailbox)):
        try:
            validate_id(kind, value)
        except ValueError as exc:
            raise CommandError(str(exc), EXIT_USAGE) from exc
    started = time.monotonic()
    try:
        plan = await anyio.to_thread.run_sync(plan_import, args.paths)
    except SourceError as exc:
        raise CommandError(str(exc)) from exc
    return await _Importer(args, plan, started=started).run()
