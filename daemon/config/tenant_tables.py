"""A tenant file's tables beside its mailboxes: `[[delivery_sources]]` (kept as
written, secrets wrapped, for daemon/webhooks) and `[[processors]]` (checked whole by
adapters/extraction, kept as written)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from inboxd.adapters.extraction.config import ProcessorConfig, parse_processor
from inboxd.adapters.extraction.errors import ProcessorConfigError
from inboxd.daemon.config.reader import Reader

__all__ = ["parse_processors", "parse_raw_tables"]


def parse_raw_tables(
    r: Reader,
    raw: dict[str, Any],
    name: str,
    kind: str,
) -> tuple[Mapping[str, Any], ...]:
    """`[[delivery_sources]]`: tables with a unique `id` and a `provider`; everything
    else kept as written (secrets checked and wrapped)."""
    out: list[Mapping[str, Any]] = []
    seen: dict[str, str] = {}
    for key, table in r.tables(raw, name):
        ident = r.ident(table, "id", key, kind=kind)
        r.string(table, "provider", key, required=True, nonempty=True)
        if ident is not None:
            if ident in seen:
                r.problem(f"{key}.id", f'duplicate {kind} id "{ident}" (also {seen[ident]})')
            else:
                seen[ident] = key
        out.append(r.freeze(table, key))
    return tuple(out)


def parse_processors(
    r: Reader, raw: dict[str, Any], base: Path, mailboxes: set[str]
) -> tuple[ProcessorConfig, ...]:
    """`[[processors]]`: each checked whole by adapters.extraction (backend keys, the
    schema against its metaschema, builtin rules against the schema, the http token a
    secret reference, kept as the reference), its `mailboxes` among this tenant's."""
    out: list[ProcessorConfig] = []
    seen: dict[str, str] = {}
    for key, table in r.tables(raw, "processors"):
        ident = r.ident(table, "id", key, kind="processor")
        if ident is not None:
            if ident in seen:
                r.problem(f"{key}.id", f'duplicate processor id "{ident}" (also {seen[ident]})')
            else:
                seen[ident] = key
        try:
            processor = parse_processor(table, base)
        except ProcessorConfigError as exc:
            r.problem(key, str(exc))
        else:
            unknown = sorted(set(processor.mailboxes or ()) - mailboxes)
            if unknown:
                r.problem(f"{key}.mailboxes", f"no mailbox {', '.join(unknown)} in this tenant")
            elif processor.token is None or r.secret(processor.token, f"{key}.token"):
                out.append(processor)
    return tuple(out)
