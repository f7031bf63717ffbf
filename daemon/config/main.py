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
(`daemon.config.secrets`): `api_token`, and in mailboxes, delivery sources and
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

This module holds the entry points and the main file; `daemon.config.tenant`
parses tenant files (and holds `TenantConfig`, `MailboxConfig`, `TenantSet`);
`daemon.config.reader` reads values out of one file's TOML.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inboxd.adapters.ses.config import SES_KEYS, SesSettings
from inboxd.adapters.ses.errors import SesConfigError
from inboxd.daemon.config.reader import ConfigProblem, Options, Reader, describe, relative_to
from inboxd.daemon.config.secrets import USE_A_REFERENCE
from inboxd.daemon.config.tenant import TenantSet, parse_tenant_files
from inboxd.daemon.database import ENV_DSN, dsn_has_password, mask_dsn
from inboxd.daemon.embedded_pg.data_dir import default_data_dir
from inboxd.daemon.logging import LOG_LEVELS
from inboxd.daemon.sync.turns import DEFAULT_SYNCS_AT_ONCE
from inboxd.pipeline import errors
from inboxd.pipeline.objectstore.database_tier import MAX_MAX_BYTES
from inboxd.pipeline.objectstore.local import unwritable_reason

__all__ = [
    "ConfigError",
    "ConfigProblem",
    "ConfigReport",
    "MainConfig",
    "TenantSet",
    "check_config",
    "inspect_config",
    "load_main",
    "load_tenants",
]

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
#: `[listener] trusted_proxies`: the reverse proxies whose forwarding header names the
#: client (daemon/http/forwarded.py).
TrustedProxies = tuple[IPNetwork, ...]
#: `[listener] forwarded_header` values: the one header the proxy in front writes.
FORWARDED_HEADERS = ("x-forwarded-for", "forwarded")

DEFAULT_TENANTS_DIR = "tenants"
OBJECTS_DIR = "objects"  # under the data directory, as `inboxd import` does

# Main file: section -> its keys. ([object_store] depends on its kind, see below.)
_MAIN_SECTIONS: dict[str, tuple[str, ...]] = {
    "database": ("dsn",),
    "listener": ("host", "port", "max_body_bytes", "trusted_proxies", "forwarded_header"),
    "object_store": (
        "kind",
        "path",
        "bucket",
        "prefix",
        "endpoint_url",
        "region",
        "database_max_bytes",
    ),
    "queue": ("capacity",),
    "workers": ("ingest", "batch_size"),
    "shutdown": ("deadline_s",),
    "sync": (
        "lease_ttl_s",
        "poll_scan_interval_s",
        "push_quiet_after_s",
        "max_imap_idle",
        "max_syncs_at_once",
    ),
    "tenants": ("dir",),
    "log": ("level",),
    "ses": tuple(sorted(SES_KEYS)),
}
# Same keys as adapters/objectstore/config.py accepts, per kind.
_OBJECT_STORE_KEYS: dict[str, tuple[str, ...]] = {
    "local": ("kind", "path", "database_max_bytes"),
    "s3": ("kind", "bucket", "prefix", "endpoint_url", "region", "database_max_bytes"),
}


# --- results -----------------------------------------------------------------------------


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
    trusted_proxies: TrustedProxies = ()
    forwarded_header: str = FORWARDED_HEADERS[0]
    object_store: dict[str, Any] = field(default_factory=_default_object_store, hash=False)
    queue_capacity: int = 2000
    ingest_workers: int = 2
    batch_size: int = 500
    shutdown_deadline_s: float = 30.0
    lease_ttl_s: float = 60.0
    poll_scan_interval_s: float = 5.0
    push_quiet_after_s: float = 900.0
    # IMAP IDLE connections this process holds at most (adapters/imap/idle_slots.py);
    # the mailboxes past it poll at their interval. One file handle each, so the
    # default stays far below the units' LimitNOFILE of 65,536.
    max_imap_idle: int = 1000
    # Sync runs of this process at work at once (daemon/sync/turns.py); the others wait
    # in line, a long one takes turns.
    max_syncs_at_once: int = DEFAULT_SYNCS_AT_ONCE
    log_level: str = "info"
    ses: SesSettings | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False, hash=False)


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
    path: str | os.PathLike[str],
    *,
    check_secrets: bool = False,
    environ: Mapping[str, str] | None = None,
) -> MainConfig:
    """Read and validate the main config file.

    Raises `ConfigError` with every problem of the file (missing, unreadable, bad
    TOML, unknown keys, wrong types, literal password in the DSN; with
    `check_secrets`, an unresolvable `[database] dsn` reference too). Does not
    look at the tenants directory (`load_tenants` does).
    """
    main, problems = _parse_main(Path(path), Options(check_secrets, environ))
    if problems or main is None:
        raise ConfigError(problems)
    return main


def load_tenants(
    main: MainConfig,
    *,
    check_secrets: bool = False,
    environ: Mapping[str, str] | None = None,
) -> TenantSet:
    """Read every `*.toml` in `main.tenants_dir` (sorted by name; hidden files skipped).

    Never raises for a bad file: its problems go to `TenantSet.problems` and its tenant
    is left out. A duplicate tenant id or mailbox id is reported on the later file (by
    name), which is left out. A missing or unreadable directory is one problem on the
    main file (key `tenants.dir`) and no tenants. With `check_secrets`, every secret
    reference is resolved once to report unset variables and missing files.
    """
    options = Options(check_secrets, environ)
    directory = main.tenants_dir
    try:
        files = sorted(
            p
            for p in directory.iterdir()
            if p.suffix == ".toml" and not p.name.startswith(".") and p.is_file()
        )
    except FileNotFoundError:
        return TenantSet(
            {},
            [
                ConfigProblem(
                    main.config_path, "tenants.dir", f"directory {directory} does not exist"
                )
            ],
        )
    except OSError as exc:
        return TenantSet(
            {},
            [
                ConfigProblem(
                    main.config_path,
                    "tenants.dir",
                    f"cannot read directory {directory}: {exc.strerror or exc}",
                )
            ],
        )
    return parse_tenant_files(files, options)


def inspect_config(
    path: str | os.PathLike[str],
    *,
    environ: Mapping[str, str] | None = None,
) -> ConfigReport:
    """Validate the main file and every tenant file, resolving every secret reference.

    Never raises for configuration content. Tenant files are read whenever the main
    file parses, even when some of its other keys are wrong.
    """
    options = Options(True, environ)
    main, problems = _parse_main(Path(path), options)
    if main is None:
        return ConfigReport(None, None, problems)
    tenants = load_tenants(main, check_secrets=True, environ=environ)
    return ConfigReport(main, tenants, problems + tenants.problems)


def check_config(
    path: str | os.PathLike[str],
    *,
    environ: Mapping[str, str] | None = None,
) -> list[ConfigProblem]:
    """Every problem of the main file and its tenant files (`inspect_config`); [] if none."""
    return inspect_config(path, environ=environ).problems


# --- the main file -----------------------------------------------------------------------


def _parse_main(path: Path, options: Options) -> tuple[MainConfig | None, list[ConfigProblem]]:
    """The MainConfig (bad values replaced by defaults, so the tenants directory can still
    be checked) and the problems; None when the file cannot be read or parsed."""
    config_path = path.expanduser().absolute()
    base = config_path.parent
    r = Reader(config_path, options)
    raw = r.read_toml()
    if raw is None:
        return None, r.problems
    elsewhere = {
        key: f"[{section}] {key}" for section, keys in _MAIN_SECTIONS.items() for key in keys
    }
    r.unknown_keys(raw, _MAIN_SECTIONS, "", elsewhere=elsewhere, sections=True)

    def section(name: str) -> dict[str, Any]:
        table = r.table(raw.get(name, {}), name)
        if table is None:
            return {}
        if name != "object_store":
            r.unknown_keys(table, _MAIN_SECTIONS[name], name)
        return table

    database, listener, queue, workers = (
        section(n) for n in ("database", "listener", "queue", "workers")
    )
    shutdown, sync, tenants, log = (section(n) for n in ("shutdown", "sync", "tenants", "log"))
    defaults = MainConfig(config_path=config_path, tenants_dir=base / DEFAULT_TENANTS_DIR)
    tenants_dir = (
        r.string(tenants, "dir", "tenants", default=DEFAULT_TENANTS_DIR, nonempty=True)
        or DEFAULT_TENANTS_DIR
    )
    main = MainConfig(
        config_path=config_path,
        tenants_dir=relative_to(base, tenants_dir),
        database_dsn=_database_dsn(r, database),
        listen_host=r.string(
            listener, "host", "listener", default=defaults.listen_host, nonempty=True
        )
        or defaults.listen_host,
        # 0 asks the kernel for a free port (tests, several instances on one host).
        listen_port=r.integer(
            listener, "port", "listener", defaults.listen_port, minimum=0, maximum=65535
        ),
        max_body_bytes=r.integer(
            listener, "max_body_bytes", "listener", defaults.max_body_bytes, minimum=1
        ),
        trusted_proxies=_trusted_proxies(r, listener),
        forwarded_header=r.choice(listener, "forwarded_header", "listener", FORWARDED_HEADERS, None)
        or defaults.forwarded_header,
        object_store=_object_store(r, raw.get("object_store"), base),
        queue_capacity=r.integer(queue, "capacity", "queue", defaults.queue_capacity, minimum=1),
        ingest_workers=r.integer(workers, "ingest", "workers", defaults.ingest_workers, minimum=1),
        batch_size=r.integer(workers, "batch_size", "workers", defaults.batch_size, minimum=1),
        shutdown_deadline_s=r.number(
            shutdown, "deadline_s", "shutdown", defaults.shutdown_deadline_s
        ),
        lease_ttl_s=r.number(sync, "lease_ttl_s", "sync", defaults.lease_ttl_s),
        poll_scan_interval_s=r.number(
            sync, "poll_scan_interval_s", "sync", defaults.poll_scan_interval_s
        ),
        push_quiet_after_s=r.number(
            sync, "push_quiet_after_s", "sync", defaults.push_quiet_after_s
        ),
        max_imap_idle=r.integer(sync, "max_imap_idle", "sync", defaults.max_imap_idle, minimum=0),
        max_syncs_at_once=r.integer(
            sync, "max_syncs_at_once", "sync", defaults.max_syncs_at_once, minimum=1
        ),
        log_level=r.choice(log, "level", "log", LOG_LEVELS, None) or defaults.log_level,
        ses=_ses(r, section("ses")) if isinstance(raw.get("ses"), dict) else None,
        raw=raw,
    )
    return main, r.problems


def _trusted_proxies(r: Reader, listener: Mapping[str, Any]) -> TrustedProxies:
    """`[listener] trusted_proxies`: addresses or CIDRs of the reverse proxies in front
    (daemon/http/forwarded.py); each entry that is neither is a problem of its own."""
    entries = listener.get("trusted_proxies", [])
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        r.problem("listener.trusted_proxies", "must be a list of addresses or CIDRs")
        return ()
    networks: list[IPNetwork] = []
    for entry in entries:
        try:
            networks.append(ipaddress.ip_network(entry.strip(), strict=False))
        except ValueError:
            r.problem("listener.trusted_proxies", f"{entry!r} is not an IP address or CIDR")
    return tuple(networks)


def _database_dsn(r: Reader, database: dict[str, Any]) -> str | None:
    dsn = r.string(database, "dsn", "database", default=None)
    if dsn is None or not dsn.strip():
        return None  # empty counts as unset (database.resolve_dsn does the same)
    dsn = dsn.strip()
    if dsn.startswith(("env:", "file:")):
        r.secret(dsn, "database.dsn")
    elif dsn_has_password(dsn):
        r.problem(
            "database.dsn",
            f"contains a literal password ({mask_dsn(dsn)}): {USE_A_REFERENCE}, or set {ENV_DSN}",
        )
    return dsn


def _ses(r: Reader, table: dict[str, Any]) -> SesSettings | None:
    """`[ses]`: the SQS poller's settings (adapters/ses/config.py); absent, no poller."""
    try:  # unknown keys were reported by _parse_main, with a "did you mean"
        return SesSettings.from_settings({k: v for k, v in table.items() if k in SES_KEYS})
    except SesConfigError as exc:
        key, _, why = str(exc).partition(": ")
        r.problem(f"ses.{key}", why)
        return None


def _object_store(r: Reader, value: Any, base: Path) -> dict[str, Any]:
    if value is None:
        return _default_object_store()
    table = r.table(value, "object_store")
    if table is None:
        return _default_object_store()
    kind = table.get("kind", "local")
    if kind not in _OBJECT_STORE_KEYS:
        r.problem("object_store.kind", f'expected "local" or "s3", got {describe(kind)}')
        return _default_object_store()
    r.unknown_keys(table, _OBJECT_STORE_KEYS[kind], "object_store", what=f'key for kind "{kind}"')
    # absent: the kind's default (adapters/objectstore/config.py)
    tier: dict[str, Any] = {}
    if "database_max_bytes" in table:
        tier["database_max_bytes"] = r.integer(
            table, "database_max_bytes", "object_store", 0, minimum=0, maximum=MAX_MAX_BYTES
        )
    if kind == "local":
        path = r.string(table, "path", "object_store", required=True, nonempty=True)
        if path is None:
            return _default_object_store()
        directory = relative_to(base, path)
        if (reason := unwritable_reason(directory)) is not None:
            r.problem("object_store.path", f"cannot be written: {reason}")
        return {"kind": "local", "path": str(directory), **tier}
    spec: dict[str, Any] = {
        "kind": "s3",
        "bucket": r.string(table, "bucket", "object_store", required=True, nonempty=True),
        **tier,
    }
    for key in ("prefix", "endpoint_url", "region"):
        if (text := r.string(table, key, "object_store", default=None)) is not None:
            spec[key] = text
    return spec
