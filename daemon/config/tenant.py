"""Tenant files: one TOML file per tenant in `[tenants] dir`, parsed into `TenantConfig`.

A tenant file holds the tenant's `id`, `name` and `api_token`, its `[[mailboxes]]`
(`MailboxConfig`), its `[gmail]` and `[outlook]` tables (the app credentials and
push settings its Gmail or Outlook mailboxes share), and its `[[delivery_sources]]`
and `[[processors]]`, kept as written for the modules that implement them.
`parse_tenant_files` reads a list of files, then checks ids across them: tenant
ids are unique across files, mailbox ids across all tenants; the first file (by
name) keeps an id.

Mailbox providers: `maildir`, `gmail`, `outlook` and `ses` have their keys
checked strictly (gmail's and outlook's by their adapter's config.py, through
daemon/config/provider_tables.py, ses's by adapters/ses/config.py, so that check-config
names the file and key; no two ses mailboxes may route one address or @domain);
`imap`'s by adapters/imap/config.py, its secrets wrapped first.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, cast

from inboxd.adapters.extraction.config import ProcessorConfig
from inboxd.daemon.config.mailbox_settings import (
    GENERIC_MAILBOX_KEYS,
    imap_settings,
    maildir_settings,
    ses_settings,
)
from inboxd.daemon.config.provider_tables import TABLE_DOORS, parse_tables, table_mailbox
from inboxd.daemon.config.reader import (
    ConfigProblem,
    Options,
    Reader,
    describe,
    join_key,
)
from inboxd.daemon.config.secrets import Secret
from inboxd.daemon.config.tenant_tables import parse_processors, parse_raw_tables
from inboxd.pipeline.mailbox.scheduling import SyncMode

__all__ = [
    "PROVIDERS",
    "QUEUE_PROVIDERS",
    "RUNNABLE_PROVIDERS",
    "SYNC_MODES",
    "MailboxConfig",
    "TenantConfig",
    "TenantSet",
    "parse_tenant_files",
]

PROVIDERS = ("maildir", "gmail", "outlook", "imap", "ses")
RUNNABLE_PROVIDERS = frozenset({"maildir", "gmail", "outlook", "ses", "imap"})
# Mailboxes fed by a queue poller ([ses] in the main file), not by a sync runner.
QUEUE_PROVIDERS = frozenset({"ses"})
SYNC_MODES = ("push", "poll", "auto")
# A Maildir has no push channel of its own: "auto" watches new/ and also rescans
# every poll_interval_s (a missed inotify event or an NFS mount costs one interval).
_PROVIDER_SYNC_MODES: dict[str, tuple[str, ...]] = {"maildir": ("poll", "auto")}
DEFAULT_SYNC_MODE: SyncMode = "auto"
DEFAULT_POLL_INTERVAL_S = 60.0
# Local directory: a rescan is a readdir, cheap enough to do every 2 s.
_PROVIDER_POLL_INTERVAL_S: dict[str, float] = {"maildir": 2.0}

_TENANT_KEYS = (
    "id",
    "name",
    "api_token",
    "gmail",
    "outlook",
    "mailboxes",
    "delivery_sources",
    "processors",
)
_MAILDIR_KEYS = ("path",)


# A provider key this close to a generic mailbox key is taken for a typo of it
# ("sync_mdoe", "poll_interval"): provider keys are free-form until their adapter
# parses them, but a misspelt generic key would otherwise be silently ignored.
_TYPO_CUTOFF = 0.85


@dataclass(frozen=True)
class MailboxConfig:
    """One `[[mailboxes]]` entry of a tenant file.

    `settings` holds the provider's own keys, read-only: for `maildir` exactly
    `{"path": Path}` (absolute); for other providers the keys as written, with every
    credential turned into a `Secret`. `tenant_settings` is the tenant's table of
    the provider (`[gmail]`, `[outlook]`, secrets wrapped; else empty): part
    of the mailbox's identity, so a SIGHUP that changes it restarts the runner.
    """

    tenant_id: str
    mailbox_id: str
    provider: str
    address: str = ""
    sync_mode: SyncMode = DEFAULT_SYNC_MODE
    poll_interval_s: float = DEFAULT_POLL_INTERVAL_S
    settings: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), hash=False)
    tenant_settings: Mapping[str, Any] = field(
        default_factory=lambda: MappingProxyType({}), hash=False
    )

    @property
    def runnable(self) -> bool:
        """True when this version of inboxd has a door for the provider."""
        return self.provider in RUNNABLE_PROVIDERS


@dataclass(frozen=True)
class TenantConfig:
    """One tenant file. `api_token` is the bearer token of the tenant's HTTP API
    (`/v1/…`); None disables that API for the tenant. `delivery_sources` are kept
    as written (read-only, secrets as `Secret`) for daemon/webhooks; only `id` and
    `provider` are checked here. `processors` are checked whole (adapters.extraction;
    an http token stays its reference, revealed when the stage builds the backend).
    `provider_tables` holds the tables doors share (`[gmail]`, `[outlook]`), validated,
    secrets as `Secret`, by provider name; `gmail`/`outlook` read one (None when absent)."""

    tenant_id: str
    name: str
    source_file: Path
    api_token: Secret | None = None
    provider_tables: Mapping[str, Mapping[str, Any]] = field(
        default_factory=lambda: MappingProxyType({}), hash=False
    )
    mailboxes: tuple[MailboxConfig, ...] = ()
    delivery_sources: tuple[Mapping[str, Any], ...] = field(default=(), hash=False)
    processors: tuple[ProcessorConfig, ...] = field(default=(), hash=False)

    @property
    def gmail(self) -> Mapping[str, Any] | None:
        return self.provider_tables.get("gmail")

    @property
    def outlook(self) -> Mapping[str, Any] | None:
        return self.provider_tables.get("outlook")


@dataclass(frozen=True, eq=False)
class TenantSet:
    """The tenants of a tenants directory: those whose file is valid, and the problems.

    A file with any problem contributes no tenant; its problems say why.
    """

    tenants: dict[str, TenantConfig]
    problems: list[ConfigProblem]
    files: tuple[Path, ...] = ()

    @property
    def problems_by_file(self) -> dict[Path, list[ConfigProblem]]:
        """Problems grouped by file, in file order."""
        grouped: dict[Path, list[ConfigProblem]] = {}
        for problem in self.problems:
            grouped.setdefault(problem.file, []).append(problem)
        return grouped

    @property
    def mailboxes(self) -> tuple[MailboxConfig, ...]:
        """Every mailbox of every loaded tenant."""
        return tuple(m for t in self.tenants.values() for m in t.mailboxes)


def parse_tenant_files(files: list[Path], options: Options) -> TenantSet:
    """Parse every file, then check ids across them (`load_tenants` lists the files).

    Never raises for a bad file: its problems go to `TenantSet.problems` and its tenant
    is left out, as is the later file (by name) of a duplicate tenant or mailbox id.
    """
    parsed = [_parse_tenant_file(path, options) for path in files]
    _check_unique_ids(parsed)
    _check_unique_routes(parsed)
    tenants = {
        p.tenant.tenant_id: p.tenant
        for p in parsed
        if p.tenant is not None and not p.reader.problems
    }
    problems = [problem for p in parsed for problem in p.reader.problems]
    return TenantSet(tenants, problems, tuple(files))


# --- tenant files ------------------------------------------------------------------------


@dataclass
class _TenantFile:
    reader: Reader
    tenant: TenantConfig | None = None
    tenant_id: str | None = None
    # (key, mailbox id) of every mailbox with a valid id, whatever else is wrong
    mailbox_ids: list[tuple[str, str]] = field(default_factory=list)
    # (key, address or @domain) of every ses mailbox's routing entry
    ses_routes: list[tuple[str, str]] = field(default_factory=list)


def _parse_tenant_file(path: Path, options: Options) -> _TenantFile:
    r = Reader(path, options)
    result = _TenantFile(r)
    raw = r.read_toml()
    if raw is None:
        return result
    r.unknown_keys(raw, _TENANT_KEYS, "")
    tenant_id = r.ident(raw, "id", "", kind="tenant")
    result.tenant_id = tenant_id
    name = r.string(raw, "name", "", default=tenant_id or "") or ""
    api_token = r.secret(raw["api_token"], "api_token") if "api_token" in raw else None
    tables = parse_tables(r, raw)
    mailboxes = []
    for key, table in r.tables(raw, "mailboxes"):
        mailbox_id, mailbox = _parse_mailbox(r, table, key, tenant_id or "", path.parent, tables)
        if mailbox_id is not None:
            result.mailbox_ids.append((f"{key}.id", mailbox_id))
        if mailbox is not None:
            mailboxes.append(mailbox)
            if mailbox.provider == "ses":
                for entry in mailbox.settings.get("addresses", ()):
                    result.ses_routes.append((f"{key}.addresses", entry))
    delivery_sources = parse_raw_tables(r, raw, "delivery_sources", "delivery source")
    known_mailboxes = {mailbox_id for _, mailbox_id in result.mailbox_ids}
    processors = parse_processors(r, raw, path.parent, known_mailboxes)
    if tenant_id is not None:
        result.tenant = TenantConfig(
            tenant_id=tenant_id,
            name=name,
            source_file=path,
            api_token=api_token,
            provider_tables=MappingProxyType(tables),
            mailboxes=tuple(mailboxes),
            delivery_sources=delivery_sources,
            processors=processors,
        )
    return result


def _parse_mailbox(
    r: Reader,
    table: dict[str, Any],
    prefix: str,
    tenant_id: str,
    base: Path,
    tables: Mapping[str, Mapping[str, Any]],
) -> tuple[str | None, MailboxConfig | None]:
    """The mailbox id (None if invalid) and the mailbox (None when its id or provider
    is unusable); problems recorded."""
    mailbox_id = r.ident(table, "id", prefix, kind="mailbox")
    provider = r.choice(table, "provider", prefix, PROVIDERS, None, required=True)
    address = r.string(table, "address", prefix, default="") or ""
    if address and "@" not in address:
        r.problem(
            join_key(prefix, "address"), f"expected an email address, got {describe(address)}"
        )
    modes = _PROVIDER_SYNC_MODES.get(provider or "", SYNC_MODES)
    sync_mode = r.choice(
        table,
        "sync_mode",
        prefix,
        modes,
        DEFAULT_SYNC_MODE,
        context=(f' for provider "{provider}"' if provider in _PROVIDER_SYNC_MODES else ""),
    )
    poll_interval_s = r.number(
        table,
        "poll_interval_s",
        prefix,
        _PROVIDER_POLL_INTERVAL_S.get(provider or "", DEFAULT_POLL_INTERVAL_S),
    )
    extra = {k: v for k, v in table.items() if k not in GENERIC_MAILBOX_KEYS}
    settings: Mapping[str, Any]
    tenant_settings: Mapping[str, Any] = MappingProxyType({})
    if provider == "maildir":
        r.unknown_keys(
            extra, GENERIC_MAILBOX_KEYS + _MAILDIR_KEYS, prefix, what='key for provider "maildir"'
        )
        settings = MappingProxyType(maildir_settings(r, table, prefix, base))
    elif provider == "ses":
        settings = ses_settings(r, extra, prefix)
    elif provider == "imap":
        settings = imap_settings(r, extra, prefix)
    elif provider in TABLE_DOORS:
        shared = tables.get(provider)
        door = TABLE_DOORS[provider]
        settings = table_mailbox(r, door, extra, prefix, address, shared, GENERIC_MAILBOX_KEYS)
        tenant_settings = shared if shared is not None else tenant_settings
    else:
        for key in extra:
            typo = difflib.get_close_matches(key, GENERIC_MAILBOX_KEYS, n=1, cutoff=_TYPO_CUTOFF)
            if typo:
                r.problem(join_key(prefix, key), f'unknown key; did you mean "{typo[0]}"?')
        settings = r.freeze(extra, prefix)
    if mailbox_id is None or provider is None:
        return mailbox_id, None
    return mailbox_id, MailboxConfig(
        tenant_id=tenant_id,
        mailbox_id=mailbox_id,
        provider=provider,
        address=address,
        sync_mode=cast(SyncMode, sync_mode or DEFAULT_SYNC_MODE),  # one of SYNC_MODES
        poll_interval_s=poll_interval_s,
        settings=settings,
        tenant_settings=tenant_settings,
    )


def _check_unique_routes(files: list[_TenantFile]) -> None:
    """No two ses mailboxes claim one address or @domain: a message for it would have
    two owners. The first file (by name) keeps it; the later claim is the problem."""
    owner: dict[str, tuple[Path, str, str]] = {}
    for parsed in files:
        r = parsed.reader
        for key, entry in parsed.ses_routes:
            first = owner.setdefault(entry, (r.file, parsed.tenant_id or "?", key))
            if first == (r.file, parsed.tenant_id or "?", key):
                continue
            where = (
                f"{first[2]} of this file"
                if first[0] == r.file
                else f'tenant "{first[1]}" ({first[0]}: {first[2]})'
            )
            r.problem(key, f'"{entry}" is already routed to another ses mailbox: {where}')


def _check_unique_ids(files: list[_TenantFile]) -> None:
    """Tenant ids are unique across files, mailbox ids across all tenants; the first file
    (by name) keeps an id, later ones get the problem."""
    tenant_owner: dict[str, Path] = {}
    mailbox_owner: dict[str, tuple[Path, str, str]] = {}
    for parsed in files:
        r = parsed.reader
        if parsed.tenant_id is not None:
            owner = tenant_owner.setdefault(parsed.tenant_id, r.file)
            if owner != r.file:
                r.problem(
                    "id", f'duplicate tenant id "{parsed.tenant_id}": already defined in {owner}'
                )
        for key, mailbox_id in parsed.mailbox_ids:
            claim = (r.file, parsed.tenant_id or "?", key)
            owner_file, owner_tenant, owner_key = mailbox_owner.setdefault(mailbox_id, claim)
            if (owner_file, owner_key) == (r.file, key):
                continue
            where = (
                f"{owner_key} of this file"
                if owner_file == r.file
                else f'tenant "{owner_tenant}" ({owner_file}: {owner_key})'
            )
            r.problem(
                key,
                f'duplicate mailbox id "{mailbox_id}": already used by {where}; '
                "mailbox ids are unique across all tenants",
            )
