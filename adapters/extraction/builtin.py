"""The `builtin` parse backend: deterministic extraction by per-field rules.

A processor declares, beside its schema, one rule per result field
(`[processors.rules]` in the tenant file)::

    [processors.rules]
    invoice_no = { regex = 'Invoice (?P<value>[A-Z0-9-]+)', in = "text" }
    total      = { regex = 'Total: (?P<value>[\\d,.]+)', in = "attachments", type = "number" }
    subject    = { header = "Subject" }
    files      = { attachment = "names" }
    vendor     = { address = "from.domain" }

Rules (exactly one of the four keys per rule):

* ``header = "Name"``: the first occurrence of that header in the raw MIME,
  RFC 2047 decoded (pipeline/mime/headers.py); without raw bytes, the parsed
  field for Subject, From, To, Cc, Reply-To, Message-ID and In-Reply-To.
* ``regex = "…(?P<value>…)…", in = "text" | "html_text" | "attachments" |
  "attachment_names" | "subject"``: a search over the plain-text body, the
  visible text of the HTML body, each text/* attachment or each attachment's
  file name in message order (the first that matches wins), or the subject;
  the named group `value` is the field. Case-sensitive unless the
  pattern says `(?i)`. Only the first SEARCH_MAX_CHARS of each text are searched.
  Patterns are those of the `regex` module (mrab; `re`'s syntax and more, such
  as `\\p{L}`), checked by check-config with the same module that runs them.
* ``attachment = "names" | "types" | "count"``: every attachment and inline part
  in message order: file names (non-empty ones), content types, or how many.
* ``address = "from.email" | "from.domain" | "from.name" | "to.emails"``.

`type = "string" | "number" | "integer"` (header and regex rules; default
string) converts the text: surrounding blanks go; for numbers, spaces, NBSPs
and apostrophes are digit-group marks, and so is the separator that is not
`decimal` (default "."; `decimal = ","` reads "1.234,50"): "1,234.50" → 1234.5.
A text that does not convert is terminal (the mail holds something else than
the schema promises), and so is a number JSON cannot carry: an integer outside
the signed 64-bit range, a number too large for a double (it would be
infinite); money that needs exact cents should stay a string.

A rule that finds nothing (no header, no match, no attachment, an empty value
or list) leaves its field out; the schema's `required` then decides, so a
missing required field is terminal: the mail does not contain it. `count` is
always found. Fields appear in rule order. The same message and rules always
give the same result: nothing here reads the network or the locale.

A tenant's pattern may backtrack catastrophically on a hostile mail (`re` has
no way to stop it: hours over a 1 MiB body). So the rules run in a worker
thread (`BuiltinBackend.extract`, `anyio.to_thread`), never on the event loop,
and each regex rule has RULE_TIMEOUT_S for all the texts it searches (the
`regex` module's `timeout`, with the GIL released while it matches); a rule
that runs out is terminal for that message, naming the field and the limit.
This is the one place the clock counts: a pattern that needs almost the whole
limit may finish on one try and not on another, which is why the limit sits
two orders of magnitude above what an honest pattern needs.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from email.message import Message
from email.parser import BytesHeaderParser
from email.policy import compat32
from typing import Any

import anyio.to_thread
import regex

from inboxd.adapters.extraction.errors import ExtractionTerminal, ProcessorConfigError
from inboxd.adapters.extraction.schema import JSON_INT_MAX, JSON_INT_MIN, ResultSchema
from inboxd.pipeline.extraction.messages import Reads
from inboxd.pipeline.mailbox.leases import one_line
from inboxd.pipeline.message import Address, MessageData
from inboxd.pipeline.mime.charsets import decode_bytes
from inboxd.pipeline.mime.headers import header_text, param_8bit, raw_header
from inboxd.pipeline.mime.parse import html_to_text

REGEX_SOURCES = ("text", "html_text", "attachments", "attachment_names", "subject")
ATTACHMENT_PARTS = ("names", "types", "count")
ADDRESS_PARTS = ("from.email", "from.domain", "from.name", "to.emails")
VALUE_TYPES = ("string", "number", "integer")
DECIMAL_MARKS = (".", ",")
#: Characters of one text a regex searches: bounds the cost of a pattern on a huge
#: body or attachment (a 1.8 MB torture message is in the corpus); 1 MiB of text
#: is far more than any invoice or receipt carries.
SEARCH_MAX_CHARS = 1 << 20
#: Time one regex rule may take over all the texts it searches, seconds. Honest
#: patterns take milliseconds over SEARCH_MAX_CHARS (measured: `Total:\s*(?P<value>
#: [\d.,]+)\s*EUR` over 1 MiB, 7 ms); 1 s is ~100 times that, and bounds what one
#: hostile message costs a round (a round holds its transaction) and how long a
#: shutdown waits for the rule under way (a thread cannot be cancelled).
RULE_TIMEOUT_S = 1.0
#: Header block read from raw MIME for `header` rules, bytes (RFC 5322 sets no
#: limit; the corpus holds a 210 KB Subject, so the cap is generous).
HEADER_BLOCK_MAX_BYTES = 1 << 20
#: Longest piece of mail text quoted in a failure reason, characters.
QUOTE_MAX_CHARS = 60

# Header names answered from MessageData when there are no raw bytes.
_PARSED_HEADERS: dict[str, Callable[[MessageData], str]] = {
    "subject": lambda m: m.subject,
    "from": lambda m: _address_list([m.from_] if m.from_ else []),
    "to": lambda m: _address_list(m.to),
    "cc": lambda m: _address_list(m.cc),
    "reply-to": lambda m: _address_list(m.reply_to),
    "message-id": lambda m: m.internet_message_id or "",
    "in-reply-to": lambda m: m.in_reply_to or "",
}
_RULE_KINDS = ("header", "regex", "attachment", "address")
_RULE_OPTIONS = {"header": {"type", "decimal"}, "regex": {"in", "type", "decimal"}}
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_INTEGER = re.compile(r"[+-]?\d+")
_INT64_MAX_DIGITS = len(str(JSON_INT_MAX))
_GROUP_MARKS = str.maketrans("", "", " \u00a0\u202f'’")


@dataclass(frozen=True, slots=True)
class HeaderRule:
    name: str
    type: str = "string"
    decimal: str = "."


@dataclass(frozen=True, slots=True)
class RegexRule:
    pattern: regex.Pattern[str]
    source: str = "text"
    type: str = "string"
    decimal: str = "."


@dataclass(frozen=True, slots=True)
class AttachmentRule:
    part: str


@dataclass(frozen=True, slots=True)
class AddressRule:
    part: str


Rule = HeaderRule | RegexRule | AttachmentRule | AddressRule


def parse_rules(table: object, *, key: str = "rules") -> dict[str, Rule]:
    """Rules of a `rules` table (field → rule table), in declaration order.

    ProcessorConfigError names the key (``rules.total.in``) of anything wrong:
    no rule or two, an unknown option, a pattern that does not compile or has
    no `value` group, a value outside the lists above."""
    if not isinstance(table, Mapping) or not table:
        raise ProcessorConfigError(f"`{key}` must be a table of field = rule")
    return {str(field): _parse_rule(spec, f"{key}.{field}") for field, spec in table.items()}


def _parse_rule(spec: object, key: str) -> Rule:
    if not isinstance(spec, Mapping):
        raise ProcessorConfigError(f'`{key}` must be a table such as {{ header = "Subject" }}')
    kinds = [kind for kind in _RULE_KINDS if kind in spec]
    if len(kinds) != 1:
        raise ProcessorConfigError(f"`{key}` needs exactly one of {', '.join(_RULE_KINDS)}")
    kind = kinds[0]
    for option in spec:
        if option != kind and option not in _RULE_OPTIONS.get(kind, set()):
            raise ProcessorConfigError(f"`{key}.{option}`: unknown key for a {kind} rule")
    value = spec[kind]
    if not isinstance(value, str) or not value:
        raise ProcessorConfigError(f"`{key}.{kind}` must be a non-empty string")
    if kind == "attachment":
        return AttachmentRule(_choice(value, ATTACHMENT_PARTS, f"{key}.{kind}"))
    if kind == "address":
        return AddressRule(_choice(value, ADDRESS_PARTS, f"{key}.{kind}"))
    value_type = _choice(spec.get("type", "string"), VALUE_TYPES, f"{key}.type")
    decimal = _choice(spec.get("decimal", "."), DECIMAL_MARKS, f"{key}.decimal")
    if kind == "header":
        return HeaderRule(value, value_type, decimal)
    try:
        pattern = regex.compile(value)
    except regex.error as exc:
        raise ProcessorConfigError(f"`{key}.regex` does not compile: {exc}") from exc
    if "value" not in pattern.groupindex:
        raise ProcessorConfigError(f"`{key}.regex` needs a named group (?P<value>…)")
    source = _choice(spec.get("in", "text"), REGEX_SOURCES, f"{key}.in")
    return RegexRule(pattern, source, value_type, decimal)


def _choice(value: object, allowed: tuple[str, ...], key: str) -> str:
    if value not in allowed:
        raise ProcessorConfigError(f"`{key}` must be one of {', '.join(allowed)}, not {value!r}")
    return str(value)


class BuiltinBackend:
    """Rules plus the schema: `await extract(message)` is the validated result.

    `reads`: what of a stored message the rules need (pipeline/extraction/messages.py):
    attachment bytes only for a regex over attachments, the raw header block only
    for header rules, else the fields ingest stored."""

    def __init__(
        self,
        rules: Mapping[str, Rule],
        schema: ResultSchema,
        *,
        rule_timeout_s: float = RULE_TIMEOUT_S,
    ) -> None:
        self.rules = dict(rules)
        self.schema = schema
        self.rule_timeout_s = rule_timeout_s
        self.reads = reads_of(self.rules)

    async def extract(self, message: MessageData) -> dict[str, Any]:
        """The fields the rules find, validated; ExtractionTerminal when they do not
        validate, a value does not convert or a rule runs out of time. Never
        retryable: nothing here can go better on a second try. Runs in a worker
        thread (module docstring); cancellation waits for the message under way."""
        return await anyio.to_thread.run_sync(self.extract_blocking, message)

    def extract_blocking(self, message: MessageData) -> dict[str, Any]:
        """`extract` in the caller's thread, which must not be the event loop's: a
        locked round runs all its messages' rules in one worker thread with it."""
        fields = extract_fields(message, self.rules, rule_timeout_s=self.rule_timeout_s)
        return self.schema.validate_result(fields)


def reads_of(rules: Mapping[str, Rule]) -> Reads:
    """How much of a stored message `rules` read (BuiltinBackend.reads)."""
    kinds = list(rules.values())
    if any(isinstance(r, RegexRule) and r.source == "attachments" for r in kinds):
        return Reads.PARSED
    if any(isinstance(r, HeaderRule) for r in kinds):
        return Reads.RAW
    return Reads.ROW


def extract_fields(
    message: MessageData, rules: Mapping[str, Rule], *, rule_timeout_s: float = RULE_TIMEOUT_S
) -> dict[str, Any]:
    """Field → value for every rule that found something (not validated). Blocks
    for up to `rule_timeout_s` per regex rule: call it off the event loop."""
    reader = _Reader(message, rule_timeout_s)
    result: dict[str, Any] = {}
    for field, rule in rules.items():
        value = reader.apply(field, rule)
        if value is not None:
            result[field] = value
    return result


class _Reader:
    """One message's texts, each computed at most once per extraction."""

    def __init__(self, message: MessageData, rule_timeout_s: float) -> None:
        self.message = message
        self.rule_timeout_s = rule_timeout_s
        self._headers: Message | None = None
        self._html_text: str | None = None
        self._attachment_texts: list[str] | None = None

    def apply(self, field: str, rule: Rule) -> Any:
        if isinstance(rule, AttachmentRule):
            return self._attachments(rule.part)
        if isinstance(rule, AddressRule):
            return self._address(rule.part)
        if isinstance(rule, HeaderRule):
            text = self._header(rule.name)
        else:
            text = self._search(field, rule)
        if text is None or not text.strip():
            return None
        return convert(text, rule.type, rule.decimal, field)

    def _header(self, name: str) -> str | None:
        raw = self.message.raw
        if raw is None:
            parsed = _PARSED_HEADERS.get(name.lower())
            return parsed(self.message) if parsed else None
        if self._headers is None:
            self._headers = _header_block(raw)
        value = raw_header(self._headers, name)
        return None if value is None else header_text(value)

    def _search(self, field: str, rule: RegexRule) -> str | None:
        deadline = time.monotonic() + self.rule_timeout_s
        for text in self._texts(rule.source):
            try:
                # concurrent: the GIL is released while it matches, so the event
                # loop runs on meanwhile; the timeout covers the rule's texts together
                match = rule.pattern.search(
                    text[:SEARCH_MAX_CHARS],
                    concurrent=True,
                    timeout=max(deadline - time.monotonic(), 0.0),
                )
            except TimeoutError as exc:
                raise ExtractionTerminal(
                    f"field {field}: the regex rule over {rule.source} took over"
                    f" {self.rule_timeout_s:g} s (a pattern that backtracks on this mail)"
                ) from exc
            if match is not None and match.group("value") is not None:
                return match.group("value")
        return None

    def _texts(self, source: str) -> list[str]:
        if source == "text":
            return [self.message.text or ""]
        if source == "subject":
            return [self.message.subject]
        if source == "attachment_names":
            return [a.filename for a in self.message.attachments if a.filename]
        if source == "html_text":
            if self._html_text is None:
                self._html_text = html_to_text(self.message.html)
            return [self._html_text]
        if self._attachment_texts is None:
            self._attachment_texts = attachment_texts(self.message)
        return self._attachment_texts

    def _attachments(self, part: str) -> Any:
        attachments = self.message.attachments
        if part == "count":
            return len(attachments)
        if part == "names":
            values = [a.filename for a in attachments if a.filename]
        else:
            values = [a.content_type.split(";")[0].strip().lower() for a in attachments]
        return values or None

    def _address(self, part: str) -> Any:
        if part == "to.emails":
            return [a.email for a in self.message.to if a.email] or None
        sender = self.message.from_
        if sender is None:
            return None
        if part == "from.email":
            return sender.email or None
        if part == "from.name":
            return sender.name.strip() or None
        domain = sender.email.rpartition("@")[2] if "@" in sender.email else ""
        return domain.lower() or None


def attachment_texts(message: MessageData) -> list[str]:
    """Text of every text/* attachment whose bytes are at hand, in message order:
    decoded with the charset its content type names, else UTF-8, else
    windows-1252 (pipeline/mime/charsets.py: never raises); text/html as its visible text."""
    texts: list[str] = []
    for attachment in message.attachments:
        content_type = attachment.content_type.lower()
        if attachment.content is None or not content_type.startswith("text/"):
            continue
        charset = param_8bit(attachment.content_type, "charset")
        text = decode_bytes(attachment.content[: SEARCH_MAX_CHARS * 4], charset)
        if content_type.startswith("text/html"):
            text = html_to_text(text)
        texts.append(text)
    return texts


def convert(text: str, value_type: str, decimal: str = ".", field: str = "value") -> Any:
    """`text` as the rule's type (module docstring); ExtractionTerminal when it is
    not one, naming the field and quoting the text."""
    text = text.strip()
    if value_type == "string":
        return text
    digits = text.translate(_GROUP_MARKS)
    digits = digits.replace("," if decimal == "." else ".", "").replace(decimal, ".")
    quoted = one_line(text, QUOTE_MAX_CHARS)
    if value_type == "integer" and _INTEGER.fullmatch(digits):
        # the length first: int() refuses over 4300 digits (sys.int_info) with ValueError
        if len(digits.lstrip("+-0")) <= _INT64_MAX_DIGITS:
            number = int(digits)
            if JSON_INT_MIN <= number <= JSON_INT_MAX:
                return number
        raise ExtractionTerminal(
            f"field {field}: {quoted!r} is outside the signed 64-bit integer range"
        )
    if value_type == "number" and _NUMBER.fullmatch(digits):
        value = float(digits)
        if math.isfinite(value):
            return value
        raise ExtractionTerminal(f"field {field}: {quoted!r} is too large for a JSON number")
    article = "an" if value_type == "integer" else "a"
    raise ExtractionTerminal(f"field {field}: {quoted!r} is not {article} {value_type}")


def _header_block(raw: bytes) -> Message:
    """The header section of `raw` (up to the first empty line), parsed leniently."""
    head = raw[:HEADER_BLOCK_MAX_BYTES]
    ends = [i for i in (head.find(b"\r\n\r\n"), head.find(b"\n\n")) if i >= 0]
    if ends:
        head = head[: min(ends)]
    return BytesHeaderParser(policy=compat32).parsebytes(head + b"\n\n")


def _address_list(addresses: list[Address]) -> str:
    return ", ".join(f"{a.name} <{a.email}>" if a.name else a.email for a in addresses)
