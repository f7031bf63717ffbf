"""Shared fixtures: a real PostgreSQL, a fresh database per test, a local object store.

Server choice (README "Tests"): INBOXD_TEST_DSN when set, else the server on
127.0.0.1:5432 if one answers, else the embedded one (as root it runs as the
unprivileged INBOXD_EMBEDDED_PG_USER, default `nobody`). Every test gets its
own database cloned from a template that has schema.sql applied, so tests
never see each other's rows.

Fixtures every folder shares but that live in tests/helpers are registered here
as plugins: `moto_endpoint` (moto's S3/SQS server, tests/helpers/moto_server.py).
"""

from __future__ import annotations

import os
import socket
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

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
async def empty_db(server_dsn: str) -> AsyncIterator[str]:
    """DSN of a fresh database without the schema (a newcomer's first run, a wheel's
    first migrate, an older release's schema to upgrade), dropped afterwards."""
    name = f"inboxd_empty_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(server_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        yield _with_db(server_dsn, name)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@pytest.fixture(scope="session")
async def template_db(server_dsn: str) -> AsyncIterator[str]:
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
        yield name
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


# DROP DATABASE returns only once the server has taken a checkpoint for it, and drops
# sent together share one checkpoint. Measured on 127.0.0.1:5432 here (2 cores, busy):
# a create from the template 0.12 s, a drop 1.5 s; ten drops one after another 15 s,
# the same ten at once 0.6 s. So test databases are dropped in batches of this many,
# all at once, and the rest at the end of the session; meanwhile at most this many
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


@pytest.fixture
async def db_dsn(server_dsn: str, template_db: str, _dropper: _Dropper) -> AsyncIterator[str]:
    """DSN of a fresh database with the schema applied, dropped after the test (in a
    batch with others: DROP_BATCH)."""
    name = f"inboxd_t_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(server_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    finally:
        await admin.close()
    yield _with_db(server_dsn, name)
    await _dropper.retire(name)


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
