"""Fixtures for the object-store contract suite: a bucket on moto's server and both stores.

S3 is moto's server over HTTP (docs/architecture.md §9): the session fixture
`moto_endpoint` (tests/helpers/moto_server.py, shared by every test folder) starts it
only when a test asks for an S3 store.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aioboto3
import asyncpg
import boto3
import pytest
from helpers.moto_server import AWS_REGION

from inboxd.adapters.objectstore import S3Store
from inboxd.pipeline.objectstore.database_tier import DatabaseTierStore
from inboxd.pipeline.objectstore.local import LocalDirectoryStore
from inboxd.pipeline.objectstore.store import ObjectStore

TEST_BUCKET = "inboxd-objects-test"
TEST_REGION = AWS_REGION
# The database tier's size limit in the contract suite: small enough that the suite's
# large objects (3 MiB) go to the directory, its small ones (0..800 bytes) to the table.
TIER_MAX_BYTES = 1024


@pytest.fixture(scope="session")
def s3_bucket(moto_endpoint: str) -> str:
    """An empty bucket on the moto server; tests isolate themselves by key prefix."""
    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name=TEST_REGION)
    try:
        client.create_bucket(Bucket=TEST_BUCKET)
    finally:
        client.close()
    return TEST_BUCKET


@pytest.fixture(scope="session")
def aws_session(moto_endpoint: str) -> aioboto3.Session:
    """One session for all stores, as the daemon shares one: botocore's service
    model is then loaded once instead of once per test."""
    return aioboto3.Session()


@pytest.fixture
async def s3_store(
    moto_endpoint: str, s3_bucket: str, aws_session: aioboto3.Session
) -> AsyncIterator[S3Store]:
    """A started S3Store under a prefix of its own, so tests never see each other's keys."""
    store = S3Store(
        s3_bucket,
        prefix=f"test-{uuid.uuid4().hex}",
        endpoint_url=moto_endpoint,
        region=TEST_REGION,
        session=aws_session,
    )
    async with store:
        yield store


@pytest.fixture
async def local_store(tmp_path: Path) -> AsyncIterator[LocalDirectoryStore]:
    async with LocalDirectoryStore(tmp_path / "objects") as store:
        yield store


@pytest.fixture
async def db_store(tmp_path: Path, pool: asyncpg.Pool) -> AsyncIterator[DatabaseTierStore]:
    """Small objects in the test database, large ones in a directory."""
    large = LocalDirectoryStore(tmp_path / "objects")
    async with DatabaseTierStore(pool, large, max_bytes=TIER_MAX_BYTES) as store:
        yield store


# S3 starts moto_server, a subprocess: those cases are slow (make test-fast skips them).
@pytest.fixture(params=["local", "db", pytest.param("s3", marks=pytest.mark.slow)])
def store(request: pytest.FixtureRequest) -> ObjectStore:
    """Each contract test runs once per implementation."""
    fixture: ObjectStore = request.getfixturevalue(f"{request.param}_store")
    return fixture
