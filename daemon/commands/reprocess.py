"""`inboxd reprocess`: re-derive stored messages from their raw bytes (a parser upgrade).

The protocol — which messages, what is compared, written and reported — is
`pipeline/reprocess/run.py`'s docstring. This command adds:

    set up    DSN → pool → object store (the same [object_store] as `inboxd run`);
              the schema is not applied (a reprocess changes rows, never tables)
    batches   `Reprocessor.next_batch` one after another, each committed on its
              own; a progress bar on a terminal (messages done of those in scope)
    report    examined, unchanged, updated (per changed field), reported (with
              message ids and reasons), no_raw, app_sent, raw_missing (listed),
              elapsed, messages/s — for humans, or one JSON object (--json)

Stopping: a first SIGINT/SIGTERM lets the batch in progress commit, then prints
the summary (status interrupted, the last message id done) and exits 130; a
second one abandons that batch (rolled back). `--after-id N` resumes after
message N; running again from the start is just as correct (unchanged messages
write nothing). A batch the database or the object store fails, or whose parse
worker process dies (the OOM killer), ends the run the same way with exit 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from typing import Any

import anyio
import asyncpg
import structlog

from inboxd.adapters.objectstore import open_object_store
from inboxd.daemon.commands.common import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    CommandError,
    Subparsers,
    database_error,
    emit_json,
    load_config,
    object_store_spec,
    open_pool,
    resolve,
    target_of,
)
from inboxd.daemon.commands.progress import ProgressBar
from inboxd.daemon.commands.stopping import StopSignals
from inboxd.daemon.database import DsnChoice
from inboxd.pipeline.errors import DATABASE_ERRORS, StoreUnavailableError, describe
from inboxd.pipeline.reprocess.run import RAW_READ_CONCURRENCY, Report, Reprocessor, Scope
from inboxd.pipeline.tenancy import validate_id

log = structlog.get_logger(__name__)

# Reported and missing messages listed in the human summary (--json lists all).
LISTED_SHOWN = 20
# What ends a run after its committed batches (exit 1, resumable): the database or
# the object store failing a batch, or a parse worker process dying.
BATCH_FAILURES: tuple[type[BaseException], ...] = (
    *DATABASE_ERRORS,
    StoreUnavailableError,
    anyio.BrokenWorkerProcess,
)
# Connections: one for the batch's transaction, one per concurrent raw read.
POOL_SIZE = 1 + RAW_READ_CONCURRENCY


def register(subparsers: Subparsers, parent: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "reprocess",
        parents=[parent],
        help="re-derive stored messages from their raw bytes with the current parser",
        description=(
            "Parse the stored raw bytes of TENANT's messages again and update what the "
            "current parser derives differently (subject, addresses, bodies, attachments, "
            "fingerprint), in place, with a message.updated event each. Unchanged "
            "messages are not written. A message whose new fingerprint disagrees with a "
            "merged copy, or equals another message's, is reported and left as it is. "
            "Safe to interrupt and to run again. Exit codes: 0 done, 1 operational "
            "failure, 2 usage error, 130 interrupted."
        ),
    )
    parser.add_argument("--tenant", required=True, help="tenant id")
    parser.add_argument(
        "--mailbox",
        help="only messages whose primary copy is in this mailbox (messages.mailbox_id)",
    )
    parser.add_argument(
        "--since",
        type=since_time,
        metavar="DATE",
        help="only messages received at or after DATE (YYYY-MM-DD or ISO 8601 time; UTC "
        "unless it names a zone): received_at, which is the import time for imported mail",
    )
    parser.add_argument(
        "--after-id",
        type=message_id,
        default=0,
        metavar="N",
        help="start after message_id N (resume where an interrupted run stopped)",
    )
    parser.add_argument(
        "--parse-in",
        choices=("thread", "process"),
        default="process",
        help="parse MIME in a worker thread or a worker process (default: %(default)s)",
    )
    parser.set_defaults(handler=run)


def since_time(text: str) -> datetime:
    """--since: a date (midnight UTC) or an ISO 8601 time (UTC when naive)."""
    try:
        value = (
            datetime.combine(date.fromisoformat(text), datetime.min.time())
            if len(text) == 10
            else datetime.fromisoformat(text)
        )
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a date or ISO 8601 time: {text!r}") from None
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def message_id(text: str) -> int:
    """--after-id: a message id, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a message id: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a message id is 0 or more, not {value}")
    return value


@dataclass(slots=True)
class Summary:
    """The run's Report plus how it ended; `status` is ok, interrupted or failed."""

    scope: Scope
    after_id: int
    report: Report = field(default_factory=Report)
    status: str = "ok"
    error: str | None = None
    elapsed_s: float = 0.0

    @property
    def rate(self) -> float:
        return self.report.examined / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def resume_after_id(self) -> int:
        return self.report.last_message_id or self.after_id

    def as_json(self) -> dict[str, Any]:
        r = self.report
        return {
            "command": "reprocess",
            "status": self.status,
            "tenant": self.scope.tenant_id,
            "mailbox": self.scope.mailbox_id,
            "since": self.scope.since.isoformat() if self.scope.since else None,
            "after_id": self.after_id,
            "examined": r.examined,
            "unchanged": r.unchanged,
            "updated": r.updated,
            "updated_fields": dict(sorted(r.fields.items())),
            "reported": len(r.reported),
            "reported_messages": [
                {"message_id": x.message_id, "reason": x.reason, "detail": x.detail}
                for x in r.reported
            ],
            "no_raw": r.no_raw,
            "app_sent": r.app_sent,
            "raw_missing": len(r.raw_missing),
            "raw_missing_messages": [{"message_id": m, "raw_key": k} for m, k in r.raw_missing],
            "last_message_id": r.last_message_id,
            "elapsed_s": round(self.elapsed_s, 3),
            "messages_per_s": round(self.rate, 1),
            "error": self.error,
        }

    def print_human(self) -> None:
        r, out = self.report, sys.stdout
        verb = {"ok": "reprocessed", "interrupted": "interrupted", "failed": "stopped"}[self.status]
        where = f", mailbox {self.scope.mailbox_id}" if self.scope.mailbox_id else ""
        print(
            f"{verb}: {r.examined} messages of tenant {self.scope.tenant_id}{where} in "
            f"{self.elapsed_s:.2f} s ({self.rate:.1f} messages/s)",
            file=out,
        )
        fields = ", ".join(f"{name} {n}" for name, n in sorted(r.fields.items()))
        for label, value, note in (
            ("unchanged", r.unchanged, ""),
            ("updated", r.updated, f"  ({fields})" if fields else ""),
            ("reported", len(r.reported), "  (left as stored)" if r.reported else ""),
            ("no_raw", r.no_raw, ""),
            ("app_sent", r.app_sent, ""),
            ("raw_missing", len(r.raw_missing), ""),
        ):
            print(f"  {label:<12} {value:>8}{note}", file=out)
        listed = [
            (m.message_id, f"{m.reason} ({m.detail})" if m.detail else m.reason) for m in r.reported
        ] + [(m, f"raw bytes missing ({k})") for m, k in r.raw_missing]
        for mid, why in listed[:LISTED_SHOWN]:
            print(f"  message {mid}: {why}", file=out)
        if len(listed) > LISTED_SHOWN:
            print(f"  … and {len(listed) - LISTED_SHOWN} more (--json lists all)", file=out)

    def closing_message(self, *, rolled_back: bool) -> str | None:
        """The stderr line of an interrupted or failed run; None when ok."""
        resume = (
            f"resume with --after-id {self.resume_after_id} (or run again from the start: "
            "unchanged messages write nothing)"
        )
        if self.status == "interrupted":
            abandoned = "the batch in progress was rolled back; " if rolled_back else ""
            return f"inboxd: interrupted: {abandoned}every committed batch is stored; {resume}"
        if self.status == "failed":
            return f"inboxd: error: {self.error}; every committed batch is stored; {resume}"
        return None


class _Run:
    def __init__(self, args: argparse.Namespace, scope: Scope) -> None:
        self.args = args
        self.summary = Summary(scope, args.after_id)
        self.signals = StopSignals("reprocess")
        self.progress = ProgressBar("reprocessing", "updated")

    async def run(self) -> int:
        started = time.monotonic()
        try:
            await self.signals.run(self._run)
        finally:
            self.summary.elapsed_s = time.monotonic() - started
        return self._finish()

    async def _run(self) -> None:
        config = load_config(self.args.config)
        spec = object_store_spec(config, self.args.config)
        choice = await resolve(self.args, config)
        async with (
            open_pool(choice, max_size=POOL_SIZE) as pool,
            open_object_store(spec, pool=pool) as store,
        ):
            runner = Reprocessor(pool, store, in_thread=self.args.parse_in == "thread")
            total = await _count(runner, self.summary, choice)
            self.signals.working = True
            with self.progress.open(total):
                await self._batches(runner, choice)

    async def _batches(self, runner: Reprocessor, choice: DsnChoice) -> None:
        """Batch after batch until none is left, a stop signal, or a failure."""
        s = self.summary
        while not self.signals.stop.is_set():
            try:
                batch = await runner.next_batch(s.scope, s.resume_after_id)
            except BATCH_FAILURES as exc:
                s.status = "failed"
                s.error = _failure(exc, choice)
                return
            if not batch.examined:
                return
            s.report.merge(batch)
            log.info(
                "reprocess_batch_committed",
                tenant=s.scope.tenant_id,
                examined=batch.examined,
                updated=batch.updated,
                last_message_id=batch.last_message_id,
            )
            self.progress.advance(batch.examined, s.report.updated)

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


def _failure(exc: BaseException, choice: DsnChoice) -> str:
    """What failed a batch, in one line."""
    if isinstance(exc, anyio.BrokenWorkerProcess):
        return str(exc)
    if isinstance(exc, DATABASE_ERRORS):
        return str(database_error(exc, choice))
    return f"object store: {describe(exc)}"


async def _count(runner: Reprocessor, summary: Summary, choice: DsnChoice) -> int:
    """Messages in scope; a database without the schema is a one-line error."""
    try:
        return await runner.count(summary.scope, summary.after_id)
    except (asyncpg.UndefinedTableError, asyncpg.UndefinedColumnError) as exc:
        raise CommandError(
            f"database at {target_of(choice)} has no inboxd schema, or an older one: "
            "run `inboxd migrate`"
        ) from exc
    except DATABASE_ERRORS as exc:
        raise database_error(exc, choice) from exc


async def run(args: argparse.Namespace) -> int:
    for kind, value in (("tenant", args.tenant), ("mailbox", args.mailbox)):
        if value is None:
            continue
        try:
            validate_id(kind, value)
        except ValueError as exc:
            raise CommandError(str(exc), EXIT_USAGE) from exc
    scope = Scope(args.tenant, args.mailbox, args.since)
    return await _Run(args, scope).run()
