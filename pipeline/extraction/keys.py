"""The dedup key and payload fingerprint of a message for the extraction claim protocol.

An extraction job is unique per (tenant, processor, schema_version, dedup key)
(pipeline/extraction/claims.py, docs/architecture.md §10). The key names the
*message*, not the copy a door delivered, and it is derived from the stored
message row the dedup cascade already resolved (docs/architecture.md §3), never
from the item a door is holding:

1. ``<provider>:<mailbox>:<external id>`` when the row's primary copy has an
   immutable provider id (`IMMUTABLE_ID_PROVIDERS`);
2. else ``mid:<normalised Message-ID>``;
3. else ``sha256:<raw MIME sha256>``;
4. else ``row:<message_id>`` (a row with none of these: nothing better is stable).

This is the issue's order (provider id, else Message-ID, else raw sha256),
applied to the one row every door's copy of a message resolves to:

* **Why the row, not the copy.** One message seen through two doors (a Gmail
  copy and a Maildir copy of it) is one `messages` row with two
  `message_copies` rows. Keyed by the copy, the Maildir copy would have a key of
  its own (a Maildir file has no immutable id, so ``mid:…``) and be extracted a
  second time; keyed by the row, whichever door queues it gets the key of the
  primary copy, so the second door is *linked*, never re-extracted.
* **Why the mailbox is not part of the unique key.** The issue scopes the key
  by mailbox too. A mailbox has exactly one provider, so a Maildir copy and a
  Gmail copy of one message are always in two mailboxes; a key scoped by the
  queuing mailbox would re-extract every cross-door message. The primary
  copy's mailbox is instead *inside* a provider-id key: Gmail, Graph and IMAP
  ids are unique only per account (SES ids globally, kept uniform).
* **Why the primary copy is stable.** The cascade never rewrites a row's
  `mailbox_id`/`external_id`, except when the provider's copy of a message the
  application recorded replaces its placeholder (pipeline/ingest/rows.py
  `promote_outbound`). Rows with `send_status` set are therefore keyed by
  ``row:<message_id>`` whatever they hold: their ids are not stable.
* **Message-ID before raw sha256.** The sha256 identifies bytes, not messages
  (two doors' copies of one message differ in bytes, e.g. line endings); the
  normalised Message-ID is what the cascade itself matches on. A reused
  Message-ID with other content is two rows (cascade `conflict`) with one key
  and two fingerprints: the protocol records a payload conflict for review.

Immutable provider ids (`IMMUTABLE_ID_PROVIDERS`): Gmail message ids never
change within an account (Gmail API, users.messages); Outlook ids are Graph
*immutable ids* (adapters/outlook/client.py asks for `IdType="ImmutableId"`,
which survive moves between folders); SES ids are the SES message id, else the
S3 object key (adapters/ses/pointers.py), neither ever reused; IMAP ids are
``folder:uidvalidity:uid``, immutable while UIDVALIDITY holds (RFC 3501 §2.3.1.1),
and a UIDVALIDITY change gives new copies that the cascade merges into the same
row (tier 2b), so the key does not move. Maildir ids (file names change with
flags) and import ids (the raw sha256 already) are not provider identities.

The payload fingerprint is the row's `content_fingerprint` (normalised sender,
subject, date, body: pipeline/identity.py), else ``raw:<sha256>``, else
``row:<message_id>``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TypeAlias

import asyncpg

Executor: TypeAlias = asyncpg.Connection | asyncpg.Pool

#: Doors whose external id is an immutable provider identity (module docstring).
IMMUTABLE_ID_PROVIDERS = frozenset({"gmail", "outlook", "ses", "imap"})


@dataclass(frozen=True, slots=True)
class MessageIdentity:
    """What a message row holds that its extraction key is derived from."""

    message_id: int
    mailbox_id: str  # mailbox of the primary copy
    provider: str  # that mailbox's door
    external_id: str  # the primary copy's provider id
    recorded_by_application: bool  # send_status IS NOT NULL: ids may be placeholders
    message_id_norm: str | None
    raw_sha256: str | None
    content_fingerprint: str | None

    @property
    def dedup_key(self) -> str:
        """The message's extraction key (module docstring, rules 1-4)."""
        if self.recorded_by_application:
            return f"row:{self.message_id}"
        if self.provider in IMMUTABLE_ID_PROVIDERS and self.external_id:
            return f"{self.provider}:{self.mailbox_id}:{self.external_id}"
        if self.message_id_norm:
            return f"mid:{self.message_id_norm}"
        if self.raw_sha256:
            return f"sha256:{self.raw_sha256}"
        return f"row:{self.message_id}"

    @property
    def payload_fingerprint(self) -> str:
        """The content fingerprint compared when a key is seen again."""
        if self.content_fingerprint:
            return self.content_fingerprint
        if self.raw_sha256:
            return f"raw:{self.raw_sha256}"
        return f"row:{self.message_id}"


_LOAD = """
SELECT m.message_id, m.mailbox_id, mb.provider, m.external_id,
       m.send_status IS NOT NULL AS recorded, m.message_id_norm, m.raw_sha256,
       m.content_fingerprint
  FROM messages m
  JOIN mailboxes mb ON mb.tenant_id = m.tenant_id AND mb.mailbox_id = m.mailbox_id
 WHERE m.tenant_id = $1 AND m.message_id = ANY($2::bigint[])
 ORDER BY m.message_id
"""


async def load_identities(
    conn: Executor, tenant_id: str, message_ids: Sequence[int]
) -> list[MessageIdentity]:
    """The identities of the tenant's messages among `message_ids`, in message_id order.

    One statement. Ids that are not the tenant's messages are left out.
    """
    if not message_ids:
        return []
    rows = await conn.fetch(_LOAD, tenant_id, sorted(set(message_ids)))
    return [
        MessageIdentity(
            message_id=r["message_id"],
            mailbox_id=r["mailbox_id"],
            provider=r["provider"],
            external_id=r["external_id"],
            recorded_by_application=r["recorded"],
            message_id_norm=r["message_id_norm"],
            raw_sha256=r["raw_sha256"],
            content_fingerprint=r["content_fingerprint"],
        )
        for r in rows
    ]


@asynccontextmanager
async def transaction(conn: Executor) -> AsyncIterator[asyncpg.Connection]:
    """A transaction on `conn` (a savepoint inside the caller's), or on a pool connection."""
    if isinstance(conn, asyncpg.Pool):
        async with conn.acquire() as acquired, acquired.transaction():
            yield acquired
    else:
        async with conn.transaction():
            yield conn
