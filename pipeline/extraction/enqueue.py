"""Queuing extractions: the atomic claim of a message identity's key (step 1-2 of the protocol).

`enqueue` turns message rows (those the ingest outcome handed over: new, conflict,
and merged ones — a copy in a new mailbox; pipeline/extraction/inbox.py)
into `extraction_jobs` rows, one per (tenant, processor, schema_version, dedup
key), set-based. The unique key is the claim: a key that already has a job with
the same payload fingerprint is *linked* (no new job, no second backend call,
no second event, whatever the job's state); another fingerprint under the same
key is a row of `extraction_payload_conflicts` for review, the job untouched —
never dropped, never overwritten. What happens to a job next is
pipeline/extraction/claims.py; the key itself, pipeline/extraction/keys.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from inboxd.pipeline.extraction.keys import Executor, load_identities, transaction


@dataclass(frozen=True, slots=True)
class EnqueueResult:
    """Message ids of one `enqueue`, by what became of them."""

    queued: list[int]  # a new job
    linked: list[int]  # the key already had a job with the same fingerprint
    conflicts: list[int]  # same key, different fingerprint: a payload conflict row
    missing: list[int]  # not a message of the tenant


# Messages that are already the very message of a job of this (processor, version)
# with their current payload fingerprint: linked without reading their identities.
# A re-run (`inboxd extract backfill` again, the same mail fed twice) is all of
# these; one indexed query (extraction_jobs_message_idx) instead of three made a
# re-run of 20,000 messages ~2× faster (bench/extraction.py (c)). The fingerprint
# is MessageIdentity.payload_fingerprint's rule, in SQL. Whatever key the message
# would get now (reprocess may renormalise a Message-ID), it was extracted: linked.
# Driven from the ids (not `message_id = ANY(…)` as a filter: over a processor's
# whole job list that compared every job with every id, 96 ms per 2,000).
_ALREADY_QUEUED = """
SELECT j.message_id
  FROM unnest($4::bigint[]) AS i(message_id)
  JOIN extraction_jobs j ON j.tenant_id = $1 AND j.message_id = i.message_id
  JOIN messages m ON m.tenant_id = $1 AND m.message_id = i.message_id
 WHERE j.processor_id = $2 AND j.schema_version = $3
   AND j.payload_fingerprint = coalesce(nullif(m.content_fingerprint, ''),
                                        'raw:' || nullif(m.raw_sha256, ''),
                                        'row:' || m.message_id)
"""

_INSERT_JOBS = """
INSERT INTO extraction_jobs (tenant_id, processor_id, schema_version, dedup_key, message_id,
                             mailbox_id, payload_fingerprint, backfill)
SELECT $1, $2, $3, i.key, i.message_id, i.mailbox_id, i.fp, $8
  FROM unnest($4::text[], $5::bigint[], $6::text[], $7::text[]) WITH ORDINALITY
       AS i(key, message_id, mailbox_id, fp, ord)
 ORDER BY i.ord
ON CONFLICT (tenant_id, processor_id, schema_version, dedup_key) DO NOTHING
RETURNING message_id
"""

# For the inputs not inserted. A separate statement, so that under READ COMMITTED
# it sees the job a concurrent enqueue committed while our INSERT waited for it.
_MATCH_EXISTING = """
WITH i AS (
    SELECT * FROM unnest($4::text[], $5::bigint[], $6::text[]) AS i(key, message_id, fp)
), m AS (
    SELECT i.message_id, i.fp, j.job_id, j.message_id AS job_message_id,
           j.payload_fingerprint AS job_fp
      FROM i JOIN extraction_jobs j
        ON j.tenant_id = $1 AND j.processor_id = $2 AND j.schema_version = $3
       AND j.dedup_key = i.key
), conflicts AS (
    INSERT INTO extraction_payload_conflicts (tenant_id, job_id, existing_message_id,
                                              existing_fingerprint, new_message_id,
                                              new_fingerprint)
    SELECT $1, job_id, job_message_id, job_fp, message_id, fp FROM m WHERE fp <> job_fp
    ON CONFLICT (tenant_id, job_id, new_message_id, new_fingerprint) DO NOTHING
)
SELECT message_id, fp = job_fp AS same FROM m
"""


async def enqueue(
    conn: Executor,
    tenant_id: str,
    processor_id: str,
    schema_version: str,
    message_ids: Sequence[int],
    *,
    backfill: bool = False,
) -> EnqueueResult:
    """Queue an extraction of each message for (processor, schema_version); idempotent.

    Set-based, in one transaction: one query for the messages that already are
    their job's message (linked at once), then for the rest one read of their
    identities, one insert of the jobs, one statement for the keys that already
    had a job. A key
    already claimed with the same fingerprint links (nothing written); with
    another fingerprint it records a payload conflict (the job untouched).
    Queuing a message whose key already has a job (a merged copy, a re-run) is
    harmless: linked. `backfill`: history, claimed after new mail's due jobs.
    """
    if not schema_version:
        raise ValueError("schema_version must be a non-empty string")
    async with transaction(conn) as tx:
        wanted = sorted(set(message_ids))
        already = {
            r["message_id"]
            for r in await tx.fetch(
                _ALREADY_QUEUED, tenant_id, processor_id, schema_version, wanted
            )
        }
        rest_ids = [m for m in wanted if m not in already]
        identities = await load_identities(tx, tenant_id, rest_ids) if rest_ids else []
        found = {m.message_id for m in identities}
        missing = sorted(set(rest_ids) - found)
        if not identities:
            return EnqueueResult([], sorted(already), [], missing)
        inserted = await tx.fetch(
            _INSERT_JOBS,
            tenant_id,
            processor_id,
            schema_version,
            [m.dedup_key for m in identities],
            [m.message_id for m in identities],
            [m.mailbox_id for m in identities],
            [m.payload_fingerprint for m in identities],
            backfill,
        )
        queued = {r["message_id"] for r in inserted}
        rest = [m for m in identities if m.message_id not in queued]
        linked: list[int] = list(already)
        conflicts: list[int] = []
        if rest:
            rows = await tx.fetch(
                _MATCH_EXISTING,
                tenant_id,
                processor_id,
                schema_version,
                [m.dedup_key for m in rest],
                [m.message_id for m in rest],
                [m.payload_fingerprint for m in rest],
            )
            for r in rows:
                (linked if r["same"] else conflicts).append(r["message_id"])
    return EnqueueResult(sorted(queued), sorted(linked), sorted(conflicts), missing)
