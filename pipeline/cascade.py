"""The dedup cascade: decide, for a whole batch at once, what each item is.

docs/architecture.md §3, tiers, all scoped to the tenant:

  2. (mailbox, external id) seen before → duplicate. Evaluated first because it
     is exact and cheap: a complete re-sync is one indexed lookup per batch and
     nothing else. A hit means this very copy was processed already, so no
     other tier could change its outcome.
  0. Outbound reconciliation: a row the application recorded as sent
     (send_status pending/sent) with the same normalised Message-ID → merged,
     no content check (we generated that id). Fallback, when no id matches:
     exactly one placeholder outbound row with the same sender, same non-empty
     normalised subject, within 5 minutes.
  1. Message-ID with agreeing content fingerprint → merged; Message-ID hit
     with different content → conflict (own row, linked, never dropped).
  2b. The same raw bytes (sha256) stored in this mailbox under another id →
     merged: a resync under new ids (IMAP UIDVALIDITY change) of mail that has
     no Message-ID, sender or date for tiers 1 and 3.
  3. Inside one thread: same sender, ±2 minutes, same non-empty normalised
     subject and agreeing fingerprint → merged (ids mangled in transit).
  else new. Tier 4, the unique constraints, acts at insert time (ingest.py).

Items repeated inside one batch are resolved here too: the first occurrence
leads, later ones follow it (same external id → duplicate; same Message-ID and
fingerprint, the tier-3 key or the same bytes → merged into the leader's message; same
Message-ID with other content → conflict with the leader).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import asyncpg

from inboxd.pipeline.identity import normalise_body
from inboxd.pipeline.message import MessageData
from inboxd.pipeline.mime.parse import html_to_text
from inboxd.pipeline.outcomes import Outcome

# Tier 3 window (docs/architecture.md §3): clocks of two relays rarely differ by more.
HEURISTIC_WINDOW = timedelta(minutes=2)
# Tier 0 fallback window (docs/architecture.md §3): send-to-sync-back delay of a provider.
OUTBOUND_WINDOW = timedelta(minutes=5)

_COPY_HITS = """
SELECT b.idx, c.message_id,
       EXISTS (SELECT 1 FROM attachments a
                WHERE a.tenant_id = $1 AND a.message_id = c.message_id AND NOT a.stored)
  FROM unnest($3::text[]) WITH ORDINALITY AS b(external_id, idx)
 CROSS JOIN LATERAL (
       -- a lateral lookup pins the index nested loop: during a first sync the
       -- statistics are stale and a hash join would scan every copy per batch
       SELECT c.message_id FROM message_copies c
        WHERE c.tenant_id = $1 AND c.mailbox_id = $2 AND c.external_id = b.external_id
        LIMIT 1) AS c
"""

_CLASSIFY = """
SELECT b.idx,
       (SELECT ARRAY[m.message_id, (m.mailbox_id = $2)::int] FROM messages m
         WHERE b.mid IS NOT NULL AND m.tenant_id = $1 AND m.message_id_norm = b.mid
           AND m.send_status IN ('pending', 'sent')
         ORDER BY m.message_id LIMIT 1) AS outbound_hit,
       (SELECT m.message_id FROM messages m
         WHERE b.mid IS NOT NULL AND m.tenant_id = $1 AND m.message_id_norm = b.mid
           AND m.content_fingerprint = b.fp
         ORDER BY m.message_id LIMIT 1) AS mid_agree,
       (SELECT m.message_id FROM messages m
         WHERE b.mid IS NOT NULL AND m.tenant_id = $1 AND m.message_id_norm = b.mid
         ORDER BY m.message_id LIMIT 1) AS mid_any,
       (SELECT m.message_id FROM threads t
          JOIN messages m ON m.tenant_id = t.tenant_id AND m.thread_id = t.thread_id
         WHERE b.subj <> '' AND b.sender <> '' AND b.sent_at IS NOT NULL
           AND t.tenant_id = $1 AND t.mailbox_id = $2 AND t.external_thread_id = b.thread_key
           AND m.from_address = b.sender AND m.subject_norm = b.subj
           AND m.content_fingerprint = b.fp
           AND m.sent_at BETWEEN b.sent_at - $10::interval AND b.sent_at + $10::interval
         ORDER BY m.message_id LIMIT 1) AS heuristic_hit,
       (SELECT c.message_id FROM message_copies c
         WHERE b.sha IS NOT NULL AND c.tenant_id = $1 AND c.mailbox_id = $2
           AND c.raw_sha256 = b.sha
         LIMIT 1) AS bytes_hit,
       (SELECT CASE WHEN count(*) = 1 THEN min(m.message_id) END FROM messages m
         WHERE b.subj <> '' AND b.sender <> '' AND b.sent_at IS NOT NULL
           AND m.tenant_id = $1 AND m.mailbox_id = $2 AND m.send_status IN ('pending', 'sent')
           AND m.from_address = b.sender AND m.subject_norm = b.subj
           AND (m.external_id ~ $12 OR m.external_id ~* $13)
           AND m.sent_at BETWEEN b.sent_at - $11::interval AND b.sent_at + $11::interval
       ) AS outbound_fallback
  FROM unnest($3::int[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[],
              $9::timestamptz[], $14::text[])
       AS b(idx, mid, fp, thread_key, sender, subj, sent_at, sha)
"""
_PLACEHOLDER_PREFIX_RE = r"^(pending_|draft_|new_)"
_PLACEHOLDER_UUID_RE = r"^[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}$"


@dataclass(slots=True)
class Decision:
    """What the cascade decided for one item (index into the batch)."""

    outcome: Outcome
    existing_id: int | None = None  # matched row (duplicate/merged) or conflict_of
    leader: int | None = None  # in-batch leader index for followers
    promote: bool = False  # merged into an outbound placeholder: provider copy wins
    retry_attachments: bool = False


def group_in_batch(items: list[MessageData]) -> tuple[list[int], dict[int, tuple[int, Outcome]]]:
    """Split a batch into leaders and followers of an earlier identical item.

    Returns (leader indices, {follower index: (leader index, outcome)}).
    """
    by_ext: dict[str, int] = {}
    by_mid_fp: dict[tuple[str, str | None], int] = {}
    by_heuristic: dict[tuple[str, str, str, str | None], int] = {}
    by_bytes: dict[str, int] = {}
    leaders: list[int] = []
    followers: dict[int, tuple[int, Outcome]] = {}
    for i, item in enumerate(items):
        lead = by_ext.get(item.external_id)
        if lead is not None:
            # the first holder of this external id may itself follow a leader
            followers[i] = (followers.get(lead, (lead,))[0], Outcome.DUPLICATE)
            continue
        by_ext[item.external_id] = i
        key_mid = (item.message_id_norm, item.content_fingerprint) if item.message_id_norm else None
        sender = item.from_.email if item.from_ else ""
        key_h = (
            (item.thread_key, sender, item.subject_norm, item.content_fingerprint)
            if item.subject_norm and sender and item.sent_at
            else None
        )
        lead = by_mid_fp.get(key_mid) if key_mid else None
        if lead is None and key_h is not None:
            lead = by_heuristic.get(key_h)
        if lead is None and item.raw_sha256:
            lead = by_bytes.get(item.raw_sha256)
        if lead is not None:
            followers[i] = (lead, Outcome.MERGED)
            continue
        if key_mid:
            by_mid_fp[key_mid] = i
        if key_h is not None:
            by_heuristic.setdefault(key_h, i)
        if item.raw_sha256:
            by_bytes.setdefault(item.raw_sha256, i)
        leaders.append(i)
    return leaders, followers


async def classify(
    conn: asyncpg.Connection,
    tenant_id: str,
    mailbox_id: str,
    items: list[MessageData],
) -> tuple[dict[int, Decision], dict[int, tuple[int, Outcome]]]:
    """Run the cascade for a batch; two queries at most.

    Returns (decisions for items resolved against the database, followers of an
    in-batch leader). Tier 2 runs for every item first, so a complete re-sync
    costs one query; the rest is grouped in-batch before tiers 0/1/3.
    """
    decisions: dict[int, Decision] = {}
    ext_ids = [m.external_id for m in items]
    for ordinal, message_id, att_pending in await conn.fetch(
        _COPY_HITS, tenant_id, mailbox_id, ext_ids
    ):
        decisions[ordinal - 1] = Decision(
            Outcome.DUPLICATE, message_id, retry_attachments=att_pending
        )
    unseen = [i for i in range(len(items)) if i not in decisions]
    if not unseen:
        return decisions, {}
    lead_local, follow_local = group_in_batch([items[i] for i in unseen])
    followers = {unseen[f]: (unseen[lead], out) for f, (lead, out) in follow_local.items()}
    rest = [unseen[i] for i in lead_local]
    sel = [items[i] for i in rest]
    rows = await conn.fetch(
        _CLASSIFY,
        tenant_id,
        mailbox_id,
        rest,
        [m.message_id_norm for m in sel],
        [m.content_fingerprint for m in sel],
        [m.thread_key for m in sel],
        [m.from_.email if m.from_ else "" for m in sel],
        [m.subject_norm for m in sel],
        [m.sent_at for m in sel],
        HEURISTIC_WINDOW,
        OUTBOUND_WINDOW,
        _PLACEHOLDER_PREFIX_RE,
        _PLACEHOLDER_UUID_RE,
        [m.raw_sha256 for m in sel],
    )
    fallbacks: dict[int, int] = {}
    for idx, outbound, agree, any_mid, heuristic, same_bytes, fallback in rows:
        if outbound is not None:
            # Our own Message-ID: one message, no content check. Only the sending
            # mailbox's copy replaces the placeholders; a CC'd colleague's copy in
            # another mailbox is another sighting of it.
            outbound_id, same_mailbox = outbound
            decisions[idx] = Decision(Outcome.MERGED, outbound_id, promote=bool(same_mailbox))
        elif same_bytes is not None:
            # These very bytes are stored in this mailbox under another id: the same
            # message read again under new ids (an IMAP UIDVALIDITY change), even
            # when it has no Message-ID, sender or date for tiers 1 and 3.
            decisions[idx] = Decision(Outcome.MERGED, same_bytes)
        elif fallback is not None and any_mid is None:
            # No Message-ID of ours matched and the item's own id is unknown too:
            # the provider rewrote ours (SES, Exchange). Exactly one placeholder of
            # this mailbox, same sender and subject, ±5 min, and its recorded body
            # (if any) is the item's body verbatim.
            fallbacks[idx] = fallback
            decisions[idx] = Decision(Outcome.MERGED, fallback, promote=True)
        elif agree is not None:
            decisions[idx] = Decision(Outcome.MERGED, agree)
        elif any_mid is not None:
            decisions[idx] = Decision(Outcome.CONFLICT, any_mid)
        elif heuristic is not None:
            decisions[idx] = Decision(Outcome.MERGED, heuristic)
        else:
            decisions[idx] = Decision(Outcome.NEW)
    if fallbacks:
        await _confirm_fallbacks(conn, tenant_id, items, fallbacks, decisions)
    _mark_in_batch_conflicts(items, rest, decisions)
    return decisions, followers


async def _confirm_fallbacks(
    conn: asyncpg.Connection,
    tenant_id: str,
    items: list[MessageData],
    fallbacks: dict[int, int],
    decisions: dict[int, Decision],
) -> None:
    """A fallback match stands only if the placeholder's recorded body (if any) agrees.

    Without this, another message the agent sent from the same mailbox with the
    same subject within five minutes would be folded into the placeholder.
    """
    rows = await conn.fetch(
        "SELECT message_id, text_body, html_body FROM messages "
        "WHERE tenant_id = $1 AND message_id = ANY($2::bigint[])",
        tenant_id,
        list(set(fallbacks.values())),
    )
    bodies = {r[0]: r[1] or html_to_text(r[2]) for r in rows}
    for idx, placeholder in fallbacks.items():
        recorded = normalise_body(bodies.get(placeholder))
        item = items[idx]
        seen = normalise_body(item.text or html_to_text(item.html))
        if recorded and recorded != seen:
            decisions[idx] = Decision(Outcome.NEW)


def _mark_in_batch_conflicts(
    items: list[MessageData], rest: list[int], decisions: dict[int, Decision]
) -> None:
    """Two new leaders sharing a Message-ID with different content: the later conflicts."""
    first_new: dict[str, int] = {}
    for i in rest:
        decision = decisions[i]
        mid = items[i].message_id_norm
        if decision.outcome is not Outcome.NEW or not mid:
            continue
        if mid in first_new:
            decisions[i] = Decision(Outcome.CONFLICT, leader=first_new[mid])
        else:
            first_new[mid] = i
