"""Raw RFC 5322 bytes → MessageData, degrading gracefully on the mail people get.

Parser choice (bench/parse.py, measured on tests/corpus): stdlib
`email.parser.BytesParser` with `policy.compat32`, decoding headers and payloads
ourselves. policy.default is slower and raises from header access on malformed
input; fast-mail-parser is faster but loses parts and raises on the corpus'
torture messages. compat32 never raises on parse and gives us the bytes, so
every charset decision is ours (`pipeline.charsets`).

What "degrade gracefully" means here:
- A message is never decoded as a whole; each part is decoded from its own
  declared charset with fallbacks, 8-bit header bytes are recovered.
- CR-only and mixed line endings parse (the feed parser splits on any of them).
- Missing boundaries, bad base64, missing header/body separator: the stdlib
  records a defect and carries on; we keep the defect names on the item.
- Only input with no header at all (or no bytes) is not a message: it becomes
  a DeadItem with a clear reason, and its batch neighbours are unaffected.
The raw bytes are always kept by the caller (object store, sha256 recorded).
"""

from __future__ import annotations

import email.header
import email.utils
import hashlib
import re
from datetime import UTC, datetime
from email.message import Message
from email.parser import BytesParser
from email.policy import compat32
from typing import TypeVar, overload

from selectolax.lexbor import LexborHTMLParser

from inboxd.pipeline.charsets import decode_bytes, recover_header_bytes
from inboxd.pipeline.identity import (
    attachment_key,
    content_fingerprint,
    normalise_id_list,
    normalise_message_id,
    normalise_subject,
)
from inboxd.pipeline.message import Address, AttachmentData, DeadItem, MessageData

# A header longer than this is truncated before decoding: the corpus holds a
# 135 KB To and a 210 KB Subject built to stall parsers; no real reader needs
# more than this many characters of a subject.
MAX_SUBJECT_CHARS = 4_000
# Addresses kept per header; a 135 KB To header decodes to ~3,000 entries.
MAX_ADDRESSES_PER_HEADER = 1_000
# Parts walked per message; one corpus file has ~3,000 parts.
MAX_PARTS = 5_000

_T = TypeVar("_T")


class _Message(Message):
    """compat32 Message whose boundary tolerates folding (RFC 2045 allows a quoted
    boundary to be folded; the stdlib then looks for a boundary with CRLF in it
    and loses the whole multipart, e.g. mime-tools `multi-digest`)."""

    # The same overloads as Message.get_boundary, which this overrides.
    @overload
    def get_boundary(self, failobj: None = None) -> str | None: ...
    @overload
    def get_boundary(self, failobj: _T) -> str | _T: ...
    def get_boundary(self, failobj: object = None) -> object:
        boundary = super().get_boundary(failobj)
        if isinstance(boundary, str):
            return boundary.replace("\r", "").replace("\n", "")
        return boundary


_PARSER = BytesParser(_class=_Message, policy=compat32)
# Salvage of addresses when the header defeats getaddresses().
_ADDR_SPEC = re.compile(r"[\w.!#$%&'*+/=?^`{|}~-]+@[\w.-]+\w")
_BOM = b"\xef\xbb\xbf"
_CFB_MAGIC = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"  # MS-CFB header signature, [MS-CFB] 2.2
# Bytes looked at to sniff line endings and binary input.
_SNIFF_BYTES = 8_192
# "Name  :" (obsolete WSP before the colon) and a mangled first field "Fro :x".
_OBS_COLON = re.compile(rb"(?m)^([!-9;-~]+)[ \t]+:")


def parse_raw(
    raw: bytes,
    *,
    tenant_id: str,
    mailbox_id: str,
    external_id: str | None = None,
    source: str = "raw",
    received_at: datetime | None = None,
) -> MessageData | DeadItem:
    """Parse raw MIME bytes into MessageData, or a DeadItem when it is not mail.

    `external_id` defaults to the raw sha256 (content-addressed doors such as
    import), so re-ingesting the same bytes is a tier-2 duplicate even without
    a Message-ID. `source` prefixes the derived thread key of messages that
    carry no Message-ID at all. Never raises for any input bytes.
    """
    raw_sha256 = hashlib.sha256(raw).hexdigest()
    ext_id = external_id or raw_sha256
    if not raw.strip():
        return DeadItem(tenant_id, mailbox_id, ext_id, "empty", "no bytes", raw, raw_sha256)
    head = raw[:_SNIFF_BYTES]
    if head.startswith(_CFB_MAGIC):
        return DeadItem(
            tenant_id,
            mailbox_id,
            ext_id,
            "not_mime",
            "an Outlook .msg (CFB) file, not RFC 5322 mail",
            raw,
            raw_sha256,
        )
    if b"\x00" in head.partition(b"\n\n")[0].partition(b"\r\n\r\n")[0]:
        return DeadItem(
            tenant_id,
            mailbox_id,
            ext_id,
            "not_mime",
            "binary data (NUL bytes), not RFC 5322 mail",
            raw,
            raw_sha256,
        )
    try:
        msg = _parse_lenient(raw)
    except Exception as exc:  # the stdlib is documented not to raise; be sure
        return DeadItem(
            tenant_id,
            mailbox_id,
            ext_id,
            "parse_error",
            f"{type(exc).__name__}: {exc}"[:300],
            raw,
            raw_sha256,
        )
    try:
        return _to_message_data(
            msg, raw, raw_sha256, tenant_id, mailbox_id, ext_id, source, received_at
        )
    except RecursionError:
        return DeadItem(
            tenant_id,
            mailbox_id,
            ext_id,
            "too_deep",
            "MIME structure nested too deeply to walk",
            raw,
            raw_sha256,
        )


def _parse_lenient(raw: bytes) -> Message:
    """compat32 parse, with the repairs real mail needs before the stdlib sees it.

    - A UTF-8 byte-order mark before the first header (MimeKit feedback-report
      sample) hides every header; it is skipped.
    - CR-only line endings (classic Mac) parse, but quoted-printable soft breaks
      `=\\r` are not undone and nested boundaries are missed, so such input is
      parsed with LF endings (the raw bytes are kept unchanged elsewhere).
    - RFC 5322 §4.5 obsolete syntax allows whitespace before a header colon
      ("Subject :"); the stdlib then sees no header at all, so the header block
      is re-parsed with that whitespace removed.
    A message that still has no header is parsed as a body-only message.
    """
    if raw.startswith(_BOM):
        raw = raw[len(_BOM) :]
    if b"\n" not in raw[:_SNIFF_BYTES] and b"\r" in raw:
        raw = raw.replace(b"\r", b"\n")
    msg = _PARSER.parsebytes(raw)
    if msg.keys():
        return msg
    head, sep, body = (
        raw.partition(b"\n\n") if b"\r\n\r\n" not in raw else raw.partition(b"\r\n\r\n")
    )
    repaired = _OBS_COLON.sub(rb"\1:", head)
    if repaired != head:
        retry = _PARSER.parsebytes(repaired + sep + body)
        if retry.keys():
            return retry
    return msg


def _to_message_data(
    msg: Message,
    raw: bytes,
    raw_sha256: str,
    tenant_id: str,
    mailbox_id: str,
    ext_id: str,
    source: str,
    received_at: datetime | None,
) -> MessageData:
    cs = _text_charset(msg)
    mid_raw = _header_text(_raw_header(msg, "Message-ID"))
    mid_norm = normalise_message_id(mid_raw)
    references = normalise_id_list(_header_text(_raw_header(msg, "References")))
    in_reply = normalise_id_list(_header_text(_raw_header(msg, "In-Reply-To")))
    subject = _header_text(_raw_header(msg, "Subject"), cs)[:MAX_SUBJECT_CHARS]
    subject = " ".join(subject.split())
    froms = _addresses(msg, "From", cs) or _addresses(msg, "Sender", cs)
    sender = froms[0] if froms else None
    to, cc = _addresses(msg, "To", cs), _addresses(msg, "Cc", cs)
    sent_at = _date(_raw_header(msg, "Date"))
    text, html, attachments = _bodies(msg)
    subject_norm = normalise_subject(subject)
    defects = sorted({type(d).__name__ for d in _all_defects(msg)})
    if references:
        derived = references[0]
    elif in_reply:
        derived = in_reply[0]
    elif mid_norm:
        derived = mid_norm
    else:
        derived = f"{source}:{ext_id}"
    return MessageData(
        tenant_id=tenant_id,
        mailbox_id=mailbox_id,
        external_id=ext_id,
        thread_key_derived=derived,
        internet_message_id=mid_raw or None,
        message_id_norm=mid_norm,
        in_reply_to=in_reply[0] if in_reply else None,
        references=references,
        from_=sender,
        to=to,
        cc=cc,
        bcc=_addresses(msg, "Bcc", cs),
        reply_to=_addresses(msg, "Reply-To", cs),
        subject=subject,
        subject_norm=subject_norm,
        sent_at=sent_at,
        received_at=received_at,
        text=text,
        html=html,
        attachments=attachments,
        content_fingerprint=content_fingerprint(
            sender=sender.email if sender else None,
            # every From entry: RFC 5322 §3.6.2 allows several authors
            sender_name=" ".join(f"{a.email} {a.name}" for a in froms),
            subject_norm=subject_norm,
            sent_at=sent_at,
            text=text,
            html_text=html_to_text(html),
            recipients=[a.email for a in (*to, *cc)],
            attachment_keys=[
                attachment_key(a.filename, a.content_type, a.content, a.size_bytes)
                for a in attachments
            ],
        ),
        raw_sha256=raw_sha256,
        raw=raw,
        parse_defects=defects,
    )


def html_to_text(html: str | None) -> str:
    """Visible text of an HTML body (scripts/styles dropped), for fingerprints."""
    if not html:
        return ""
    try:
        tree = LexborHTMLParser(html)
        tree.strip_tags(["script", "style", "head", "title"])
        root = tree.body or tree.root
        return root.text(separator=" ") if root is not None else ""
    except Exception:  # selectolax on hostile markup: fall back to nothing visible
        return ""


def _header_text(value: object, charset: str | None = None) -> str:
    """A header value as readable text: 8-bit bytes recovered, RFC 2047 decoded.

    `charset` is the message's own text charset, the best guess for raw 8-bit
    header bytes that are not UTF-8.
    """
    if value is None:
        return ""
    if isinstance(value, email.header.Header):
        value = str(value)
    text = recover_header_bytes(str(value), charset)
    if "=?" not in text:
        return " ".join(text.split()) if "\n" in text or "\r" in text else text.strip()
    try:
        chunks = email.header.decode_header(text)
    except Exception:  # malformed encoded word: keep it as written
        return " ".join(text.split())
    out: list[str] = []
    for data, charset in chunks:
        out.append(data if isinstance(data, str) else decode_bytes(data, charset))
    return " ".join("".join(out).split())


def _addresses(msg: Message, name: str, charset: str | None = None) -> list[Address]:
    values = _raw_headers(msg, name)
    if not values:
        return []
    raw_values = [recover_header_bytes(str(v), charset) for v in values]
    try:
        pairs = email.utils.getaddresses(raw_values)
    except Exception:  # RecursionError on the corpus' 135 KB To header, among others
        pairs = [("", addr) for v in raw_values for addr in _ADDR_SPEC.findall(v)]
    out: list[Address] = []
    for display, addr in pairs[:MAX_ADDRESSES_PER_HEADER]:
        addr = addr.strip().strip("<>").lower()
        display = _header_text(display, charset) if display else ""
        if "@" not in addr and not display:
            continue
        if "@" not in addr:
            addr = ""
        out.append(Address(email=addr, name=display))
    return out


def _date(value: object) -> datetime | None:
    if value is None:
        return None
    try:
        parsed = email.utils.parsedate_to_datetime(str(value))
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if parsed is None:
        return None
    if parsed.tzinfo is None:
        # RFC 5322 §3.3: "-0000" means local time unknown; treat as UTC
        parsed = parsed.replace(tzinfo=UTC)
    try:
        return parsed.astimezone(UTC)
    except (OverflowError, ValueError):
        return None


def _text_charset(msg: Message) -> str | None:
    """Charset declared by the first text part (or the top level), if any."""
    for i, part in enumerate(msg.walk()):
        if i > 50:
            break
        if part.get_content_maintype() == "text":
            charset = part.get_content_charset()
            if charset:
                return charset
    return msg.get_content_charset()


def _param_8bit(header: str, param: str) -> str | None:
    """A plain (non-RFC 2231) parameter value from header text that was 8-bit."""
    match = re.search(rf'(?i)(?:^|;)\s*{param}\s*=\s*(?:"([^"]*)"|([^;]+))', header)
    if not match:
        return None
    return (match.group(1) if match.group(1) is not None else match.group(2)).strip()


def _raw_headers(msg: Message, name: str) -> list[str]:
    """Header values as parsed, 8-bit bytes still surrogate-escaped.

    `Message.get()` under compat32 wraps 8-bit values in a Header whose str()
    has already replaced the bytes with U+FFFD; `raw_items()` keeps them, so
    `recover_header_bytes` can decode them as UTF-8 (RFC 6532) or legacy text.
    """
    wanted = name.lower()
    return [str(v) for k, v in msg.raw_items() if k.lower() == wanted]


def _raw_header(msg: Message, name: str) -> str | None:
    values = _raw_headers(msg, name)
    return values[0] if values else None


def _all_defects(msg: Message) -> list[object]:
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


def _bodies(msg: Message) -> tuple[str | None, str | None, list[AttachmentData]]:
    texts: list[str] = []
    htmls: list[str] = []
    attachments: list[AttachmentData] = []
    for part in _walk_leaves(msg):
        ctype = part.get_content_type()
        disposition = (_raw_header(part, "Content-Disposition") or "").split(";", 1)[0]
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
                content_id=normalise_message_id(_header_text(_raw_header(part, "Content-ID"))),
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
        raw_cd = _raw_header(part, "Content-Disposition") or ""
        raw_ct = _raw_header(part, "Content-Type") or ""
        if not (raw_cd.isascii() and raw_ct.isascii()):
            # 8-bit bytes in the parameter: the stdlib has already turned them
            # into U+FFFD, so read the parameter from the recovered header text
            name = (
                _param_8bit(recover_header_bytes(raw_cd), "filename")
                or _param_8bit(recover_header_bytes(raw_ct), "name")
                or name
            )
    except Exception:
        name = None
    if name is None:
        return ""
    return _header_text(name)
