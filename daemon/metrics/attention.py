"""`inboxd_mailbox_needs_attention` and `_needs_connect`, kept current from the
mailboxes table.

The table is the truth for every replica (one replica marks a mailbox that
another then reports), so the gauge is re-read from it, not tracked in this
process. A task of the supervisor's tree; it outlives database errors: the last
reading stays, "unavailable" and "recovered" are logged once each.
"""

from __future__ import annotations

import anyio
import anyio.abc
import asyncpg
import structlog

from inboxd.daemon.metrics.registry import OPERATOR_STATES, Metrics
from inboxd.pipeline.errors import DATABASE_ERRORS
from inboxd.pipeline.mailbox.status import mailboxes_in_states

log = structlog.get_logger(__name__)

# inboxd_mailbox_needs_attention is re-read this often: Prometheus scrapes every
# 15-60 s, so a fresher reading would go unseen; one indexed-size query per interval.
ATTENTION_REFRESH_INTERVAL_S = 15.0
# The query reads a few rows; past this the database is in trouble and /readyz says so.
ATTENTION_QUERY_TIMEOUT_S = 5.0


async def refresh_attention(
    pool: asyncpg.Pool,
    metrics: Metrics,
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Keep `inboxd_mailbox_needs_attention` current from the mailboxes table.

    The table is the truth for every replica (a replica marks a mailbox another one
    then reports), so it is read, not tracked in this process. Outlives database
    errors: the last reading stays, "unavailable" and "recovered" are logged once each.
    """
    task_status.started()
    failing = False
    while True:
        try:
            with anyio.fail_after(ATTENTION_QUERY_TIMEOUT_S):
                rows = await mailboxes_in_states(pool, OPERATOR_STATES)
        except DATABASE_ERRORS as exc:
            if not failing:
                log.warning("attention_refresh_unavailable", error=type(exc).__name__)
            failing = True
        else:
            if failing:
                log.info("attention_refresh_recovered")
            failing = False
            for state in OPERATOR_STATES:
                metrics.set_flagged(
                    state,
                    ((r["tenant_id"], r["mailbox_id"]) for r in rows if r["sync_state"] == state),
                )
        await anyio.sleep(ATTENTION_REFRESH_INTERVAL_S)
