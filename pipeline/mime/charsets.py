"""Bytes → str for the charsets real mail declares, including the bogus ones.

Mail is bytes. A declared charset is a hint that is often wrong (`fakescii`,
`us-askey`, `x-unknown`, `_iso-2022-jp$ESC` all appear in the corpus), so decoding
goes: declared charset (through an alias table of what clients actually mean),
then UTF-8, then windows-1252, which maps every byte and so never fails. Nothing
here raises on input.
"""

from __future__ import annotations

import codecs

# What senders write → the codec that decodes what they actually sent.
# Superset codecs win because mailers label by the base standard and send the
# vendor extension (WHATWG Encoding Standard §4.2 makes the same substitutions).
_ALIASES = {
    "iso-8859-1": "cp1252",
    "latin1": "cp1252",
    "latin-1": "cp1252",
    "ansi_x3.4-1968": "ascii",
    "iso-8859-8-i": "iso8859_8",
    "iso-8859-6-i": "iso8859_6",
    "iso-8859-9": "cp1254",
    "iso-8859-11": "cp874",
    "tis-620": "cp874",
    "ks_c_5601-1987": "cp949",
    "ks_c_5601": "cp949",
    "euc-kr": "cp949",
    "gb2312": "gb18030",
    "gbk": "gb18030",
    "x-gbk": "gb18030",
    "big5": "big5hkscs",
    "shift_jis": "cp932",
    "shift-jis": "cp932",
    "sjis": "cp932",
    "x-sjis": "cp932",
    "windows-31j": "cp932",
    "x-mac-cyrillic": "mac_cyrillic",
    "x-mac-roman": "mac_roman",
    "macintosh": "mac_roman",
    "unicode-1-1-utf-7": "utf-7",
    "utf8": "utf-8",
    "unicode": "utf-16",
}

_LAST_RESORT = "cp1252"
# One replacement character per this many is still "mostly UTF-8": a multibyte
# character cut at a fold. cp1252 text read as UTF-8 fails on nearly every
# non-ASCII byte, far denser than this.
_MOSTLY_UTF8_RATIO = 50


def codec_for(charset: str | None) -> str | None:
    """Python codec name for a declared charset, or None when it is unknown/bogus."""
    if not charset:
        return None
    name = charset.strip().strip("\"'").lower()
    name = _ALIASES.get(name, name)
    try:
        return codecs.lookup(name).name
    except (LookupError, ValueError):
        return None


def decode_bytes(data: bytes, charset: str | None = None) -> str:
    """Decode `data`, trusting `charset` only as far as it decodes cleanly.

    The last resort keeps every byte (as its cp1252 character, or U+FFFD for
    the five bytes cp1252 leaves undefined) so no text is ever dropped.
    """
    codec = codec_for(charset)
    if codec is not None:
        try:
            return data.decode(codec)
        except (UnicodeDecodeError, LookupError):
            pass
    if codec != "utf-8":
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            pass
    if codec is not None and codec != "ascii":
        # A known charset with a few bad bytes reads better than cp1252 garbage.
        return data.decode(codec, errors="replace")
    # No label, a bogus one, or 8-bit bytes labelled us-ascii (a classic lie):
    # windows-1252 maps every byte the way most such mail was written.
    return data.decode(_LAST_RESORT, errors="replace")


def recover_header_bytes(value: str, charset: str | None = None) -> str:
    """Undo the stdlib's surrogateescape of 8-bit header bytes and decode them.

    compat32 parses headers as ASCII and smuggles raw 8-bit bytes through as
    lone surrogates. Such headers are UTF-8 (RFC 6532) or, in older mail, the
    charset the message's text parts declare (`charset`), else windows-1252.
    """
    if value.isascii():
        return value
    try:
        raw = value.encode("ascii", "surrogateescape")
    except UnicodeEncodeError:
        return value  # already real text, not escaped bytes
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        pass
    codec = codec_for(charset)
    if codec is not None and codec not in ("utf-8", "ascii"):
        try:
            return raw.decode(codec)
        except (UnicodeDecodeError, LookupError):
            pass
    # UTF-8 cut mid-character (folded or truncated by the sender) is still UTF-8
    lenient = raw.decode("utf-8", errors="replace")
    if lenient.count("\ufffd") * _MOSTLY_UTF8_RATIO <= len(lenient):
        return lenient
    return raw.decode(_LAST_RESORT, errors="replace")
