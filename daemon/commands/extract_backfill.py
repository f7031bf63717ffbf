"""`inboxd extract backfill`: queue a tenant's existing messages for one processor.

The protocol — scope, order, filter, what each message becomes — is
`pipeline/extraction/backfill.py`'s docstring. This command adds:

    set up    --config → the tenant file's processor (its mailboxes, filter and
              schema_version, exactly as `inboxd run` parses it); unknown tenant
              or processor → exit 2 naming it; DSN → pool
    batches   `backfill_batch` one after another, BACKFILL_BATCH_SIZE messages
              each, each committed on its own; a progress bar on a terminal
    report    examined, queued, linked, payload conflicts, not matching, the last
              message id — for humans, or one JSON object (--json)

The running daemon's workers claim the jobs from the table (claims poll it), so
nothing else is needed for them to be extracted; without a daemon they wait.

Stopping: a first SIGINT/SIGTERM lets the batch in progress commit, then prints
the summary (status interrupted, the last message id done) and exits 130; a
second one abandons that batch (rolled back). `--after-id N` resumes after
message N; running again from the start is just as correct (queued messages
are linked, never queued twice). A batch the database fails ends the run the
same way with exit 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import structlog

from inboxd.adapters.extraction.config import ProcessorConfig, matches_fields
from inboxd.daemon.commands.common import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    CommandError,
    database_error,
    emit_json,
    open_pool,
    resolve,
    target_of,
)
from inboxd.daemon.commands.progress import ProgressBar
from inboxd.daemon.commands.status import valid_id_option
from inboxd.daemon.commands.stopping import StopSignals
from inboxd.daemon.config.main import ConfigError, load_main, load_tenants
from inboxd.daemon.database import DsnChoice
from inboxd.pipeline.errors import DATABASE_ERRORS
from inboxd.pipeline.extraction.backfill import (
    BackfillReport,
    BackfillScope,
    backfill_batch,
    count_scope,
)
from inboxd.pipeline.extraction.inbox import FilterFields
from inboxd.pipeline.statistics import EXTRACTION_TABLES, IngestStatistics

log = structlog.get_logger(__name__)

# Messages per batch (one transaction each): the live feeder's size; a batch is a
# few set-based statements over ≤ 2,000 ids (fields, identities, jobs), ~70 ms, so
# a Ctrl-C waits that long and a lock is held no longer. The statements' fixed cost
# dominates smaller batches: a re-run of 10,000 linked messages took 0.62 s in
# batches of 500 and 0.34 s in batches of 2,000 (bench/extraction.py (c)).
BACKFILL_BATCH_SIZE = 2000


@dataclass(slots=True)
class Summary:
    """The run's report plus how it ended; `status` is ok, interrupted or failed."""

    scope: BackfillScope
    after_id: int
    report: BackfillReport = field(default_factory=BackfillReport)
    status: str = "ok"
    error: str | None = None
    elapsed_s: float = 0.0

    @property
    def resume_after_id(self) -> int:
        return self.report.last_message_id or self.after_id

    def as_json(self) -> dict[str, Any]:
        r, s = self.report, self.scope
        return {
            "command": "extract backfill",
            "status": self.status,
            "tenant": s.tenant_id,
            "processor": s.processor_id,
            "schema_version": s.schema_version,
            "mailbox": s.mailbox_id,
            "after_id": self.after_id,
            "examined": r.examined,
            "queued": r.queued,
            "linked": r.linked,
            "conflicts": r.conflicts,
            "not_matching": r.not_matching,
            "missing": r.missing,
            "last_message_id": r.last_message_id,
            "elapsed_s": round(self.elapsed_s, 3),
            "error": self.error,
        }

    def print_human(self) -> None:
        r, s = self.report, self.scope
        verb = {"ok": "backfilled", "interrupted": "interrupted", "failed": "stopped"}
        where = f", mailbox {s.mailbox_id}" if s.mailbox_id else ""
        print(
            f"{verb[self.status]}: {r.examined} messages of tenant {s.tenant_id}{where} for "
            f"processor {s.processor_id} (schema_version {s.schema_version}) in "
            f"{self.elapsed_s:.2f} s"
        )
        for label, value, note in (
            ("queued", r.queued, "  (a running inboxd extracts them)" if r.queued else ""),
            ("linked", r.linked, "  (already queued or extracted)" if r.linked else ""),
            (
                "conflicts",
                r.conflicts,
                "  (inboxd extract list --conflicts)" if r.conflicts else "",
            ),
            ("not matching", r.not_matching, ""),
        ):
            print(f"  {label:<13} {value:>8}{note}")
        if r.missing:
            print(f"  {'deleted':<13} {r.missing:>8}  (removed while the backfill ran)")
        last = r.last_message_id if r.last_message_id is not None else "-"
        print(f"  last message id {last}")

    def closing_message(self, *, rolled_back: bool) -> str | None:
        """The stderr line of an interrupted or failed run; None when ok."""
        resume = (
            f"resume with --after-id {self.resume_after_id} (or run again from the start: "
            "queued messages are linked, never queued twice)"
        )
        if self.status == "interrupted":
            abandoned = "the batch in progress was rolled back; " if rolled_back else ""
            return f"inboxd: interrupted: {abandoned}every committed batch is queued; {resume}"
        if self.status == "failed":
            return f"inboxd: error: {self.error}; every committed batch is queued; {resume}"
        return None


def find_processor(
    config: Path | None, tenant_id: str, processor_id: str
) -> tuple[ProcessorConfig, dict[str, Any]]:
    """The tenant's processor as `inboxd run` would parse it, and the main file's
    tables (for the DSN); CommandError (exit 2) naming what is missing or wrong."""
    if config is None:
        raise CommandError(
            "extract backfill needs --config FILE: the processor is read from the tenant file",
            EXIT_USAGE,
        )
    try:
        main = load_main(config)
    except ConfigError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from exc
    tenants = load_tenants(main)
    tenant = tenants.tenants.get(tenant_id)
    if tenant is None:
        # A tenant file with problems is left out whole: show them (file and key), since
        # the tenant may well be in one, rather than a bare "no tenant".
        for problem in tenants.problems:
            print(problem, file=sys.stderr)
        broken = f" ({len(tenants.problems)} problem(s) in tenant files, above)"
        raise CommandError(
            f"no tenant {tenant_id} in {main.tenants_dir}" + (broken if tenants.problems else ""),
            EXIT_USAGE,
        )
    for processor in tenant.processors:
        if processor.id == processor_id:
            return processor, main.raw
    known = ", ".join(p.id for p in tenant.processors) or "none"
    raise CommandError(
        f"no processor {processor_id} in tenant {tenant_id} (its processors: {known})",
        EXIT_USAGE,
    )


class _Run:
    def __init__(self, args: argparse.Namespace, processor: ProcessorConfig) -> None:
        self.args = args
        self.processor = processor
        scope = BackfillScope(
            args.tenant, processor.id, str(processor.schema_version), args.mailbox
        )
        self.summary = Summary(scope, args.after_id)
        self.signals = StopSignals("extract_backfill")
        self.progress = ProgressBar("backfilling", "queued")

    async def run(self, config: dict[str, Any]) -> int:
        started = time.monotonic()
        try:
            await self.signals.run(lambda: self._run(config))
        finally:
            self.summary.elapsed_s = time.monotonic() - started
        return self._finish()

    async def _run(self, config: dict[str, Any]) -> None:
        choice = await resolve(self.args, config)
        async with open_pool(choice, max_size=1) as pool:
            total = await _count(pool, self.summary, choice)
            self.signals.working = True
            with self.progress.open(total):
                await self._batches(pool, choice)

    async def _batches(self, pool: asyncpg.Pool, choice: DsnChoice) -> None:
        """Batch after batch until none is left, a stop signal, or a failure."""
        s = self.summary
        processor = self.processor

        def select(fields: FilterFields) -> bool:
            return matches_fields(processor, fields)

        # a backfill is what grows extraction_jobs fastest: keep its plans current
        statistics = IngestStatistics(pool, tables=EXTRACTION_TABLES, counted="extraction_jobs")

        while not self.signals.stop.is_set():
            try:
                batch = await backfill_batch(
                    pool, s.scope, s.resume_after_id, BACKFILL_BATCH_SIZE, select
                )
            except DATABASE_ERRORS as exc:
                s.status = "failed"
                s.error = str(database_error(exc, choice))
                return
            if not batch.examined:
                return
            s.report.merge(batch)
            await statistics.note_stored(batch.queued)
            log.info(
                "extract_backfill_batch_committed",
                tenant=s.scope.tenant_id,
                processor=s.scope.processor_id,
                examined=batch.examined,
                queued=batch.queued,
                last_message_id=batch.last_message_id,
            )
            self.progress.advance(batch.examined, s.report.queued)

    def _finish(self) -> int:
        s = self.summary
        if self.signals.stop.is_set():
            s.status = "interrupted"
        if self.args.json:
            emit_json(s.as_json())
        else:
            s.print_human()
        message = s.closing_message(rolled_back=self.signals.aborted and self.signals.working)
        if message:
            sys.stdout.flush()
            print(message, file=sys.stderr)
        return {"ok": EXIT_OK, "interrupted": EXIT_INTERRUPTED}.get(s.status, EXIT_FAILURE)


async def _count(pool: asyncpg.Pool, summary: Summary, choice: DsnChoice) -> int:
    """Messages in scope; a database without the schema is a one-line error."""
    try:
        return await count_scope(pool, summary.scope, summary.after_id)
    except (asyncpg.UndefinedTableError, asyncpg.UndefinedColumnError) as exc:
        raise CommandError(
            f"database at {target_of(choice)} has no inboxd schema, or an older one: "
            "run `inboxd migrate`"
        ) from exc
    except DATABASE_ERRORS as exc:
        raise database_error(exc, choice) from exc


async def run_backfill(args: argparse.Namespace) -> int:
    """`inboxd extract backfill` (module docstring)."""
    valid_id_option("tenant", args.tenant)
    valid_id_option("processor", args.processor)
    valid_id_option("mailbox", args.mailbox)
    processor, main_config = find_processor(args.config, args.tenant, args.processor)
    if args.mailbox and processor.mailboxes is not None and args.mailbox not in processor.mailboxes:
        raise CommandError(
            f"processor {processor.id} takes mailboxes {', '.join(processor.mailboxes)} only, "
            f"not {args.mailbox}",
            EXIT_USAGE,
        )
    return await _Run(args, processor).run(main_config)
