"""A processor's new `schema_version`: the jobs still waiting under another version.

A runner claims only the jobs of its processor's current version (a v1 job run by
the v2 rules would store a v2-shaped result under the v1 label). Jobs queued under
another version and never run — pending, retry_wait, or running with an expired
lease (their holder died) — would then wait forever, and the mail they stand for
would never be extracted. When a runner starts, `carry_over` moves them to the
current version:

    job of version ≠ V, no result yet, not held ──▶ same job, version V, pending,
    (no V job with its key)                           due now, attempts 0
    job of version ≠ V, no result yet, not held ──▶ needs_review, "superseded by
    (a V job with its key exists)                     job N": already queued under V

The job keeps its id and its payload conflicts (deleting it would drop them); a
completed or needs_review job is history and stays as it is; a job held by a live
lease (another daemon still running the old config) is left to its holder. Rows
are locked with SKIP LOCKED, so a carry-over never waits for a locked round.
"""

from __future__ import annotations

from dataclasses import dataclass

from inboxd.pipeline.extraction.keys import Executor, transaction

__all__ = ["CarriedOver", "carry_over"]

_WAITING = """
SELECT job_id, dedup_key FROM extraction_jobs
 WHERE tenant_id = $1 AND processor_id = $2 AND schema_version <> $3
   AND (state IN ('pending', 'retry_wait')
        OR (state = 'running' AND lease_expires_at <= now()))
   FOR UPDATE SKIP LOCKED
"""

# A job of V with the same key already holds the claim: the waiting one is redundant.
_SUPERSEDED = """
UPDATE extraction_jobs old
   SET state = 'needs_review',
       review_reason = format('superseded by job %s (schema_version %s)', v.job_id, $3::text),
       lease_owner = NULL, lease_expires_at = NULL, updated_at = now()
  FROM extraction_jobs v
 WHERE old.tenant_id = $1 AND old.job_id = ANY($4::bigint[])
   AND v.tenant_id = $1 AND v.processor_id = $2 AND v.schema_version = $3
   AND v.dedup_key = old.dedup_key
RETURNING old.job_id
"""

_SUPERSEDED_BY = """
UPDATE extraction_jobs
   SET state = 'needs_review',
       review_reason = format('superseded by job %s (schema_version %s)', $3::bigint, $4::text),
       lease_owner = NULL, lease_expires_at = NULL, updated_at = now()
 WHERE tenant_id = $1 AND job_id = $2
"""

_MOVED = """
UPDATE extraction_jobs
   SET schema_version = $3, state = 'pending', attempts = 0, next_attempt_at = now(),
       review_reason = NULL, lease_owner = NULL, lease_expires_at = NULL, updated_at = now()
 WHERE tenant_id = $1 AND processor_id = $2 AND job_id = ANY($4::bigint[])
"""


@dataclass(frozen=True, slots=True)
class CarriedOver:
    """Job ids of one `carry_over`, by what became of them."""

    moved: list[int]
    superseded: list[int]


async def carry_over(
    conn: Executor, tenant_id: str, processor_id: str, schema_version: str
) -> CarriedOver:
    """Move the processor's waiting jobs of other versions to `schema_version`
    (module docstring), in one transaction."""
    if not schema_version:
        raise ValueError("schema_version must be a non-empty string")
    async with transaction(conn) as tx:
        waiting = await tx.fetch(_WAITING, tenant_id, processor_id, schema_version)
        if not waiting:
            return CarriedOver([], [])
        ids = [r["job_id"] for r in waiting]
        superseded = {
            r["job_id"]
            for r in await tx.fetch(_SUPERSEDED, tenant_id, processor_id, schema_version, ids)
        }
        # two waiting jobs of different old versions may share a key: the first moves,
        # the other is superseded by it
        moved: dict[str, int] = {}
        twins: list[tuple[int, int]] = []
        for row in sorted(waiting, key=lambda r: r["job_id"]):
            if row["job_id"] in superseded:
                continue
            first = moved.setdefault(row["dedup_key"], row["job_id"])
            if first != row["job_id"]:
                twins.append((row["job_id"], first))
        if moved:
            await tx.execute(_MOVED, tenant_id, processor_id, schema_version, list(moved.values()))
        for job_id, first in twins:
            await tx.execute(_SUPERSEDED_BY, tenant_id, job_id, first, schema_version)
            superseded.add(job_id)
        return CarriedOver(sorted(moved.values()), sorted(superseded))
