"""Fixtures for the object-store contract suite: moto's real S3 server and both stores.

S3 is moto's server over HTTP (docs/architecture.md §9), started once per session as a
subprocess so the adapter's real aiobotocore/aiohttp stack is exercised, not an
in-process mock. It only starts when a test asks for an S3 store.
"""

from __future__ import annotations

import http.client
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aioboto3
import boto3
import pytest
from helpers import wait_for

from inboxd.adapters.objectstore import S3Store
from inboxd.pipeline.objectstore import ObjectStore
from inboxd.pipeline.objectstore_local import LocalDirectoryStore

# Importing moto + flask and binding takes 1-3 s on a laptop; a loaded CI runner
# can be several times slower. Past this the server is broken, not slow.
MOTO_START_TIMEOUT_S = 30.0
# Between readiness probes: a probe is a cheap local HTTP request, and this keeps
# startup detection within one probe interval of the server being up.
MOTO_POLL_INTERVAL_S = 0.05
# A probe that hangs this long means "not ready yet"; try again.
MOTO_PROBE_TIMEOUT_S = 1.0
# SIGTERM → exit for the werkzeug server; after this it is killed.
MOTO_STOP_TIMEOUT_S = 10.0

TEST_BUCKET = "inboxd-objects-test"
TEST_REGION = "us-east-1"


def _free_port() -> int:
    # The port is free when we look; moto binds it a moment later. A collision in
    # that window fails loudly at startup (the process exits), never silently.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _probe(host: str, port: int) -> bool:
    conn = http.client.HTTPConnection(host, port, timeout=MOTO_PROBE_TIMEOUT_S)
    try:
        conn.request("GET", "/moto-api/data.json")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


@pytest.fixture(scope="session")
def moto_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a moto S3 server running for the whole session, with fake credentials.

    The fake credentials are set in the environment for the session so that both
    the server and every botocore client in this process resolve them, and so no
    developer's ~/.aws profile or endpoint override can leak into a test.
    """
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_SECURITY_TOKEN", "testing")
        mp.setenv("AWS_SESSION_TOKEN", "testing")
        mp.setenv("AWS_DEFAULT_REGION", TEST_REGION)
        mp.setenv("AWS_CONFIG_FILE", "/nonexistent/inboxd-test-aws-config")
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/inboxd-test-aws-credentials")
        for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION"):
            mp.delenv(name, raising=False)

        host, port = "127.0.0.1", _free_port()
        log_path = Path(tmp_path_factory.mktemp("moto")) / "moto_server.log"
        with log_path.open("wb") as log:
            # Output goes to a file, not a pipe nobody reads, so the server can
            # never block on a full pipe buffer.
            proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", host, "-p", str(port)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            wait_for(
                lambda: _probe(host, port),
                MOTO_START_TIMEOUT_S,
                what=f"moto_server answering on {host}:{port}",
                poll_s=MOTO_POLL_INTERVAL_S,
                abort=lambda: (
                    None if proc.poll() is None else f"moto_server exited with {proc.returncode}"
                ),
                context=log_path.read_text,
            )
            yield f"http://{host}:{port}"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=MOTO_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


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


# S3 starts moto_server, a subprocess: those cases are slow (make test-fast skips them).
@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.slow)])
def store(request: pytest.FixtureRequest) -> ObjectStore:
    """Each contract test runs once per implementation."""
    fixture: ObjectStore = request.getfixturevalue(f"{request.param}_store")
    return fixture
