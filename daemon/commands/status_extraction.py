"""The extraction section of `inboxd status`: each tenant's processors' backlog.

Per tenant and processor, the jobs not completed by state (pending, running,
retry_wait, needs_review), how many are due now and how long the oldest due one
has waited (`pipeline.extraction.review.backlog`); per tenant, the new mail the
feeder has not matched to processors yet (`pipeline.extraction.inbox.inbox_depth`).
The same readings as the /metrics gauges (daemon/metrics/extraction.py).

Only tenants with something to show appear: a tenant without processors, or
whose jobs are all completed and whose inbox is empty, adds nothing. `inboxd
status` prints the table after the mailboxes when there is one; `inboxd status
--extraction` prints it alone, and with --json a list with one object per
tenant (the plain `--json` output stays the list of mailboxes it always was).
"""

from __future__ import annotations

from dataclasses import dataclass

import asyncpg

from inboxd.pipeline.extraction.inbox import inbox_depth
from inboxd.pipeline.extraction.review import Backlog, backlog
from inboxd.pipeline.tenancy import tenant_ids


@dataclass(frozen=True, slots=True)
class TenantExtraction:
    """One tenant's extraction backlog: the inbox and each processor with jobs left."""

    tenant_id: str
    inbox: int  # new messages not yet matched to processors
    inbox_oldest_s: float  # age of the oldest of them (0 when none)
    processors: tuple[Backlog, ...]

    def as_json(self) -> dict[str, object]:
        return {
            "tenant": self.tenant_id,
            "inbox": self.inbox,
            "inbox_oldest_s": round(self.inbox_oldest_s, 3),
            "processors": [
                {
                    "processor": b.processor_id,
                    "pending": b.pending,
                    "running": b.running,
                    "retry_wait": b.retry_wait,
                    "needs_review": b.needs_review,
                    "due": b.due,
                    "oldest_due_s": round(b.oldest_due_s, 3),
                }
                for b in self.processors
            ],
        }


async def extraction_status(pool: asyncpg.Pool, tenant: str | None) -> list[TenantExtraction]:
    """The backlog of `tenant` (None: every tenant), tenants with nothing left out."""
    async with pool.acquire() as conn:
        tenants = [tenant] if tenant is not None else await tenant_ids(conn)
        rows = await backlog(conn, tenants)
        depth = await inbox_depth(conn, tenants)
    by_tenant: dict[str, list[Backlog]] = {}
    for b in rows:
        by_tenant.setdefault(b.tenant_id, []).append(b)
    return [
        TenantExtraction(t, *depth.get(t, (0, 0.0)), tuple(by_tenant.get(t, ())))
        for t in sorted(set(by_tenant) | set(depth))
    ]
