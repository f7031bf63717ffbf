"""The extraction backlog gauges, kept current from the jobs and inbox tables.

`inboxd_extraction_jobs`, `_due`, `_oldest_due_seconds` and `_inbox` (daemon/
metrics.py) are read from the database, not counted in this process: every
replica's workers change the same rows (a job one replica queues another one
claims), so only the tables know the backlog. One reading is
`pipeline.extraction.review.backlog` (per tenant and processor, jobs not
completed by state, what is due now) plus `pipeline.extraction.inbox.inbox_depth`
(per tenant, new messages the feeder has not matched yet).

Which series exist: the (tenant, processor) pairs that have jobs not completed,
plus the configured pairs (`processors`) at 0 when idle, so a dashboard shows a
quiet processor as 0 instead of a gap; a pair in neither (a processor removed
from the config, its jobs done) loses its series at the next reading. The inbox
gauge has one series per tenant of `tenant_ids()`.

A task of the supervisor's tree; it outlives database errors like the attention
gauge (daemon/metrics/attention.py): the last reading stays, "unavailable" and
"recovered" are logged once each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import anyio
import anyio.abc
import asyncpg
import structlog

from inboxd.daemon.metrics.registry import Metrics
from inboxd.pipeline.errors import DATABASE_ERRORS
from inboxd.pipeline.extraction.inbox import inbox_depth
from inboxd.pipeline.extraction.review import Backlog, backlog

log = structlog.get_logger(__name__)

# Re-read this often: Prometheus scrapes every 15-60 s, so a fresher reading would
# go unseen (the attention gauge's interval). Two grouped counts per interval, on
# the partial due index and the small inbox table.
EXTRACTION_REFRESH_INTERVAL_S = 15.0
# Two aggregate statements over jobs not completed; past this the database is in
# trouble (the attention gauge's bound), and the last reading stays.
EXTRACTION_QUERY_TIMEOUT_S = 5.0


async def read_extraction_backlog(
    pool: asyncpg.Pool,
    tenant_ids: Sequence[str],
    processors: Iterable[tuple[str, str]] = (),
) -> tuple[list[Backlog], dict[str, tuple[int, float]]]:
    """One reading: the backlog of every pair with jobs not completed, plus each
    configured (tenant, processor) pair of `processors` at 0 when it has none; the
    inbox (rows, oldest age in s) of every tenant, 0 when empty."""
    tenants = sorted(set(tenant_ids))
    async with pool.acquire() as conn:
        rows = await backlog(conn, tenants)
        depth = await inbox_depth(conn, tenants)
    seen = {(b.tenant_id, b.processor_id) for b in rows}
    idle = [
        Backlog(tenant, processor, 0, 0, 0, 0, 0, 0.0)
        for tenant, processor in sorted(set(processors) - seen)
        if tenant in tenants
    ]
    return rows + idle, {tenant: depth.get(tenant, (0, 0.0)) for tenant in tenants}


async def refresh_extraction_backlog(
    pool: asyncpg.Pool,
    metrics: Metrics,
    tenant_ids: Callable[[], Sequence[str]],
    processors: Callable[[], Iterable[tuple[str, str]]] | None = None,
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Keep the extraction backlog gauges current (module docstring), every
    EXTRACTION_REFRESH_INTERVAL_S, first right after start.

    `tenant_ids()` (called at each refresh, so a SIGHUP reload is followed) names
    the tenants to read, e.g. those with processors; `processors()`, when given,
    the configured (tenant, processor) pairs shown at 0 while idle. Outlives
    database errors: the last reading stays, logged once when it fails and once
    when it recovers.
    """
    task_status.started()
    failing = False
    while True:
        try:
            with anyio.fail_after(EXTRACTION_QUERY_TIMEOUT_S):
                jobs, inbox = await read_extraction_backlog(
                    pool, tenant_ids(), processors() if processors is not None else ()
                )
        except DATABASE_ERRORS as exc:
            if not failing:
                log.warning("extraction_metric_unavailable", error=type(exc).__name__)
            failing = True
        else:
            if failing:
                log.info("extraction_metric_recovered")
            failing = False
            metrics.set_extraction_backlog(jobs, inbox)
        await anyio.sleep(EXTRACTION_REFRESH_INTERVAL_S)
