"""Attachments whose store failed, re-derived from the message's stored raw bytes.

A raw-MIME door (Maildir, import, SES, IMAP) hands over a message once: after
its page is settled the file is in cur/, the queue message deleted, the cursor
past it. If the object store refused an attachment then, the message row was
still committed (the raw bytes were stored, or the item would have been
retriable) and the attachment recorded `stored = false` with its
`store_error`. Nothing would ever try again, so this sweep does:

    pass, per tenant:
      candidates  unstored attachments with a store_error, no provider_ref (raw
                  doors only: provider doors refetch on their own), whose
                  message has raw_key; oldest first, at most SWEEP_BATCH
      per message get the raw bytes → parse_raw (in a worker thread) → the part
                  at `position` → put under att/<tenant>/<sha256>
      per part    UPDATE … SET stored = true WHERE NOT stored (idempotent:
                  several replicas may sweep at once)

A part that cannot be re-derived (its sha256 no longer matches, the raw
object is gone) is logged and skipped for the rest of this process's life;
`inboxd status` keeps counting it as pending. Store or database trouble ends
the pass; the next one tries again.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass

import anyio
import anyio.to_thread
import asyncpg
import structlog

from inboxd.pipeline.errors import DATABASE_ERRORS, describe
from inboxd.pipeline.message import MessageData
from inboxd.pipeline.mime.parse import parse_raw
from inboxd.pipeline.objectstore.store import ObjectNotFound, ObjectStore, ObjectStoreError

log = structlog.get_logger(__name__)

# Attachments one pass takes per tenant; a backlog drains over several passes.
SWEEP_BATCH = 200
# Between passes. Store outages last minutes; this retries soon after without
# scanning an empty set every few seconds.
SWEEP_INTERVAL_S = 300.0

_CANDIDATES = """
SELECT a.attachment_id, a.position, a.sha256, a.content_type, m.raw_key
  FROM attachments a
  JOIN messages m ON m.tenant_id = a.tenant_id AND m.message_id = a.message_id
 WHERE a.tenant_id = $1 AND NOT a.stored AND a.store_error IS NOT NULL
   AND a.provider_ref IS NULL AND m.raw_key IS NOT NULL
   AND a.attachment_id <> ALL($2::bigint[])
 ORDER BY a.attachment_id
 LIMIT $3
"""

_MARK_STORED = """
UPDATE attachments SET stored = true, store_error = NULL, storage_key = $3,
                       sha256 = coalesce(sha256, $4)
 WHERE tenant_id = $1 AND attachment_id = $2 AND NOT stored
"""


@dataclass(slots=True)
class SweepResult:
    stored: int = 0
    skipped: int = 0


class AttachmentSweeper:
    """Re-derives failed attachments; remembers the ones that cannot be."""

    def __init__(self, pool: asyncpg.Pool, store: ObjectStore) -> None:
        self.pool = pool
        self.store = store
        self._hopeless: set[int] = set()

    async def run(self, interval_s: float = SWEEP_INTERVAL_S) -> None:
        """Sweep every `interval_s` until cancelled; no error ends the loop."""
        while True:
            try:
                result = await self.sweep()
                if result.stored or result.skipped:
                    log.info("attachments_swept", stored=result.stored, skipped=result.skipped)
            except DATABASE_ERRORS as exc:
                log.warning("attachment_sweep_failed", error=describe(exc))
            except ObjectStoreError as exc:
                log.warning("attachment_sweep_failed", error=describe(exc))
            except Exception:  # a defect in one pass must not end the daemon
                log.exception("attachment_sweep_crashed")
            await anyio.sleep(interval_s)

    async def sweep(self) -> SweepResult:
        """One pass over every tenant (module docstring)."""
        result = SweepResult()
        async with self.pool.acquire() as conn:
            tenants = [r[0] for r in await conn.fetch("SELECT tenant_id FROM tenants")]
        for tenant in tenants:
            await self._sweep_tenant(tenant, result)
        return result

    async def _sweep_tenant(self, tenant: str, result: SweepResult) -> None:
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(_CANDIDATES, tenant, sorted(self._hopeless), SWEEP_BATCH)
        by_raw: dict[str, list[asyncpg.Record]] = defaultdict(list)
        for row in rows:
            by_raw[row["raw_key"]].append(row)
        for raw_key, parts in by_raw.items():
            message = await self._parse(tenant, raw_key)
            for row in parts:
                content = _part(message, row["position"], row["sha256"])
                if content is None:
                    self._hopeless.add(row["attachment_id"])
                    result.skipped += 1
                    log.error(
                        "attachment_not_rederivable",
                        tenant=tenant,
                        attachment_id=row["attachment_id"],
                        raw_key=raw_key,
                    )
                    continue
                sha = hashlib.sha256(content).hexdigest()
                key = f"att/{tenant}/{sha}"
                await self.store.put(key, content, content_type=row["content_type"])
                async with self.pool.acquire() as conn:
                    await conn.execute(_MARK_STORED, tenant, row["attachment_id"], key, sha)
                result.stored += 1

    async def _parse(self, tenant: str, raw_key: str) -> MessageData | None:
        try:
            raw = await self.store.get(raw_key)
        except ObjectNotFound:  # nothing to derive from; other store errors end the pass
            log.warning("attachment_raw_missing", tenant=tenant, raw_key=raw_key)
            return None
        item = await anyio.to_thread.run_sync(
            lambda: parse_raw(raw, tenant_id=tenant, mailbox_id="sweep")
        )
        return item if isinstance(item, MessageData) else None


def _part(message: MessageData | None, position: int, sha256: str | None) -> bytes | None:
    """The bytes of the attachment at `position`, when they are the ones recorded."""
    if message is None or not 0 <= position < len(message.attachments):
        return None
    content = message.attachments[position].content
    if content is None:
        return None
    if sha256 and hashlib.sha256(content).hexdigest() != sha256:
        return None
    return content
