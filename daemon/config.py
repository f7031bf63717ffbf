"""The configuration of `inboxd run`: one main TOML file plus one TOML file per tenant.

    config.toml                      MainConfig   (load_main)
      [tenants] dir = "tenants"  ──▶ tenants/*.toml, one tenant each
                                     TenantConfig + MailboxConfig (load_tenants)

Every relative path is relative to the directory of the file that contains it:
`[tenants] dir` and `[object_store] path` to the main file's, a Maildir `path`
to the tenant file's. config.example.toml documents every key and its default.

Validation collects problems instead of stopping at the first one, so an
operator fixes everything in one round. A `ConfigProblem` names the file and
the key (`mailboxes[0].poll_interval_s`) and renders as

    /etc/inboxd/tenants/acme.toml: mailboxes[0].poll_interval_s: expected a number, got "abc"

Checked: TOML syntax (with line and column), unknown keys (with the closest
known key), types and ranges, missing required keys, ids (the rule of
`pipeline.tenancy.validate_id`), duplicate tenant ids across files, duplicate
mailbox ids across all tenants (a mailbox id names one mailbox to the CLI,
`inboxd sync now --mailbox M`), and secrets. Credentials are secret references
(`daemon.secrets`): `api_token`, and in mailboxes, delivery sources and
processors every key that `secrets.is_secret_key` recognises (`password`,
`token`, `client_secret`, `refresh_token`, `credentials`, `*_secret`, ...).
A literal there is a problem whose message does not contain the literal. With
`check_secrets=True` (what `inboxd check-config` does) each reference is also
resolved, to report unset variables and missing files; values are discarded.

Tenant files are independent: `load_tenants` returns the tenants whose file is
valid and the problems of the others (`TenantSet.problems_by_file`), so a
SIGHUP reload can keep running a broken file's previous config. Caveat: when a
file cannot be parsed at all, its mailbox ids are unknown, so another file
claiming one of them is not reported as a duplicate until the first is fixed.

Mailbox providers: only `maildir` can run today, and its keys are checked
strictly; `gmail`, `outlook`, `imap` and `ses` get their generic keys checked,
their secrets checked, and their other keys kept as they are (`settings`) for
their adapter's own config.py to parse.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime, time
from pathlib import Path
from types import MappingProxyType
from typing import Any

from inboxd.daemon.database import ENV_DSN, dsn_has_password, mask_dsn
from inboxd.daemon.embedded_pg import default_data_dir
from inboxd.daemon.logging import LOG_LEVELS
from inboxd.daemon.secrets import (
    USE_A_REFERENCE,
    Secret,
    SecretError,
    is_secret_key,
    secret_ref_error,
)
from inboxd.pipeline import errors
from inboxd.pipeline.tenancy import validate_id

__all__ = [
    "PROVIDERS",
    "RUNNABLE_PROVIDERS",
    "SYNC_MODES",
    "ConfigError",
    "ConfigProblem",
    "ConfigReport",
    "MailboxConfig",
    "MainConfig",
    "TenantConfig",
    "TenantSet",
    "check_config",
    "inspect_config",
    "load_main",
    "load_tenants",
]

PROVIDERS = ("maildir", "gmail", "outlook", "imap", "ses")
RUNNABLE_PROVIDERS = frozenset({"maildir"})
SYNC_MODES = ("push", "poll", "auto")
# A Maildir has no push channel of its own: "auto" watches new/ and also rescans
# every poll_interval_s (a missed inotify event or an NFS mount costs one interval).
_PROVIDER_SYNC_MODES: dict[str, tuple[str, ...]] = {"maildir": ("poll", "auto")}
DEFAULT_SYNC_MODE = "auto"
DEFAULT_POLL_INTERVAL_S = 60.0
# Local directory: a rescan is a readdir, cheap enough to do every 2 s.
_PROVIDER_POLL_INTERVAL_S: dict[str, float] = {"maildir": 2.0}

DEFAULT_TENANTS_DIR = "tenants"
OBJECTS_DIR = "objects"  # under the data directory, as `inboxd import` does

# Main file: section -> its keys. ([object_store] depends on its kind, see below.)
_MAIN_SECTIONS: dict[str, tuple[str, ...]] = {
    "database": ("dsn",),
    "listener": ("host", "port", "max_body_bytes"),
    "object_store": ("kind", "path", "bucket", "prefix", "endpoint_url", "region"),
    "queue": ("capacity",),
    "workers": ("ingest", "batch_size"),
    "shutdown": ("deadline_s",),
    "sync": ("lease_ttl_s", "poll_scan_interval_s", "push_quiet_after_s"),
    "tenants": ("dir",),
    "log": ("level",),
}
# Same keys as adapters/objectstore/config.py accepts, per kind.
_OBJECT_STORE_KEYS: dict[str, tuple[str, ...]] = {
    "local": ("kind", "path"),
    "s3": ("kind", "bucket", "prefix", "endpoint_url", "region"),
}
_TENANT_KEYS = ("id", "name", "api_token", "mailboxes", "delivery_sources", "processors")
_MAILBOX_KEYS = ("id", "provider", "address", "sync_mode", "poll_interval_s")
_MAILDIR_KEYS = ("path",)
# A provider key this close to a generic mailbox key is taken for a typo of it
# ("sync_mdoe", "poll_interval"): provider keys are free-form until their adapter
# parses them, but a misspelt generic key would otherwise be silently ignored.
_TYPO_CUTOFF = 0.85
_DESCRIBE_MAX_CHARS = 40
_TOML_POSITION = re.compile(r"\s*\(at (line \d+, column \d+|end of document)\)$")


# --- results -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with one file. `key` is a path like `listener.port` or
    `mailboxes[0].id`, or a position like `line 3, column 7`, or "" for the whole file."""

    file: Path
    key: str
    message: str

    def __str__(self) -> str:
        if self.key:
            return f"{self.file}: {self.key}: {self.message}"
        return f"{self.file}: {self.message}"


class ConfigError(errors.ConfigError):
    """The configuration cannot be used; `problems` lists everything found.

    `str()` is every problem, one per line.
    """

    def __init__(self, problems: Sequence[ConfigProblem]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(map(str, self.problems)) or "invalid configuration")


def _default_object_store() -> dict[str, Any]:
    return {"kind": "local", "path": str(default_data_dir(os.environ) / OBJECTS_DIR)}


@dataclass(frozen=True, kw_only=True)
class MainConfig:
    """The main config file, parsed. Defaults are the values used when a key is absent.

    `database_dsn` is the raw `[database] dsn` (maybe `env:`/`file:`); the DSN to
    connect to is `database.resolve_dsn(cli_dsn, main.raw)`, which also honours
    `--dsn` and `INBOXD_DSN`. `object_store` is a mapping for
    `adapters.objectstore.open_object_store`, with a local `path` made absolute.
    """

    config_path: Path
    tenants_dir: Path
    database_dsn: str | None = field(default=None, repr=False)
    listen_host: str = "127.0.0.1"
    listen_port: int = 8025
    max_body_bytes: int = 262_144
    object_store: dict[str, Any] = field(default_factory=_default_object_store, hash=False)
    queue_capacity: int = 2000
    ingest_workers: int = 2
    batch_size: int = 500
    shutdown_deadline_s: float = 30.0
    lease_ttl_s: float = 60.0
    poll_scan_interval_s: float = 5.0
    push_quiet_after_s: float = 900.0
    log_level: str = "info"
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False, hash=False)


@dataclass(frozen=True)
class MailboxConfig:
    """One `[[mailboxes]]` entry of a tenant file.

    `settings` holds the provider's own keys, read-only: for `maildir` exactly
    `{"path": Path}` (absolute); for other providers the keys as written, with every
    credential turned into a `Secret`.
    """

    tenant_id: str
    mailbox_id: str
    provider: str
    address: str = ""
    sync_mode: str = DEFAULT_SYNC_MODE
    poll_interval_s: float = DEFAULT_POLL_INTERVAL_S
    settings: Mapping[str, Any] = field(
        default_factory=lambda: MappingProxyType({}), hash=False)

    @property
    def runnable(self) -> bool:
        """True when this version of inboxd has a door for the provider."""
        return self.provider in RUNNABLE_PROVIDERS


@dataclass(frozen=True)
class TenantConfig:
    """One tenant file. `api_token` is the bearer token of the tenant's HTTP API
    (`/v1/…`); None disables that API for the tenant. `delivery_sources` and
    `processors` are kept as written (read-only, secrets as `Secret`) for the
    modules that implement them; only `id` and `provider` are checked here."""

    tenant_id: str
    name: str
    source_file: Path
    api_token: Secret | None = None
    mailboxes: tuple[MailboxConfig, ...] = ()
    delivery_sources: tuple[Mapping[str, Any], ...] = field(default=(), hash=False)
    processors: tuple[Mapping[str, Any], ...] = field(default=(), hash=False)


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


@dataclass(frozen=True, eq=False)
class ConfigReport:
    """Everything `inspect_config` found. `main` is None when the main file could not
    be read or parsed; `tenants` is None then too."""

    main: MainConfig | None
    tenants: TenantSet | None
    problems: list[ConfigProblem]

    @property
    def ok(self) -> bool:
        return not self.problems


# --- entry points ------------------------------------------------------------------------


def load_main(
    path: str | os.PathLike[str], *, check_secrets: bool = False,
    environ: Mapping[str, str] | None = None,
) -> MainConfig:
    """Read and validate the main config file.

    Raises `ConfigError` with every problem of the file (missing, unreadable, bad
    TOML, unknown keys, wrong types, literal password in the DSN; with
    `check_secrets`, an unresolvable `[database] dsn` reference too). Does not
    look at the tenants directory (`load_tenants` does).
    """
    main, problems = _parse_main(Path(path), _Options(check_secrets, environ))
    if problems or main is None:
        raise ConfigError(problems)
    return main


def load_tenants(
    main: MainConfig, *, check_secrets: bool = False,
    environ: Mapping[str, str] | None = None,
) -> TenantSet:
    """Read every `*.toml` in `main.tenants_dir` (sorted by name; hidden files skipped).

    Never raises for a bad file: its problems go to `TenantSet.problems` and its tenant
    is left out. A duplicate tenant id or mailbox id is reported on the later file (by
    name), which is left out. A missing or unreadable directory is one problem on the
    main file (key `tenants.dir`) and no tenants. With `check_secrets`, every secret
    reference is resolved once to report unset variables and missing files.
    """
    options = _Options(check_secrets, environ)
    directory = main.tenants_dir
    try:
        files = sorted(p for p in directory.iterdir()
                       if p.suffix == ".toml" and not p.name.startswith(".") and p.is_file())
    except FileNotFoundError:
        return TenantSet({}, [ConfigProblem(main.config_path, "tenants.dir",
                                            f"directory {directory} does not exist")])
    except OSError as exc:
        return TenantSet({}, [ConfigProblem(main.config_path, "tenants.dir",
                                            f"cannot read directory {directory}: "
                                            f"{exc.strerror or exc}")])
    parsed = [_parse_tenant_file(path, options) for path in files]
    _check_unique_ids(parsed)
    tenants = {p.tenant.tenant_id: p.tenant for p in parsed
               if p.tenant is not None and not p.reader.problems}
    problems = [problem for p in parsed for problem in p.reader.problems]
    return TenantSet(tenants, problems, tuple(files))


def inspect_config(
    path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None,
) -> ConfigReport:
    """Validate the main file and every tenant file, resolving every secret reference.

    Never raises for configuration content. Tenant files are read whenever the main
    file parses, even when some of its other keys are wrong.
    """
    options = _Options(True, environ)
    main, problems = _parse_main(Path(path), options)
    if main is None:
        return ConfigReport(None, None, problems)
    tenants = load_tenants(main, check_secrets=True, environ=environ)
    return ConfigReport(main, tenants, problems + tenants.problems)


def check_config(
    path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None,
) -> list[ConfigProblem]:
    """Every problem of the main file and its tenant files (`inspect_config`); [] if none."""
    return inspect_config(path, environ=environ).problems


# --- the main file -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Options:
    check_secrets: bool
    environ: Mapping[str, str] | None


def _parse_main(path: Path, options: _Options) -> tuple[MainConfig | None, list[ConfigProblem]]:
    """The MainConfig (bad values replaced by defaults, so the tenants directory can still
    be checked) and the problems; None when the file cannot be read or parsed."""
    config_path = path.expanduser().absolute()
    base = config_path.parent
    r = _Reader(config_path, options)
    raw = r.read_toml()
    if raw is None:
        return None, r.problems
    elsewhere = {key: f"[{section}] {key}"
                 for section, keys in _MAIN_SECTIONS.items() for key in keys}
    r.unknown_keys(raw, _MAIN_SECTIONS, "", elsewhere=elsewhere, sections=True)

    def section(name: str) -> dict[str, Any]:
        table = r.table(raw.get(name, {}), name)
        if table is None:
            return {}
        if name != "object_store":
            r.unknown_keys(table, _MAIN_SECTIONS[name], name)
        return table

    database, listener, queue, workers = (section(n) for n in
                                          ("database", "listener", "queue", "workers"))
    shutdown, sync, tenants, log = (section(n) for n in ("shutdown", "sync", "tenants", "log"))
    defaults = MainConfig(config_path=config_path, tenants_dir=base / DEFAULT_TENANTS_DIR)
    tenants_dir = r.string(tenants, "dir", "tenants", default=DEFAULT_TENANTS_DIR,
                           nonempty=True) or DEFAULT_TENANTS_DIR
    main = MainConfig(
        config_path=config_path,
        tenants_dir=_relative_to(base, tenants_dir),
        database_dsn=_database_dsn(r, database),
        listen_host=r.string(listener, "host", "listener", default=defaults.listen_host,
                             nonempty=True) or defaults.listen_host,
        # 0 asks the kernel for a free port (tests, several instances on one host).
        listen_port=r.integer(listener, "port", "listener", defaults.listen_port,
                              minimum=0, maximum=65535),
        max_body_bytes=r.integer(listener, "max_body_bytes", "listener",
                                 defaults.max_body_bytes, minimum=1),
        object_store=_object_store(r, raw.get("object_store"), base),
        queue_capacity=r.integer(queue, "capacity", "queue", defaults.queue_capacity,
                                 minimum=1),
        ingest_workers=r.integer(workers, "ingest", "workers", defaults.ingest_workers,
                                 minimum=1),
        batch_size=r.integer(workers, "batch_size", "workers", defaults.batch_size, minimum=1),
        shutdown_deadline_s=r.number(shutdown, "deadline_s", "shutdown",
                                     defaults.shutdown_deadline_s),
        lease_ttl_s=r.number(sync, "lease_ttl_s", "sync", defaults.lease_ttl_s),
        poll_scan_interval_s=r.number(sync, "poll_scan_interval_s", "sync",
                                      defaults.poll_scan_interval_s),
        push_quiet_after_s=r.number(sync, "push_quiet_after_s", "sync",
                                    defaults.push_quiet_after_s),
        log_level=r.choice(log, "level", "log", LOG_LEVELS, None) or defaults.log_level,
        raw=raw,
    )
    return main, r.problems


def _database_dsn(r: _Reader, database: dict[str, Any]) -> str | None:
    dsn = r.string(database, "dsn", "database", default=None)
    if dsn is None or not dsn.strip():
        return None  # empty counts as unset (database.resolve_dsn does the same)
    dsn = dsn.strip()
    if dsn.startswith(("env:", "file:")):
        r.secret(dsn, "database.dsn")
    elif dsn_has_password(dsn):
        r.problem("database.dsn",
                  f"contains a literal password ({mask_dsn(dsn)}): {USE_A_REFERENCE}, "
                  f"or set {ENV_DSN}")
    return dsn


def _object_store(r: _Reader, value: Any, base: Path) -> dict[str, Any]:
    if value is None:
        return _default_object_store()
    table = r.table(value, "object_store")
    if table is None:
        return _default_object_store()
    kind = table.get("kind", "local")
    if kind not in _OBJECT_STORE_KEYS:
        r.problem("object_store.kind",
                  f'expected "local" or "s3", got {_describe(kind)}')
        return _default_object_store()
    r.unknown_keys(table, _OBJECT_STORE_KEYS[kind], "object_store",
                   what=f'key for kind "{kind}"')
    if kind == "local":
        path = r.string(table, "path", "object_store", required=True, nonempty=True)
        if path is None:
            return _default_object_store()
        return {"kind": "local", "path": str(_relative_to(base, path))}
    spec: dict[str, Any] = {"kind": "s3",
                            "bucket": r.string(table, "bucket", "object_store",
                                               required=True, nonempty=True)}
    for key in ("prefix", "endpoint_url", "region"):
        if (text := r.string(table, key, "object_store", default=None)) is not None:
            spec[key] = text
    return spec


# --- tenant files ------------------------------------------------------------------------


@dataclass
class _TenantFile:
    reader: _Reader
    tenant: TenantConfig | None = None
    tenant_id: str | None = None
    # (key, mailbox id) of every mailbox with a valid id, whatever else is wrong
    mailbox_ids: list[tuple[str, str]] = field(default_factory=list)


def _parse_tenant_file(path: Path, options: _Options) -> _TenantFile:
    r = _Reader(path, options)
    result = _TenantFile(r)
    raw = r.read_toml()
    if raw is None:
        return result
    r.unknown_keys(raw, _TENANT_KEYS, "")
    tenant_id = r.ident(raw, "id", "", kind="tenant")
    result.tenant_id = tenant_id
    name = r.string(raw, "name", "", default=tenant_id or "") or ""
    api_token = r.secret(raw["api_token"], "api_token") if "api_token" in raw else None
    mailboxes = []
    for key, table in r.tables(raw, "mailboxes"):
        mailbox_id, mailbox = _parse_mailbox(r, table, key, tenant_id or "", path.parent)
        if mailbox_id is not None:
            result.mailbox_ids.append((f"{key}.id", mailbox_id))
        if mailbox is not None:
            mailboxes.append(mailbox)
    delivery_sources = _parse_raw_tables(r, raw, "delivery_sources", "delivery source")
    processors = _parse_raw_tables(r, raw, "processors", "processor")
    if tenant_id is not None:
        result.tenant = TenantConfig(
            tenant_id=tenant_id, name=name, source_file=path, api_token=api_token,
            mailboxes=tuple(mailboxes), delivery_sources=delivery_sources,
            processors=processors)
    return result


def _parse_mailbox(
    r: _Reader, table: dict[str, Any], prefix: str, tenant_id: str, base: Path,
) -> tuple[str | None, MailboxConfig | None]:
    """The mailbox id (None if invalid) and the mailbox (None when its id or provider
    is unusable); problems recorded."""
    mailbox_id = r.ident(table, "id", prefix, kind="mailbox")
    provider = r.choice(table, "provider", prefix, PROVIDERS, None, required=True)
    address = r.string(table, "address", prefix, default="") or ""
    if address and "@" not in address:
        r.problem(_join(prefix, "address"),
                  f"expected an email address, got {_describe(address)}")
    modes = _PROVIDER_SYNC_MODES.get(provider or "", SYNC_MODES)
    sync_mode = r.choice(table, "sync_mode", prefix, modes, DEFAULT_SYNC_MODE,
                         context=(f' for provider "{provider}"'
                                  if provider in _PROVIDER_SYNC_MODES else ""))
    poll_interval_s = r.number(table, "poll_interval_s", prefix,
                               _PROVIDER_POLL_INTERVAL_S.get(provider or "",
                                                             DEFAULT_POLL_INTERVAL_S))
    extra = {k: v for k, v in table.items() if k not in _MAILBOX_KEYS}
    settings: Mapping[str, Any]
    if provider == "maildir":
        r.unknown_keys(extra, _MAILBOX_KEYS + _MAILDIR_KEYS, prefix,
                       what='key for provider "maildir"')
        settings = MappingProxyType(_maildir_settings(r, table, prefix, base))
    else:
        for key in extra:
            typo = difflib.get_close_matches(key, _MAILBOX_KEYS, n=1, cutoff=_TYPO_CUTOFF)
            if typo:
                r.problem(_join(prefix, key), f'unknown key; did you mean "{typo[0]}"?')
        settings = r.freeze(extra, prefix)
    if mailbox_id is None or provider is None:
        return mailbox_id, None
    return mailbox_id, MailboxConfig(
        tenant_id=tenant_id, mailbox_id=mailbox_id, provider=provider, address=address,
        sync_mode=sync_mode or DEFAULT_SYNC_MODE, poll_interval_s=poll_interval_s,
        settings=settings)


def _maildir_settings(r: _Reader, table: dict[str, Any], prefix: str,
                      base: Path) -> dict[str, Any]:
    text = r.string(table, "path", prefix, required=True, nonempty=True)
    if text is None:
        return {}
    path = _relative_to(base, text)
    # A missing directory is created when the door starts; a file in its place is not
    # something we should turn into a Maildir.
    if path.exists() and not path.is_dir():
        r.problem(_join(prefix, "path"), f"{path} exists and is not a directory")
    return {"path": path}


def _parse_raw_tables(
    r: _Reader, raw: dict[str, Any], name: str, kind: str,
) -> tuple[Mapping[str, Any], ...]:
    """`[[delivery_sources]]` / `[[processors]]`: tables with a unique `id` and a
    `provider`; everything else kept as written (secrets checked and wrapped)."""
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
                r.problem("id", f'duplicate tenant id "{parsed.tenant_id}": '
                                f"already defined in {owner}")
        for key, mailbox_id in parsed.mailbox_ids:
            claim = (r.file, parsed.tenant_id or "?", key)
            owner_file, owner_tenant, owner_key = mailbox_owner.setdefault(mailbox_id, claim)
            if (owner_file, owner_key) == (r.file, key):
                continue
            where = (f"{owner_key} of this file" if owner_file == r.file
                     else f'tenant "{owner_tenant}" ({owner_file}: {owner_key})')
            r.problem(key, f'duplicate mailbox id "{mailbox_id}": already used by {where}; '
                           "mailbox ids are unique across all tenants")


# --- reading values ----------------------------------------------------------------------


class _Reader:
    """Reads values out of one file's TOML, recording a ConfigProblem for each bad one
    and returning a default (or None) so that reading can go on."""

    def __init__(self, file: Path, options: _Options) -> None:
        self.file = file
        self.options = options
        self.problems: list[ConfigProblem] = []

    def problem(self, key: str, message: str) -> None:
        self.problems.append(ConfigProblem(self.file, key, message))

    def read_toml(self) -> dict[str, Any] | None:
        try:
            text = self.file.read_bytes().decode("utf-8")
        except FileNotFoundError:
            self.problem("", "no such file")
            return None
        except OSError as exc:
            self.problem("", f"cannot read: {exc.strerror or exc}")
            return None
        except UnicodeDecodeError:
            self.problem("", "not UTF-8 text (TOML files are UTF-8)")
            return None
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            # tomllib's messages name the position, never the text found there.
            message = str(exc)
            position = _TOML_POSITION.search(message)
            key = position.group(1) if position else ""
            self.problem(key, f"invalid TOML: {_TOML_POSITION.sub('', message)}")
            return None

    def unknown_keys(
        self, table: Mapping[str, Any], known: Iterable[str], prefix: str, *,
        elsewhere: Mapping[str, str] | None = None, what: str = "key", sections: bool = False,
    ) -> None:
        """A problem for each key of `table` not in `known`, with the closest known key
        (or where else the key belongs, `elsewhere`) as a hint."""
        known = list(known)
        for name in table:
            if name in known:
                continue
            if sections:
                what = "section" if isinstance(table[name], dict) else "key"
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            if close:
                hint = f'; did you mean "{close[0]}"?'
            elif elsewhere and name in elsewhere:
                hint = f"; did you mean {elsewhere[name]}?"
            else:
                hint = f" (known: {', '.join(known)})"
            self.problem(_join(prefix, name), f"unknown {what}{hint}")

    def table(self, value: Any, key: str) -> dict[str, Any] | None:
        if isinstance(value, dict):
            return value
        self.problem(key, f"expected a table, got {_describe(value)}")
        return None

    def tables(self, raw: Mapping[str, Any], name: str) -> list[tuple[str, dict[str, Any]]]:
        """(key, table) of an array of tables such as `[[mailboxes]]`; [] when absent."""
        value = raw.get(name, [])
        if not isinstance(value, list):
            self.problem(name, f"expected an array of tables ([[{name}]]), "
                               f"got {_describe(value)}")
            return []
        out = []
        for i, item in enumerate(value):
            key = f"{name}[{i}]"
            if isinstance(item, dict):
                out.append((key, item))
            else:
                self.problem(key, f"expected a table, got {_describe(item)}")
        return out

    def _missing(self, table: Mapping[str, Any], name: str, prefix: str, required: bool) -> bool:
        if name in table:
            return False
        if required:
            self.problem(_join(prefix, name), "missing required key")
        return True

    def string(
        self, table: Mapping[str, Any], name: str, prefix: str, *, default: str | None = None,
        required: bool = False, nonempty: bool = False,
    ) -> str | None:
        if self._missing(table, name, prefix, required):
            return default
        value = table[name]
        if not isinstance(value, str):
            self.problem(_join(prefix, name), f"expected a string, got {_describe(value)}")
            return default
        if nonempty and not value.strip():
            self.problem(_join(prefix, name), "must not be empty")
            return default
        return value

    def choice(
        self, table: Mapping[str, Any], name: str, prefix: str, choices: Sequence[str],
        default: str | None, *, required: bool = False, context: str = "",
    ) -> str | None:
        value = self.string(table, name, prefix, required=required)
        if value is None:
            return default
        if value in choices:
            return value
        options = ", ".join(f'"{c}"' for c in choices)
        close = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
        hint = f'; did you mean "{close[0]}"?' if close else ""
        self.problem(_join(prefix, name),
                     f"expected one of {options}{context}, got {_describe(value)}{hint}")
        return default

    def ident(self, table: Mapping[str, Any], name: str, prefix: str, *,
              kind: str) -> str | None:
        value = self.string(table, name, prefix, required=True)
        if value is None:
            return None
        try:
            return validate_id(kind, value)
        except ValueError as exc:
            self.problem(_join(prefix, name), str(exc))
            return None

    def integer(self, table: Mapping[str, Any], name: str, prefix: str, default: int, *,
                minimum: int, maximum: int | None = None) -> int:
        if self._missing(table, name, prefix, False):
            return default
        value = table[name]
        key = _join(prefix, name)
        if isinstance(value, bool) or not isinstance(value, int):
            self.problem(key, f"expected an integer, got {_describe(value)}")
            return default
        if value < minimum or (maximum is not None and value > maximum):
            bounds = (f"between {minimum} and {maximum}" if maximum is not None
                      else f"at least {minimum}")
            self.problem(key, f"must be {bounds}, got {value}")
            return default
        return value

    def number(self, table: Mapping[str, Any], name: str, prefix: str, default: float) -> float:
        """A duration or rate: a finite number greater than 0 (integers accepted)."""
        if self._missing(table, name, prefix, False):
            return default
        value = table[name]
        key = _join(prefix, name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.problem(key, f"expected a number, got {_describe(value)}")
            return default
        if not math.isfinite(value) or value <= 0:
            self.problem(key, f"must be a number greater than 0, got {_describe(value)}")
            return default
        return float(value)

    def secret(self, value: Any, key: str) -> Secret | None:
        """The Secret for a value that must be a reference; None (and a problem that does
        not quote the value) otherwise. Resolved once when checking secrets."""
        reason = secret_ref_error(value)
        if reason is not None:
            self.problem(key, reason)
            return None
        secret = Secret(str(value).strip())
        if self.options.check_secrets:
            try:
                secret.reveal(self.options.environ)  # the value is dropped at once
            except SecretError as exc:
                self.problem(key, str(exc))
        return secret

    def freeze(self, table: Mapping[str, Any], prefix: str) -> Mapping[str, Any]:
        """A read-only deep copy of free-form provider settings; credentials (by key name,
        `secrets.is_secret_key`) checked and wrapped in `Secret`, literals dropped."""
        out: dict[str, Any] = {}
        for name, value in table.items():
            key = _join(prefix, name)
            out[name] = (self.secret(value, key) if is_secret_key(name)
                         else self._freeze_value(value, key))
        return MappingProxyType(out)

    def _freeze_value(self, value: Any, key: str) -> Any:
        if isinstance(value, dict):
            return self.freeze(value, key)
        if isinstance(value, list):
            return tuple(self._freeze_value(v, f"{key}[{i}]") for i, v in enumerate(value))
        return value


def _relative_to(base: Path, text: str) -> Path:
    """`text` as a path, relative to `base` unless absolute; `..` resolved so that
    messages and logs show the directory actually meant."""
    path = Path(text).expanduser()
    if path.is_absolute():
        return path
    joined = base / path
    return joined.resolve() if ".." in path.parts else joined


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _describe(value: Any) -> str:
    """A value for a message: strings quoted and cut short, containers by kind.
    Never used for a value that may be a secret."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        shown = value if len(value) <= _DESCRIBE_MAX_CHARS else value[:_DESCRIBE_MAX_CHARS] + "…"
        return json.dumps(shown, ensure_ascii=False)
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, datetime | date | time):
        return f"a date/time ({value.isoformat()})"
    return type(value).__name__
