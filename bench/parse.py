#!/usr/bin/env python3
"""Which MIME parser should inboxd use?  Measured over the shared corpus, not guessed.

    .venv/bin/python bench/parse.py [--corpus DIR] [--passes N] [--timeout S] [--quick] [--smoke]

Every candidate turns raw RFC 5322 bytes into the same shape (``Parsed``): decoded
Subject, From/To/Cc as (display name, address) pairs, Message-ID, every text/plain
and text/html body part as str, and the attachment list as (filename, content type,
decoded size).  Then the script reports

* correctness: exceptions per candidate (with file names), subjects that did not
  decode, bodies one parser missed that others found, attachment-count
  disagreements, RFC 2047 header differences, the sisimai bsd/dos/mac line-ending
  triples, the CR-only files, the bogus / exotic charsets, and output that
  PostgreSQL ``text`` cannot store (NUL, lone surrogates);
* speed: messages/s over the whole corpus and over the "typical" files (< 50 KB),
  best of N passes, side by side, as ratios against compat32.

Each candidate's correctness pass runs in a child process with a per-file timeout
and an address-space limit (the corpus has files built to break parsers); files
slower than 1 s are listed.  The speed passes run in-process over the files that
no candidate timed out on.

Candidates:
  compat32   stdlib BytesParser(policy=compat32) + the manual decoding below
  default    stdlib BytesParser(policy=default), idiomatic get_body /
             iter_attachments / get_content, no extra guards
  fmp        fast_mail_parser.parse_email (Rust; PyPI fast-mail-parser)
  fmp+fallback  fmp after the CR-only repair, RFC 2047 filenames decoded, and
             compat32 whenever fmp raises
  mailparser mail-parser (SpamScope; a layer over stdlib compat32), if installed
             (not a project dependency: `.venv/bin/pip install mail-parser`)

parse_compat32() and its helpers (decode_bytes, decode_header_text, unescape_8bit,
normalise_raw, _Message32, _addresses32, _filename32) are the reference for the
robustness idioms the stdlib needs; each comment says which corpus case forced it.
"""

from __future__ import annotations

import argparse
import base64
import codecs
import gc
import logging
import multiprocessing as mp
import os
import re
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from email import policy
from email.errors import HeaderParseError
from email.header import decode_header
from email.message import Message
from email.parser import BytesParser
from email.utils import getaddresses
from pathlib import Path

try:
    import fast_mail_parser as fmp
except ImportError:  # pragma: no cover - reported in the output
    fmp = None
try:
    import mailparser  # PyPI "mail-parser"

    logging.getLogger("mailparser").setLevel(logging.CRITICAL)
except ImportError:
    mailparser = None

HERE = Path(__file__).resolve()
DEFAULT_CORPUS = HERE.parents[1] / "tests" / "corpus" / "mime"
TYPICAL_MAX = 50 * 1024
SLOW_S = 1.0
#: --smoke (CI): every SMOKE_EVERY-th typical file, the SMOKE_LARGE_FILES smallest
#: of the larger ones (so "whole" differs from "typical"), the files the reports
#: name; one speed pass and a shorter per-file timeout: ~5 s instead of ~20 s.
SMOKE_EVERY = 4
SMOKE_LARGE_FILES = 2
SMOKE_TIMEOUT_S = 10.0
#: A candidate failing on more than this share of the files is broken in this
#: script (a renamed attribute, an API change), not a finding about the parser.
BROKEN_SHARE = 0.5


# --------------------------------------------------------------------------- shape


@dataclass
class Parsed:
    subject: str | None
    from_: list[tuple[str, str]]
    to: list[tuple[str, str]]
    cc: list[tuple[str, str]]
    message_id: str | None
    text: list[str]
    html: list[str]
    attachments: list[tuple[str | None, str, int]]  # (filename, content type, size)
    notes: list[str] = field(default_factory=list)  # repairs the candidate made
    n_headers: int = -1  # header fields the parser saw at the top level


# --------------------------------------------------------- charset decoding (shared)

# Labels whose registered decoder is stricter than what senders actually emit: decode
# with the superset the WHATWG Encoding Standard maps them to.  Labels Python does
# not know at all get an alias.
_SUPERSET = {
    "iso-8859-1": "cp1252",
    "latin1": "cp1252",
    "latin-1": "cp1252",
    "l1": "cp1252",
    "gb2312": "gb18030",
    "gbk": "gb18030",
    "x-gbk": "gb18030",
    "euc-cn": "gb18030",
    "euc-kr": "cp949",
    "ks_c_5601-1987": "cp949",
    "ks_c_5601": "cp949",
    "shift_jis": "cp932",
    "shift-jis": "cp932",
    "x-sjis": "cp932",
    "sjis": "cp932",
    "iso-2022-jp": "iso2022_jp_ext",
    "big5": "big5hkscs",
    "x-mac-cyrillic": "mac_cyrillic",
    "x-mac-roman": "mac_roman",
    "macintosh": "mac_roman",
    "unicode-1-1-utf-7": "utf-7",
    "iso-8859-8-i": "iso8859_8",  # "-i"/"-e": bidi ordering hints, same bytes
    "iso-8859-8-e": "iso8859_8",
    "iso-8859-6-i": "iso8859_6",
    "iso-8859-6-e": "iso8859_6",
    "x-unicode20utf8": "utf-8",
    "utf8": "utf-8",
    "ascii": "ascii",
    "us-ascii": "ascii",
    "ansi_x3.4-1968": "ascii",
}


def _codec(label: str | None) -> str | None:
    """A Python codec name for a MIME charset label, or None if there is none."""
    if not label:
        return None
    label = label.strip().strip("\"'").lower()
    label = _SUPERSET.get(label, label)
    try:
        return codecs.lookup(label).name
    except LookupError:
        return None


_HIGH_BYTES = bytes(range(0x80, 0x100))
_ISO2022JP_ESC = re.compile(rb"\x1b(\$[@B]|\([BJI])")


def _iso2022jp_as_cp932(data: bytes) -> str:
    """ISO-2022-JP the way Windows (CP50220) and WHATWG decode it.

    Python's iso2022_jp* codecs reject the NEC/IBM extensions of JIS X 0208 that
    Outlook and other Windows mailers put in "ISO-2022-JP" (No., circled digits,
    Roman numerals...).  Each JIS pair is transcoded to Shift_JIS and the result
    decoded as cp932, which has those rows.  Raises UnicodeDecodeError if invalid.
    """
    out = bytearray()
    mode = b"(B"
    pos = 0
    for m in [*_ISO2022JP_ESC.finditer(data), None]:
        end = m.start() if m else len(data)
        chunk = data[pos:end]
        if mode in (b"$@", b"$B"):
            if len(chunk) % 2:
                raise UnicodeDecodeError("iso-2022-jp", data, pos, end, "odd JIS run")
            for j in range(0, len(chunk), 2):
                c1, c2 = chunk[j], chunk[j + 1]
                if not (0x21 <= c1 <= 0x7E and 0x21 <= c2 <= 0x7E):
                    raise UnicodeDecodeError("iso-2022-jp", data, pos + j, pos + j + 2, "bad JIS")
                s1 = ((c1 - 0x21) >> 1) + 0x81
                if s1 > 0x9F:
                    s1 += 0x40
                if c1 % 2:
                    s2 = c2 + (0x20 if c2 >= 0x60 else 0x1F)
                else:
                    s2 = c2 + 0x7E
                out += bytes((s1, s2))
        elif mode == b"(I":  # JIS X 0201 katakana -> half-width katakana in cp932
            out += bytes(c + 0x80 for c in chunk)
        else:
            out += chunk
        if m:
            mode, pos = m.group(1), m.end()
    return bytes(out).decode("cp932")


def decode_bytes(data: bytes, label: str | None, notes: list[str] | None = None) -> str:
    """Bytes -> str that never raises.  Strict attempts first, one lossy decode last.

    1. the declared charset (mapped to its WHATWG superset, see _SUPERSET), strict;
       with no usable label: UTF-16 if there is a BOM, ISO-2022-JP if its escape
       sequences are present (7-bit, so it would otherwise pass as ASCII garbage);
    2. UTF-8, strict: mislabelled UTF-8 is the most common lie, and strict UTF-8
       almost never succeeds by accident on legacy 8-bit text (skipped for a
       declared UTF-16/32, whose NULs are valid UTF-8);
    3. lossy: the declared charset with U+FFFD replacements when there is a real
       label; with none (or us-ascii): UTF-8 with replacements when at most a quarter
       of the 8-bit bytes fail to decode, else cp1252 (maps every byte but five).
    """
    if not data:
        return ""
    declared = _codec(label)
    strict: list[str] = []
    if declared:
        strict.append(declared)
    elif data[:2] in (b"\xff\xfe", b"\xfe\xff"):
        strict.append("utf-16")
    elif b"\x1b$" in data or b"\x1b(" in data:
        strict.append("iso2022_jp_ext")
    # UTF-8 is no fallback for 7-bit encodings (the escapes would pass as ASCII) nor
    # for UTF-16/32 (their NULs are valid UTF-8)
    seven_or_wide = bool(declared) and declared.startswith(("utf-16", "utf-32", "iso2022", "utf-7"))
    if declared != "utf-8" and not seven_or_wide:
        strict.append("utf-8")
    for i, name in enumerate(strict):
        try:
            text = data.decode(name)
        except UnicodeError:
            if not name.startswith("iso2022_jp"):
                continue
            try:
                text = _iso2022jp_as_cp932(data)
            except UnicodeError:
                continue
        if notes is not None and i > 0 and label:
            notes.append(f"charset {label!r} -> {name}")
        return text
    if declared and declared != "ascii":
        # a real label: respect it, replacing what does not decode (as browsers do)
        text = data.decode(declared, "replace")
    else:
        # no usable label: mostly-UTF-8 with a few broken bytes stays UTF-8; anything
        # else (legacy 8-bit text, binary junk in a text part) is cp1252
        text = data.decode("utf-8", "replace")
        high = len(data) - len(data.translate(None, _HIGH_BYTES))
        if text.count("\ufffd") * 4 > high:
            text = data.decode("cp1252", "replace")
    if notes is not None:
        notes.append(f"charset {label!r}: lossy decode")
    return text


_HAS_SURROGATE = re.compile("[\udc80-\udcff]")
_FOLD = re.compile(r"(?:\r\n|\r|\n)(?=[ \t])")
_EW = re.compile(r"=\?[^?\s]+\?[bBqQ]\?[^?\s]*\?=")


def unescape_8bit(value: str, notes: list[str] | None = None, hint: str | None = None) -> str:
    """BytesParser keeps raw 8-bit header bytes as surrogateescapes; decode them.

    UTF-8 (RFC 6532) first; then ``hint``, the charset the message's own text parts
    declare (an 8-bit cp1251 Subject usually comes with a cp1251 body); then the
    lossy fallbacks of decode_bytes.
    """
    if not _HAS_SURROGATE.search(value):
        return value
    data = value.encode("ascii", "surrogateescape")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    if hint and _codec(hint):
        try:
            return data.decode(_codec(hint))
        except UnicodeDecodeError:
            pass
    return decode_bytes(data, None, notes)


def decode_header_text(value: str, notes: list[str] | None = None, hint: str | None = None) -> str:
    """RFC 2047 decode of an unfolded header value, never raising.

    Raw 8-bit bytes (RFC 6532 UTF-8, or legacy 8-bit) are decoded first, and only
    then are encoded words looked for.  The chunks from email.header.decode_header()
    are decoded here and simply concatenated: Python 3's decode_header keeps the
    whitespace of the unencoded runs and already drops whitespace between adjacent
    encoded words, whereas make_header() (a) raises LookupError on an unknown
    charset and UnicodeDecodeError on bad bytes and (b) inserts a space at every
    encoded/unencoded boundary, turning "3d-=?ISO-8859-1?Q?=63?=om" into "3d- c om".
    """
    value = unescape_8bit(value, notes, hint)
    if "=?" not in value:
        return value
    try:
        pairs = decode_header(value)
    except (HeaderParseError, ValueError) as exc:  # bad base64 inside an encoded word
        if notes is not None:
            notes.append(f"header left encoded: {exc}")
        return value
    out = []
    for chunk, cs in pairs:
        if isinstance(chunk, str):
            out.append(chunk)
        elif cs is None:
            # decode_header turns the unencoded runs into bytes with raw-unicode-escape
            out.append(chunk.decode("raw-unicode-escape"))
        else:
            out.append(decode_bytes(chunk, cs, notes))
    return "".join(out)


# ------------------------------------------------------------- candidate: compat32


class _Message32(Message):
    """compat32 Message whose boundary survives header folding.

    A quoted boundary may legally be folded (boundary="foo<CRLF> bar"); compat32
    returns it with the line break, so no delimiter line ever matches and the whole
    multipart body becomes one opaque string.  The feed parser asks get_boundary().
    """

    def get_boundary(self, failobj=None):
        b = super().get_boundary(failobj)
        if isinstance(b, str) and ("\n" in b or "\r" in b):
            b = re.sub(r"\r\n|\r|\n", "", b)
        return b


_P32 = BytesParser(_class=_Message32, policy=policy.compat32)
_ADDR_SPEC = re.compile(r"[^\s<>()\[\]\\,;:\"@]+@[^\s<>()\[\]\\,;:\"@]+")


def normalise_raw(raw: bytes) -> bytes:
    """The two byte-level repairs the stdlib parser needs before it sees a message."""
    if raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 BOM hides the first header
        raw = raw[3:]
    if b"\n" not in raw and b"\r" in raw:
        # CR-only (classic Mac): the header/MIME splitting copes, but quoted-printable
        # decoding (binascii.a2b_qp) does not know "\r" as a line break.
        raw = raw.replace(b"\r", b"\n")
    return raw


def _raw_header(msg: Message, name: str) -> str | None:
    """First raw value of a header (str, 8-bit bytes as surrogateescapes), unfolded.

    msg.get() is avoided on purpose: for a value with raw 8-bit bytes compat32
    returns an email.header.Header whose str() replaces every such byte with U+FFFD.
    """
    for k, v in msg.raw_items():
        if k.lower() == name:
            return _FOLD.sub("", str(v)).strip()
    return None


def _addresses32(
    msg: Message, name: str, notes: list[str], hint: str | None = None
) -> list[tuple[str, str]]:
    raw = _raw_header(msg, name)
    if raw is None:
        return []
    raw = unescape_8bit(raw, notes, hint)
    # parse first, decode the display names afterwards: a decoded name may contain
    # the commas and quotes the address grammar splits on
    try:
        pairs = getaddresses([raw])
    except RecursionError:  # _parseaddr recurses per phrase word: a 135 KB To header
        notes.append(f"{name}: getaddresses RecursionError, addr-spec regex used")
        return [("", a) for a in _ADDR_SPEC.findall(raw)]
    return [(decode_header_text(dn, notes), addr) for dn, addr in pairs if dn or addr]


def _filename32(part: Message, notes: list[str]) -> str | None:
    view = part
    cd, ct = _raw_header(part, "content-disposition"), _raw_header(part, "content-type")
    if any(v and _HAS_SURROGATE.search(v) for v in (cd, ct)):
        # get_filename() goes through msg.get(), i.e. Header objects that turn every
        # raw 8-bit byte into U+FFFD: rebuild the two headers decoded instead.
        view = Message()
        for k, v in (("Content-Disposition", cd), ("Content-Type", ct)):
            if v is not None:
                view[k] = unescape_8bit(v, notes)
    fn = view.get_filename()  # RFC 2231 (incl. continuations) handled by the stdlib
    if fn is None:
        return None
    # RFC 2047 inside a quoted filename is not legal but Outlook/Gmail emit it
    return decode_header_text(str(fn), notes)


def _charset_hint(msg: Message) -> str | None:
    """The first charset other than ASCII/UTF-8 that a text part declares."""
    for part in msg.walk():
        cs = part.get_content_charset()
        if cs and part.get_content_maintype() == "text" and _codec(cs) not in ("ascii", "utf-8"):
            return cs
    return None


def parse_compat32(raw: bytes) -> Parsed:
    msg = _P32.parsebytes(normalise_raw(raw))
    notes: list[str] = []
    subj = _raw_header(msg, "subject")
    mid = _raw_header(msg, "message-id")
    hint = None
    if any(_HAS_SURROGATE.search(v) for v in map(str, msg.values())):
        hint = _charset_hint(msg)
    p = Parsed(
        subject=None if subj is None else decode_header_text(subj, notes, hint),
        from_=_addresses32(msg, "from", notes, hint),
        to=_addresses32(msg, "to", notes, hint),
        cc=_addresses32(msg, "cc", notes, hint),
        message_id=None if mid is None else decode_header_text(mid, notes),
        text=[],
        html=[],
        attachments=[],
        notes=notes,
        n_headers=len(msg),
    )
    stack = [msg]  # explicit stack: the corpus nests deeply enough to matter
    while stack:
        part = stack.pop()
        ctype = part.get_content_type()
        if part.is_multipart():
            payload = part.get_payload()
            if part.get_content_maintype() == "multipart":
                stack.extend(reversed(payload))
                continue
            # message/rfc822, message/delivery-status, ...: compat32 parsed them into
            # sub-messages.  One attachment, not descended into (a forwarded or
            # bounced message's body is not this message's body).
            size = 0
            for sub in payload:
                try:
                    size += len(sub.as_bytes())
                except Exception:
                    size += len(str(sub).encode("utf-8", "surrogateescape"))
            p.attachments.append((_filename32(part, notes), ctype, size))
            continue
        # get_payload(decode=True) is None for containers; never None for a leaf, but
        # "or b''" keeps it bytes whatever happens.  Bad base64 does not raise: it is
        # decoded as far as possible and a defect is recorded on the part.
        data = part.get_payload(decode=True) or b""
        disp = part.get_content_disposition()
        if part.get_content_maintype() == "multipart":
            # declared multipart/* whose boundary never appears: compat32 leaves the
            # body as one string.  Keep it as text rather than lose it.
            notes.append(f"{ctype} without its boundary: kept as text/plain")
            ctype = "text/plain"
        if ctype in ("text/plain", "text/html") and disp != "attachment":
            text = decode_bytes(data, part.get_content_charset(), notes)
            (p.text if ctype == "text/plain" else p.html).append(text)
        else:
            p.attachments.append((_filename32(part, notes), ctype, len(data)))
    return p


# -------------------------------------------------------------- candidate: default

_PDEF = BytesParser(policy=policy.default)


def _addresses_default(msg, name: str) -> list[tuple[str, str]]:
    h = msg[name]
    if h is None:
        return []
    return [(a.display_name, a.addr_spec) for a in h.addresses]


def parse_default(raw: bytes) -> Parsed:
    """The documented EmailMessage API, used the way its docs suggest; no guards."""
    msg = _PDEF.parsebytes(raw)
    subj = msg["subject"]
    mid = msg["message-id"]
    p = Parsed(
        subject=None if subj is None else str(subj),
        from_=_addresses_default(msg, "from"),
        to=_addresses_default(msg, "to"),
        cc=_addresses_default(msg, "cc"),
        message_id=None if mid is None else str(mid),
        text=[],
        html=[],
        attachments=[],
        n_headers=len(msg),
    )
    body = msg.get_body(preferencelist=("plain",))
    if body is not None:
        p.text.append(body.get_content())
    body = msg.get_body(preferencelist=("html",))
    if body is not None:
        p.html.append(body.get_content())
    for att in msg.iter_attachments():
        content = att.get_content()
        if isinstance(content, bytes):
            size = len(content)
        elif isinstance(content, str):
            size = len(att.get_payload(decode=True) or b"")
        else:  # message/rfc822 -> EmailMessage
            size = len(content.as_bytes())
        p.attachments.append((att.get_filename(), att.get_content_type(), size))
    return p


# ------------------------------------------------------------------ candidate: fmp


def _pyaddr(a) -> tuple[str, str]:
    return (a.display_name or "", a.address or "")


def _fmp_to_parsed(m) -> Parsed:
    mid = None
    for k, v in m.headers.items():
        if k.lower() == "message-id" and v:
            mid = v[0]
            break
    return Parsed(
        subject=m.subject,  # "" when absent
        from_=[_pyaddr(m.from_)] if m.from_ is not None else [],
        to=[_pyaddr(a) for a in m.to],
        cc=[_pyaddr(a) for a in m.cc],
        message_id=mid,
        text=list(m.text_plain),
        html=list(m.text_html),
        attachments=[(a.filename or None, a.mimetype, len(a.content)) for a in m.attachments],
        notes=[f"{w.kind}: {w.detail}" for w in m.warnings],
        n_headers=sum(len(v) for v in m.headers.values()),
    )


def parse_fmp(raw: bytes) -> Parsed:
    return _fmp_to_parsed(fmp.parse_email(raw))


def parse_fmp_fallback(raw: bytes) -> Parsed:
    """fmp as the fast path, hardened with what this bench found it needs.

    CR-only input normalised first (fmp silently returns an empty message for it),
    RFC 2047 in attachment filenames decoded (fmp leaves it encoded), and any
    ParseError (strict base64, a header block starting with whitespace) handed to
    the compat32 path.  Silent differences (charset guessing, first From mailbox
    only, encoded words not followed by whitespace) remain.
    """
    try:
        m = fmp.parse_email(normalise_raw(raw))
    except fmp.ParseError:
        p = parse_compat32(raw)
        p.notes.append("fmp ParseError: compat32 used")
        return p
    p = _fmp_to_parsed(m)
    if any(fn and "=?" in fn for fn, _, _ in p.attachments):
        p.attachments = [
            (decode_header_text(fn) if fn else fn, ct, n) for fn, ct, n in p.attachments
        ]
    return p


# ----------------------------------------------------------- candidate: mail-parser


_B64_JUNK = re.compile(r"[^A-Za-z0-9+/]")


def _b64_size(text: str) -> int:
    """Decoded size of possibly broken base64 (mail-parser hands back the wire text)."""
    clean = _B64_JUNK.sub("", text)
    return len(base64.b64decode(clean[: len(clean) - len(clean) % 4]))


def parse_mailparser(raw: bytes) -> Parsed:
    m = mailparser.parse_from_bytes(raw)
    atts = []
    for a in m.attachments:
        payload = a["payload"]
        if a["binary"]:
            size = _b64_size(payload)
        else:
            size = len(payload.encode("utf-8", "surrogateescape"))
        atts.append((a["filename"], a["mail_content_type"], size))
    msg = m.message
    subject = m.subject
    if isinstance(subject, list):  # mail-parser returns a list for a repeated header
        subject = subject[0]
    return Parsed(
        subject=subject if msg.get("subject") is not None else None,
        from_=[tuple(x) for x in m.from_],
        to=[tuple(x) for x in m.to],
        cc=[tuple(x) for x in m.cc],
        message_id=m.message_id or None,
        text=list(m.text_plain),
        html=list(m.text_html),
        attachments=atts,
        notes=[str(d) for d in m.defects][:5],
        n_headers=len(msg),
    )


CANDIDATES: dict[str, object] = {"compat32": parse_compat32, "default": parse_default}
if fmp is not None:
    CANDIDATES["fmp"] = parse_fmp
    CANDIDATES["fmp+fallback"] = parse_fmp_fallback
if mailparser is not None:
    CANDIDATES["mailparser"] = parse_mailparser
REF = "compat32"


# ------------------------------------------------------- guarded correctness pass


def _limit_memory() -> None:
    try:
        import resource

        limit = 3 * 1024**3
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ImportError, ValueError, OSError):
        pass


def _worker(name: str, paths: list[str], conn) -> None:
    _limit_memory()
    fn = CANDIDATES[name]
    for i, path in enumerate(paths):
        raw = Path(path).read_bytes()
        t0 = time.perf_counter()
        try:
            res, err = fn(raw), None
        except BaseException as exc:
            res, err = None, f"{type(exc).__name__}: {str(exc)[:160]}"
        dt = time.perf_counter() - t0
        conn.send((i, res, err, dt))
    conn.close()


@dataclass
class Outcome:
    res: Parsed | None
    err: str | None  # exception text, "TIMEOUT" or "CRASH"
    dt: float


def guarded_pass(name: str, paths: list[str], timeout: float) -> list[Outcome]:
    ctx = mp.get_context("fork")
    out: list[Outcome | None] = [None] * len(paths)
    start = 0
    while start < len(paths):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_worker, args=(name, paths[start:], child), daemon=True)
        proc.start()
        child.close()
        i = start
        while i < len(paths):
            if not parent.poll(timeout):
                out[i] = Outcome(None, f"TIMEOUT (> {timeout:g} s)", timeout)
                proc.kill()
                break
            try:
                j, res, err, dt = parent.recv()
            except EOFError:
                proc.join()
                out[i] = Outcome(None, f"CRASH (child exit code {proc.exitcode})", 0.0)
                break
            out[start + j] = Outcome(res, err, dt)
            i = start + j + 1
        proc.join()
        parent.close()
        start = i + 1 if i < len(paths) else i
    return out  # type: ignore[return-value]


# ------------------------------------------------------------------- comparisons


def _norm_text(s: str) -> str:
    s = s.replace("\r\n", "\n").replace("\r", "\n")
    return "\n".join(line.rstrip() for line in s.split("\n")).strip()


def _ws(s: str | None) -> str:
    return " ".join((s or "").split())


def _short(s, n: int = 70) -> str:
    r = repr(s)
    return r if len(r) <= n else r[: n - 3] + "..."


def _has_body(texts: list[str]) -> bool:
    return any(t.strip() for t in texts)


def _pg_unsafe(p: Parsed) -> bool:
    blobs = [p.subject or "", *p.text, *p.html]
    blobs += [fn or "" for fn, _, _ in p.attachments]
    blobs += [x for pair in p.from_ + p.to + p.cc for x in pair]
    return any("\x00" in b or _HAS_SURROGATE.search(b) for b in blobs)


def _raw_headers(raw: bytes) -> bytes:
    m = re.search(rb"\r?\n\r?\n|\r\r", raw)
    return raw[: m.start()] if m else raw


def _has_subject_header(raw: bytes) -> bool:
    return re.search(rb"(?im)^subject[ \t]*:", _raw_headers(raw)) is not None


def _addr_key(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(_ws(n), (a or "").lower()) for n, a in pairs]


def print_table(headers: list[str], rows: list[list[str]], title: str | None = None) -> None:
    if title:
        print(f"\n{title}")
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=False)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=False))
    print(line)
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(r, widths, strict=False)))


def correctness(names: list[str], rels: list[str], raws: list[bytes], results) -> None:
    n = len(rels)
    summary: dict[str, Counter] = {c: Counter() for c in names}
    detail: dict[str, dict[str, list[str]]] = {c: defaultdict(list) for c in names}

    for i, rel in enumerate(rels):
        outs = {c: results[c][i] for c in names}
        ok = {c: o.res for c, o in outs.items() if o.res is not None}
        for c, o in outs.items():
            if o.dt > SLOW_S:
                summary[c]["slow>1s"] += 1
                detail[c]["slow>1s"].append(f"{rel} ({o.dt:.2f} s)")
            if o.err:
                kind = "timeout" if o.err.startswith("TIMEOUT") else "exception"
                summary[c][kind] += 1
                detail[c][kind].append(f"{rel}: {o.err}")
        has_subj = _has_subject_header(raws[i])
        for c, p in ok.items():
            s = p.subject
            if has_subj and not s:
                # only a failure if somebody else did get a subject out of it
                if any(q.subject for q in ok.values()):
                    summary[c]["subject missing"] += 1
                    detail[c]["subject missing"].append(rel)
            elif s and "\ufffd" in s and b"\xef\xbf\xbd" not in _raw_headers(raws[i]):
                summary[c]["subject has U+FFFD"] += 1
                detail[c]["subject has U+FFFD"].append(f"{rel}: {_short(s)}")
            if s and _EW.search(s):
                summary[c]["subject still encoded"] += 1
                detail[c]["subject still encoded"].append(f"{rel}: {_short(s)}")
            if _pg_unsafe(p):
                summary[c]["NUL/surrogate in output"] += 1
                detail[c]["NUL/surrogate in output"].append(rel)
            if p.notes:
                summary[c]["repairs/warnings"] += 1
        most = max((q.n_headers for q in ok.values()), default=0)
        for c, p in ok.items():
            if p.n_headers < most - 1:  # fmp also counts an mbox "From " line
                summary[c]["headers lost (>=2 fewer)"] += 1
                detail[c]["headers lost (>=2 fewer)"].append(f"{rel}: {p.n_headers} vs {most}")
        for kind, attr in (("text", "text"), ("html", "html")):
            found = {c for c, p in ok.items() if _has_body(getattr(p, attr))}
            for c in ok:
                others = found - {c}
                if c not in found and len(others) >= 2:
                    summary[c][f"no {kind} body (>=2 others have)"] += 1
                    detail[c][f"no {kind} body (>=2 others have)"].append(
                        f"{rel} (found by {', '.join(sorted(others))})"
                    )
        if REF in ok:
            ref = ok[REF]
            for c, p in ok.items():
                if c == REF:
                    continue
                if len(p.attachments) != len(ref.attachments):
                    summary[c]["attachment count != compat32"] += 1
                    detail[c]["attachment count != compat32"].append(
                        f"{rel}: {len(p.attachments)} vs {len(ref.attachments)}"
                        f"  {sorted({ct for _, ct, _ in p.attachments})}"
                        f" vs {sorted({ct for _, ct, _ in ref.attachments})}"
                    )
                elif sorted(_ws(f) for f, _, _ in p.attachments if f) != sorted(
                    _ws(f) for f, _, _ in ref.attachments if f
                ):
                    summary[c]["filenames != compat32"] += 1
                    detail[c]["filenames != compat32"].append(
                        f"{rel}: {[f for f, _, _ in p.attachments]}"
                        f" vs {[f for f, _, _ in ref.attachments]}"
                    )
                if p.text and ref.text and _norm_text(p.text[0]) != _norm_text(ref.text[0]):
                    summary[c]["1st text body != compat32"] += 1
                    detail[c]["1st text body != compat32"].append(
                        f"{rel}: {_short(_norm_text(p.text[0])[:200], 60)} vs "
                        f"{_short(_norm_text(ref.text[0])[:200], 60)}"
                    )

    # ---- summary table
    kinds = [
        "exception",
        "timeout",
        "slow>1s",
        "subject missing",
        "subject has U+FFFD",
        "subject still encoded",
        "headers lost (>=2 fewer)",
        "no text body (>=2 others have)",
        "no html body (>=2 others have)",
        "attachment count != compat32",
        "filenames != compat32",
        "1st text body != compat32",
        "NUL/surrogate in output",
        "repairs/warnings",
    ]
    rows = [[k] + [str(summary[c][k]) for c in names] for k in kinds]
    slowest = {c: max(range(n), key=lambda i, c=c: results[c][i].dt) for c in names}
    rows.append(["slowest file, s"] + [f"{results[c][slowest[c]].dt:.2f}" for c in names])
    print_table([f"files (of {n}) with ...", *names], rows, title="== Correctness summary ==")
    for c in names:
        print(f"  slowest for {c}: {rels[slowest[c]]}")
    print("  (repairs/warnings: compat32 = charset fallbacks used; fmp = PyMail.warnings;")
    print("   mailparser = defects; default = n/a)")
    for c in names:
        for k in kinds:
            if k == "repairs/warnings" or not detail[c][k]:
                continue
            items = detail[c][k]
            print(f"\n-- {c}: {k} ({len(items)})")
            for it in items[:25]:
                print("   ", it)
            if len(items) > 25:
                print(f"    ... {len(items) - 25} more")


def rfc2047_report(names, rels, raws, results, limit: int = 20) -> None:
    print("\n== RFC 2047 header decoding (files whose header block has encoded words) ==")
    files = [i for i, r in enumerate(raws) if _EW.search(_raw_headers(r).decode("latin-1"))]
    diffs = Counter()
    shown = 0
    for i in files:
        ok = {c: results[c][i].res for c in names if results[c][i].res is not None}
        if REF not in ok:
            continue
        ref = ok[REF]
        for c, p in ok.items():
            if c == REF:
                continue
            fields = []
            if _ws(p.subject) != _ws(ref.subject):
                fields.append(("subject", p.subject, ref.subject))
            for f in ("from_", "to", "cc"):
                a, b = _addr_key(getattr(p, f)), _addr_key(getattr(ref, f))
                if a != b:
                    fields.append((f, a[:3], b[:3]))
            for f, mine, theirs in fields:
                diffs[(c, f)] += 1
                if shown < limit:
                    shown += 1
                    print(f"  {rels[i]} [{f}]\n      {c:<10} {_short(mine, 110)}")
                    print(f"      {REF:<10} {_short(theirs, 110)}")
    print(f"  {len(files)} files with encoded words; differences vs {REF} per field:")
    for c in names:
        if c != REF:
            parts = [f"{f}={diffs[(c, f)]}" for f in ("subject", "from_", "to", "cc")]
            print(f"    {c:<10} " + "  ".join(parts))


def _sig(p: Parsed):
    return (
        _ws(p.subject),
        tuple(_norm_text(t) for t in p.text),
        tuple(_norm_text(t) for t in p.html),
        tuple((f, ct) for f, ct, _ in p.attachments),
    )


TRIPLE_STEMS = ("lhost-postfix-01", "lhost-exchange2007-01")
CR_ONLY = ("mac__lhost-postfix-01", "mac__lhost-exchange2007-01")
EXOTIC_CHARSETS = (
    ("jhillyerd-enmime/testdata__low-quality__unk-charset-part.eml", "fakescii text"),
    ("jhillyerd-enmime/testdata__low-quality__unk-charset-html-only.eml", "fakescii html"),
    ("jhillyerd-enmime/testdata__mail__html-mime-bad-unknown-charset-inline.eml", "us-askey"),
    ("mikel-mail/plain_emails__raw_email10.eml", "X-UNKNOWN, 8-bit UTF-8 body"),
    ("sisimai-set-of-emails/bsd__lhost-outlook-01.eml", "unicode-1-1-utf-7"),
    ("sisimai-set-of-emails/bsd__rhost-outlook-01.eml", "unicode-1-1-utf-7"),
    ("django-mailbox/message_with_invalid_encoding.eml", "_iso-2022-jp$ESC"),
    ("stalwart-mail-parser/thirdparty__005.eml", "utf-16le/be + euc-jp parts"),
)


def special_files() -> list[str]:
    """The corpus files special_report looks at by name."""
    trios = [
        f"sisimai-set-of-emails/{v}__{s}.eml" for s in TRIPLE_STEMS for v in ("bsd", "dos", "mac")
    ]
    return (
        trios
        + [f"sisimai-set-of-emails/{t}.eml" for t in CR_ONLY]
        + [r for r, _ in EXOTIC_CHARSETS]
    )


def special_report(names, rels, results) -> None:
    idx = {r: i for i, r in enumerate(rels)}
    print("\n== sisimai line-ending triples (bsd=LF, dos=CRLF, mac=CR-only) ==")
    print("   'same' = subject, text, html and attachment names/types equal after")
    print("   line-ending normalisation; sizes may differ by the CRs")
    for stem in TRIPLE_STEMS:
        trio = [f"sisimai-set-of-emails/{v}__{stem}.eml" for v in ("bsd", "dos", "mac")]
        if not all(t in idx for t in trio):
            continue
        for c in names:
            outs = [results[c][idx[t]] for t in trio]
            if any(o.res is None for o in outs):
                print(f"  {stem:<22} {c:<10} error: {[o.err for o in outs]}")
                continue
            sigs = [_sig(o.res) for o in outs]
            verdict = []
            for label, s in zip(("dos", "mac"), sigs[1:], strict=True):
                if s == sigs[0]:
                    verdict.append(f"{label}=bsd")
                else:
                    bad = [
                        n
                        for n, a, b in zip(
                            ("subject", "text", "html", "atts"), s, sigs[0], strict=True
                        )
                        if a != b
                    ]
                    verdict.append(f"{label}!=bsd({','.join(bad)})")
            print(f"  {stem:<22} {c:<10} {'  '.join(verdict)}")
    print("\n== CR-only files ==")
    for t in CR_ONLY:
        rel = f"sisimai-set-of-emails/{t}.eml"
        if rel not in idx:
            continue
        for c in names:
            o = results[c][idx[rel]]
            if o.res is None:
                print(f"  {t:<28} {c:<10} {o.err}")
                continue
            p = o.res
            print(
                f"  {t:<28} {c:<10} subject={_short(p.subject, 40)} from={len(p.from_)}"
                f" text={len(p.text)}({sum(len(x) for x in p.text)} ch)"
                f" html={len(p.html)} atts={len(p.attachments)}"
                + (f" warnings={len(p.notes)}" if p.notes else "")
            )

    print("\n== Bogus / exotic charsets ==")
    for rel, what in EXOTIC_CHARSETS:
        if rel not in idx:
            continue
        print(f"  {rel}  [{what}]")
        for c in names:
            o = results[c][idx[rel]]
            if o.res is None:
                print(f"      {c:<10} {o.err}")
                continue
            p = o.res
            bodies = [("text", t) for t in p.text] + [("html", h) for h in p.html]
            shown = "; ".join(f"{k}:{_short(v[:60], 48)}" for k, v in bodies[:5]) or "(no body)"
            extra = f"  atts={len(p.attachments)}"
            if p.notes:
                extra += f"  notes={_short(p.notes[:2], 80)}"
            print(f"      {c:<10} {shown}{extra}")


# ------------------------------------------------------------------------- speed


def _run_once(fn, raws: list[bytes]) -> float:
    t0 = time.perf_counter()
    for raw in raws:
        try:
            fn(raw)
        except Exception:  # noqa: S112 - failures cost time too; counted above
            continue
    return time.perf_counter() - t0


def _run_many(raws: list[bytes], threads: int) -> float:
    t0 = time.perf_counter()
    for out in fmp.parse_many(raws, threads=threads):
        if not isinstance(out, fmp.ParseError):
            _fmp_to_parsed(out)
    return time.perf_counter() - t0


def speed(names, rels, raws, results, passes: int) -> dict[tuple[str, str], float]:
    skip = {
        i
        for i in range(len(rels))
        for c in names
        if (results[c][i].err or "").startswith(("TIMEOUT", "CRASH"))
    }
    whole = [r for i, r in enumerate(raws) if i not in skip]
    typical = [r for r in whole if len(r) < TYPICAL_MAX]
    sets = {"whole": whole, "typical": typical}
    fns = {c: CANDIDATES[c] for c in names}
    fns["compat32 parse only"] = _P32.parsebytes
    if "default" in names:
        fns["default parse only"] = _PDEF.parsebytes
    if "fmp" in names:
        fns["fmp parse only"] = fmp.parse_email
        ncpu = os.cpu_count() or 1
        fns[f"fmp parse_many({ncpu} thr)"] = lambda rs, n=ncpu: _run_many(rs, n)
    best: dict[tuple[str, str], float] = {}
    gc.collect()
    for _ in range(passes):
        for set_name, rs in sets.items():
            for name, fn in fns.items():
                if name.startswith("fmp parse_many"):
                    dt = fn(rs)
                else:
                    dt = _run_once(fn, rs)
                key = (name, set_name)
                best[key] = min(best.get(key, float("inf")), dt)
    mb_whole = sum(map(len, whole)) / 1e6
    mb_typ = sum(map(len, typical)) / 1e6
    print(
        f"\n== Speed: best of {passes} passes, single process, full extraction to Parsed =="
        f"\n   whole = {len(whole)} files, {mb_whole:.1f} MB"
        + (f" (excluding {len(skip)} file(s) some candidate timed out/crashed on)" if skip else "")
        + f";  typical = {len(typical)} files < {TYPICAL_MAX // 1024} KB, {mb_typ:.1f} MB"
    )
    rows = []
    ref_w, ref_t = best[(REF, "whole")], best[(REF, "typical")]
    for name in fns:
        w, t = best[(name, "whole")], best[(name, "typical")]
        rows.append(
            [
                name,
                f"{w:.3f}",
                f"{len(whole) / w:,.0f}",
                f"{mb_whole / w:.1f}",
                f"{ref_w / w:.2f}x",
                f"{t:.3f}",
                f"{len(typical) / t:,.0f}",
                f"{1e6 * t / len(typical):,.0f}",
                f"{ref_t / t:.2f}x",
            ]
        )
    print_table(
        [
            "candidate",
            "whole s",
            "msg/s",
            "MB/s",
            "vs compat32",
            "typical s",
            "msg/s",
            "us/msg",
            "vs compat32",
        ],
        rows,
    )
    print("   (vs compat32 > 1 means faster than compat32)")
    return best


# -------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--corpus", type=Path, default=Path(os.environ.get("INBOXD_CORPUS", DEFAULT_CORPUS))
    )
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=20.0, help="per-file seconds")
    ap.add_argument("--quick", action="store_true", help="1 speed pass")
    ap.add_argument("--only", nargs="*", help="candidate names")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help=f"CI size: every {SMOKE_EVERY}th typical file, {SMOKE_LARGE_FILES} larger ones, "
        "the named special files, 1 speed pass; exit 1 when the figures are not measurements",
    )
    args = ap.parse_args()

    paths = sorted(args.corpus.rglob("*.eml"))
    if not paths:
        print(f"no .eml files under {args.corpus}", file=sys.stderr)
        return 2
    problems = [
        f"special file missing from the corpus: {rel}"
        for rel in special_files()
        if not (args.corpus / rel).is_file()
    ]
    if args.smoke:
        special = {args.corpus / rel for rel in special_files()}
        sizes = {p: p.stat().st_size for p in paths}
        large = sorted((p for p in paths if sizes[p] >= TYPICAL_MAX), key=sizes.__getitem__)
        keep = special | set(large[:SMOKE_LARGE_FILES])
        paths = [
            p
            for i, p in enumerate(paths)
            if p in keep or (i % SMOKE_EVERY == 0 and sizes[p] < TYPICAL_MAX)
        ]
        args.timeout = min(args.timeout, SMOKE_TIMEOUT_S)
    # compat32 is the reference every comparison and ratio is made against
    names = [c for c in CANDIDATES if not args.only or c in args.only or c == REF]
    rels = [str(p.relative_to(args.corpus)) for p in paths]
    raws = [p.read_bytes() for p in paths]
    versions = [f"python {sys.version.split()[0]}"]
    if fmp is not None:
        from importlib.metadata import version

        versions.append(f"fast-mail-parser {version('fast-mail-parser')}")
    else:
        versions.append("fast-mail-parser not installed (skipped; pip install -e '.[bench]')")
    if mailparser is not None:
        from importlib.metadata import version

        versions.append(f"mail-parser {version('mail-parser')}")
    else:
        versions.append("mail-parser not installed (skipped)")
    print(f"corpus: {args.corpus}  ({len(paths)} .eml, {sum(map(len, raws)) / 1e6:.1f} MB)")
    print("versions: " + ", ".join(versions))

    t0 = time.perf_counter()
    results = {}
    for c in names:
        t = time.perf_counter()
        results[c] = guarded_pass(c, [str(p) for p in paths], args.timeout)
        print(f"  guarded pass {c:<10} {time.perf_counter() - t:6.1f} s", flush=True)

    correctness(names, rels, raws, results)
    rfc2047_report(names, rels, raws, results)
    special_report(names, rels, results)
    best = speed(names, rels, raws, results, 1 if args.quick or args.smoke else args.passes)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    problems += check(names, results, best)
    if problems:
        print("\nFAILED: these figures are not measurements:", file=sys.stderr)
        for text in problems:
            print(f"  {text}", file=sys.stderr)
        return 1
    return 0


def check(names: list[str], results, best: dict[tuple[str, str], float]) -> list[str]:
    """Why the output is not a measurement: the reference failing (every comparison is
    made against it), a candidate failing on most files, a speed figure of nothing."""
    out = []
    for c in names:
        failed = [o.err for o in results[c] if o.err]
        if c == REF and failed:
            out.append(f"the reference {REF} failed on {len(failed)} files, e.g. {failed[0]}")
        elif len(failed) > BROKEN_SHARE * len(results[c]):
            out.append(f"{c} failed on {len(failed)} of {len(results[c])} files, e.g. {failed[0]}")
    for (name, files), seconds in best.items():
        if not 0 < seconds < float("inf"):
            out.append(f"speed of {name} over {files}: {seconds} s")
    return out


if __name__ == "__main__":
    sys.exit(main())
