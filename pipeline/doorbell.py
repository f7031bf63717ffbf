"""The doorbell: "sync mailbox M of tenant T now", across processes, via NOTIFY.

Anything that learns a mailbox has new mail — `inboxd sync now`, a push
webhook handled by another replica, SQL run by the application — rings the
bell with `ring()`; every daemon LISTENs on DOORBELL_CHANNEL and hands the
parsed (tenant, mailbox) to its own coalescing trigger. A doorbell is a hint,
not a delivery: it carries no mail, is lost when no daemon is listening (the
poll scanner catches up), and may arrive at several replicas at once — the
mailbox lease decides which of them syncs.

Payload (JSON, well under NOTIFY's 8000-byte limit):
    {"tenant": "<tenant_id>", "mailbox": "<mailbox_id>"}
which the application can send itself:
    SELECT pg_notify('inboxd_doorbell', '{"tenant":"acme","mailbox":"support"}');
"""

from __future__ import annotations

import asyncpg
import orjson

from inboxd.pipeline.tenancy import validate_id

DOORBELL_CHANNEL = "inboxd_doorbell"


async def ring(conn: asyncpg.Connection | asyncpg.Pool, tenant_id: str, mailbox_id: str) -> None:
    """Notify every listening daemon that `mailbox_id` of `tenant_id` should sync.

    Inside a transaction the notification is sent at commit (and dropped on
    rollback), so ringing in the transaction that caused it is safe. Raises
    ValueError for ids that are not valid tenant/mailbox ids.
    """
    validate_id("tenant", tenant_id)
    validate_id("mailbox", mailbox_id)
    payload = orjson.dumps({"tenant": tenant_id, "mailbox": mailbox_id}).decode()
    await conn.execute("SELECT pg_notify($1, $2)", DOORBELL_CHANNEL, payload)


def parse_doorbell(payload: str) -> tuple[str, str] | None:
    """(tenant_id, mailbox_id) of a doorbell payload, or None when it is not one.

    The channel is open to any database user, so a malformed payload is
    ignored (the caller may log it), never raised.
    """
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict):
        return None
    tenant, mailbox = data.get("tenant"), data.get("mailbox")
    if not isinstance(tenant, str) or not isinstance(mailbox, str):
        return None
    try:
        return validate_id("tenant", tenant), validate_id("mailbox", mailbox)
    except ValueError:
        return None
