"""MIME part walking: a message's body text, HTML and attachments.

The part tree is walked iteratively, in order, at most `MAX_PARTS` parts; an
attached message/rfc822 is one leaf (stored as its own .eml bytes), not
descended into. A leaf is body text when it is text/plain or text/html, not
marked as an attachment and unnamed; each is decoded from its own declared
charset with fallbacks (`pipeline.mime.charsets`) and several are joined. Every
other leaf is an attachment. A declared multipart whose boundary never
appears keeps its text as body. Payloads that cannot be decoded degrade to
their raw bytes, or to nothing, never to an exception.

``mime.py`` calls `bodies_and_attachments` and `all_defects`.
"""

from __future__ import annotations

import hashlib
from email.message import Message
from email.policy import compat32

from inboxd.pipeline.identity import normalise_message_id
from inboxd.pipeline.message import AttachmentData
from inboxd.pipeline.mime.charsets import decode_bytes, recover_header_bytes
from inboxd.pipeline.mime.headers import header_text, param_8bit, raw_header

# Parts walked per message; one corpus file has ~3,000 parts.
MAX_PARTS = 5_000


def all_defects(msg: Message) -> list[object]:
    """The parser's defects on every part (at most MAX_PARTS parts)."""
    found: list[object] = []
    for i, part in enumerate(msg.walk()):
        if i >= MAX_PARTS:
            break
        found.extend(part.defects)
    return found


def _walk_leaves(msg: Message) -> list[Message]:
    """Leaf parts in order; an attached message/rfc822 is one leaf, not descended."""
    leaves: list[Message] = []
    stack: list[Message] = [msg]
    while stack and len(leaves) < MAX_PARTS:
        part = stack.pop()
        ctype = part.get_content_type()
        if part.is_multipart() and not ctype.startswith("message/"):
            stack.extend(reversed(_subparts(part)))
            continue
        if part.is_multipart() and part is msg:
            # top-level message/* wrapper (rare): look inside
            stack.extend(reversed(_subparts(part)))
            continue
        leaves.append(part)
    return leaves


def _subparts(part: Message) -> list[Message]:
    """A multipart's parts; the typeshed payload list also admits str, which the parser
    never puts there."""
    payload = part.get_payload()
    if not isinstance(payload, list):
        return []
    return [p for p in payload if isinstance(p, Message)]


def bodies_and_attachments(msg: Message) -> tuple[str | None, str | None, list[AttachmentData]]:
    """Body text, body HTML (each None when the message has none) and attachments."""
    texts: list[str] = []
    htmls: list[str] = []
    attachments: list[AttachmentData] = []
    for part in _walk_leaves(msg):
        ctype = part.get_content_type()
        disposition = (raw_header(part, "Content-Disposition") or "").split(";", 1)[0]
        disposition = disposition.strip().lower()
        filename = _filename(part)
        is_body_text = (
            ctype in ("text/plain", "text/html") and disposition != "attachment" and not filename
        )
        payload = _payload_bytes(part)
        if is_body_text:
            decoded = decode_bytes(payload, part.get_content_charset())
            (texts if ctype == "text/plain" else htmls).append(decoded)
            continue
        if ctype.startswith("multipart/"):
            # declared multipart whose boundary never appears: keep its text
            if payload.strip():
                texts.append(decode_bytes(payload, part.get_content_charset()))
            continue
        attachments.append(
            AttachmentData(
                filename=filename,
                content_type=ctype,
                size_bytes=len(payload),
                sha256=hashlib.sha256(payload).hexdigest(),
                content=payload,
                content_id=normalise_message_id(header_text(raw_header(part, "Content-ID"))),
                disposition="inline" if disposition == "inline" else "attachment",
            )
        )
    text = "\n".join(texts) if texts else None
    html = "\n".join(htmls) if htmls else None
    return text, html, attachments


def _payload_bytes(part: Message) -> bytes:
    if part.get_content_type().startswith("message/") or part.is_multipart():
        # an attached message is stored as its own bytes (.eml)
        try:
            inner = part.get_payload()
            if isinstance(inner, list) and inner and isinstance(inner[0], Message):
                return inner[0].as_bytes(policy=compat32)
        except Exception:  # re-serialising a broken inner message
            return b""
        return b""
    try:
        data = part.get_payload(decode=True)
    except Exception:
        data = None
    # decode=True gives bytes for any non-multipart part; None when it cannot decode.
    if isinstance(data, bytes):
        return data
    raw = part.get_payload()
    if isinstance(raw, str):
        return raw.encode("ascii", "surrogateescape")
    return b""


def _filename(part: Message) -> str:
    try:
        name = part.get_filename()
        raw_cd = raw_header(part, "Content-Disposition") or ""
        raw_ct = raw_header(part, "Content-Type") or ""
        if not (raw_cd.isascii() and raw_ct.isascii()):
            # 8-bit bytes in the parameter: the stdlib has already turned them
            # into U+FFFD, so read the parameter from the recovered header text
            name = (
                param_8bit(recover_header_bytes(raw_cd), "filename")
                or param_8bit(recover_header_bytes(raw_ct), "name")
                or name
            )
    except Exception:
        name = None
    if name is None:
        return ""
    return header_text(name)
