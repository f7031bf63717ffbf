"""Attachments whose store failed on a raw-MIME door are re-derived from the raw bytes."""

from __future__ import annotations

from email.message import EmailMessage
from pathlib import Path

import asyncpg
from factories import CountingStore

from inboxd.pipeline.ingest.stage import IngestBatch, IngestStage
from inboxd.pipeline.mailbox import status as mailbox_status
from inboxd.pipeline.message import MessageData
from inboxd.pipeline.mime.parse import parse_raw
from inboxd.pipeline.objectstore.local import LocalDirectoryStore
from inboxd.pipeline.outcomes import Outcome
from inboxd.pipeline.reprocess.attachments import AttachmentSweeper

PDF = b"%PDF-1.4 an invoice that only lives inside the raw message\n" * 20


def invoice_mail() -> bytes:
    msg = EmailMessage()
    msg["From"] = "billing@vendor.example"
    msg["To"] = "ap@acme.example"
    msg["Subject"] = "Invoice 7"
    msg["Message-ID"] = "<invoice-7@vendor.example>"
    msg["Date"] = "Mon, 02 Nov 2026 09:30:00 +0000"
    msg.set_content("Invoice attached.")
    msg.add_attachment(PDF, maintype="application", subtype="pdf", filename="invoice-7.pdf")
    return msg.as_bytes()


async def pending(pool: asyncpg.Pool) -> int:
    [status] = await mailbox_status.mailbox_status(pool, "acme", mailbox_id="inbox")
    return status.attachments_pending


async def ingest_with_attachment_store_down(pool: asyncpg.Pool, root: Path) -> None:
    item = parse_raw(invoice_mail(), tenant_id="acme", mailbox_id="inbox")
    assert isinstance(item, MessageData) and len(item.attachments) == 1
    flaky = CountingStore(root, fail_prefixes=("att/",))
    [result] = await IngestStage(pool, flaky).ingest(IngestBatch("acme", "inbox", [item]))
    assert result.outcome is Outcome.NEW  # the message is stored; its attachment is not


async def test_a_failed_attachment_is_stored_by_the_next_sweep(
    pool: asyncpg.Pool, make_mailbox, tmp_path: Path
) -> None:
    await make_mailbox("acme", "inbox")
    root = tmp_path / "objects"
    await ingest_with_attachment_store_down(pool, root)
    assert await pending(pool) == 1

    store = LocalDirectoryStore(root)
    result = await AttachmentSweeper(pool, store).sweep()

    assert (result.stored, result.skipped) == (1, 0)
    row = await pool.fetchrow("SELECT stored, store_error, storage_key FROM attachments")
    assert row["stored"] and row["store_error"] is None
    assert await store.get(row["storage_key"]) == PDF
    assert await pending(pool) == 0
    again = await AttachmentSweeper(pool, store).sweep()
    assert (again.stored, again.skipped) == (0, 0)


async def test_a_part_that_no_longer_matches_is_skipped_and_stays_pending(
    pool: asyncpg.Pool, make_mailbox, tmp_path: Path
) -> None:
    await make_mailbox("acme", "inbox")
    root = tmp_path / "objects"
    await ingest_with_attachment_store_down(pool, root)
    await pool.execute("UPDATE attachments SET sha256 = repeat('0', 64)")

    sweeper = AttachmentSweeper(pool, LocalDirectoryStore(root))
    result = await sweeper.sweep()

    assert (result.stored, result.skipped) == (0, 1)
    assert await pending(pool) == 1  # still counted: an operator should look
    assert (await sweeper.sweep()).skipped == 0  # not retried in every pass
