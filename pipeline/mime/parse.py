"""Raw RFC 5322 bytes → MessageData, degrading gracefully on the mail people get.

Parser choice (bench/parse.py, measured on tests/corpus): stdlib
`email.parser.BytesParser` with `policy.compat32`, decoding headers and payloads
ourselves. policy.default is slower and raises from header access on malformed
input; fast-mail-parser is faster but loses parts and raises on the corpus'
torture messages. compat32 never raises on parse and gives us the bytes, so
every charset decision is ours (`pipeline.mime.charsets`).

What "degrade gracefully" means here:
- A message is never decoded as a whole; each part is decoded from its own
  declared charset with fallbacks, 8-bit header bytes are recovered.
- CR-only and mixed line endings parse (the feed parser splits on any of them).
- Missing boundaries, bad base64, missing header/body separator: the stdlib
  records a defect and carries on; we keep the defect names on the item.
- Only input with no header at all (or no bytes) is not a message: it becomes
  a DeadItem with a clear reason, and its batch neighbours are unaffected.
The raw bytes are always kept by the caller (object store, sha256 recorded).

This module sniffs the input, parses it leniently and assembles the
MessageData; header values are decoded in `pipeline/mime/headers.py`, the part tree
is walked for bodies and attachments in `pipeline/mime/parts.py`.
"""

from __future__ import annotations

import hashlib
import re
from datetime import datetime
from email.message import Message
from email.parser import BytesParser
from email.policy import compat32
from typing import TypeVar, overload

from selectolax.lexbor import LexborHTMLParser

from inboxd.pipeline.identity import (
    attachment_key,
    content_fingerprint,
    normalise_id_list,
    normalise_message_id,
    normalise_subject,
)
from inboxd.pipeline.message import DeadItem, MessageData
from inboxd.pipeline.mime.headers import (
    addresses,
    header_date,
    header_text,
    raw_header,
    text_charset,
)
from inboxd.pipeline.mime.parts import all_defects, bodies_and_attachments

# A header longer than this is truncated before decoding: the corpus holds a
# 135 KB To and a 210 KB Subject built to stall parsers; no real reader needs
# more than this many characters of a subject.
MAX_SUBJECT_CHARS = 4_000

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
    cs = text_charset(msg)
    mid_raw = header_text(raw_header(msg, "Message-ID"))
    mid_norm = normalise_message_id(mid_raw)
    references = normalise_id_list(header_text(raw_header(msg, "References")))
    in_reply = normalise_id_list(header_text(raw_header(msg, "In-Reply-To")))
    subject = header_text(raw_header(msg, "Subject"), cs)[:MAX_SUBJECT_CHARS]
    subject = " ".join(subject.split())
    froms = addresses(msg, "From", cs) or addresses(msg, "Sender", cs)
    sender = froms[0] if froms else None
    to, cc = addresses(msg, "To", cs), addresses(msg, "Cc", cs)
    sent_at = header_date(raw_header(msg, "Date"))
    text, html, attachments = bodies_and_attachments(msg)
    subject_norm = normalise_subject(subject)
    defects = sorted({type(d).__name__ for d in all_defects(msg)})
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
        bcc=addresses(msg, "Bcc", cs),
        reply_to=addresses(msg, "Reply-To", cs),
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
    """Visible text of an HTML body (scripts and styles dropped), for fingerprints."""
    if not html:
        return ""
    try:
        tree = LexborHTMLParser(html)
        tree.strip_tags(["script", "style", "head", "title"])
        root = tree.body or tree.root
        return root.text(separator=" ") if root is not None else ""
    except Exception:  # selectolax on hostile markup: fall back to nothing visible
        return ""
