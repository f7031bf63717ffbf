"""`inboxd extract backfill|retry|list`: the operator's hands on the extraction stage.

  backfill  queue a tenant's existing messages for one processor (a processor
            added later, or a new schema_version that deliberately re-extracts
            history); the running daemon's workers pick the jobs up, since claims
            poll the jobs table. daemon/commands/extract_backfill.py.
  retry     run one needs_review (or retry_wait) job again now, attempts reset
            (pipeline/extraction/review.py `retry`); a completed result is never
            overwritten.
  list      the tenant's jobs, newest first, with state, attempts, next attempt
            and why it failed, to find what to retry; `--conflicts` lists the
            unresolved payload conflicts instead.

Everything goes through the database, so any host that reaches it serves,
whichever replica runs the workers. Exit codes: 0 done; 1 database failure,
and for `retry` a job that was not re-queued (no such job in the tenant, or it
is pending, running or completed): exit 0 means exactly "re-queued", which a
script can rely on; 2 usage or configuration error (unknown tenant or
processor for `backfill`); 130 interrupted.
"""

from __future__ import annotations

import argparse
from datetime import datetime
from typing import Any

from inboxd.daemon.commands.common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    CommandError,
    Subparsers,
    emit_json,
    load_config,
    open_pool,
    resolve,
)
from inboxd.daemon.commands.status import (
    database_call,
    format_time,
    plain_table,
    shorten_end,
    valid_id_option,
)
from inboxd.pipeline.extraction.claims import JobState
from inboxd.pipeline.extraction.review import (
    ConflictListing,
    JobListing,
    list_conflicts,
    list_jobs,
    retry_job,
    retry_processor,
)

#: Job ids are PostgreSQL bigint identities.
JOB_ID_MAX = 2**63 - 1
#: `extract list --limit` default and bound: a screenful, and a bound that keeps one
#: listing a bounded read (narrow with --state/--processor instead).
LIST_DEFAULT_LIMIT = 50
LIST_MAX_LIMIT = 10_000
#: Width of the REASON column (review_reason or last_error; --json has them whole).
REASON_SHOWN_CHARS = 60
LISTED_STATES = tuple(s.value for s in JobState)
JOB_COLUMNS = (
    "JOB",
    "PROCESSOR",
    "VERSION",
    "MESSAGE",
    "STATE",
    "ATTEMPTS",
    "NEXT ATTEMPT",
    "REASON",
)
CONFLICT_COLUMNS = ("CONFLICT", "JOB", "PROCESSOR", "VERSION", "MESSAGE", "NEW MESSAGE", "SEEN")


def register(subparsers: Subparsers, parent: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "extract",
        help="queue history for a processor, retry an extraction, list extraction jobs",
        description="Operate the extraction stage through the database: backfill, retry "
        "and list jobs. Exit codes: 0 done, 1 database failure or a job not re-queued, "
        "2 usage or configuration error, 130 interrupted.",
    )
    actions = parser.add_subparsers(dest="extract_action", metavar="ACTION", required=True)

    backfill = actions.add_parser(
        "backfill",
        parents=[parent],
        help="queue the tenant's existing messages that a processor takes",
        description="Queue TENANT's stored messages, in message id order, that processor "
        "P takes (its mailboxes and filter, as for new mail), as extraction jobs of its "
        "current schema_version; a running inboxd extracts them. The processor is read "
        "from the tenant file, so --config is required. Batches commit one by one: safe "
        "to interrupt (Ctrl-C finishes the batch, exit 130) and to run again (messages "
        "already queued are linked, never queued twice). Resume with --after-id.",
    )
    backfill.add_argument("--tenant", metavar="T", required=True, help="tenant id")
    backfill.add_argument("--processor", metavar="P", required=True, help="processor id")
    backfill.add_argument(
        "--mailbox", metavar="M", help="only messages with a copy in this mailbox"
    )
    backfill.add_argument(
        "--after-id",
        type=_message_id,
        default=0,
        metavar="N",
        help="start after message id N (resume where an interrupted run stopped)",
    )
    backfill.set_defaults(handler=_run_backfill)

    again = actions.add_parser(
        "retry",
        parents=[parent],
        help="run a needs_review or retry_wait job (or all of a processor's) again now",
        description="Make job N (or, with --processor, every needs_review and "
        "retry_wait job of processor P) pending and due now, attempts reset, so a "
        "worker runs it again (after fixing what made it fail). A completed result is "
        "never overwritten (bump schema_version to extract again); a pending or running "
        "job is left alone. --id: exit 0 only when the job was re-queued; --processor: "
        "exit 0 with the number re-queued, which may be 0.",
    )
    again.add_argument("--tenant", metavar="T", required=True, help="tenant id")
    which = again.add_mutually_exclusive_group(required=True)
    which.add_argument("--id", type=_job_id, metavar="N", help="job id")
    which.add_argument("--processor", metavar="P", help="every failed job of this processor")
    again.set_defaults(handler=run_retry)

    listing = actions.add_parser(
        "list",
        parents=[parent],
        help="list the tenant's extraction jobs (or payload conflicts)",
        description="List TENANT's extraction jobs, newest first: job id, processor, "
        "schema_version, message, state, attempts, next attempt (a running job's lease "
        "expiry) and the review reason or last error. --conflicts lists the unresolved "
        "payload conflicts instead (a key seen again with other content).",
    )
    listing.add_argument("--tenant", metavar="T", required=True, help="tenant id")
    listing.add_argument("--state", choices=LISTED_STATES, help="only jobs in this state")
    listing.add_argument("--processor", metavar="P", help="only this processor's jobs")
    listing.add_argument(
        "--limit",
        type=_limit,
        default=LIST_DEFAULT_LIMIT,
        metavar="N",
        help=f"at most N rows (default: %(default)s, at most {LIST_MAX_LIMIT})",
    )
    listing.add_argument(
        "--conflicts", action="store_true", help="list unresolved payload conflicts instead"
    )
    listing.set_defaults(handler=run_list)


def _positive(text: str, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a {what}: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a {what} is 1 or more, not {value}")
    return value


def _job_id(text: str) -> int:
    value = _positive(text, "job id")
    if value > JOB_ID_MAX:  # past bigint the database would answer, as a failure of its own
        raise argparse.ArgumentTypeError(f"a job id is at most {JOB_ID_MAX}, not {value}")
    return value


def _limit(text: str) -> int:
    value = _positive(text, "limit")
    if value > LIST_MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"--limit is at most {LIST_MAX_LIMIT}, not {value}")
    return value


def _message_id(text: str) -> int:
    """--after-id: a message id, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a message id: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a message id is 0 or more, not {value}")
    return value


async def _run_backfill(args: argparse.Namespace) -> int:
    # Imported here: the tenant files' parser pulls in every adapter's config and
    # jsonschema, which `retry` and `list` never need.
    from inboxd.daemon.commands.extract_backfill import run_backfill

    return await run_backfill(args)


async def run_retry(args: argparse.Namespace) -> int:
    tenant = valid_id_option("tenant", args.tenant) or ""
    if args.processor is not None:
        return await _retry_processor(args, tenant)
    choice = await resolve(args, load_config(args.config))
    async with open_pool(choice, max_size=1) as pool:
        with database_call(choice):
            result = await retry_job(pool, tenant, args.id)
    previous = result.previous.value if result.previous is not None else None
    if args.json:
        emit_json(
            {
                "command": "extract retry",
                "status": "retried" if result.retried else "not_retried",
                "tenant": tenant,
                "job_id": args.id,
                "previous_state": previous,
                "state": JobState.PENDING.value if result.retried else previous,
            }
        )
    elif previous is None:
        print(f"no job {args.id} in tenant {tenant}")
    elif result.retried:
        print(f"job {args.id} re-queued (was {previous}): pending, due now, attempts reset")
    else:
        print(f"job {args.id} is {previous}: not retried")
    return EXIT_OK if result.retried else EXIT_FAILURE


async def _retry_processor(args: argparse.Namespace, tenant: str) -> int:
    processor = valid_id_option("processor", args.processor) or ""
    choice = await resolve(args, load_config(args.config))
    async with open_pool(choice, max_size=1) as pool:
        with database_call(choice):
            retried = await retry_processor(pool, tenant, processor)
    if args.json:
        emit_json(
            {
                "command": "extract retry",
                "status": "retried" if retried else "nothing_to_retry",
                "tenant": tenant,
                "processor": processor,
                "retried": retried,
            }
        )
    else:
        print(f"{retried} job(s) of processor {processor} re-queued: pending, due now")
    return EXIT_OK


async def run_list(args: argparse.Namespace) -> int:
    tenant = valid_id_option("tenant", args.tenant) or ""
    processor = valid_id_option("processor", args.processor)
    if args.conflicts and args.state is not None:
        raise CommandError("--state does not apply to --conflicts", EXIT_USAGE)
    state = JobState(args.state) if args.state is not None else None
    choice = await resolve(args, load_config(args.config), start=False)
    async with open_pool(choice, max_size=1) as pool:
        with database_call(choice):
            if args.conflicts:
                conflicts, total = await list_conflicts(
                    pool, tenant, processor_id=processor, limit=args.limit
                )
            else:
                jobs, total = await list_jobs(
                    pool, tenant, state=state, processor_id=processor, limit=args.limit
                )
    scope = {"tenant": tenant, "processor": processor}
    if args.conflicts:
        rows: list[dict[str, Any]] = [_conflict_json(c) for c in conflicts]
        if args.json:
            emit_json({"command": "extract list", **scope, "total": total, "conflicts": rows})
        else:
            _print_listing([_conflict_row(c) for c in conflicts], CONFLICT_COLUMNS, total, scope)
        return EXIT_OK
    if args.json:
        emit_json(
            {
                "command": "extract list",
                **scope,
                "state": args.state,
                "total": total,
                "jobs": [_job_json(j) for j in jobs],
            }
        )
    else:
        what = {**scope, "state": args.state}
        _print_listing([_job_row(j) for j in jobs], JOB_COLUMNS, total, what)
    return EXIT_OK


def _print_listing(
    rows: list[tuple[str, ...]], columns: tuple[str, ...], total: int, scope: dict[str, Any]
) -> None:
    noun = "payload conflicts" if columns is CONFLICT_COLUMNS else "extraction jobs"
    where = ", ".join(f"{k} {v}" for k, v in scope.items() if v is not None)
    if not rows:
        print(f"no {noun} ({where})")
        return
    print(plain_table(rows, columns))
    if total > len(rows):
        print(f"{len(rows)} of {total} {noun}, newest first (--limit shows more)")


def _time(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _job_json(j: JobListing) -> dict[str, Any]:
    return {
        "job_id": j.job_id,
        "processor": j.processor_id,
        "schema_version": j.schema_version,
        "message_id": j.message_id,
        "mailbox": j.mailbox_id,
        "state": j.state.value,
        "attempts": j.attempts,
        "next_attempt_at": _time(j.next_attempt_at),
        "review_reason": j.review_reason,
        "last_error": j.last_error,
        "created_at": _time(j.created_at),
        "updated_at": _time(j.updated_at),
    }


def _job_row(j: JobListing) -> tuple[str, ...]:
    # A completed or needs_review job is never due: its next_attempt_at is history.
    waiting = j.state in (JobState.PENDING, JobState.RETRY_WAIT, JobState.RUNNING)
    reason = j.review_reason or j.last_error
    return (
        str(j.job_id),
        j.processor_id,
        j.schema_version,
        str(j.message_id),
        j.state.value,
        str(j.attempts),
        format_time(j.next_attempt_at) if waiting else "-",
        shorten_end(" ".join(reason.split()), REASON_SHOWN_CHARS) if reason else "-",
    )


def _conflict_json(c: ConflictListing) -> dict[str, Any]:
    return {
        "conflict_id": c.conflict_id,
        "job_id": c.job_id,
        "processor": c.processor_id,
        "schema_version": c.schema_version,
        "dedup_key": c.dedup_key,
        "existing_message_id": c.existing_message_id,
        "new_message_id": c.new_message_id,
        "created_at": _time(c.created_at),
    }


def _conflict_row(c: ConflictListing) -> tuple[str, ...]:
    return (
        str(c.conflict_id),
        str(c.job_id),
        c.processor_id,
        c.schema_version,
        str(c.existing_message_id),
        str(c.new_message_id),
        format_time(c.created_at),
    )
