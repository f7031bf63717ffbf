"""moto's server for every test folder: the `moto_endpoint` session fixture.

S3 and SQS are moto's server over HTTP (CONTRIBUTING.md rule 12), started as a
subprocess so the code's real aiobotocore/aiohttp stack is exercised, not an
in-process mock; its SQS calls one at a time, as consistent as real SQS
(moto_consistent.py). One server serves every AWS service moto has (S3, SQS, …): a
client picks the service by its request, not by the port. It starts only when a
test asks for `moto_endpoint`, once per session — once per xdist worker, each on
a free port of its own — and while it runs the environment carries fake
credentials.

tests/conftest.py registers this module as a plugin (`pytest_plugins`), so any
test or conftest.py under tests/ can take `moto_endpoint`; `AWS_REGION` is the
region the environment names.
"""

from __future__ import annotations

import http.client
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.waiting import wait_for

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

# The region of the fake credentials (AWS_DEFAULT_REGION while the server runs).
AWS_REGION = "us-east-1"

# moto.server with its SQS calls serialised (moto_consistent.py: moto's SQS backend
# is not thread-safe); run by path, the helpers folder kept off sys.path.
_MOTO_SERVER = [
    sys.executable,
    "-c",
    "import runpy, sys; runpy.run_path(sys.argv.pop(1), run_name='__main__')",
    str(Path(__file__).with_name("moto_consistent.py")),
]


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


def isolate_aws_environment(mp: pytest.MonkeyPatch, region: str = AWS_REGION) -> None:
    """Fake credentials and `region` for every botocore client of the test and the
    daemons it starts, and nothing of a developer's AWS set-up (profile, config
    files, endpoint overrides, session token) that could reach a test."""
    mp.setenv("AWS_ACCESS_KEY_ID", "testing")
    mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    mp.setenv("AWS_DEFAULT_REGION", region)
    mp.setenv("AWS_CONFIG_FILE", "/nonexistent/inboxd-test-aws-config")
    mp.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/inboxd-test-aws-credentials")
    for name in (
        "AWS_PROFILE",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_ENDPOINT_URL_SQS",
        "AWS_REGION",
        "AWS_SESSION_TOKEN",
        "AWS_SECURITY_TOKEN",
    ):
        mp.delenv(name, raising=False)


@pytest.fixture(scope="session")
def moto_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a moto server (S3, SQS, …) running for the whole session, with fake credentials.

    The fake credentials are set in the environment for the session so that the
    server, every botocore client in this process and every subprocess started
    with this environment (`inboxd run`) resolve them, and so no developer's
    ~/.aws profile or endpoint override can leak into a test.
    """
    with pytest.MonkeyPatch.context() as mp:
        isolate_aws_environment(mp)
        mp.setenv("AWS_SECURITY_TOKEN", "testing")
        mp.setenv("AWS_SESSION_TOKEN", "testing")

        host, port = "127.0.0.1", _free_port()
        log_path = Path(tmp_path_factory.mktemp("moto")) / "moto_server.log"
        with log_path.open("wb") as log:
            # Output goes to a file, not a pipe nobody reads, so the server can
            # never block on a full pipe buffer.
            proc = subprocess.Popen(
                [*_MOTO_SERVER, "-H", host, "-p", str(port)],
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
