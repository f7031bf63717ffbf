"""Recording a message the application is sending, so its sync-back reconciles.

The application (or `POST /v1/outbound` later) records the send before the
provider has it: its own Message-ID, placeholder thread/message ids (`pending_…`,
`draft_…`, `new_…` or a bare UUID) and send_status pending. When the provider's
copy syncs back, cascade tier 0 matches it by Message-ID (no content check: we
generated that id) and promotes the placeholders to the provider's ids.

The same contract as plain SQL, for applications that write directly (in one
transaction; if you also write `events` rows yourself, take
`SELECT pg_advisory_xact_lock(110798, hashtext(<tenant_id>))` first, as
pipeline/outbox.py does, so a tenant's events commit in id order):
  INSERT INTO threads (tenant_id, mailbox_id, external_thread_id) VALUES (…, 'pending_…')
  INSERT INTO messages (tenant_id, mailbox_id, thread_id, external_id, direction,
      send_status, internet_message_id, message_id_norm, from_address, subject,
      subject_norm, sent_at, text_body, html_body)
  VALUES (…, 'pending_…', 'outbound', 'pending', '<id@host>', 'id@host', …)

With `announce=True` (what `POST /v1/outbound` does) a `message.recorded` event
is written to the outbox in the same transaction, so other clients of the
application learn about the send from `GET /v1/events`. Its payload carries the
caller's `client_id` when given, which lets the client that made the change
skip its own echo (`GET /v1/events?exclude_client=<client_id>`). An application
writing the SQL above itself adds, in the same transaction:
  INSERT INTO events (tenant_id, kind, mailbox_id, thread_id, message_id, payload)
  VALUES (…, 'message.recorded', …, '{"client_id": "tab-42", …}');
  SELECT pg_notify('inboxd_events', '{"tenant": "…", "last_event_id": …}');
"""

from __future__ import annotations

from datetime import datetime

import asyncpg

from inboxd.pipeline.identity import is_placeholder_id, normalise_message_id, normalise_subject
from inboxd.pipeline.outbox import EventBuffer
from inboxd.pipeline.threads import recompute_threads


async def record_outbound(
    conn: asyncpg.Connection,
    *,
    tenant_id: str,
    mailbox_id: str,
    message_id_header: str,
    placeholder_message_id: str,
    thread_id: str,
    from_address: str,
    subject: str = "",
    sent_at: datetime | None = None,
    text: str | None = None,
    html: str | None = None,
    send_status: str = "pending",
    announce: bool = False,
    client_id: str | None = None,
    esp_message_id: str | None = None,
) -> int:
    """Insert the outbound row (and its thread if new); returns messages.message_id.

    `thread_id` is a placeholder for a new conversation, or the provider thread
    key of the conversation being replied to. `esp_message_id` is the sending
    provider's id of the message (its API's answer), which correlates delivery
    events that carry no Message-ID (Postmark, Resend). `announce` (implied by a
    `client_id`) also writes a `message.recorded` outbox event, payload
    `{placeholder_message_id, send_status[, client_id]}`, in the same transaction.
    Raises ValueError when the message id is not a placeholder or the Message-ID
    is unusable.
    """
    if not is_placeholder_id(placeholder_message_id):
        raise ValueError("placeholder_message_id must start with pending_/draft_/new_ or be a UUID")
    mid = normalise_message_id(message_id_header)
    if not mid:
        raise ValueError("message_id_header is empty")
    async with conn.transaction():
        tid = await conn.fetchval(
            "INSERT INTO threads (tenant_id, mailbox_id, external_thread_id, subject) "
            "VALUES ($1, $2, $3, $4) ON CONFLICT (tenant_id, mailbox_id, external_thread_id) "
            "DO UPDATE SET updated_at = now() RETURNING thread_id",
            tenant_id,
            mailbox_id,
            thread_id,
            subject,
        )
        message_id: int = await conn.fetchval(
            "INSERT INTO messages (tenant_id, mailbox_id, thread_id, external_id, direction, "
            "send_status, internet_message_id, message_id_norm, from_address, subject, "
            "subject_norm, sent_at, text_body, html_body, esp_message_id) VALUES ($1, $2, $3, "
            "$4, 'outbound', $5, $6, $7, $8, $9, $10, $11, $12, $13, $14) RETURNING message_id",
            tenant_id,
            mailbox_id,
            tid,
            placeholder_message_id,
            send_status,
            message_id_header,
            mid,
            from_address.lower(),
            subject,
            normalise_subject(subject),
            sent_at,
            text,
            html,
            esp_message_id,
        )
        await recompute_threads(conn, tenant_id, {tid})
        if announce or client_id is not None:
            payload: dict[str, object] = {
                "placeholder_message_id": placeholder_message_id,
                "send_status": send_status,
            }
            if client_id is not None:
                payload["client_id"] = client_id
            events = EventBuffer()
            events.add("message.recorded", thread_id=tid, message_id=message_id, payload=payload)
            await events.flush(conn, tenant_id, mailbox_id)
    return message_id


async def find_placeholder(
    conn: asyncpg.Connection, tenant_id: str, mailbox_id: str, placeholder_id: str
) -> asyncpg.Record | None:
    """The message row a placeholder id names in the mailbox (`message_id`,
    `message_id_norm`), None when there is none: a repeated `POST /v1/outbound`."""
    return await conn.fetchrow(
        "SELECT message_id, message_id_norm FROM messages"
        " WHERE tenant_id = $1 AND mailbox_id = $2 AND external_id = $3",
        tenant_id,
        mailbox_id,
        placeholder_id,
    )


async def find_attachment(
    conn: asyncpg.Connection | asyncpg.Pool, tenant_id: str, attachment_id: int
) -> asyncpg.Record | None:
    """An attachment's name, type and where its bytes are (`filename`,
    `content_type`, `storage_key`, `stored`), for `GET /v1/attachments/{id}`."""
    return await conn.fetchrow(
        "SELECT filename, content_type, storage_key, stored FROM attachments"
        " WHERE tenant_id = $1 AND attachment_id = $2",
        tenant_id,
        attachment_id,
    )
