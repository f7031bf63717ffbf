"""MIME header decoding: header values as readable text, addresses and dates.

Headers are read raw (`raw_headers`): under compat32 `Message.get()` has
already replaced 8-bit bytes with U+FFFD, `raw_items()` keeps them, so
`recover_header_bytes` can decode them as UTF-8 (RFC 6532) or as the legacy
charset the message's own text declares (`text_charset`, the best guess for
8-bit header bytes). RFC 2047 encoded words are decoded per chunk; a malformed
one is kept as written. Address lists are bounded and salvaged when
`getaddresses()` gives up; dates are normalised to UTC. Nothing here raises
for any header value.

``mime.py`` assembles the MessageData from these; ``pipeline/mime/parts.py`` uses them
for part headers (Content-Disposition, Content-ID, filenames).
"""

from __future__ import annotations

import email.header
import email.utils
import re
from datetime import UTC, datetime
from email.message import Message

from inboxd.pipeline.message import Address
from inboxd.pipeline.mime.charsets import decode_bytes, recover_header_bytes

# Addresses kept per header; a 135 KB To header decodes to ~3,000 entries.
MAX_ADDRESSES_PER_HEADER = 1_000

# Salvage of addresses when the header defeats getaddresses().
_ADDR_SPEC = re.compile(r"[\w.!#$%&'*+/=?^`{|}~-]+@[\w.-]+\w")


def header_text(value: object, charset: str | None = None) -> str:
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


def addresses(msg: Message, name: str, charset: str | None = None) -> list[Address]:
    values = raw_headers(msg, name)
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
        display = header_text(display, charset) if display else ""
        if "@" not in addr and not display:
            continue
        if "@" not in addr:
            addr = ""
        out.append(Address(email=addr, name=display))
    return out


def header_date(value: object) -> datetime | None:
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


def text_charset(msg: Message) -> str | None:
    """Charset declared by the first text part (or the top level), if any."""
    for i, part in enumerate(msg.walk()):
        if i > 50:
            break
        if part.get_content_maintype() == "text":
            charset = part.get_content_charset()
            if charset:
                return charset
    return msg.get_content_charset()


def param_8bit(header: str, param: str) -> str | None:
    """A plain (non-RFC 2231) parameter value from header text that was 8-bit."""
    match = re.search(rf'(?i)(?:^|;)\s*{param}\s*=\s*(?:"([^"]*)"|([^;]+))', header)
    if not match:
        return None
    return (match.group(1) if match.group(1) is not None else match.group(2)).strip()


def raw_headers(msg: Message, name: str) -> list[str]:
    """Header values as parsed, 8-bit bytes still surrogate-escaped.

    `Message.get()` under compat32 wraps 8-bit values in a Header whose str()
    has already replaced the bytes with U+FFFD; `raw_items()` keeps them, so
    `recover_header_bytes` can decode them as UTF-8 (RFC 6532) or legacy text.
    """
    wanted = name.lower()
    return [str(v) for k, v in msg.raw_items() if k.lower() == wanted]


def raw_header(msg: Message, name: str) -> str | None:
    values = raw_headers(msg, name)
    return values[0] if values else None
