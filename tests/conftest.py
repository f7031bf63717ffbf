"""Shared fixtures: a real PostgreSQL, a clean database per test, a local object store.

Server choice (README "Tests"): INBOXD_TEST_DSN when set, else the server on
127.0.0.1:5432 if one answers, else the embedded one (as root it runs as the
unprivileged INBOXD_EMBEDDED_PG_USER, default `nobody`).

Isolation (CONTRIBUTING "Tests"): `db_dsn` (and `pool`, `stage`, `make_mailbox` on
it) is one database per pytest process with schema.sql applied, emptied before
every test (DELETE from all its tables, sequences restarted) after ending every
other session on it; so tests never see each other's rows, sequences, advisory locks, LISTENs or
daemon presence rows. A test marked `own_database` (`pytest.mark.own_database`)
gets a fresh copy of the template instead, dropped afterwards: tests that change
the schema (triggers, ALTER/DROP TABLE), the database (ALLOW_CONNECTIONS) or its
statistics, and modules whose daemon subprocesses could outlive a test. A test
that changes the shared database's schema without the mark fails at teardown
(and the database is rebuilt for the next test).

Fixtures every folder shares but that live in tests/helpers are registered here
as plugins: `moto_endpoint` (moto's S3/SQS server, tests/helpers/moto_server.py).
"""

from __future__ import annotations

import os
import signal
import socket
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import anyio
import asyncpg
import pytest

from inboxd.pipeline.ingest.stage import IngestStage
from inboxd.pipeline.objectstore.local import LocalDirectoryStore
from inboxd.pipeline.schema import apply_schema
from inboxd.pipeline.tenancy import ensure_mailbox

REPO = Path(__file__).resolve().parents[1]
CORPUS = Path(os.environ.get("INBOXD_CORPUS", REPO / "tests" / "corpus"))
LOCAL_PG = "postgresql://postgres@127.0.0.1:5432/postgres"
T = TypeVar("T")

# Fixture modules of tests/helpers (importable as `helpers`: pyproject's pythonpath).
pytest_plugins = ["helpers.moto_server", "helpers.dovecot", "helpers.xdist_groups"]


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def server_dsn() -> Iterator[str]:
    """Admin DSN of the PostgreSQL server the suite uses."""
    if os.environ.get("INBOXD_TEST_DSN"):
        yield os.environ["INBOXD_TEST_DSN"]
        return
    if _answers("127.0.0.1", 5432):
        yield LOCAL_PG
        return
    from inboxd.daemon.embedded_pg.server import ensure_embedded, stop_embedded

    env = dict(os.environ)
    data_dir = tempfile.mkdtemp(prefix="inboxd-test-pg-")
    env["INBOXD_DATA_DIR"] = data_dir
    if os.geteuid() == 0:
        env.setdefault("INBOXD_EMBEDDED_PG_USER", "nobody")
        os.chmod(data_dir, 0o777)  # noqa: S103 - the unprivileged server user writes here
    server = ensure_embedded(environ=env)
    yield server.dsn
    stop_embedded(environ=env)


def _with_db(dsn: str, name: str) -> str:
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path="/" + name))


@pytest.fixture
async def empty_db(server_dsn: str, _dropper: _Dropper) -> AsyncIterator[str]:
    """DSN of a fresh database without the schema (a newcomer's first run, a wheel's
    first migrate, an older release's schema to upgrade), dropped afterwards (in a
    batch with others: DROP_BATCH)."""
    name = f"inboxd_empty_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(server_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    yield _with_db(server_dsn, name)
    await _dropper.retire(name)


@pytest.fixture(scope="session")
async def template_db(server_dsn: str, _dropper: _Dropper) -> AsyncIterator[str]:
    name = f"inboxd_tmpl_{os.getpid()}"
    admin = await asyncpg.connect(server_dsn)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
        await admin.execute(f'CREATE DATABASE "{name}"')
        conn = await asyncpg.connect(_with_db(server_dsn, name))
        try:
            await apply_schema(conn)
        finally:
            await conn.close()
    finally:
        await admin.close()
    yield name
    await _dropper.retire(name)


# DROP DATABASE returns only once the server has taken a checkpoint for it, and drops
# sent together share one checkpoint. Measured on 127.0.0.1:5432 here (2 cores, busy):
# a create from the template 0.12 s, a drop 1.5 s; ten drops one after another 15 s,
# the same ten at once 0.6 s. So test databases are dropped in batches of this many,
# all at once, and the rest (with the template and the shared database) at the end of
# the session; meanwhile at most this many
# finished ones (template copies) wait per process (up to that many more are left
# behind if the session is killed).
DROP_BATCH = 8


class _Dropper:
    """Finished test databases, dropped DROP_BATCH at a time, each on a connection of
    its own so that the drops run at once."""

    def __init__(self, server_dsn: str) -> None:
        self.server_dsn = server_dsn
        self.pending: list[str] = []

    async def retire(self, name: str) -> None:
        self.pending.append(name)
        if len(self.pending) >= DROP_BATCH:
            await self.flush()

    async def flush(self) -> None:
        names, self.pending = self.pending, []
        async with anyio.create_task_group() as tg:
            for name in names:
                tg.start_soon(self._drop, name)

    async def _drop(self, name: str) -> None:
        admin = await asyncpg.connect(self.server_dsn)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()


@pytest.fixture(scope="session")
async def _dropper(server_dsn: str) -> AsyncIterator[_Dropper]:
    dropper = _Dropper(server_dsn)
    yield dropper
    await dropper.flush()


OWN_DATABASE_MARK = "own_database"


def restore_interrupts() -> None:
    """Give this process Python's own SIGINT handler if it started with SIGINT ignored.

    A shell without job control starts a background command (`make test &`, two
    suites at once from a script) with SIGINT ignored, and every process the tests
    start inherits that: the commands the tests interrupt (connect, import, extract,
    run) then never see the SIGINT and the test waits out its deadline. A handler,
    unlike an ignored signal, is reset to the default in a child at exec."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_configure(config: pytest.Config) -> None:
    restore_interrupts()
    config.addinivalue_line(
        "markers",
        f"{OWN_DATABASE_MARK}: db_dsn is a fresh copy of the template, not the process's "
        "shared database emptied before each test (tests/conftest.py)",
    )


# What makes the shared database's schema: relations, columns, constraints, triggers
# and functions outside the system schemas. Compared after each test that shares it.
SCHEMA_FINGERPRINT_SQL = """
SELECT md5(coalesce(string_agg(item, ',' ORDER BY item), '')) FROM (
    SELECT 'r:' || n.nspname || '.' || c.relname || ':' || c.relkind::text AS item
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE n.nspname NOT IN ('pg_catalog', 'information_schema')
      AND n.nspname NOT LIKE 'pg\\_to%' AND n.nspname NOT LIKE 'pg\\_temp%'
    UNION ALL
    SELECT 'a:' || a.attrelid::regclass || '.' || a.attname || ':' || a.atttypid
    FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
    JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE n.nspname = 'public' AND a.attnum > 0 AND NOT a.attisdropped
    UNION ALL
    SELECT 'k:' || conrelid::regclass || ':' || pg_get_constraintdef(oid)
    FROM pg_constraint WHERE connamespace = 'public'::regnamespace
    UNION ALL
    SELECT 't:' || tgrelid::regclass || '.' || tgname FROM pg_trigger WHERE NOT tgisinternal
    UNION ALL
    SELECT 'f:' || oid::regprocedure FROM pg_proc WHERE pronamespace = 'public'::regnamespace
) AS schema_items
"""

# Every table of the database. Those that hold rows once schema.sql is applied
# (inboxd_schema_version) are kept through resets: without that row every daemon
# started on the database would apply schema.sql again.
TABLES_SQL = """
SELECT format('%I.%I', schemaname, tablename)::regclass::text FROM pg_tables
WHERE schemaname NOT IN ('pg_catalog', 'information_schema')
ORDER BY 1
"""

# Foreign keys as (referencing table, referenced table), named as TABLES_SQL names
# them: a table is emptied before the tables it references.
REFERENCES_SQL = """
SELECT conrelid::regclass::text, confrelid::regclass::text
FROM pg_constraint WHERE contype = 'f' AND conrelid <> confrelid
"""

# Every sequence (serial and identity columns) back to its first value.
RESTART_SEQUENCES_SQL = """
SELECT setval(format('%I.%I', schemaname, sequencename)::regclass, start_value, false)
FROM pg_sequences WHERE schemaname NOT IN ('pg_catalog', 'information_schema')
"""


# Measured on 127.0.0.1:5432 here (2 cores, load 19): a connect and close 105 ms, the
# reset statements 5.5 ms and the schema fingerprint 5.1 ms on an open connection. So
# SharedDatabase keeps one session of its own for them instead of two connects a test.
# A test may end it (pg_terminate_backend of every other session); a statement that
# fails on the kept session is tried once more on a new one.
SESSION_LOST = (
    asyncpg.PostgresConnectionError,
    asyncpg.AdminShutdownError,
    asyncpg.InterfaceError,
    OSError,
)


class SharedDatabase:
    """The one database of a pytest process that tests share, emptied between them."""

    def __init__(self, server_dsn: str, name: str) -> None:
        self.server_dsn = server_dsn
        self.name = name
        self.dsn = _with_db(server_dsn, name)
        self.reset_sql = ""
        self.fingerprint = ""
        self._session: asyncpg.Connection | None = None

    async def create(self, template: str) -> None:
        admin = await asyncpg.connect(self.server_dsn)
        try:
            await admin.execute(f'CREATE DATABASE "{self.name}" TEMPLATE "{template}"')
        finally:
            await admin.close()
        conn = await asyncpg.connect(self.dsn)
        try:
            self.reset_sql = await _reset_statements(conn)
            self.fingerprint = await conn.fetchval(SCHEMA_FINGERPRINT_SQL)
        finally:
            await conn.close()

    async def drop(self) -> None:
        await self.close()
        admin = await asyncpg.connect(self.server_dsn)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')
        finally:
            await admin.close()

    async def close(self) -> None:
        if self._session is not None:
            self._session.terminate()  # nothing to flush; close() could wait on a dead peer
            self._session = None

    async def _on_session(self, use: Callable[[asyncpg.Connection], Awaitable[T]]) -> T:
        """`use` on this process's own session, opened once (SESSION_LOST)."""
        for attempt in (1, 2):
            if self._session is None or self._session.is_closed():
                self._session = await asyncpg.connect(self.dsn)
            try:
                return await use(self._session)
            except SESSION_LOST:
                await self.close()
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    async def empty(self) -> None:
        """End every other session on the database (their advisory locks and LISTENs
        go with them; DELETE would wait on their locks), then empty the tables and
        restart the sequences, in one round trip."""

        async def empty_on(conn: asyncpg.Connection) -> None:
            await conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            await conn.execute(self.reset_sql)

        await self._on_session(empty_on)

    async def schema_changed(self) -> bool:
        async def fingerprint_on(conn: asyncpg.Connection) -> str:
            return str(await conn.fetchval(SCHEMA_FINGERPRINT_SQL))

        return await self._on_session(fingerprint_on) != self.fingerprint


async def _reset_statements(conn: asyncpg.Connection) -> str:
    """DELETE from every table that is empty once the schema is applied, referencing
    tables first, then restart the sequences.

    DELETE and not TRUNCATE: TRUNCATE gives every table new files, which the commit
    syncs. Measured on 127.0.0.1:5432 here (2 cores, load 11): one TRUNCATE of the 23
    tables 0.2-0.4 s, the DELETEs of a test's few rows 1-7 ms."""
    tables = [row[0] for row in await conn.fetch(TABLES_SQL)]
    empty = [t for t in tables if not await conn.fetchval(f"SELECT EXISTS (SELECT 1 FROM {t})")]
    references = [(row[0], row[1]) for row in await conn.fetch(REFERENCES_SQL)]
    deletes = [f"DELETE FROM {table}" for table in _referencing_first(empty, references)]
    return ";\n".join([*deletes, RESTART_SEQUENCES_SQL])


def _referencing_first(tables: list[str], references: list[tuple[str, str]]) -> list[str]:
    """`tables` ordered so that a table comes before every table it references."""
    ordered: list[str] = []
    left = list(tables)
    while left:
        ready = [t for t in left if not any(r == t and c in left for c, r in references)]
        if not ready:
            raise RuntimeError(f"foreign keys form a cycle among {left}")
        ordered += ready
        left = [t for t in left if t not in ready]
    return ordered


@pytest.fixture(scope="session")
async def shared_database(
    server_dsn: str, template_db: str, _dropper: _Dropper
) -> AsyncIterator[SharedDatabase]:
    """This process's shared test database (one per pytest-xdist worker)."""
    shared = SharedDatabase(server_dsn, f"inboxd_w_{uuid.uuid4().hex[:12]}")
    await shared.create(template_db)
    yield shared
    await shared.close()
    await _dropper.retire(shared.name)


async def _own_database(server_dsn: str, template_db: str) -> str:
    name = f"inboxd_t_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(server_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    finally:
        await admin.close()
    return name


@pytest.fixture
async def db_dsn(
    request: pytest.FixtureRequest,
    server_dsn: str,
    template_db: str,
    _dropper: _Dropper,
    shared_database: SharedDatabase,
) -> AsyncIterator[str]:
    """DSN of an empty database with the schema applied: this process's shared one,
    emptied first; or, for a test marked `own_database`, a fresh copy of the template
    dropped after the test (in a batch with others: DROP_BATCH)."""
    if request.node.get_closest_marker(OWN_DATABASE_MARK) is not None:
        name = await _own_database(server_dsn, template_db)
        yield _with_db(server_dsn, name)
        await _dropper.retire(name)
        return
    await shared_database.empty()
    yield shared_database.dsn
    if await shared_database.schema_changed():
        await shared_database.drop()
        await shared_database.create(template_db)
        pytest.fail(
            "the test changed the schema of the shared test database: mark it "
            f"@pytest.mark.{OWN_DATABASE_MARK} (tests/conftest.py)"
        )


@pytest.fixture
async def pool(db_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await asyncpg.create_pool(db_dsn, min_size=1, max_size=6)
    try:
        yield pool
    finally:
        await pool.close()


@pytest.fixture
def store(tmp_path: Path) -> LocalDirectoryStore:
    return LocalDirectoryStore(tmp_path / "objects")


@pytest.fixture
def stage(pool: asyncpg.Pool, store: LocalDirectoryStore) -> IngestStage:
    return IngestStage(pool, store)


@pytest.fixture
def make_mailbox(pool: asyncpg.Pool):
    """Factory: create a tenant + mailbox, return their ids."""

    async def make(
        tenant: str = "acme", mailbox: str = "inbox", *, provider: str = "import", address: str = ""
    ) -> tuple[str, str]:
        async with pool.acquire() as conn:
            await ensure_mailbox(conn, tenant, mailbox, provider=provider, address=address)
        return tenant, mailbox

    return make


@pytest.fixture(scope="session")
def corpus() -> Path:
    mime = CORPUS / "mime"
    if not mime.is_dir():
        pytest.fail(f"corpus not found at {mime} (set INBOXD_CORPUS)")
    return CORPUS
