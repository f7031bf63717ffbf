"""Which PostgreSQL every inboxd command talks to, and opening a pool to it.

One order for every command (`run`, `migrate`, `status`, `import`, ...), first match wins:

1. `--dsn` on the command line,
2. the `INBOXD_DSN` environment variable,
3. `[database] dsn` in the main config file,
4. the embedded server under the inboxd data directory (`embedded_pg`) — unless
   `INBOXD_EMBEDDED_PG=refuse`, which the container image sets: a sidecar that writes
   mail into a database of its own volume, beside the application's PostgreSQL, is
   never what its user wants, so a container without a DSN stops with a message
   instead (`INBOXD_EMBEDDED_PG=allow` asks for the embedded server explicitly).

Each of the first three may be a secret reference instead of a DSN: `env:NAME` reads the
environment variable NAME, `file:/path` reads a file (trailing whitespace stripped, so
`echo … > file` works). The config file is the one place a DSN must not carry a literal
password: config files end up in git, backups and support tickets (docs/architecture.md §5: secrets
are references, never inline). A literal DSN without a password (peer auth, a
`.pgpass`, `PGPASSWORD`) is fine there.

An empty value (`INBOXD_DSN=` from an EnvironmentFile, `dsn = ""`) counts as unset.

DSNs are never logged or shown with their password: `DsnChoice`'s repr and every error
message here mask it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import parse_qs, unquote, urlsplit

import anyio
import asyncpg

from inboxd.daemon.config.secrets import Secret, SecretError
from inboxd.pipeline.errors import DATABASE_ERRORS, DbFault, db_fault

DsnOrigin = Literal["cli", "env", "config", "embedded"]

ENV_DSN = "INBOXD_DSN"
#: "refuse": no fallback to the embedded server (the container image); "allow" or unset:
#: the fallback of step 4.
ENV_EMBEDDED = "INBOXD_EMBEDDED_PG"
CONNECT_TIMEOUT_S = 10.0  # a healthy local or same-region server answers in well under 1 s
DEFAULT_PORT = 5432

_URI_SCHEMES = ("postgresql://", "postgres://")
# libpq key/value form: password=secret or password='se cret' (quotes escaped with \)
_KV_PASSWORD = re.compile(r"(?P<key>\bpassword\s*=\s*)(?P<value>'(?:[^'\\]|\\.)*'|\S+)")
_QUERY_PASSWORD = re.compile(r"(?P<key>[?&]password=)(?P<value>[^&#]*)")
_MASK = "***"


class DsnError(ValueError):
    """The configured DSN cannot be used as given (bad reference, literal password, …)."""


class DatabaseUnavailable(Exception):
    """The server did not answer (refused, unreachable, no socket, or too slow).

    Retriable: the server may come back. The message is one line, names host:port (or the
    socket path) and the cause, and never contains the password.
    """


class DatabaseRejected(Exception):
    """The server answered but refused us (bad credentials, unknown database or role).

    Not retriable without an operator changing the configuration.
    """


@dataclass(frozen=True)
class DsnChoice:
    """The DSN a command will use and where it came from. repr/str mask the password."""

    dsn: str = field(repr=False)
    source: DsnOrigin

    @property
    def masked(self) -> str:
        return mask_dsn(self.dsn)

    def __repr__(self) -> str:
        return f"DsnChoice(dsn={self.masked!r}, source={self.source!r})"


def mask_dsn(dsn: str) -> str:
    """Return `dsn` with any password replaced by `***` (URI userinfo, `?password=`,
    or key/value `password=`). Safe to log."""
    if dsn.startswith(_URI_SCHEMES):
        scheme, rest = dsn.split("://", 1)
        authority, sep, tail = _split_authority(rest)
        userinfo, at, hosts = authority.rpartition("@")
        if at and ":" in userinfo:
            user = userinfo.split(":", 1)[0]
            authority = f"{user}:{_MASK}@{hosts}"
        return _QUERY_PASSWORD.sub(rf"\g<key>{_MASK}", f"{scheme}://{authority}{sep}{tail}")
    return _KV_PASSWORD.sub(rf"\g<key>{_MASK}", dsn)


def dsn_has_password(dsn: str) -> bool:
    """True if `dsn` itself carries a non-empty password."""
    if dsn.startswith(_URI_SCHEMES):
        authority, _, _ = _split_authority(dsn.split("://", 1)[1])
        userinfo, at, _ = authority.rpartition("@")
        if at and userinfo.partition(":")[2]:
            return True
        query = urlsplit(dsn).query
        return any(v for v in parse_qs(query, keep_blank_values=True).get("password", []))
    return any(m.group("value").strip("'") for m in _KV_PASSWORD.finditer(dsn))


def describe_target(dsn: str, environ: Mapping[str, str] = os.environ) -> str:
    """Best-effort `host:port` (or unix socket path) a DSN points at, for messages."""
    hosts: str | None = None
    port: str | None = None
    if dsn.startswith(_URI_SCHEMES):
        try:
            parts = urlsplit(dsn)
        except ValueError:  # e.g. an unclosed [ of an IPv6 host; connect_pool says why
            return "an unparsable DSN"
        authority = parts.netloc.rpartition("@")[2]
        query = parse_qs(parts.query)
        if authority:
            # multi-host URIs (h1:5432,h2:5433) are left as written
            if "," in authority or authority.startswith("["):
                hosts = unquote(authority)
            else:
                hosts, _, port = unquote(authority).partition(":")
        if not hosts and "host" in query:
            hosts = query["host"][0]
        if not port and "port" in query:
            port = query["port"][0]
    else:
        kv = dict(re.findall(r"\b(host|port)\s*=\s*'?([^'\s]+)'?", dsn))
        hosts, port = kv.get("host"), kv.get("port")
    hosts = hosts or environ.get("PGHOST") or None
    port = port or environ.get("PGPORT") or str(DEFAULT_PORT)
    if hosts is None:
        return f"the default local socket (port {port})"
    if "," in hosts:
        return hosts
    if hosts.startswith("/"):
        return f"{hosts.rstrip('/')}/.s.PGSQL.{port}"
    return f"{hosts}:{port}"


def resolve_dsn(
    cli_dsn: str | None,
    config: Mapping[str, Any] | None,
    *,
    environ: Mapping[str, str] = os.environ,
    embedded: Callable[[], str] | None = None,
) -> DsnChoice:
    """Pick the DSN by the order in the module docstring.

    `config` is the parsed main config TOML (only its `[database]` table is read).
    `embedded` returns the embedded server's DSN; by default it starts or reuses the
    server under the inboxd data directory (`embedded_pg.ensure_embedded`), which blocks
    for up to `embedded_pg.START_TIMEOUT_S` on a first start — call this from a worker
    thread when inside an event loop.

    Raises `DsnError` for an unusable value (missing env variable, unreadable file,
    literal password in the config file, wrong type) and
    `errors.EmbeddedPostgresError` when the embedded server cannot be started.
    """
    if cli_dsn is not None and cli_dsn.strip():
        return DsnChoice(_dereference(cli_dsn.strip(), "--dsn", environ), "cli")

    env_value = environ.get(ENV_DSN, "").strip()
    if env_value:
        return DsnChoice(_dereference(env_value, ENV_DSN, environ), "env")

    configured = _config_dsn(config)
    if configured is not None:
        where = "[database] dsn"
        if not configured.startswith(("env:", "file:")) and dsn_has_password(configured):
            raise DsnError(
                f"{where} contains a literal password ({mask_dsn(configured)}): use a secret "
                'reference instead, dsn = "env:NAME" or dsn = "file:/path", '
                f"or set {ENV_DSN}"
            )
        return DsnChoice(_dereference(configured, where, environ), "config")

    policy = environ.get(ENV_EMBEDDED, "").strip().lower()
    if policy not in ("", "allow", "refuse"):
        raise DsnError(f'{ENV_EMBEDDED} must be "allow" or "refuse", not {policy!r}')
    if policy == "refuse":
        raise DsnError(
            f"no database configured: set {ENV_DSN} (or [database] dsn, or --dsn) to the "
            f"application's PostgreSQL; {ENV_EMBEDDED}=refuse (set by the container image) "
            f"forbids an embedded one; {ENV_EMBEDDED}=allow asks for it explicitly"
        )
    if embedded is None:
        from inboxd.daemon.embedded_pg.server import ensure_embedded

        return DsnChoice(ensure_embedded(environ=environ).dsn, "embedded")
    return DsnChoice(embedded(), "embedded")


# Longest one statement may run on a pooled connection before the call fails
# (asyncpg command_timeout). A connection that died without a FIN (a partition,
# a failover) otherwise hangs its caller for good; every loop then backs off and
# retries. Far above any healthy statement here (an ingest batch's are ~1 s), and
# above the schema migration's own 120 s deadline (commands/migrate.py).
COMMAND_TIMEOUT_S = 300.0


async def keep_session(conn: asyncpg.Connection) -> None:
    """The pool's reset on release: nothing on the server.

    asyncpg's default sends `SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *;
    RESET ALL;` every time a connection goes back to the pool — a round trip as dear
    as the statement it followed (about 100-150 µs of the daemon's CPU per
    acquisition on the 2-core machine, /tmp micro-benchmark of 3,000 acquisitions;
    a poll at 10,000 mailboxes is three acquisitions, issue 25). With a reset
    callback asyncpg still does the client side first (rolls back a transaction left
    open, drops listeners). Nothing here leaves session state on a pooled
    connection: settings are `SET LOCAL`, advisory locks are transaction-scoped,
    LISTEN and the presence lock have connections of their own, and
    tests/test_layering.py fails when code outside those modules takes any of them.
    """
    del conn


async def connect_pool(
    dsn: str,
    *,
    min_size: int = 1,
    max_size: int = 10,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
    **pool_kwargs: Any,
) -> asyncpg.Pool:
    """Open an asyncpg pool and prove it works with `select 1`, all within
    `connect_timeout_s`.

    Raises `DatabaseUnavailable` when the server does not answer in time (refused,
    unreachable, missing socket, still starting up), `DatabaseRejected` when it answers
    but refuses the login or database, and `DsnError` for a DSN asyncpg cannot parse.
    Each carries a one-line message without the password.
    The caller owns the pool and closes it.
    """
    target = describe_target(dsn)
    pool: asyncpg.Pool | None = None
    try:
        with anyio.fail_after(connect_timeout_s):
            pool = await asyncpg.create_pool(
                dsn,
                min_size=min_size,
                max_size=max_size,
                timeout=connect_timeout_s,
                **{"command_timeout": COMMAND_TIMEOUT_S, "reset": keep_session, **pool_kwargs},
            )
            await pool.fetchval("select 1")
    except TimeoutError as exc:
        _terminate(pool)
        raise DatabaseUnavailable(
            f"database at {target} did not answer within {connect_timeout_s:g} s"
        ) from exc
    except (
        asyncpg.InvalidAuthorizationSpecificationError,
        asyncpg.InvalidCatalogNameError,
    ) as exc:
        _terminate(pool)
        raise DatabaseRejected(
            f"database at {target} refused the connection: {_cause(exc, dsn)}"
        ) from exc
    except ValueError as exc:
        # asyncpg parses the DSN before connecting (ClientConfigurationError is a
        # ValueError, and an InterfaceError: so before the clause below): a malformed
        # DSN is the operator's to fix, not a retriable outage.
        _terminate(pool)
        raise DsnError(f"invalid DSN {mask_dsn(dsn)}: {_cause(exc, dsn)}") from exc
    except DATABASE_ERRORS as exc:
        if db_fault(exc) is not DbFault.UNAVAILABLE:
            raise
        _terminate(pool)
        raise DatabaseUnavailable(
            f"database at {target} did not answer: {_cause(exc, dsn)}"
        ) from exc
    except BaseException:
        _terminate(pool)
        raise
    return pool


def _terminate(pool: asyncpg.Pool | None) -> None:
    # terminate() is synchronous: nothing to await (and nothing that could hang) while
    # an exception or a cancellation is already on its way out.
    if pool is not None:
        pool.terminate()


def _cause(exc: BaseException, dsn: str) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    password = _password_of(dsn)
    if password:
        text = text.replace(password, _MASK)
    return text


def _password_of(dsn: str) -> str | None:
    if dsn.startswith(_URI_SCHEMES):
        try:
            parts = urlsplit(dsn)
            if parts.password:
                return unquote(parts.password)
        except ValueError:  # unparsable (bad IPv6 host, non-numeric port): mask what we can
            return None
        values = parse_qs(parts.query).get("password")
        return values[0] if values else None
    match = _KV_PASSWORD.search(dsn)
    return match.group("value").strip("'") if match else None


def _split_authority(rest: str) -> tuple[str, str, str]:
    """Split `user:pw@host/db?x` after the scheme into (authority, separator, tail).

    Stops at the first / ? or # after the last @, so a password containing / or ? (legal
    once percent-encoded, common when it is not) stays inside the authority.
    """
    at = rest.rfind("@")
    for i in range(max(at, 0), len(rest)):
        if rest[i] in "/?#":
            return rest[:i], rest[i], rest[i + 1 :]
    return rest, "", ""


def _config_dsn(config: Mapping[str, Any] | None) -> str | None:
    if not config:
        return None
    database = config.get("database")
    if database is None:
        return None
    if not isinstance(database, Mapping):
        raise DsnError("[database] in the config file must be a table")
    value = database.get("dsn")
    if value is None:
        return None
    if not isinstance(value, str):
        raise DsnError(f"[database] dsn must be a string, not {type(value).__name__}")
    return value.strip() or None


def _dereference(value: str, where: str, environ: Mapping[str, str]) -> str:
    """A DSN given directly, or read through an env:/file: reference (daemon.config.secrets)."""
    if not value.startswith(("env:", "file:")):
        return value
    try:
        return Secret(value).reveal(environ)
    except SecretError as exc:
        raise DsnError(f"{where}: {exc}") from None
