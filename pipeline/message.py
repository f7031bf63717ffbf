"""MessageData: the one shape every door normalises mail into (docs/architecture.md §3).

A door (Gmail, Graph, SES, IMAP, Maildir, import) builds these; the ingest stage
(`pipeline.ingest.stage`) is the only thing that turns them into rows. Nothing here
touches the network or the database.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime


@dataclass(frozen=True, slots=True)
class Address:
    """One mailbox in an address header; `email` is lower-cased, may be empty."""

    email: str
    name: str = ""


@dataclass(slots=True)
class AttachmentData:
    """An attachment or inline part.

    `content` holds the decoded bytes when the door already has them (raw MIME);
    provider doors leave it None and set `provider_ref`, and the ingest stage
    fetches the bytes only for messages whose outcome is `new` (or whose earlier
    store failed).
    """

    filename: str
    content_type: str
    size_bytes: int
    sha256: str | None = None
    content: bytes | None = None
    content_id: str | None = None
    disposition: str = "attachment"
    provider_ref: str | None = None


@dataclass(slots=True)
class MessageData:
    """A message as one door saw it. Field meanings match schema.sql `messages`.

    `external_thread_id` is the provider's thread key; raw-MIME doors leave it None
    and set `thread_key_derived` instead (first References entry, else
    In-Reply-To, else Message-ID, else a source-prefixed id).
    """

    tenant_id: str
    mailbox_id: str
    external_id: str
    external_thread_id: str | None = None
    thread_key_derived: str | None = None
    internet_message_id: str | None = None
    message_id_norm: str | None = None
    in_reply_to: str | None = None
    references: list[str] = field(default_factory=list)
    from_: Address | None = None
    to: list[Address] = field(default_factory=list)
    cc: list[Address] = field(default_factory=list)
    bcc: list[Address] = field(default_factory=list)
    reply_to: list[Address] = field(default_factory=list)
    subject: str = ""
    subject_norm: str = ""
    sent_at: datetime | None = None
    received_at: datetime | None = None
    text: str | None = None
    html: str | None = None
    attachments: list[AttachmentData] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    content_fingerprint: str | None = None
    raw_sha256: str | None = None
    raw: bytes | None = None
    direction: str = "inbound"
    parse_defects: list[str] = field(default_factory=list)

    @property
    def thread_key(self) -> str:
        """The key threads are upserted on: the provider's, else the derived one."""
        return self.external_thread_id or self.thread_key_derived or f"msg:{self.external_id}"


@dataclass(frozen=True, slots=True)
class DeadItem:
    """An item a door could not turn into MessageData: it becomes a dead_items row."""

    tenant_id: str
    mailbox_id: str
    external_id: str
    reason: str
    detail: str
    raw: bytes | None = None
    raw_sha256: str | None = None
