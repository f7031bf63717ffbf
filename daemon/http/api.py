"""The application's API: `POST /v1/outbound` and `GET /v1/attachments/{id}`.

Both authenticate with the tenant's bearer token and only ever touch rows of
that tenant. Another tenant's attachment id answers 404, exactly like an id
that does not exist, so ids cannot be probed across tenants.

`POST /v1/outbound` records a message the application is sending so that the
provider's copy is reconciled into the same row when it syncs back
(`pipeline/outbound.py` has the contract and the same thing as plain SQL).
Body, JSON object (`application/json`):

    mailbox_id              str, required: a mailbox of the token's tenant (else 404)
    message_id_header       str, required: the Message-ID you put in the mail
    placeholder_message_id  str, required: pending_…, draft_…, new_… or a UUID
    thread_id               str, required: placeholder for a new conversation, or
                            the provider thread key of the one being replied to
    from_address            str, required
    subject                 str, default ""
    sent_at                 ISO 8601 with a UTC offset, default: now
    text, html              str or null, default null
    send_status             "pending" (default) or "sent"
    client_id               str, optional: stored in the `message.recorded` event's
                            payload, so `GET /v1/events?exclude_client=…` can skip it
    esp_message_id          str, optional: the sending provider's id of the message
                            (Postmark MessageID, Resend id, SES MessageId, SendGrid
                            X-Message-Id), so its delivery events are correlated

Answers 201 `{"message_id": N}`; 200 with the same body when this placeholder
was already recorded with the same Message-ID (a retried request); 409 when the
placeholder is taken by another message; 422 `{"error": "invalid_request",
"fields": {name: problem}}` for bad fields; 400 for a body that is not a JSON
object; 415 for another content type.

Every field is validated before any SQL runs, so content the database cannot
hold is the caller's 422, never a 503 or 500 (docs/architecture.md §8): text
without NUL (PostgreSQL text cannot hold it); lengths in UTF-8 bytes where the
value is a key of a btree index, whose entries PostgreSQL refuses over 2,704
bytes (Message-ID, esp_message_id, from_address with the normalised subject);
`sent_at` within the range every reader converts without overflow
(`storable_time`: 1970 to datetime.max less a day).

`GET /v1/attachments/{id}`: 404 unknown (or another tenant's), 409 when the
bytes are not stored yet (`attachments.stored` false: a lazy fetch is pending or
failed), 302 to a presigned URL valid `ATTACHMENT_URL_TTL_S` when the store
hands them out (S3), else 200 with the bytes, the row's content type and a
`Content-Disposition: attachment` naming the file (RFC 6266 §4.3 `filename`
ASCII fallback plus RFC 5987 `filename*=UTF-8''…`).
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import anyio
import asyncpg
import orjson
import structlog
from aiohttp import hdrs, web

from inboxd.daemon.http.state import HTTP_STATE, authenticate, json_error, json_response
from inboxd.pipeline.delivery.intake_rows import storable_time
from inboxd.pipeline.identity import is_placeholder_id, normalise_message_id, normalise_subject
from inboxd.pipeline.objectstore.store import ObjectNotFound, ObjectStoreError
from inboxd.pipeline.outbound import find_attachment, find_placeholder, record_outbound
from inboxd.pipeline.tenancy import mailbox_exists, validate_id

__all__ = ["ATTACHMENT_URL_TTL_S", "attachment_handler", "content_disposition", "outbound_handler"]

log = structlog.get_logger(__name__)

#: Lifetime of a presigned attachment URL: long enough to start a download
#: after the redirect, short enough that a leaked URL is soon useless.
ATTACHMENT_URL_TTL_S = 300
DB_TIMEOUT_S = 10.0
#: Reading an attachment from the store; S3Store has its own per-call deadlines too.
STORE_TIMEOUT_S = 120.0

# RFC 5322 §2.1.1: a header line is at most 998 characters.
_MAX_HEADER_CHARS = 998
#: The same line limit in UTF-8 bytes, for header values that are btree keys
#: (messages_mid_key, messages_esp_message_idx, messages_outbound_idx): 998 bytes
#: plus the tenant id stay far inside PostgreSQL's 2,704-byte index entry.
_MAX_KEY_BYTES = 998
#: Longest normalised subject, in UTF-8 bytes: messages_outbound_idx holds
#: (tenant_id ≤ 63, from_address ≤ 998, subject_norm) in one 2,704-byte btree
#: entry; 1,536 leaves room for the tuple and column headers. Checked after
#: normalisation, since case folding can lengthen text (ΐ → 3 code points).
_MAX_SUBJECT_NORM_BYTES = 1536
_MAX_ID_CHARS = 255
_MAX_CLIENT_ID_CHARS = 200
_MAX_ATTACHMENT_ID = 2**63 - 1
_REQUIRED = (
    "mailbox_id",
    "message_id_header",
    "placeholder_message_id",
    "thread_id",
    "from_address",
)
_OPTIONAL = ("subject", "sent_at", "text", "html", "send_status", "client_id", "esp_message_id")
_SEND_STATUSES = ("pending", "sent")
# RFC 6838 §4.2 type/subtype names; anything else is served as octet-stream.
_MIME_TYPE = re.compile(r"[a-z0-9][a-z0-9!#$&^_.+-]{0,126}/[a-z0-9][a-z0-9!#$&^_.+-]{0,126}")
# RFC 5987 §3.2.1 attr-char, beyond the ALPHA / DIGIT / "_.-~" that quote() keeps anyway.
_ATTR_CHAR_SAFE = "!#$&+^`|"


def _parse_outbound(body: dict[str, Any]) -> dict[str, Any]:
    """Validate a `POST /v1/outbound` object; 422 naming every bad field."""
    problems: dict[str, str] = {}
    for name in body:
        if name not in _REQUIRED and name not in _OPTIONAL:
            problems[name] = "unknown field"

    def text_field(
        name: str,
        *,
        required: bool,
        max_chars: int | None = None,
        max_bytes: int | None = None,
        nullable: bool = False,
    ) -> str | None:
        value = body.get(name)
        if value is None:
            if required:
                problems[name] = "required"
            elif name in body and not nullable:
                problems[name] = "must be a string"
            return None
        if not isinstance(value, str):
            problems[name] = "must be a string"
            return None
        if "\x00" in value:
            problems[name] = "must not contain NUL characters"
            return None
        if not value.isascii():
            try:  # orjson.loads never yields a lone surrogate; checked all the same
                value.encode("utf-8")
            except UnicodeEncodeError:
                problems[name] = "not valid Unicode text"
                return None
        if required and not value.strip():
            problems[name] = "must not be empty"
            return None
        if max_chars is not None and len(value) > max_chars:
            problems[name] = f"longer than {max_chars} characters"
            return None
        if max_bytes is not None and len(value.encode("utf-8")) > max_bytes:
            problems[name] = f"longer than {max_bytes} bytes in UTF-8"
            return None
        return value

    mailbox_id = text_field("mailbox_id", required=True, max_chars=_MAX_ID_CHARS)
    if mailbox_id is not None:
        try:
            validate_id("mailbox", mailbox_id)
        except ValueError:
            problems["mailbox_id"] = "not a valid mailbox id"
    message_id_header = text_field(
        "message_id_header", required=True, max_chars=_MAX_HEADER_CHARS, max_bytes=_MAX_KEY_BYTES
    )
    if message_id_header is not None and not normalise_message_id(message_id_header):
        problems["message_id_header"] = "not a usable Message-ID"
    placeholder = text_field("placeholder_message_id", required=True, max_chars=_MAX_ID_CHARS)
    if placeholder is not None and not is_placeholder_id(placeholder):
        problems["placeholder_message_id"] = (
            "must start with pending_, draft_ or new_, or be a UUID"
        )
    thread_id = text_field("thread_id", required=True, max_chars=_MAX_ID_CHARS)
    from_address = text_field(
        "from_address", required=True, max_chars=_MAX_HEADER_CHARS, max_bytes=_MAX_KEY_BYTES
    )
    if from_address is not None and "@" not in from_address:
        problems["from_address"] = "not an email address"
    subject = text_field("subject", required=False, max_chars=_MAX_HEADER_CHARS * 10)
    if subject and len(normalise_subject(subject).encode("utf-8")) > _MAX_SUBJECT_NORM_BYTES:
        problems["subject"] = f"longer than {_MAX_SUBJECT_NORM_BYTES} bytes in UTF-8"
    text = text_field("text", required=False, nullable=True)
    html = text_field("html", required=False, nullable=True)
    client_id = text_field(
        "client_id", required=False, max_chars=_MAX_CLIENT_ID_CHARS, nullable=True
    )
    esp_message_id = text_field(
        "esp_message_id",
        required=False,
        max_chars=_MAX_HEADER_CHARS,
        max_bytes=_MAX_KEY_BYTES,
        nullable=True,
    )
    send_status = body.get("send_status", "pending")
    if not isinstance(send_status, str) or send_status not in _SEND_STATUSES:
        problems["send_status"] = "must be pending or sent"
    sent_at: datetime | None = datetime.now(UTC)
    raw_sent_at = body.get("sent_at")
    if raw_sent_at is not None:
        sent_at = None
        if not isinstance(raw_sent_at, str):
            problems["sent_at"] = "must be an ISO 8601 string"
        else:
            try:
                sent_at = datetime.fromisoformat(raw_sent_at)
            except ValueError:
                problems["sent_at"] = "not an ISO 8601 date-time"
            else:
                if sent_at.tzinfo is None:
                    problems["sent_at"] = "needs a UTC offset (e.g. Z or +02:00)"
                elif not storable_time(sent_at):
                    problems["sent_at"] = "out of range (1970-01-01 to 9999-12-30 UTC)"
    if problems:
        json_error(422, "invalid_request", fields=problems)
    return {
        "mailbox_id": mailbox_id,
        "message_id_header": message_id_header,
        "placeholder_message_id": placeholder,
        "thread_id": thread_id,
        "from_address": from_address,
        "subject": subject or "",
        "sent_at": sent_at,
        "text": text,
        "html": html,
        "send_status": send_status,
        "client_id": client_id,
        "esp_message_id": esp_message_id or None,
    }


async def outbound_handler(request: web.Request) -> web.Response:
    """`POST /v1/outbound`: see the module docstring."""
    state = request.app[HTTP_STATE]
    tenant = authenticate(request)
    if request.content_type != "application/json" and not request.content_type.endswith("+json"):
        json_error(415, "unsupported_media_type", expected="application/json")
    # The body-limit middleware has already read (and bounded) the body.
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        json_error(400, "invalid_json")
    if not isinstance(body, dict):
        json_error(400, "invalid_json", detail="expected a JSON object")
    fields = _parse_outbound(body)
    bound = log.bind(tenant=tenant, mailbox=fields["mailbox_id"])
    with anyio.fail_after(DB_TIMEOUT_S):
        async with state.pool.acquire() as conn:
            if not await mailbox_exists(conn, tenant, fields["mailbox_id"]):
                json_error(404, "mailbox_not_found")
            try:
                message_id = await record_outbound(conn, tenant_id=tenant, announce=True, **fields)
            except ValueError as exc:
                json_error(422, "invalid_request", detail=str(exc))
            except asyncpg.UniqueViolationError:
                existing = await find_placeholder(
                    conn, tenant, fields["mailbox_id"], fields["placeholder_message_id"]
                )
                if existing is not None and existing["message_id_norm"] == normalise_message_id(
                    fields["message_id_header"]
                ):
                    return json_response({"message_id": existing["message_id"]}, status=200)
                json_error(409, "placeholder_in_use")
    bound.info("outbound_recorded", message_id=message_id, send_status=fields["send_status"])
    return json_response({"message_id": message_id}, status=201)


def content_disposition(filename: str, *, fallback: str) -> str:
    """`attachment; filename="…"; filename*=UTF-8''…` for any file name.

    RFC 6266 §4.3: `filename*` (RFC 5987 percent-encoded UTF-8) for current
    user agents, a plain ASCII `filename` for old ones. Path separators and
    control characters are replaced; an empty name becomes `fallback`.
    """
    name = (
        "".join("_" if ch in "/\\" or ord(ch) < 0x20 or ord(ch) == 0x7F else ch for ch in filename)
        .strip()
        .strip(".")
        or fallback
    )
    ascii_name = "".join(ch if 0x20 <= ord(ch) < 0x7F and ch not in '"\\%' else "_" for ch in name)
    encoded = quote(name, safe=_ATTR_CHAR_SAFE, encoding="utf-8", errors="surrogateescape")
    return f"attachment; filename=\"{ascii_name}\"; filename*=UTF-8''{encoded}"


def _safe_content_type(declared: str) -> str:
    mime = declared.split(";", 1)[0].strip().lower()
    return mime if _MIME_TYPE.fullmatch(mime) else "application/octet-stream"


async def attachment_handler(request: web.Request) -> web.StreamResponse:
    """`GET /v1/attachments/{id}`: see the module docstring."""
    state = request.app[HTTP_STATE]
    tenant = authenticate(request)
    attachment_id = int(request.match_info["id"])  # the route only matches digits
    if attachment_id > _MAX_ATTACHMENT_ID:
        json_error(404, "not_found")
    with anyio.fail_after(DB_TIMEOUT_S):
        row = await find_attachment(state.pool, tenant, attachment_id)
    if row is None:
        json_error(404, "not_found")
    if not row["stored"] or not row["storage_key"]:
        json_error(409, "not_stored", detail="the attachment's bytes have not been fetched yet")
    key: str = row["storage_key"]
    bound = log.bind(tenant=tenant, attachment=attachment_id)
    try:
        with anyio.fail_after(STORE_TIMEOUT_S):
            url = await state.store.url_for(key, expires_s=ATTACHMENT_URL_TTL_S)
            if url is not None:
                # The URL is a bearer credential: not logged, not cached.
                raise web.HTTPFound(url, headers={hdrs.CACHE_CONTROL: "no-store"})
            data = await state.store.get(key)
    except ObjectNotFound:
        bound.warning("attachment_object_missing")
        json_error(404, "not_found")
    except (ObjectStoreError, TimeoutError) as exc:
        bound.warning("attachment_store_unavailable", error=type(exc).__name__)
        json_error(503, "store_unavailable", headers={hdrs.RETRY_AFTER: "5"})
    return web.Response(
        body=data,
        headers={
            hdrs.CONTENT_TYPE: _safe_content_type(row["content_type"]),
            hdrs.CONTENT_DISPOSITION: content_disposition(
                row["filename"], fallback=f"attachment-{attachment_id}"
            ),
            # Mail attachments are untrusted content served from our origin: never sniffed
            # into something executable, never rendered with scripts.
            "X-Content-Type-Options": "nosniff",
            "Content-Security-Policy": "default-src 'none'; sandbox",
            hdrs.CACHE_CONTROL: "private, no-store",
        },
    )
