"""The ingest stage's object-store side: the bytes a batch's rows will point at.

What it guarantees (docs/architecture.md §3):

* Bytes are stored before the transaction's rows reference them. Keys are
  content-addressed (``raw/<tenant>/<sha256>``, ``html/…``, ``att/…``), so a
  crash or rollback leaves at worst an orphan object, never a row pointing at
  nothing, and storing the same bytes again is a no-op.
* Only items that need bytes cost an upload: raw MIME for every item that is
  not a duplicate; large HTML and attachments only for new, conflicting or
  promoted messages; attachments again for a duplicate whose earlier store
  failed. Attachment bytes a provider did not include are fetched lazily, for
  those messages only, a few at a time.
* A failed store degrades, never loses: a large HTML body stays inline; an
  attachment is recorded unstored with its error and retried on the next
  sighting; raw bytes that could not be stored make the item a
  retriable_failure (raw bytes are the one thing we must never lose), and so do
  a dead item's.

``ingest.py`` owns the transaction and calls in here; nothing here commits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import anyio
import asyncpg
import structlog

from inboxd.pipeline.cascade import Decision
from inboxd.pipeline.errors import describe
from inboxd.pipeline.ingest.rows import clean
from inboxd.pipeline.message import AttachmentData, DeadItem, MessageData
from inboxd.pipeline.objectstore.store import ObjectStore
from inboxd.pipeline.outcomes import Outcome

log = structlog.get_logger(__name__)

# HTML bodies above this go to the object store. Gmail clips display at 102 KB,
# so larger bodies are rare and mostly newsletters nobody reads inline.
HTML_INLINE_MAX_BYTES = 128 * 1024
# Concurrent provider attachment fetches per batch (Graph: 4 concurrent
# requests per mailbox, docs/architecture.md §4).
ATTACHMENT_FETCH_CONCURRENCY = 4

AttachmentFetcher = Callable[[MessageData, AttachmentData], Awaitable[bytes]]
# (storage key, store error) per attachment of one message, in attachment order
AttachmentState = list[tuple[str | None, str | None]]


@dataclass(slots=True)
class StoredBytes:
    """Where a batch's bytes went, per message item index.

    `raw_keys` / `html_keys`: keys of stored raw MIME and HTML bodies (a failed
    HTML store is absent: the body stays inline). `att_state`: per attachment.
    `failures`: items whose raw bytes were not stored, with the reason.
    """

    raw_keys: dict[int, str] = field(default_factory=dict)
    html_keys: dict[int, str] = field(default_factory=dict)
    att_state: dict[int, AttachmentState] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)


async def store_message_bytes(
    store: ObjectStore,
    tenant: str,
    fetch: AttachmentFetcher | None,
    items: Sequence[MessageData],
    outcomes: Sequence[Outcome],
    decisions: dict[int, Decision],
    *,
    conn: asyncpg.Connection | None = None,
) -> StoredBytes:
    """Store raw MIME, large HTML and attachments, only for items that need them.

    `outcomes[k]` is item k's classified outcome; `decisions` the cascade's
    decisions (followers have none); `conn` the batch's transaction, passed to the
    store (ObjectStore.put_many). Store failures are reported in the result, never
    raised; a bad key raises ValueError (a programming error).
    """
    stored = StoredBytes()
    puts: list[tuple[str, bytes, str]] = []
    owners: list[tuple[str, int, int]] = []  # (kind, item index, attachment position)
    for k, item in enumerate(items):
        outcome = outcomes[k]
        if outcome is Outcome.DUPLICATE:
            if decisions.get(k) and decisions[k].retry_attachments:
                _queue_attachments(tenant, k, item, stored, puts, owners)
            continue
        if item.raw is not None and item.raw_sha256:
            key = f"raw/{tenant}/{item.raw_sha256}"
            stored.raw_keys[k] = key
            puts.append((key, item.raw, "message/rfc822"))
            owners.append(("raw", k, -1))
        decision = decisions.get(k)
        promoted = decision is not None and decision.promote
        if outcome not in (Outcome.NEW, Outcome.CONFLICT) and not promoted:
            continue
        if (html := html_object(tenant, item.html)) is not None:
            key, data = html
            stored.html_keys[k] = key
            puts.append((key, data, "text/html; charset=utf-8"))
            owners.append(("html", k, -1))
        await _fetch_attachments(fetch, item)
        _queue_attachments(tenant, k, item, stored, puts, owners)
    if not puts:
        return stored
    errors = await store.put_many(puts, conn=conn)
    for (kind, k, pos), err in zip(owners, errors, strict=True):
        if err is None:
            continue
        if kind == "raw":
            # Raw bytes are the one thing we must never lose: retry later.
            stored.failures[k] = f"raw bytes not stored: {_one_line(err)}"
            stored.raw_keys.pop(k, None)
        elif kind == "html":
            stored.html_keys.pop(k, None)  # degrade: keep the HTML inline
            log.warning("html_body_inline_fallback", tenant=tenant, error=_one_line(err))
        else:
            stored.att_state[k][pos] = (None, _one_line(err))
    return stored


def html_object(tenant: str, html: str | None) -> tuple[str, bytes] | None:
    """(key, bytes) of an HTML body kept in the object store rather than inline (over
    HTML_INLINE_MAX_BYTES), else None. `inboxd reprocess` compares with the same rule."""
    if not html or len(html) <= HTML_INLINE_MAX_BYTES:
        return None
    data = html.encode("utf-8", "replace")
    return f"html/{tenant}/{_sha(data)}", data


@dataclass(slots=True)
class DeadRawKeys:
    """Where each dead item's raw bytes went, by batch index.

    `keys[i]` is the object key, or None when the item had no raw bytes.
    `failed` holds the indices whose store failed: such a dead item is not
    recorded yet (rows.insert_dead_items skips it) and comes back retriable.
    """

    keys: dict[int, str | None]
    failed: set[int]


async def store_dead_raw(
    store: ObjectStore,
    tenant: str,
    deads: list[tuple[int, DeadItem]],
    *,
    conn: asyncpg.Connection | None = None,
) -> DeadRawKeys:
    """Store dead items' raw bytes (DeadRawKeys)."""
    keys: dict[int, str | None] = {}
    failed_indices: set[int] = set()
    puts: list[tuple[str, bytes, str]] = []
    for i, dead in deads:
        if dead.raw is not None and dead.raw_sha256:
            raw_key = f"raw/{tenant}/{dead.raw_sha256}"
            keys[i] = raw_key
            puts.append((raw_key, dead.raw, "application/octet-stream"))
        else:
            keys[i] = None
    if puts:
        errors = await store.put_many(puts, conn=conn)
        failed = {key for (key, _, _), err in zip(puts, errors, strict=True) if err}
        failed_indices = {i for i, key in keys.items() if key in failed}
    return DeadRawKeys(keys, failed_indices)


async def record_retried_attachments(
    conn: asyncpg.Connection,
    tenant: str,
    decisions: dict[int, Decision],
    att_state: dict[int, AttachmentState],
) -> None:
    """Mark attachments of duplicates stored now that a retried store succeeded."""
    keys, shas, ids = [], [], []
    for k, d in decisions.items():
        if d.outcome is Outcome.DUPLICATE and d.retry_attachments:
            for key, err in att_state.get(k, []):
                if key and err is None:
                    keys.append(key)
                    shas.append(key.rsplit("/", 1)[1])
                    ids.append(d.existing_id)
    if keys:
        await conn.execute(
            "UPDATE attachments a SET stored = true, store_error = NULL, storage_key = u.key "
            "FROM unnest($2::bigint[], $3::text[], $4::text[]) AS u(message_id, sha, key) "
            "WHERE a.tenant_id = $1 AND a.message_id = u.message_id AND a.sha256 = u.sha "
            "AND NOT a.stored",
            tenant,
            ids,
            shas,
            keys,
        )


async def _fetch_attachments(fetch: AttachmentFetcher | None, item: MessageData) -> None:
    missing = [a for a in item.attachments if a.content is None and a.provider_ref]
    if fetch is None or not missing:
        return
    limiter = anyio.CapacityLimiter(ATTACHMENT_FETCH_CONCURRENCY)

    async def one(att: AttachmentData) -> None:
        async with limiter:
            try:
                data = await fetch(item, att)
            except Exception as exc:  # recorded as stored=false, retried next sighting
                log.warning("attachment_fetch_failed", error=_one_line(exc))
                return
        att.content = data
        att.size_bytes = len(data)
        att.sha256 = _sha(data)

    async with anyio.create_task_group() as tg:
        for att in missing:
            tg.start_soon(one, att)


def _queue_attachments(
    tenant: str,
    k: int,
    item: MessageData,
    stored: StoredBytes,
    puts: list[tuple[str, bytes, str]],
    owners: list[tuple[str, int, int]],
) -> None:
    """Queue attachment bytes under deterministic keys; unfetched ones stay unstored."""
    state: AttachmentState = []
    for pos, att in enumerate(item.attachments):
        if att.content is None or not att.sha256:
            state.append((None, "bytes not fetched"))
            continue
        key = f"att/{tenant}/{att.sha256}"
        state.append((key, None))
        puts.append((key, att.content, att.content_type or "application/octet-stream"))
        owners.append(("att", k, pos))
    stored.att_state[k] = state


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _one_line(exc: BaseException) -> str:
    return clean(describe(exc))
