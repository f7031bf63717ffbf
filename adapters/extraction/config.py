"""One `[[processors]]` table of a tenant file, parsed and checked, and its mail filter.

    [[processors]]
    id = "invoices"
    mailboxes = ["billing"]                 # default: every mailbox of the tenant
    filter = { senders = ["*@vendor.example"], subjects = ["Invoice *"],
               recipients = ["ap@*"], attachment_types = ["application/pdf"] }
    schema = "schemas/invoice.json"          # or an inline table; paths are relative
    schema_version = 2                       #   to the tenant file's folder
    backend = "builtin"                      # or "http"
    concurrency = 4
    [processors.rules]                       # builtin only (adapters/extraction/builtin.py)
    number = { regex = 'Invoice (?P<value>[A-Z0-9-]+)', in = "subject" }

    # http only: url, token = "env:NAME" | "file:/path", schema_id, timeout_s

Choices:
* **Filter patterns are globs** (`fnmatch`: `*`, `?`, `[…]`), matched
  case-insensitively against the whole value: sender address, every To/Cc/Bcc
  address, the subject, every attachment's content type. Globs cannot
  backtrack catastrophically on a hostile subject, and read like the addresses
  they match. Within one list any pattern may match; every list given must
  match (and an empty or absent list matches everything).
* **`mailboxes` takes a message with a copy in any of them.** A stored message
  is one row however many mailboxes it was seen in (docs/architecture.md §3);
  mail that reached a Gmail mailbox first and then `billing` is mail of
  `billing`, so `matches_fields` checks every mailbox the message has a copy in.
* **`schema_version` is an integer ≥ 1**: it is part of the job's unique key
  (pipeline/extraction/claims.py), so it must compare exactly; bump it to
  extract again.
* **The token is stored as its reference** (`env:NAME` or `file:/path`), never
  resolved here: the daemon reveals it when it builds the backend.
* The schema is loaded and checked against its metaschema here, so
  `check-config` reports a bad schema with the processor and key. Unknown keys
  are errors, never ignored.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from yarl import URL

from inboxd.adapters.extraction.builtin import Rule, parse_rules
from inboxd.adapters.extraction.errors import ProcessorConfigError
from inboxd.adapters.extraction.schema import ResultSchema, compile_schema, load_schema
from inboxd.pipeline.extraction.inbox import FilterFields
from inboxd.pipeline.message import MessageData

BACKENDS = ("builtin", "http")
#: Workers of one processor: default and bounds (64: beyond that a parse API's own
#: rate limit, not our parallelism, decides; the issue's bound).
DEFAULT_CONCURRENCY = 4
MAX_CONCURRENCY = 64
#: Total deadline of one http call, seconds: default (a parse API answers one mail in
#: seconds; 30 s leaves room for OCR of an attachment) and largest accepted (past the
#: claim protocol's lease a job would be reclaimed under a worker still waiting).
DEFAULT_TIMEOUT_S = 30.0
MAX_TIMEOUT_S = 300.0
FILTER_KEYS = ("senders", "recipients", "subjects", "attachment_types")
_COMMON_KEYS = {"id", "mailboxes", "filter", "schema", "schema_version", "backend", "concurrency"}
_BACKEND_KEYS = {"builtin": {"rules"}, "http": {"url", "token", "schema_id", "timeout_s"}}
_SECRET_REFERENCE = re.compile(r"env:[A-Za-z_][A-Za-z0-9_]*|file:/.+")
# A host as it goes on the wire (yarl gives IDNA names as xn--…): DNS labels
# (RFC 1123 §2.1) or an IPv4 address; an IPv6 literal is checked by `ipaddress`.
_HOST = re.compile(r"[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.?")


@dataclass(frozen=True, slots=True)
class MailFilter:
    """Lower-cased glob lists; an empty list matches everything."""

    senders: tuple[str, ...] = ()
    recipients: tuple[str, ...] = ()
    subjects: tuple[str, ...] = ()
    attachment_types: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ProcessorConfig:
    """A checked `[[processors]]` table; `mailboxes` None means every mailbox."""

    id: str
    schema: ResultSchema
    schema_version: int
    backend: str
    mailboxes: tuple[str, ...] | None = None
    filter: MailFilter = field(default_factory=MailFilter)
    concurrency: int = DEFAULT_CONCURRENCY
    rules: Mapping[str, Rule] = field(default_factory=dict)
    url: str | None = None
    token: str | None = None  # the secret *reference*, e.g. "env:PARSER_TOKEN"
    schema_id: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S


def parse_processor(table: Mapping[str, Any], base_dir: Path) -> ProcessorConfig:
    """`table` as tomllib gives it → ProcessorConfig; ProcessorConfigError names
    the processor and the key. `base_dir` anchors a relative schema path."""
    processor_id = table.get("id")
    if not isinstance(processor_id, str) or not processor_id.strip():
        raise ProcessorConfigError("processor: `id` must be a non-empty string")
    try:
        return _parse(table, processor_id, base_dir)
    except ProcessorConfigError as exc:
        raise ProcessorConfigError(f"processor {processor_id!r}: {exc}") from exc


def _parse(table: Mapping[str, Any], processor_id: str, base_dir: Path) -> ProcessorConfig:
    backend = table.get("backend")
    if backend not in BACKENDS:
        raise ProcessorConfigError(f"`backend` must be one of {', '.join(BACKENDS)}")
    for key in table:
        if key in _COMMON_KEYS or key in _BACKEND_KEYS[backend]:
            continue
        other = [name for name, keys in _BACKEND_KEYS.items() if key in keys]
        if other:
            raise ProcessorConfigError(f"`{key}` is only for backend = {other[0]!r}")
        raise ProcessorConfigError(f"`{key}`: unknown key")
    if "schema" not in table:
        raise ProcessorConfigError("`schema` is required (a JSON file path or an inline table)")
    schema = compile_schema(load_schema(table["schema"], base_dir))
    version = table.get("schema_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ProcessorConfigError("`schema_version` must be an integer ≥ 1")
    concurrency = table.get("concurrency", DEFAULT_CONCURRENCY)
    if isinstance(concurrency, bool) or not isinstance(concurrency, int):
        raise ProcessorConfigError(f"`concurrency` must be an integer 1..{MAX_CONCURRENCY}")
    if not 1 <= concurrency <= MAX_CONCURRENCY:
        raise ProcessorConfigError(f"`concurrency` must be an integer 1..{MAX_CONCURRENCY}")
    common: dict[str, Any] = {
        "id": processor_id,
        "schema": schema,
        "schema_version": version,
        "backend": backend,
        "mailboxes": _mailboxes(table.get("mailboxes")),
        "filter": _filter(table.get("filter", {})),
        "concurrency": concurrency,
    }
    if backend == "builtin":
        rules = parse_rules(table.get("rules"))
        allowed = schema.property_names
        for name in rules:
            if allowed is not None and name not in allowed:
                raise ProcessorConfigError(
                    f"`rules.{name}`: the schema allows no property {name!r}"
                )
        return ProcessorConfig(**common, rules=rules)
    return ProcessorConfig(**common, **_http(table))


def _http(table: Mapping[str, Any]) -> dict[str, Any]:
    url = table.get("url")
    _check_url(url)
    token = table.get("token")
    if not isinstance(token, str) or not _SECRET_REFERENCE.fullmatch(token):
        # Never echo the value: a pasted token must not land in logs.
        raise ProcessorConfigError("`token` must be a secret reference: env:NAME or file:/path")
    schema_id = table.get("schema_id")
    if schema_id is not None and (not isinstance(schema_id, str) or not schema_id):
        raise ProcessorConfigError("`schema_id` must be a non-empty string")
    timeout_s = table.get("timeout_s", DEFAULT_TIMEOUT_S)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float):
        raise ProcessorConfigError(
            f"`timeout_s` must be a number of seconds in (0, {MAX_TIMEOUT_S:g}]"
        )
    if not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise ProcessorConfigError(
            f"`timeout_s` must be a number of seconds in (0, {MAX_TIMEOUT_S:g}]"
        )
    return {"url": url, "token": token, "schema_id": schema_id, "timeout_s": float(timeout_s)}


def _check_url(url: object) -> None:
    """ProcessorConfigError unless `url` is an http(s) URL with a host, a port in
    range and no user or password. The URL is never echoed: it may hold a secret."""
    if not isinstance(url, str):
        raise ProcessorConfigError("`url` must be an http:// or https:// URL")
    try:
        parsed = URL(url)
        port = parsed.port  # yarl checks the range (0-65535) only when asked
    except ValueError as exc:  # no host, a port out of range, a bad IPv6 literal
        raise ProcessorConfigError(f"`url` is not a valid URL: {exc}") from exc
    if parsed.scheme not in ("http", "https") or not parsed.raw_host:
        raise ProcessorConfigError("`url` must be an http:// or https:// URL with a host")
    if not port or not _valid_host(parsed.raw_host):
        raise ProcessorConfigError("`url` has an invalid host or port")
    if any(c.isspace() or not c.isprintable() for c in url):
        raise ProcessorConfigError("`url` must not contain spaces or control characters")
    if parsed.user is not None or parsed.password is not None:
        # a password in the tenant file is a literal secret; the token is the credential
        raise ProcessorConfigError(
            "`url` must not hold a user or password: put the credential in `token` "
            "(env:NAME or file:/path)"
        )


def _valid_host(host: str) -> bool:
    if ":" not in host:
        return _HOST.fullmatch(host) is not None
    try:
        ipaddress.IPv6Address(host)  # a zone (fe80::1%eth0) is accepted too
    except ValueError:
        return False
    return True


def _mailboxes(value: object) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise ProcessorConfigError("`mailboxes` must be a non-empty list of mailbox ids")
    return tuple(value)


def _filter(value: object) -> MailFilter:
    if not isinstance(value, Mapping):
        raise ProcessorConfigError("`filter` must be a table")
    lists: dict[str, tuple[str, ...]] = {}
    for key, patterns in value.items():
        if key not in FILTER_KEYS:
            raise ProcessorConfigError(f"`filter.{key}`: unknown key")
        if not isinstance(patterns, list) or not all(isinstance(p, str) and p for p in patterns):
            raise ProcessorConfigError(f"`filter.{key}` must be a list of glob patterns")
        lists[key] = tuple(p.lower() for p in patterns)
    return MailFilter(**lists)


def matches(processor: ProcessorConfig, message: MessageData, mailbox_id: str) -> bool:
    """True when `processor` takes `message`, which arrived in `mailbox_id`
    (module docstring: globs, any within a list, every list)."""
    recipients = [a.email for a in (*message.to, *message.cc, *message.bcc) if a.email]
    return _matches(
        processor,
        (mailbox_id,),
        message.from_.email if message.from_ else "",
        recipients,
        message.subject,
        [a.content_type for a in message.attachments],
    )


def matches_fields(processor: ProcessorConfig, fields: FilterFields) -> bool:
    """`matches` for a stored message, by what the database holds of it
    (pipeline/extraction/inbox.py `load_filter_fields`); `mailboxes` takes it
    when any mailbox it has a copy in is listed (module docstring)."""
    return _matches(
        processor,
        fields.mailbox_ids,
        fields.sender,
        list(fields.recipients),
        fields.subject,
        list(fields.attachment_types),
    )


def _matches(
    processor: ProcessorConfig,
    mailbox_ids: tuple[str, ...],
    sender: str,
    recipients: list[str],
    subject: str,
    content_types: list[str],
) -> bool:
    if processor.mailboxes is not None and not any(m in processor.mailboxes for m in mailbox_ids):
        return False
    rules = processor.filter
    types = [t.split(";")[0].strip() for t in content_types]
    return (
        _any(rules.senders, [sender])
        and _any(rules.recipients, recipients)
        and _any(rules.subjects, [subject])
        and _any(rules.attachment_types, types)
    )


def _any(patterns: tuple[str, ...], values: list[str]) -> bool:
    if not patterns:
        return True
    return any(fnmatchcase(value.lower(), p) for value in values for p in patterns)
