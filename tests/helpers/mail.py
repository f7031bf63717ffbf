"""Stored messages for tests outside tests/pipeline (which has its own factories.py):
`store_mail` ingests one message per sender through the real IngestStage and returns
their message ids, so extraction tests in any folder start from real rows."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from datetime import UTC, datetime

from inboxd.pipeline.identity import content_fingerprint, normalise_message_id, normalise_subject
from inboxd.pipeline.ingest.stage import IngestBatch, IngestStage
from inboxd.pipeline.message import Address, MessageData
from inboxd.pipeline.outcomes import Outcome

_seq = itertools.count(1)
SENT_AT = datetime(2026, 11, 2, 9, 30, tzinfo=UTC)


def mail(tenant: str, mailbox: str, sender: str, subject: str = "Invoice 7") -> MessageData:
    """One received message from `sender`, unique in Message-ID and body."""
    n = next(_seq)
    mid = f"<h{n}@example.com>"
    text = f"Please find invoice {n} attached."
    return MessageData(
        tenant_id=tenant,
        mailbox_id=mailbox,
        external_id=f"helper-{n}",
        internet_message_id=mid,
        message_id_norm=normalise_message_id(mid),
        from_=Address(sender),
        to=[Address("ap@acme.test")],
        subject=subject,
        subject_norm=normalise_subject(subject),
        sent_at=SENT_AT,
        received_at=SENT_AT,
        text=text,
        content_fingerprint=content_fingerprint(
            sender=sender,
            sender_name=sender,
            subject_norm=normalise_subject(subject),
            sent_at=SENT_AT,
            text=text,
            html_text=None,
            recipients=["ap@acme.test"],
            attachment_keys=[],
        ),
    )


async def store_mail(
    stage: IngestStage, tenant: str, mailbox: str, senders: Sequence[str]
) -> list[int]:
    """Ingest one new message per sender; their message ids, in order."""
    results = await stage.ingest(
        IngestBatch(tenant, mailbox, [mail(tenant, mailbox, s) for s in senders])
    )
    assert [r.outcome for r in results] == [Outcome.NEW] * len(senders), results
    return [r.message_id for r in results]
