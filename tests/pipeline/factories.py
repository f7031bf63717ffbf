"""Small factories for MessageData a test can override field by field."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from inboxd.pipeline.identity import content_fingerprint, normalise_message_id, normalise_subject
from inboxd.pipeline.message import Address, AttachmentData, MessageData
from inboxd.pipeline.objectstore.local import LocalDirectoryStore

_seq = itertools.count(1)
T0 = datetime(2026, 11, 2, 9, 30, tzinfo=UTC)


def message(
    *,
    tenant: str = "acme",
    mailbox: str = "inbox",
    external_id: str | None = None,
    thread: str | None = "thread-1",
    mid: str | None = "auto",
    sender: str = "alice@example.com",
    to: Sequence[str] = ("support@acme.test",),
    subject: str = "Invoice 42",
    sent_at: datetime | None = T0,
    text: str | None = "auto",
    html: str | None = None,
    attachments: Sequence[AttachmentData] = (),
) -> MessageData:
    n = next(_seq)
    raw_mid = f"<m{n}@Example.COM>" if mid == "auto" else mid
    if text == "auto":
        text = f"Hello, please find invoice {n} attached."
    subject_norm = normalise_subject(subject)
    return MessageData(
        tenant_id=tenant,
        mailbox_id=mailbox,
        external_id=external_id or f"ext-{n}",
        external_thread_id=thread,
        internet_message_id=raw_mid,
        message_id_norm=normalise_message_id(raw_mid),
        from_=Address(sender, sender.split("@")[0].title()),
        to=[Address(a) for a in to],
        subject=subject,
        subject_norm=subject_norm,
        sent_at=sent_at,
        received_at=(sent_at or T0) + timedelta(seconds=5),
        text=text,
        html=html,
        attachments=list(attachments),
        content_fingerprint=content_fingerprint(
            sender=sender,
            sender_name=f"{sender} {sender.split('@')[0].title()}",
            subject_norm=subject_norm,
            sent_at=sent_at,
            text=text,
            html_text=html,
            recipients=to,
            attachment_keys=[a.filename for a in attachments],
        ),
    )


class CountingStore(LocalDirectoryStore):
    """Local store that counts puts and can be told to fail keys with a prefix."""

    def __init__(self, root, fail_prefixes: Sequence[str] = ()) -> None:
        super().__init__(root)
        self.put_keys: list[str] = []
        self.fail_prefixes = tuple(fail_prefixes)

    async def put_many(self, items, *, conn=None):
        self.put_keys.extend(k for k, _, _ in items)
        ok = [(k, d, c) for k, d, c in items if not k.startswith(self.fail_prefixes)]
        results = iter(await super().put_many(ok))
        return [
            OSError("store unavailable") if k.startswith(self.fail_prefixes) else next(results)
            for k, _, _ in items
        ]
