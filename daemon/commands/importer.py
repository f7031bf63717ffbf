"""`inboxd import`: .eml files, mbox files and Maildirs into one mailbox.

    plan       adapters.files.plan_import: every path checked, nothing read yet
    set up     DSN → pool → schema.sql (idempotent) → tenant/mailbox rows → object store
    produce    read IMPORT_BATCH_SIZE raw messages (worker thread), parse them
               (pipeline.mime.parse_raw, off the event loop) → channel with no buffer
    consume    IngestStage.ingest, one transaction per batch; items that come back
               retriable_failure are retried with backoff, BATCH_ATTEMPTS times
    report     counts by outcome, dead items, skipped files, messages/s
               (daemon.commands.import_report: progress bar, summary, --json)

Parsing batch N+1 overlaps the ingest of batch N; the unbuffered channel keeps at
most two batches in memory. Messages are content-addressed (external id = raw
sha256), so re-running an import, complete or not, only adds what is missing:
the rest is reported as duplicate.

States and stopping:
- setting up: a first SIGINT/SIGTERM aborts at once (nothing written yet).
- importing: a first signal stops intake; the batch being ingested finishes
  (its transaction commits or rolls back, never half of it), then the partial
  summary is printed and the exit code is 130. A second signal cancels that
  batch too (rolled back) and exits 130.
- a batch still failing after its retries (database gone, object store full)
  ends the run: committed batches stay, the summary says how many messages were
  not imported, exit code 1. A file that vanishes mid-run ends it the same way.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import anyio
import anyio.to_process
import anyio.to_thread
import asyncpg
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_attempt,
    stop_any,
    wait_exponential_jitter,
)

from inboxd.adapters.files import ImportPlan, RawMessage, SourceError, iter_messages, plan_import
from inboxd.daemon.commands.common import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    CommandError,
    database_error,
    load_config,
    object_store_spec,
    open_pool,
    resolve,
    target_of,
)
from inboxd.daemon.commands.import_report import ImportSummary, ProgressBar, print_report
from inboxd.daemon.commands.migrate import apply_with_deadline
from inboxd.pipeline.ingest import IngestBatch, IngestStage
from inboxd.pipeline.message import DeadItem, MessageData
from inboxd.pipeline.outcomes import ItemResult, Outcome
from inboxd.pipeline.parsing import parse_many, parse_many_in_worker, with_raw
from inboxd.pipeline.tenancy import ensure_mailbox, validate_id

log = structlog.get_logger(__name__)

# Messages per ingest transaction. The cascade costs ≤ 2 queries per batch and
# every write is one set-based statement, so bigger batches amortise round trips;
# 500 messages of the corpus' mix (~18 MB) commit in 1-2 s on a 2-core VM, which
# is also about the longest a Ctrl-C waits and what a failed batch retries.
# (100, 250, 500 and 1000 measured within noise of each other on 3,940 messages.)
IMPORT_BATCH_SIZE = 500
# A batch also closes at this many raw bytes, so an mbox of large attachments
# keeps memory bounded (two batches in flight, plus parsed attachment copies).
IMPORT_BATCH_MAX_BYTES = 64 * 1024 * 1024
# Messages handed to one parse call: small enough that a cancelled producer stops
# within a fraction of a second, large enough that per-call overhead (thread
# hand-off, or pickling to a worker process) stays negligible.
PARSE_CHUNK_SIZE = 50
# Attempts per batch while items come back retriable_failure (connection lost,
# server restarting, object-store hiccup); waits grow 0.5 s → 1 → 2 → 4 s (+ up to
# 0.5 s jitter each), so a database restart of ~8 s is ridden out before giving up.
BATCH_ATTEMPTS = 5
RETRY_INITIAL_WAIT_S = 0.5
RETRY_MAX_WAIT_S = 8.0
RETRY_JITTER_S = 0.5
# One ingest call (transaction + object-store writes). A healthy batch takes ~1 s;
# past this the server or the disk is stuck, and the batch is retried.
BATCH_DEADLINE_S = 300.0
# A database that answers at all answers `SELECT 1` (or two small upserts) at once.
PROBE_TIMEOUT_S = 5.0

ParseMode = Literal["auto", "thread", "process"]
# Measured on 2 shared cores, fresh database: the whole corpus (394 messages, one
# batch, 15 MB) imports faster parsing in a thread (worker start-up is not
# repaid); 5,000 generated messages run at 1,645 msg/s with a worker process
# against 1,061 in a thread (bench/ingest.py (e)), since parsing then overlaps
# the database and object-store work instead of sharing the GIL with it.
DEFAULT_PARSE_MODE: ParseMode = "auto"
# "auto" parses in worker processes when the input is at least this large.
PROCESS_PARSE_MIN_BYTES = 32 * 1024 * 1024

Item = MessageData | DeadItem


def register(subparsers: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "import",
        parents=[parent],
        help="import .eml files, mbox files and Maildirs into a mailbox",
        description=(
            "Import mail from local files into MAILBOX of TENANT (both created if missing). "
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


# --- parsing (module level: worker processes import and call it) ------------------------


def parse_chunk(
    raws: Sequence[bytes], tenant_id: str, mailbox_id: str, keep_raw: bool
) -> list[Item]:
    """parse_raw each message of the import door (pipeline.parsing.parse_many)."""
    return parse_many(raws, tenant_id, mailbox_id, "import", keep_raw=keep_raw)


def parse_chunk_in_worker(raws: Sequence[bytes], tenant_id: str, mailbox_id: str) -> list[Item]:
    """parse_chunk in a worker process, which leaves Ctrl-C to the parent."""
    return parse_many_in_worker(raws, tenant_id, mailbox_id, "import")


def _take(messages: Iterator[RawMessage]) -> list[RawMessage]:
    """The next batch of raw messages (blocking file I/O: run in a worker thread)."""
    batch: list[RawMessage] = []
    size = 0
    for message in messages:
        batch.append(message)
        size += len(message.raw)
        if len(batch) >= IMPORT_BATCH_SIZE or size >= IMPORT_BATCH_MAX_BYTES:
            break
    return batch


# --- the run ----------------------------------------------------------------------------


@dataclass(slots=True)
class _Batch:
    refs: list[str]
    items: list[Item]
    span_bytes: int


class _Unsettled(Exception):
    """Some items of a batch are still retriable_failure after an attempt."""

    def __init__(self, count: int, detail: str) -> None:
        super().__init__(detail)
        self.count = count
        self.detail = detail


class _Importer:
    def __init__(self, args: argparse.Namespace, plan: ImportPlan) -> None:
        self.args = args
        self.plan = plan
        self.tenant: str = args.tenant
        self.mailbox: str = args.mailbox
        self.summary = ImportSummary(
            self.tenant, self.mailbox, len(plan.files), [str(p) for p in plan.skipped]
        )
        self.stop = anyio.Event()
        self.aborted = False
        self.importing = False
        self.read_error: SourceError | None = None
        self.producer_scope = anyio.CancelScope()
        self.progress = ProgressBar()

    # signals ---------------------------------------------------------------------------

    async def watch_signals(self, main_scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                name = signal.Signals(signum).name
                if not self.importing or self.stop.is_set():
                    log.warning("import_aborted", signal=name)
                    self.aborted = True
                    self.stop.set()
                    main_scope.cancel()
                    return
                log.warning("import_stopping", signal=name)
                if sys.stderr.isatty():
                    print(
                        "inboxd: stopping after the current batch "
                        "(press Ctrl-C again to abandon it)",
                        file=sys.stderr,
                    )
                self.stop.set()
                self.producer_scope.cancel()

    # producer --------------------------------------------------------------------------

    async def produce(self, send: MemoryObjectSendStream[_Batch]) -> None:
        mode = self.args.parse_in
        if mode == "auto":
            mode = "process" if self.plan.total_bytes >= PROCESS_PARSE_MIN_BYTES else "thread"
        keep_raw = mode == "thread"
        messages = iter_messages(self.plan)
        with self.producer_scope:
            async with send:
                while True:
                    try:
                        raws = await anyio.to_thread.run_sync(_take, messages)
                    except SourceError as exc:
                        self.read_error = exc
                        return
                    if not raws:
                        return
                    parse_started = time.monotonic()
                    items = await self._parse([m.raw for m in raws], keep_raw)
                    log.debug(
                        "import_batch_parsed",
                        size=len(items),
                        parse_s=round(time.monotonic() - parse_started, 3),
                    )
                    try:
                        await send.send(
                            _Batch(
                                [m.source_ref for m in raws], items, sum(m.span_bytes for m in raws)
                            )
                        )
                    except anyio.BrokenResourceError:
                        return  # the consumer stopped (failure or stop request)

    async def _parse(self, raws: list[bytes], keep_raw: bool) -> list[Item]:
        chunks = [raws[i : i + PARSE_CHUNK_SIZE] for i in range(0, len(raws), PARSE_CHUNK_SIZE)]
        if keep_raw:
            parsed = [
                await anyio.to_thread.run_sync(parse_chunk, chunk, self.tenant, self.mailbox, True)
                for chunk in chunks
            ]
        else:
            parsed = [[] for _ in chunks]

            async def one(i: int) -> None:
                parsed[i] = await anyio.to_process.run_sync(
                    parse_chunk_in_worker, chunks[i], self.tenant, self.mailbox
                )

            async with anyio.create_task_group() as tg:
                for i in range(len(chunks)):
                    tg.start_soon(one, i)
        items = [item for chunk in parsed for item in chunk]
        if not keep_raw:
            items = [with_raw(item, raw) for item, raw in zip(items, raws, strict=True)]
        return items

    # consumer --------------------------------------------------------------------------

    async def consume(self, stage: IngestStage, receive: MemoryObjectReceiveStream[_Batch]) -> None:
        async with receive:
            async for batch in receive:
                if self.stop.is_set():
                    break
                batch_started = time.monotonic()
                await self._ingest(stage, batch)
                log.info(
                    "import_batch_committed",
                    tenant=self.tenant,
                    mailbox=self.mailbox,
                    size=len(batch.items),
                    total=self.summary.messages,
                    ingest_s=round(time.monotonic() - batch_started, 3),
                )
                self.progress.advance(batch.span_bytes, self.summary.messages)

    async def _ingest(self, stage: IngestStage, batch: _Batch) -> None:
        pending = list(range(len(batch.items)))
        first_failure = True

        def log_retry(state: RetryCallState) -> None:
            nonlocal first_failure
            if first_failure:  # STYLE.md rule 8: "unavailable" once, not every attempt
                first_failure = False
                exc = state.outcome.exception() if state.outcome else None
                log.warning(
                    "import_batch_retrying",
                    tenant=self.tenant,
                    mailbox=self.mailbox,
                    items=len(pending),
                    error=str(exc),
                )

        retrying = AsyncRetrying(
            stop=stop_any(stop_after_attempt(BATCH_ATTEMPTS), lambda _: self.stop.is_set()),
            wait=wait_exponential_jitter(
                initial=RETRY_INITIAL_WAIT_S, max=RETRY_MAX_WAIT_S, jitter=RETRY_JITTER_S
            ),
            retry=retry_if_exception_type(_Unsettled),
            sleep=self._sleep,
            before_sleep=log_retry,
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    pending = await self._attempt(stage, batch, pending)
        except _Unsettled as exc:
            self.summary.outcomes[Outcome.RETRIABLE_FAILURE.value] += exc.count
            self.summary.not_imported += exc.count
            self.summary.error = exc.detail
            raise
        if not first_failure:
            log.warning("import_batch_recovered", tenant=self.tenant, mailbox=self.mailbox)

    async def _attempt(self, stage: IngestStage, batch: _Batch, pending: list[int]) -> list[int]:
        """Ingest the pending items once; returns those still retriable, raising
        `_Unsettled` when there are any."""
        items = [batch.items[i] for i in pending]
        try:
            with anyio.fail_after(BATCH_DEADLINE_S):
                results = await stage.ingest(
                    IngestBatch(self.tenant, self.mailbox, items, backfill=self.args.backfill)
                )
        except TimeoutError:
            detail = f"a batch did not finish within {BATCH_DEADLINE_S:g} s"
            results = [
                ItemResult(i, Outcome.RETRIABLE_FAILURE, detail=detail) for i in range(len(items))
            ]
        still: list[int] = []
        detail = ""
        for result in results:
            index = pending[result.index]
            if result.outcome is Outcome.RETRIABLE_FAILURE:
                still.append(index)
                detail = detail or (result.detail or "retriable failure")
                continue
            self.summary.outcomes[result.outcome.value] += 1
            if result.outcome is Outcome.PERMANENT_FAILURE:
                self.summary.dead.append((batch.refs[index], result.detail or "dead item"))
        if still:
            raise _Unsettled(len(still), detail)
        return still

    async def _sleep(self, seconds: float) -> None:
        """Backoff that a stop request cuts short (no transaction is open here)."""
        with anyio.move_on_after(seconds):
            await self.stop.wait()

    # the whole run ---------------------------------------------------------------------

    async def run(self) -> int:
        started = time.monotonic()
        error: CommandError | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.watch_signals, tg.cancel_scope)
            try:
                await self._run()
            except CommandError as exc:  # raised here, not as an ExceptionGroup
                error = exc
            finally:
                self.summary.elapsed_s = time.monotonic() - started
                tg.cancel_scope.cancel()
        if error is not None:
            raise error
        return self._finish()

    async def _run(self) -> None:
        # Imported here: aioboto3 behind it takes ~0.25 s to import, which `--help` and
        # usage errors should not pay.
        from inboxd.adapters.objectstore import open_object_store

        config = load_config(self.args.config)
        try:
            store = open_object_store(object_store_spec(config))
        except ValueError as exc:
            raise CommandError(f"config file: {exc}", EXIT_USAGE) from exc
        choice = await resolve(self.args, config)
        async with open_pool(choice) as pool, store:
            try:
                async with pool.acquire() as conn:
                    await apply_with_deadline(conn)
                    with anyio.fail_after(PROBE_TIMEOUT_S):
                        await ensure_mailbox(conn, self.tenant, self.mailbox, provider="import")
            except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
                raise database_error(exc, choice) from exc
            stage = IngestStage(pool, store)
            log.info(
                "import_started",
                tenant=self.tenant,
                mailbox=self.mailbox,
                files=len(self.plan.files),
                bytes=self.plan.total_bytes,
            )
            self.importing = True
            with self.progress.open(self.plan.total_bytes):
                send, receive = anyio.create_memory_object_stream[_Batch](0)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self.produce, send)
                    try:
                        await self.consume(stage, receive)
                    except _Unsettled:
                        self.summary.status = "incomplete"
                        self.summary.unread_input = True
                        self.summary.error = await _explain(
                            pool, target_of(choice), self.summary.error
                        )
                    finally:
                        self.producer_scope.cancel()

    def _finish(self) -> int:
        exit_code = self._settle()
        print_report(
            self.summary, as_json=self.args.json, rolled_back=self.aborted and self.importing
        )
        return exit_code

    def _settle(self) -> int:
        """Set the summary's final status from how the run ended; returns the exit code."""
        s = self.summary
        if self.stop.is_set():
            s.status = "interrupted"
            s.unread_input = True
            return EXIT_INTERRUPTED
        if s.status == "incomplete":
            return EXIT_FAILURE
        if self.read_error is not None:
            s.status = "failed"
            s.unread_input = True
            s.error = str(self.read_error)
            return EXIT_FAILURE
        return EXIT_OK


async def _explain(pool: asyncpg.Pool, target: str, detail: str | None) -> str:
    """Why a batch stayed unsettled: the database when it does not answer, else `detail`."""
    try:
        with anyio.fail_after(PROBE_TIMEOUT_S):
            await pool.fetchval("SELECT 1")
    except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        cause = " ".join(str(exc).split()) or type(exc).__name__
        return f"database at {target} did not answer: {cause}"
    return detail or "retriable failure"


async def run(args: argparse.Namespace) -> int:
    for kind, value in (("tenant", args.tenant), ("mailbox", args.mailbox)):
        try:
            validate_id(kind, value)
        except ValueError as exc:
            raise CommandError(str(exc), EXIT_USAGE) from exc
    try:
        plan = await anyio.to_thread.run_sync(plan_import, args.paths)
    except SourceError as exc:
        raise CommandError(str(exc)) from exc
    return await _Importer(args, plan).run()
