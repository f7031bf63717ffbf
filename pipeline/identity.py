"""Identity keys of a message: normalised Message-ID, subject and content fingerprint.

These are the comparison keys of the dedup cascade (docs/architecture.md §3). They must be
equal for one message seen through two providers or in three line-ending styles,
and differ for a sender reusing a Message-ID with other content. So nothing here
hashes bytes: the fingerprint is computed over *decoded* and normalised text.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Iterable
from datetime import datetime

_MSGID_IN_ANGLES = re.compile(r"<([^<>]*)>")
_WS = re.compile(r"\s+")
# Reply/forward prefixes in the languages the corpus and common clients use
# (Outlook localises them: AW/WG German, SV Nordic, VS Finnish, TR French, RIF Italian,
# ODP Polish, Antw Dutch). Repeated and bracketed forms like "Re[2]:" and "Fwd: Re:".
_REPLY_PREFIX = re.compile(
    r"^\s*(?:(?:re|fw|fwd|aw|wg|sv|vs|antw|tr|rif|r|odp|ynt|atb|res|enc|rv|πρθ|σχετ|回复|转发|答复)"
    r"\s*(?:\[\d+\]|\(\d+\))?\s*[:：]\s*)+",
    re.IGNORECASE,
)
_URL = re.compile(r"(?:https?|mailto|cid):[^\s<>\"')\]]+", re.IGNORECASE)
_NON_WORD = re.compile(r"[\W_]+", re.UNICODE)
# The same two steps for ASCII text, which most bodies are (normalise_body): on a
# 1.7 KB generated body _URL.sub took 130 µs and _NON_WORD.sub 94 µs, 40 % of a
# whole parse_raw, against a few µs for a substring check and bytes.translate. Equal
# output is the contract (tests/pipeline/test_identity_fast.py): every _URL match
# in ASCII text contains one of _URL_HINTS once lower-cased, the letters of
# IGNORECASE that match non-ASCII code points (ſ, İ, ı) cannot occur in ASCII, and
# [\W_] of an ASCII character is "not a letter or digit".
_URL_HINTS = ("http", "mailto:", "cid:")
# _URL for lower-cased ASCII text (lower-casing moves no match boundary)
_URL_LOWER = re.compile(r"(?:https?|mailto|cid):[^\s<>\"')\]]+")
_ASCII_NON_ALNUM = bytes(c for c in range(128) if not chr(c).isalnum())


def normalise_message_id(raw: str | None) -> str | None:
    """Message-ID without angle brackets and whitespace, domain part lower-cased.

    Accepts the header value as sent ("<a@B.com>", " a@B.com ", "<a@b> (comment)").
    Returns None when nothing id-like remains. The local part keeps its case:
    RFC 5322 §3.6.4 makes ids opaque, only domains are case-insensitive.
    """
    if not raw:
        return None
    match = _MSGID_IN_ANGLES.search(raw)
    value = match.group(1) if match else raw
    value = _WS.sub("", value).strip("<>")
    if not value:
        return None
    local, at, domain = value.rpartition("@")
    if not at:
        return value
    return f"{local}@{domain.lower()}"


def normalise_id_list(raw: str | None) -> list[str]:
    """Ids from a References / In-Reply-To value, in order, normalised.

    Broken values seen in the corpus (empty, one invalid entry, bare id without
    brackets) give what can be salvaged, never an error.
    """
    if not raw:
        return []
    found = _MSGID_IN_ANGLES.findall(raw)
    if not found:
        found = raw.split()
    out: list[str] = []
    for item in found:
        norm = normalise_message_id(item)
        if norm and norm not in out:
            out.append(norm)
    return out


def normalise_subject(subject: str | None) -> str:
    """Subject as a matching key: reply/forward prefixes stripped, case-folded.

    An empty result means "matches nothing" to the cascade (a bare "Re:" too).
    """
    if not subject:
        return ""
    text = _WS.sub(" ", subject).strip()
    previous = None
    while previous != text:
        previous = text
        text = _REPLY_PREFIX.sub("", text).strip()
        if text.startswith("[") and text.endswith("]") and len(text) > 2:
            # "[Fwd: original]" as some old clients wrote forwards
            text = text[1:-1].strip()
    return text.casefold()


def normalise_body(text: str | None) -> str:
    """Body text reduced to its words: tolerant of re-encoding and re-rendering.

    Line endings, whitespace, quoted-printable soft breaks, HTML-vs-plain layout,
    link targets (plain parts show URLs that a rendered HTML part hides) and case
    all vanish; letters and digits in order remain.
    """
    if not text:
        return ""
    if text.isascii():  # NFKC leaves ASCII as it is, and casefold is lower
        lowered = text.lower()
        if any(hint in lowered for hint in _URL_HINTS):
            lowered = _URL_LOWER.sub(" ", lowered)
        # bytes.translate deletes in C; str.translate looks each character up in a dict
        return lowered.encode("ascii").translate(None, _ASCII_NON_ALNUM).decode("ascii")
    text = unicodedata.normalize("NFKC", text)
    text = _URL.sub(" ", text)
    return _NON_WORD.sub("", text).casefold()


def content_fingerprint(
    *,
    sender: str | None,
    sender_name: str,
    subject_norm: str,
    sent_at: datetime | None,
    text: str | None,
    html_text: str | None,
    recipients: Iterable[str] = (),
    attachment_keys: Iterable[str] = (),
) -> str:
    """sha256 over the decoded content of a message, normalised.

    Parts: sender address and display-name words, subject (reply prefixes
    stripped), minute of sending (UTC; absorbs providers that drop seconds),
    words of the plain part, words of the rendered HTML part, the set of To/Cc
    addresses (Bcc is only on the sender's copy) and the attachments (name plus
    content key, see `attachment_key`). Header order, transfer encodings,
    charset labels, MIME layout, line endings and whitespace do not enter, so
    the sisimai LF/CRLF/CR triples agree. The HTML part is its own component
    (docs/architecture.md §3 compares plain text only, falling back to HTML): corpus
    fixtures that reuse a Message-ID differ by an added HTML part, a different
    enclosed message or display name, and must not merge.

    Consequence for provider doors: to agree with a raw-MIME copy they must
    fingerprint what raw MIME gives (fetch it: Gmail format=raw, Graph
    $value), or supply both body forms and the attachment bytes; a door that
    has only one rendering of the body would turn a cross-provider copy into a
    conflict row instead of a merge.
    """
    minute = sent_at.strftime("%Y%m%d%H%M") if sent_at else ""
    people = ",".join(sorted({r.strip().lower() for r in recipients if r and r.strip()}))
    parts = (
        (sender or "").strip().lower(),
        normalise_body(sender_name),
        subject_norm,
        minute,
        normalise_body(text),
        normalise_body(html_text),
        people,
        ",".join(sorted(attachment_keys)),
    )
    return hashlib.sha256("\x1f".join(parts).encode("utf-8", "surrogatepass")).hexdigest()


def attachment_key(filename: str, content_type: str, content: bytes | None, size: int) -> str:
    """Identity of an attachment inside the fingerprint.

    Text-like parts (text/*, message/*: enclosed messages and DSN reports) are
    keyed by their words, so their line endings do not matter; binary parts by
    their decoded bytes; parts a door has not fetched by name and size.
    """
    name = " ".join(filename.split()).casefold()
    if content is None:
        return f"{name}:{size}"
    if content_type.startswith(("text/", "message/")):
        words = normalise_body(content.decode("latin-1"))
        return f"{name}:w:{hashlib.sha256(words.encode()).hexdigest()[:16]}"
    return f"{name}:b:{hashlib.sha256(content).hexdigest()[:16]}"


def is_placeholder_id(value: str | None) -> bool:
    """True for the ids an application gives a message before the provider has it."""
    if not value:
        return True
    return value.startswith(("pending_", "draft_", "new_")) or bool(_UUID.fullmatch(value))


_UUID = re.compile(
    r"[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}"
)
