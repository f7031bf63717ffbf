"""The poller against moto's SQS and S3 and a real PostgreSQL, in process."""

from __future__ import annotations

import pytest
from helpers.ses_queue import corpus_files, ses_notification

from inboxd.adapters.ses import SesMailbox

pytestmark = pytest.mark.slow


async def _receive_all(poller) -> None:
    while batch := await poller._aws.receive():
        await poller.process(batch)


async def test_forwarded_mail_becomes_rows_and_leaves_the_queue(
    aws, make_poller, make_mailbox, pool, corpus
) -> None:
    await make_mailbox("acme", "support", provider="ses")
    raws = corpus_files(corpus, 3)
    for i, raw in enumerate(raws):
        aws.put(f"in/m{i}", raw)
        aws.send(ses_notification(aws.bucket, f"in/m{i}", f"ses-{i}", ["support@acme.test"]))
    mailbox = SesMailbox.from_settings({"addresses": ["support@acme.test"]})
    async with make_poller([("acme", "support", mailbox)]) as (poller, events):
        await _receive_all(poller)
    async with pool.acquire() as conn:
        ids = await conn.fetch(
            "SELECT external_id FROM message_copies WHERE tenant_id='acme' ORDER BY 1"
        )
    assert [r[0] for r in ids] == ["ses-0", "ses-1", "ses-2"]
    assert aws.queue_counts() == (0, 0)
    assert events.counts.get("deleted") == 3
