"""The SES door's pipeline under `inboxd run` (issue 25): a slow S3 object delays only
its own message, and a SIGTERM whose drain deadline finds it still waiting releases
it for the next daemon, which stores it once.

The daemon talks to the in-memory SQS/S3 stand-in (tests/fakes/ses_aws.py), served
from the test's own event loop so the test can hold one object's GET.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import anyio
import asyncpg
import orjson
import pytest
from fakes.ses_aws import FakeSesAws
from harness import DaemonProcess, generated_messages, ses_table, write_config, write_ses_tenant
from helpers.moto_server import isolate_aws_environment

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.slow,
    pytest.mark.own_database,  # daemon subprocesses (tests/conftest.py)
]

SUPPORT = "support@acme.example"
WAIT_S = 60
BUCKET = "inbound-mail"
# The drain deadline: short, so the held message is given up quickly.
SHORT_DEADLINE_S = 2.0


@pytest.fixture(autouse=True)
def fake_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon's botocore wants credentials (the stand-in checks none), and no
    developer's profile or endpoint override may reach it."""
    isolate_aws_environment(monkeypatch, "us-east-1")


async def copies(dsn: str) -> list[str]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT external_id FROM message_copies ORDER BY 1")
    finally:
        await conn.close()
    return [r[0] for r in rows]


def stop(daemon: DaemonProcess, timeout_s: float = 60) -> int | None:
    if daemon.exited() is None:
        daemon.signal(signal.SIGTERM)
    try:
        return daemon.wait_exit(timeout_s)
    except subprocess.TimeoutExpired:
        daemon.kill()
        return None


async def test_a_slow_object_delays_only_its_own_message_and_sigterm_releases_it(
    tmp_path: Path, db_dsn: str
) -> None:
    async with FakeSesAws(secret_key="testing") as fake:  # signatures checked
        queue_url = fake.create_queue("inbound")
        fake.buckets[BUCKET] = {}
        ids = [f"pipe-{i}" for i in range(25)]
        for i, raw in enumerate(generated_messages(25, tag="pipe")):
            fake.put(BUCKET, f"in/{i}", raw)
        slow = fake.hold["in/0"] = anyio.Event()
        config = write_config(
            tmp_path,
            tenants={"acme": []},
            shutdown_deadline_s=SHORT_DEADLINE_S,
            extra_main=ses_table(
                queue_url,
                fake.url,
                wait_time_s=1,
                visibility_timeout_s=10,
                pollers=1,  # one loop: waiting for its batch, it would store nothing more
                verify_sns_signature=False,
            ),
        )
        write_ses_tenant(tmp_path, "acme", {"support": {"addresses": [SUPPORT]}})
        for i, ses in enumerate(ids):
            pointer = {
                "version": 1,
                "provider": "ses",
                "sesMessageId": ses,
                "s3Bucket": BUCKET,
                "s3Key": f"in/{i}",
                "recipients": [SUPPORT],
            }
            fake.send(queue_url, orjson.dumps(pointer).decode())

        first = DaemonProcess(config, db_dsn, tmp_path / "first.log")
        try:
            await anyio.to_thread.run_sync(first.wait_ready)
            # the slow one's receive held ten; the other 24 (of that receive and the
            # next ones) become rows and leave the queue while its GET waits
            await first.eventually(
                lambda: copies(db_dsn),
                WAIT_S,
                what="every message but the slow one stored",
                until=lambda got: got == sorted(ids[1:]),
            )
            await first.eventually(
                lambda: fake.counts(queue_url),
                WAIT_S,
                what="all but the slow one deleted",
                until=(0, 1).__eq__,
            )
            assert fake.gets.get("in/0") == 1
            assert not [
                e for e in first.events() if e.get("event") == "ses_object_read_through_sdk"
            ]
            # SIGTERM: the drain deadline finds it waiting and releases it
            code = await anyio.to_thread.run_sync(stop, first)
            assert code == 0, first.log_tail()
            assert fake.counts(queue_url) == (1, 0), first.log_tail()
            stopped = [e for e in first.events() if e.get("event") == "ses_poller_stopped"]
            assert stopped and stopped[-1].get("released") == 1, first.log_tail()
        finally:
            first.kill()

        slow.set()
        second = DaemonProcess(config, db_dsn, tmp_path / "second.log")
        try:
            await anyio.to_thread.run_sync(second.wait_ready)
            await second.eventually(
                lambda: copies(db_dsn),
                WAIT_S,
                what="the slow one stored by the next daemon",
                until=lambda got: got == sorted(ids),
            )
            await second.eventually(
                lambda: fake.counts(queue_url), WAIT_S, what="an empty queue", until=(0, 0).__eq__
            )
            assert await anyio.to_thread.run_sync(stop, second) == 0, second.log_tail()
        finally:
            second.kill()
