"""The SES door under `inboxd run` (issue 12): forwarded mail from moto's S3 and SQS.

Each test has a queue and a bucket of its own on the session's moto server
(helpers/ses_queue.make_queue), a database of its own and a daemon subprocess
whose main file carries an `[ses]` table pointing at moto; the fake AWS
credentials moto_endpoint puts in the environment reach the daemon through it.
Short long polls (wait_time_s 1) and visibility timeouts (10 s, the least the
config takes) keep redelivery within seconds.
"""

from __future__ import annotations

import hashlib
import http.client
import signal
import subprocess
import time
from email.message import EmailMessage
from pathlib import Path
from typing import Any
from urllib.parse import quote, quote_plus

import aiohttp
import anyio
import asyncpg
import orjson
import pytest
import yarl
from aiohttp import web
from harness import DaemonProcess, generated_messages, ses_table, write_config, write_ses_tenant
from helpers import CliResult, cli_env, run_cli_async
from helpers.ses_queue import Aws, make_queue, ses_notification
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.slow,
    pytest.mark.own_database,  # daemon subprocesses (tests/conftest.py)
]

SUPPORT = "support@acme.example"
WAIT_S = 60
# Redelivery within seconds: 10 s is the smallest visibility_timeout_s [ses] takes.
VISIBILITY_S = 10
FAST_POLLS = {"wait_time_s": 1, "visibility_timeout_s": VISIBILITY_S, "max_messages": 10}


@pytest.fixture
def aws(moto_endpoint: str) -> Aws:
    """A queue and a bucket of this test's own."""
    return make_queue(moto_endpoint)


def ses_config(
    tmp: Path,
    aws: Aws,
    *,
    tenants: dict[str, dict[str, dict[str, Any]]] | None = None,
    shutdown_deadline_s: float = 20.0,
    endpoint: str | None = None,
    **ses: int | str,
) -> Path:
    """Main file with `[ses]` on the test's queue (through `endpoint` when given, else
    moto's own); tenant files of ses mailboxes (default: acme/support for SUPPORT)."""
    tenants = tenants or {"acme": {"support": {"addresses": [SUPPORT]}}}
    config = write_config(
        tmp,
        tenants={tenant: [] for tenant in tenants},
        shutdown_deadline_s=shutdown_deadline_s,
        extra_main=ses_table(aws.queue_url, endpoint or aws.endpoint, **{**FAST_POLLS, **ses}),
    )
    for tenant, mailboxes in tenants.items():
        write_ses_tenant(tmp, tenant, mailboxes)
    return config


def start(tmp: Path, config: Path, dsn: str, name: str = "daemon") -> DaemonProcess:
    daemon = DaemonProcess(config, dsn, tmp / f"{name}.log")
    daemon.wait_ready()
    return daemon


def stop(*daemons: DaemonProcess) -> None:
    """SIGTERM each daemon still running; each must exit 0 (killed if it hangs)."""
    for daemon in daemons:
        if daemon.exited() is None:
            daemon.signal(signal.SIGTERM)
    codes = []
    for daemon in daemons:
        try:
            codes.append(daemon.wait_exit(60))
        except subprocess.TimeoutExpired:
            daemon.kill()
            codes.append(None)
    for daemon, code in zip(daemons, codes, strict=True):
        assert code == 0, daemon.log_tail()


async def fetch(dsn: str, sql: str, *args: Any) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetch(sql, *args)
    finally:
        await conn.close()


async def fetchval(dsn: str, sql: str, *args: Any) -> Any:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(sql, *args)
    finally:
        await conn.close()


async def copies(dsn: str) -> int:
    return int(await fetchval(dsn, "SELECT count(*) FROM message_copies"))


async def wait_copies(dsn: str, daemon: DaemonProcess, n: int, timeout_s: float = WAIT_S) -> None:
    await daemon.eventually(
        lambda: copies(dsn), timeout_s, what=f"{n} message copies", until=lambda got: got == n
    )


async def wait_queue_empty(aws: Aws, daemon: DaemonProcess, timeout_s: float = WAIT_S) -> None:
    await daemon.eventually(
        aws.queue_counts, timeout_s, what="the queue empty", until=lambda c: c == (0, 0)
    )


async def door_counters(port: int) -> dict[str, float]:
    """inboxd_queue_door_messages of /metrics, {what: value}."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
            assert response.status == 200
            text = await response.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "inboxd_queue_door_messages":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                out[sample.labels["what"]] = sample.value
    return out


async def status(tmp: Path, dsn: str, *args: str) -> CliResult:
    """`inboxd status ARGS` against the test's database; it must exit 0."""
    result = await run_cli_async("status", *args, "--dsn", dsn, env=cli_env(tmp / "data"))
    assert result.code == 0, result.stderr
    return result


def sha256(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


# SendMessageBatch takes at most 10 entries (SQS API reference).
SQS_SEND_BATCH = 10


def put_raw(aws: Aws, items: list[tuple[str, bytes]]) -> None:
    """PutObject straight over HTTP (path-style, unsigned: moto does not check): a
    fifth of boto3's cost per object, which is what seeding a thousand takes."""
    url = yarl.URL(aws.endpoint)
    conn = http.client.HTTPConnection(url.host or "127.0.0.1", url.port, timeout=30)
    try:
        for key, raw in items:
            conn.request("PUT", f"/{aws.bucket}/{quote(key)}", body=raw)
            response = conn.getresponse()
            response.read()
            assert response.status == 200, (key, response.status)
    finally:
        conn.close()


def send_batch(aws: Aws, bodies: list[dict[str, object]]) -> None:
    entries = [
        {"Id": str(i), "MessageBody": orjson.dumps(b).decode()} for i, b in enumerate(bodies)
    ]
    answer = aws.sqs.send_message_batch(QueueUrl=aws.queue_url, Entries=entries)  # type: ignore[attr-defined]
    assert not answer.get("Failed"), answer["Failed"]


# Request headers not passed on (hop-by-hop, or set again by the proxy's client).
_REQUEST_HEADERS_DROPPED = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}
)
_RESPONSE_HEADERS_DROPPED = frozenset({"content-length", "transfer-encoding", "connection"})
_PROXY_CHUNK_BYTES = 64 * 1024


class AwsProxy:
    """An HTTP proxy of the test's between the daemon and moto (S3 and SQS share
    the daemon's endpoint_url), to see and bend what crosses the wire:

    - `object_bytes[key]`: bytes of each S3 object body passed on to the daemon
      (a body the daemon stops reading is cut off at once: its connection closes);
    - `hide_length`: object keys whose body goes out chunked, without
      Content-Length, as a server that does not announce sizes would send it;
    - `lose_deletes`: the first that many receipt handles of each message the daemon
      tries to delete answer a server-side failure (SQS's partial-failure answer),
      retries included, so the message stays in the queue and comes back after its
      visibility timeout. Counted on the deletes the daemon sends, not on the
      deliveries moto hands out: a long-poll answer that never reaches the daemon
      would otherwise doom a delivery the daemon did not see (CI saw one);
    - `throttle_gets[key]`: that many GETs of the object answer S3's 503 SlowDown.
    """

    def __init__(self, upstream: str, bucket: str) -> None:
        self.upstream = upstream
        self.bucket = bucket
        self.url = ""
        self.object_bytes: dict[str, int] = {}
        self.hide_length: set[str] = set()
        self.lose_deletes = 0
        self.lost_deletes = 0
        self.throttle_gets: dict[str, int] = {}
        self._message_of: dict[str, str] = {}  # receipt handle → SQS message id
        self._lost_of: dict[str, int] = {}  # SQS message id → receipt handles doomed
        self._doomed: set[str] = set()  # receipt handles whose delete is lost
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> AwsProxy:
        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=1024**3)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None and self._session is not None
        await self._runner.cleanup()
        await self._session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        key = request.path.removeprefix(f"/{self.bucket}/")
        if request.method == "GET" and self.throttle_gets.get(key, 0) > 0:
            self.throttle_gets[key] -= 1
            return web.Response(status=503, body=_SLOW_DOWN, content_type="application/xml")
        target = request.headers.get("X-Amz-Target", "")
        lost: list[dict[str, Any]] = []
        if target == "AmazonSQS.DeleteMessageBatch" and self.lose_deletes:
            document = orjson.loads(body)
            entries = document["Entries"]
            lost = [e for e in entries if self._doom(e["ReceiptHandle"])]
            if lost:
                self.lost_deletes += len(lost)
                kept = [e for e in entries if e not in lost]
                if not kept:
                    return web.json_response({"Successful": [], "Failed": _failed(lost)})
                body = orjson.dumps({**document, "Entries": kept})
        headers = {
            k: v for k, v in request.headers.items() if k.lower() not in _REQUEST_HEADERS_DROPPED
        }
        assert self._session is not None
        async with self._session.request(
            request.method,
            yarl.URL(self.upstream + request.raw_path, encoded=True),
            headers=headers,
            data=body,
        ) as upstream:
            if target == "AmazonSQS.ReceiveMessage" or lost:
                answer = await upstream.read()
                return self._sqs_answer(upstream, answer, target, lost)
            return await self._stream(request, upstream)

    def _sqs_answer(
        self,
        upstream: aiohttp.ClientResponse,
        answer: bytes,
        target: str,
        lost: list[dict[str, Any]],
    ) -> web.Response:
        document = orjson.loads(answer) if answer else {}
        if target == "AmazonSQS.ReceiveMessage":
            for message in document.get("Messages", []):
                self._message_of[message["ReceiptHandle"]] = message["MessageId"]
        if lost:
            document["Failed"] = [*document.get("Failed", []), *_failed(lost)]
            answer = orjson.dumps(document)
        headers = {
            k: v for k, v in upstream.headers.items() if k.lower() not in _RESPONSE_HEADERS_DROPPED
        }
        return web.Response(status=upstream.status, body=answer, headers=headers)

    def _doom(self, handle: str) -> bool:
        """Is this delete lost? Every try of a doomed handle is."""
        if handle in self._doomed:
            return True
        message = self._message_of.get(handle, "")
        if self._lost_of.get(message, 0) >= self.lose_deletes:
            return False
        self._lost_of[message] = self._lost_of.get(message, 0) + 1
        self._doomed.add(handle)
        return True

    async def _stream(
        self, request: web.Request, upstream: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        prefix = f"/{self.bucket}/"
        key = (
            request.path[len(prefix) :]
            if request.method == "GET" and request.path.startswith(prefix)
            else None
        )
        response = web.StreamResponse(
            status=upstream.status,
            headers={
                k: v
                for k, v in upstream.headers.items()
                if k.lower() not in _RESPONSE_HEADERS_DROPPED
            },
        )
        if key in self.hide_length or upstream.content_length is None:
            response.enable_chunked_encoding()
        else:
            response.content_length = upstream.content_length
        await response.prepare(request)
        sent = 0
        try:
            async for chunk in upstream.content.iter_chunked(_PROXY_CHUNK_BYTES):
                await response.write(chunk)
                sent += len(chunk)
            await response.write_eof()
        except ConnectionError:
            pass  # the daemon stopped reading and closed the connection
        finally:
            if key is not None:
                self.object_bytes[key] = self.object_bytes.get(key, 0) + sent
        return response


# S3's throttling answer (S3 API reference, "Error responses": SlowDown, 503).
_SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>T1</RequestId></Error>"
)


def _failed(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "Id": e["Id"],
            "SenderFault": False,
            "Code": "InternalError",
            "Message": "We encountered an internal error. Please try again.",
        }
        for e in entries
    ]


# --- 1. a forwarded mail end to end, each pointer shape -----------------------------------


def s3_event(bucket: str, key: str) -> dict[str, object]:
    """An S3 event notification (S3 user guide, "Event message structure")."""
    return {
        "Records": [
            {
                "eventVersion": "2.1",
                "eventSource": "aws:s3",
                "awsRegion": "us-east-1",
                "eventTime": "2026-12-01T10:00:00.000Z",
                "eventName": "ObjectCreated:Put",
                "s3": {
                    "s3SchemaVersion": "1.0",
                    "bucket": {"name": bucket, "arn": f"arn:aws:s3:::{bucket}"},
                    "object": {"key": quote_plus(key), "size": 1},
                },
            }
        ]
    }


def versioned(bucket: str, key: str, ses_id: str, recipients: list[str]) -> dict[str, object]:
    return {
        "version": 1,
        "provider": "ses",
        "sesMessageId": ses_id,
        "s3Bucket": bucket,
        "s3Key": key,
        "recipients": recipients,
        "receivedAt": "2026-12-01T10:00:00Z",
    }


async def test_a_forwarded_mail_of_each_pointer_shape_becomes_rows_and_leaves_the_queue(
    tmp_path: Path, db_dsn: str, aws: Aws
) -> None:
    raws = generated_messages(4, tag="shape")
    keys = ["ses/plain", "ses/sns", "s3 event/forwarded mail+1", "ses/versioned"]
    for key, raw in zip(keys, raws, strict=True):
        aws.put(key, raw)
    aws.send(ses_notification(aws.bucket, keys[0], "ses-plain", [SUPPORT]))
    aws.send(ses_notification(aws.bucket, keys[1], "ses-sns", [SUPPORT], sns=True))
    aws.send({"Service": "Amazon S3", "Event": "s3:TestEvent", "Bucket": aws.bucket})
    aws.send(s3_event(aws.bucket, keys[2]))  # no envelope: routed by the To header
    aws.send(versioned(aws.bucket, keys[3], "ses-versioned", [SUPPORT]))

    # the SNS envelope carries the SNS guide's example signature, which no certificate
    # here verifies (test_a_forged_sns_envelope_… and tests/adapters/ses/test_sns_envelope.py
    # check signatures)
    config = ses_config(tmp_path, aws, verify_sns_signature=False)
    daemon = start(tmp_path, config, db_dsn)
    try:
        await wait_copies(db_dsn, daemon, 4)
        await wait_queue_empty(aws, daemon)
        rows = await fetch(
            db_dsn,
            "SELECT c.external_id, c.raw_sha256, m.subject FROM message_copies c "
            "JOIN messages m USING (tenant_id, message_id) "
            "WHERE c.tenant_id = 'acme' AND c.mailbox_id = 'support' ORDER BY m.subject",
        )
        # external id: the SES message id, else the (URL-decoded) S3 key; bytes exact
        assert [(r["external_id"], r["raw_sha256"], r["subject"]) for r in rows] == [
            ("ses-plain", sha256(raws[0]), "Order shape-0"),
            ("ses-sns", sha256(raws[1]), "Order shape-1"),
            (keys[2], sha256(raws[2]), "Order shape-2"),
            ("ses-versioned", sha256(raws[3]), "Order shape-3"),
        ]
        assert await fetchval(db_dsn, "SELECT count(*) FROM dead_items") == 0
        assert await fetchval(db_dsn, "SELECT count(*) FROM unrouted_items") == 0
        assert sorted(aws.keys()) == sorted(keys)  # keep_objects defaults to true
    finally:
        stop(daemon)


def message_from(sender: str, to: str, tag: str) -> bytes:
    msg = EmailMessage()
    msg["From"] = sender
    msg["To"] = to
    msg["Subject"] = f"Invoice {tag}"
    msg["Date"] = "Mon, 02 Nov 2026 09:30:00 +0000"
    msg["Message-ID"] = f"<{tag}@vendor.example>"
    msg.set_content(f"Invoice {tag}.\n")
    return msg.as_bytes()


async def test_recipients_route_to_each_tenant_and_an_allowlist_refuses_in_its_own_mailbox(
    tmp_path: Path, db_dsn: str, aws: Aws
) -> None:
    tenants = {
        "acme": {"support": {"addresses": [SUPPORT]}},
        "beta": {
            "help": {
                "addresses": ["help@beta.example", "@billing.beta.example"],
                "allowed_senders": ["*@vendor.example"],
            }
        },
    }
    aws.put("in/both", generated_messages(1, tag="both")[0])  # From sender0@example.org
    aws.put("in/invoice", message_from("billing@vendor.example", "ap@billing.beta.example", "i1"))
    aws.put("in/sub", generated_messages(1, tag="sub")[0])
    aws.send(ses_notification(aws.bucket, "in/both", "ses-both", [SUPPORT, "help@beta.example"]))
    aws.send(ses_notification(aws.bucket, "in/invoice", "ses-invoice", ["AP@Billing.Beta.example"]))
    aws.send(ses_notification(aws.bucket, "in/sub", "ses-sub", ["Support+orders@ACME.example"]))

    daemon = start(tmp_path, ses_config(tmp_path, aws, tenants=tenants), db_dsn)
    try:
        await wait_copies(db_dsn, daemon, 3)
        await wait_queue_empty(aws, daemon)
        stored = await fetch(
            db_dsn, "SELECT tenant_id, mailbox_id, external_id FROM message_copies ORDER BY 1, 3"
        )
        assert [tuple(r) for r in stored] == [
            ("acme", "support", "ses-both"),
            ("acme", "support", "ses-sub"),
            ("beta", "help", "ses-invoice"),
        ]
        dead = await fetch(
            db_dsn, "SELECT tenant_id, mailbox_id, external_id, reason FROM dead_items"
        )
        assert [tuple(r) for r in dead] == [("beta", "help", "ses-both", "sender_refused")]
        assert await fetchval(db_dsn, "SELECT count(*) FROM unrouted_items") == 0
    finally:
        stop(daemon)


async def test_sighup_routes_a_new_ses_mailbox(tmp_path: Path, db_dsn: str, aws: Aws) -> None:
    sales = "sales@acme.example"
    raws = generated_messages(2, tag="hup")
    aws.put("in/0", raws[0])
    aws.put("in/1", raws[1])
    daemon = start(tmp_path, ses_config(tmp_path, aws), db_dsn)
    try:
        aws.send(ses_notification(aws.bucket, "in/0", "ses-before", [sales]))
        await daemon.eventually(
            lambda: fetchval(db_dsn, "SELECT reason FROM unrouted_items"),
            WAIT_S,
            what="an unrouted item for a mailbox not configured yet",
        )
        write_ses_tenant(
            tmp_path,
            "acme",
            {"support": {"addresses": [SUPPORT]}, "sales": {"addresses": [sales]}},
        )
        daemon.signal(signal.SIGHUP)
        await daemon.eventually(
            lambda: any(e.get("event") == "config_reloaded" for e in daemon.events()),
            WAIT_S,
            what="config_reloaded",
        )
        aws.send(ses_notification(aws.bucket, "in/1", "ses-after", [sales]))
        await wait_copies(db_dsn, daemon, 1)
        await wait_queue_empty(aws, daemon)
        stored = await fetch(db_dsn, "SELECT mailbox_id, external_id FROM message_copies")
        assert [tuple(r) for r in stored] == [("sales", "ses-after")]
        unrouted = await fetch(db_dsn, "SELECT external_id, reason FROM unrouted_items")
        assert [tuple(r) for r in unrouted] == [("ses-before", "no_mailbox")]
    finally:
        stop(daemon)


# --- 2. poison → dead, deleted, and the queue keeps flowing ------------------------------


def receive_without_keeping(aws: Aws, times: int) -> None:
    """Receive the queue's one message `times` times and let it go at once, as a
    consumer that crashed would: its ApproximateReceiveCount is then `times`."""
    for _ in range(times):
        answer = aws.sqs.receive_message(  # type: ignore[attr-defined]
            QueueUrl=aws.queue_url, MaxNumberOfMessages=1, WaitTimeSeconds=1, VisibilityTimeout=0
        )
        assert len(answer.get("Messages", [])) == 1


async def test_a_forged_sns_envelope_is_not_followed_and_the_queue_keeps_flowing(
    tmp_path: Path, db_dsn: str, aws: Aws, moto_endpoint: str
) -> None:
    """A pointer someone wrote onto the queue in SNS's signed shape, naming a bucket
    the daemon can read but is not the door's, with a certificate of their own:
    verify_sns_signature is on by default, so it is never followed (issue 22)."""
    elsewhere = make_queue(moto_endpoint)
    [secret, genuine] = generated_messages(2, tag="forged")
    elsewhere.put("secret", secret)
    aws.put("in/genuine", genuine)
    forged = ses_notification(elsewhere.bucket, "secret", "ses-forged", [SUPPORT], sns=True)
    forged["SigningCertURL"] = "https://certs.forger.example/SimpleNotificationService-1.pem"
    aws.send(forged)
    aws.send(versioned(aws.bucket, "in/genuine", "ses-genuine", [SUPPORT]))

    daemon = start(tmp_path, ses_config(tmp_path, aws), db_dsn)
    try:
        await wait_queue_empty(aws, daemon)  # each deleted once settled: rows committed
        stored = await fetch(db_dsn, "SELECT external_id FROM message_copies")
        assert [r[0] for r in stored] == ["ses-genuine"]
        unrouted = await fetch(db_dsn, "SELECT reason, detail, body FROM unrouted_items")
        assert [r["reason"] for r in unrouted] == ["sns_unverified"]
        assert "SigningCertURL" in unrouted[0]["detail"]
        assert "ses-forged" in unrouted[0]["body"]  # kept for an operator to judge
        assert "ses_unrouted" in daemon.log_path.read_text()
    finally:
        stop(daemon)


async def test_poison_pointers_are_dead_items_deleted_and_the_queue_keeps_flowing(
    tmp_path: Path, db_dsn: str, aws: Aws
) -> None:
    raws = generated_messages(6, tag="flow")
    for i, raw in enumerate(raws):
        aws.put(f"in/{i}", raw)
    # received twice already (a consumer crashed twice): poison at max_receive_count 2
    aws.send(ses_notification(aws.bucket, "in/0", "ses-received-too-often", [SUPPORT]))
    receive_without_keeping(aws, 2)
    aws.send("this is not JSON")
    aws.send({"notificationType": "Bounce", "mail": {}, "receipt": {}})
    aws.send(ses_notification(aws.bucket, "in/missing", "ses-missing", [SUPPORT]))
    aws.send(ses_notification(aws.bucket, "in/1", "ses-nobody", ["nobody@elsewhere.example"]))
    for i in range(2, 6):
        aws.send(ses_notification(aws.bucket, f"in/{i}", f"ses-good-{i}", [SUPPORT]))

    daemon = start(tmp_path, ses_config(tmp_path, aws, max_receive_count=2), db_dsn)
    try:
        await wait_copies(db_dsn, daemon, 4)
        await wait_queue_empty(aws, daemon)
        stored = await fetch(db_dsn, "SELECT external_id FROM message_copies ORDER BY 1")
        assert [r[0] for r in stored] == [f"ses-good-{i}" for i in range(2, 6)]
        dead = await fetch(
            db_dsn,
            "SELECT tenant_id, mailbox_id, external_id, reason FROM dead_items ORDER BY reason",
        )
        assert [tuple(r) for r in dead] == [
            ("acme", "support", "ses-missing", "object_missing"),
            ("acme", "support", "ses-received-too-often", "poison"),
        ]
        unrouted = await fetch(
            db_dsn, "SELECT reason, body, recipients FROM unrouted_items ORDER BY reason, body"
        )
        assert [(r["reason"], r["recipients"]) for r in unrouted] == [
            ("invalid_pointer", []),
            ("invalid_pointer", []),
            ("no_mailbox", ["nobody@elsewhere.example"]),
        ]
        # the pointer is kept for a replay
        assert "this is not JSON" in [r["body"] for r in unrouted]
        assert '"ses-nobody"' in unrouted[2]["body"]
    finally:
        stop(daemon)


# --- 3. the database away mid-run --------------------------------------------------------


def put_and_send(aws: Aws, raws: list[bytes], tag: str) -> list[str]:
    """Each raw as an object and an SES notification for SUPPORT; their SES ids."""
    ids = []
    for i, raw in enumerate(raws):
        aws.put(f"{tag}/{i}", raw)
        aws.send(ses_notification(aws.bucket, f"{tag}/{i}", f"{tag}-{i}", [SUPPORT]))
        ids.append(f"{tag}-{i}")
    return ids


async def test_messages_received_while_the_database_is_away_are_stored_once_after_it_returns(
    tmp_path: Path, db_dsn: str, server_dsn: str, aws: Aws
) -> None:
    database = await fetchval(db_dsn, "SELECT current_database()")
    daemon = start(tmp_path, ses_config(tmp_path, aws), db_dsn)
    port = daemon.port
    assert port is not None
    admin = await asyncpg.connect(server_dsn)  # another database: it may lock this one
    try:
        before = put_and_send(aws, generated_messages(3, tag="before"), "before")
        await wait_copies(db_dsn, daemon, 3)
        await wait_queue_empty(aws, daemon)

        # New connections refused and the existing ones gone: the database is away.
        await admin.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS false')
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1", database
        )
        during = put_and_send(aws, generated_messages(5, tag="during"), "during")
        await daemon.eventually(
            lambda: door_counters(port),
            WAIT_S,
            what="messages left for redelivery while the database is away",
            until=lambda c: c.get("left", 0) >= 1,
        )
        assert sum(aws.queue_counts()) == 5  # none deleted

        await admin.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')
        await wait_copies(db_dsn, daemon, 8)
        await wait_queue_empty(aws, daemon)
        stored = await fetch(db_dsn, "SELECT external_id FROM message_copies ORDER BY 1")
        assert [r[0] for r in stored] == sorted(before + during)
        assert await fetchval(db_dsn, "SELECT count(*) FROM messages") == 8
        assert await fetchval(db_dsn, "SELECT count(*) FROM dead_items") == 0
        assert await fetchval(db_dsn, "SELECT count(*) FROM unrouted_items") == 0
        counters = await door_counters(port)
        assert counters["received"] > 8  # redelivered after the visibility timeout
        assert counters["stored"] == 8
    finally:
        await admin.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')
        await admin.close()
        stop(daemon)


async def test_an_s3_throttle_leaves_the_message_for_redelivery_and_status_says_why(
    tmp_path: Path, db_dsn: str, aws: Aws
) -> None:
    raws = generated_messages(2, tag="slow")
    aws.put("in/slow", raws[0])
    aws.put("in/fine", raws[1])
    async with AwsProxy(aws.endpoint, aws.bucket) as proxy:
        proxy.throttle_gets["in/slow"] = 1
        daemon = DaemonProcess(
            ses_config(tmp_path, aws, endpoint=proxy.url), db_dsn, tmp_path / "daemon.log"
        )
        try:
            port = await anyio.to_thread.run_sync(daemon.wait_ready)
            aws.send(ses_notification(aws.bucket, "in/slow", "ses-slow", [SUPPORT]))
            aws.send(ses_notification(aws.bucket, "in/fine", "ses-fine", [SUPPORT]))
            await wait_copies(db_dsn, daemon, 2, timeout_s=VISIBILITY_S + WAIT_S)
            await wait_queue_empty(aws, daemon)
            assert proxy.throttle_gets["in/slow"] == 0
            counters = await door_counters(port)
            assert {k: counters.get(k) for k in ("received", "stored", "left", "dead")} == {
                "received": 3,
                "stored": 2,
                "left": 1,
                "dead": None,
            }
            assert await fetchval(db_dsn, "SELECT count(*) FROM dead_items") == 0

            async def pollers() -> list[dict[str, Any]]:
                answer = await status(tmp_path, db_dsn, "--queues", "--json")
                return orjson.loads(answer.stdout)

            (row,) = await daemon.eventually(
                pollers,
                WAIT_S,
                what="the poller's totals in inboxd status",
                until=lambda rows: len(rows) == 1 and rows[0]["stored"] == 2,
            )
            assert row["left_for_retry"] == 1
            assert "SlowDown" in row["last_error"] and "in/slow" in row["last_error"]
        finally:
            await anyio.to_thread.run_sync(stop, daemon)


# --- 4. redelivery of a message already stored -------------------------------------------


async def test_a_stored_message_redelivered_after_its_visibility_timeout_is_a_duplicate(
    tmp_path: Path, db_dsn: str, aws: Aws
) -> None:
    raw = generated_messages(1, tag="again")[0]
    aws.put("in/again", raw)
    async with AwsProxy(aws.endpoint, aws.bucket) as proxy:
        proxy.lose_deletes = 1  # stored, but the delete after commit is lost
        config = ses_config(tmp_path, aws, endpoint=proxy.url)
        daemon = DaemonProcess(config, db_dsn, tmp_path / "daemon.log")
        try:
            port = await anyio.to_thread.run_sync(daemon.wait_ready)
            aws.send(ses_notification(aws.bucket, "in/again", "ses-again", [SUPPORT]))
            await wait_copies(db_dsn, daemon, 1)
            # SQS shows it again after VISIBILITY_S; the second delivery is deleted
            await wait_queue_empty(aws, daemon, timeout_s=VISIBILITY_S + WAIT_S)
            assert proxy.lost_deletes >= 1
            counters = await door_counters(port)
            assert (counters["received"], counters["stored"], counters["duplicate"]) == (2, 1, 1)
            assert await copies(db_dsn) == 1
            assert await fetchval(db_dsn, "SELECT count(*) FROM messages") == 1
            created = "SELECT count(*) FROM events WHERE kind = 'message.created'"
            assert await fetchval(db_dsn, created) == 1
        finally:
            await anyio.to_thread.run_sync(stop, daemon)


async def test_a_stored_message_redelivered_past_max_receive_count_is_a_duplicate(
    tmp_path: Path, db_dsn: str, aws: Aws
) -> None:
    aws.put("in/again", generated_messages(1, tag="past")[0])
    async with AwsProxy(aws.endpoint, aws.bucket) as proxy:
        proxy.lose_deletes = 2  # stored at once; the first two deletes are lost
        config = ses_config(tmp_path, aws, endpoint=proxy.url, max_receive_count=2)
        daemon = DaemonProcess(config, db_dsn, tmp_path / "daemon.log")
        try:
            port = await anyio.to_thread.run_sync(daemon.wait_ready)
            aws.send(ses_notification(aws.bucket, "in/again", "ses-past", [SUPPORT]))
            await wait_copies(db_dsn, daemon, 1)
            # the third delivery is past max_receive_count; its delete goes through
            await wait_queue_empty(aws, daemon, timeout_s=2 * VISIBILITY_S + WAIT_S)
            counters = await door_counters(port)
            assert (counters["received"], counters["stored"]) == (3, 1)
            assert await copies(db_dsn) == 1
            dead = await fetch(db_dsn, "SELECT external_id, reason, detail FROM dead_items")
            assert [tuple(r) for r in dead] == []
            assert counters.get("duplicate") == 2
        finally:
            await anyio.to_thread.run_sync(stop, daemon)


async def test_a_notification_queued_twice_is_stored_once(
    tmp_path: Path, db_dsn: str, aws: Aws
) -> None:
    raws = generated_messages(3, tag="twice")
    for i, raw in enumerate(raws):
        aws.put(f"in/{i}", raw)
    # SNS delivers at least once: one notification can reach the queue twice
    for i in (0, 1, 0, 2, 1):
        aws.send(ses_notification(aws.bucket, f"in/{i}", f"ses-twice-{i}", [SUPPORT]))
    daemon = start(tmp_path, ses_config(tmp_path, aws), db_dsn)
    try:
        await wait_queue_empty(aws, daemon)
        stored = await fetch(db_dsn, "SELECT external_id FROM message_copies ORDER BY 1")
        assert [r[0] for r in stored] == ["ses-twice-0", "ses-twice-1", "ses-twice-2"]
        assert await fetchval(db_dsn, "SELECT count(*) FROM messages") == 3
        assert await fetchval(db_dsn, "SELECT count(*) FROM dead_items") == 0
        counters = await door_counters(daemon.port or 0)
        assert (counters["stored"], counters["duplicate"]) == (3, 2)
    finally:
        stop(daemon)


async def test_keep_objects_false_deletes_the_object_and_a_late_redelivery_is_a_duplicate(
    tmp_path: Path, db_dsn: str, aws: Aws
) -> None:
    raw = generated_messages(1, tag="drop")[0]
    aws.put("in/drop", raw)
    pointer = ses_notification(aws.bucket, "in/drop", "ses-drop", [SUPPORT])
    tenants = {"acme": {"support": {"addresses": [SUPPORT], "keep_objects": False}}}
    daemon = start(tmp_path, ses_config(tmp_path, aws, tenants=tenants), db_dsn)
    try:
        aws.send(pointer)
        await wait_copies(db_dsn, daemon, 1)
        await wait_queue_empty(aws, daemon)
        await daemon.eventually(
            aws.keys, WAIT_S, what="the object deleted", until=lambda k: k == []
        )
        raw_key = await fetchval(db_dsn, "SELECT raw_key FROM message_copies")
        assert raw_key  # the raw copy lives in inboxd's object store now

        aws.send(pointer)  # SNS delivers at least once: the same notification again
        await wait_queue_empty(aws, daemon)
        counters = await door_counters(daemon.port or 0)
        assert (counters["stored"], counters.get("duplicate"), counters.get("dead")) == (
            1,
            1,
            None,
        )
        assert await copies(db_dsn) == 1
        assert await fetchval(db_dsn, "SELECT count(*) FROM dead_items") == 0
        assert await fetchval(db_dsn, "SELECT count(*) FROM unrouted_items") == 0
    finally:
        stop(daemon)


# --- 5. two daemons on one queue ---------------------------------------------------------

COMPETING_MESSAGES = 1000
# moto's ReceiveMessage costs time in proportion to the messages in the queue times
# those it answers (it recounts the queue for each message: moto 5.x
# is_message_valid_based_on_retention_period), ~2.5 s per receive at 1,000 deep on
# this VM; fed this many ahead of what is stored, a receive costs ~0.1 s.
FEED_AHEAD = 40


async def test_two_daemons_on_one_queue_store_a_thousand_messages_once(
    tmp_path: Path, db_dsn: str, aws: Aws
) -> None:
    raws = generated_messages(COMPETING_MESSAGES, tag="many")
    put_raw(aws, [(f"many/{i}", raw) for i, raw in enumerate(raws)])
    pointers = [
        ses_notification(aws.bucket, f"many/{i}", f"many-{i}", [SUPPORT])
        for i in range(COMPETING_MESSAGES)
    ]
    config = ses_config(tmp_path, aws)
    first = DaemonProcess(config, db_dsn, tmp_path / "first.log")
    second = DaemonProcess(config, db_dsn, tmp_path / "second.log")
    try:
        first.wait_ready()
        second.wait_ready()
        for start in range(0, COMPETING_MESSAGES, SQS_SEND_BATCH):
            await first.eventually(
                lambda: copies(db_dsn),
                WAIT_S,
                what=f"fewer than {FEED_AHEAD} messages waiting",
                until=lambda stored, sent=start: sent - stored < FEED_AHEAD,
            )
            send_batch(aws, pointers[start : start + SQS_SEND_BATCH])
        await wait_copies(db_dsn, first, COMPETING_MESSAGES)
        await wait_queue_empty(aws, first)
        stored = await fetch(db_dsn, "SELECT external_id FROM message_copies ORDER BY 1")
        assert [r[0] for r in stored] == sorted(p["mail"]["messageId"] for p in pointers)  # type: ignore[index]
        assert await fetchval(db_dsn, "SELECT count(*) FROM messages") == COMPETING_MESSAGES
        assert await fetchval(db_dsn, "SELECT count(*) FROM dead_items") == 0
        # both consumed: the queue was shared, not drained by one of them
        one, two = await door_counters(first.port or 0), await door_counters(second.port or 0)
        assert one.get("stored", 0) > 0 and two.get("stored", 0) > 0
        assert one.get("stored", 0) + two.get("stored", 0) == COMPETING_MESSAGES
    finally:
        stop(first, second)


# --- 6. an object over max_message_bytes -------------------------------------------------

BIG_BYTES = 48 * 1024 * 1024
LIMIT_BYTES = 1024 * 1024


async def test_an_object_over_the_size_limit_is_dead_without_being_read_whole(
    tmp_path: Path, db_dsn: str, aws: Aws
) -> None:
    big = b"X-Filler: " + b"y" * (BIG_BYTES - 12) + b"\r\n"
    aws.put("big/announced", big)
    aws.put("big/unannounced", big)
    small = generated_messages(1, tag="small")[0]
    aws.put("in/small", small)
    async with AwsProxy(aws.endpoint, aws.bucket) as proxy:
        proxy.hide_length.add("big/unannounced")  # no Content-Length: refused mid-stream
        config = ses_config(tmp_path, aws, endpoint=proxy.url, max_message_bytes=LIMIT_BYTES)
        daemon = DaemonProcess(config, db_dsn, tmp_path / "daemon.log")
        try:
            await anyio.to_thread.run_sync(daemon.wait_ready)
            aws.send(ses_notification(aws.bucket, "big/announced", "ses-big", [SUPPORT]))
            aws.send(s3_event(aws.bucket, "big/unannounced"))
            aws.send(ses_notification(aws.bucket, "in/small", "ses-small", [SUPPORT]))
            await wait_copies(db_dsn, daemon, 1)
            await wait_queue_empty(aws, daemon)

            dead = await fetch(db_dsn, "SELECT external_id, reason, detail FROM dead_items")
            assert [(r["external_id"], r["reason"]) for r in dead] == [("ses-big", "too_large")]
            # refused from the announced size, before reading the body
            assert f"{len(big)} bytes, over max_message_bytes {LIMIT_BYTES}" in dead[0]["detail"]
            unrouted = await fetch(db_dsn, "SELECT external_id, reason FROM unrouted_items")
            assert [tuple(r) for r in unrouted] == [("big/unannounced", "too_large")]
            assert (await fetch(db_dsn, "SELECT external_id FROM message_copies"))[0][0] == (
                "ses-small"
            )
            # what crossed the wire: the small one whole, the big ones cut short
            assert proxy.object_bytes["in/small"] == len(small)
            assert proxy.object_bytes["big/announced"] < BIG_BYTES / 4, proxy.object_bytes
            assert proxy.object_bytes["big/unannounced"] < BIG_BYTES / 4, proxy.object_bytes
        finally:
            await anyio.to_thread.run_sync(stop, daemon)


# --- 7. SIGTERM mid-batch ----------------------------------------------------------------

# The drain deadline of the SIGTERM tests: short, so a held batch is given up quickly.
SHORT_DEADLINE_S = 2.0


async def test_mail_queued_while_the_daemon_is_down_is_stored_after_restart(
    tmp_path: Path, db_dsn: str, aws: Aws
) -> None:
    """Issue 22's property for the SES door: SQS keeps what SES announces while no
    daemon polls, and the next one stores it, once."""
    ids = [f"down-{i}" for i in range(6)]
    put_raw(aws, [(f"in/{i}", raw) for i, raw in enumerate(generated_messages(6, tag="down"))])

    def announce(*numbers: int) -> None:
        send_batch(
            aws, [ses_notification(aws.bucket, f"in/{i}", ids[i], [SUPPORT]) for i in numbers]
        )

    config = ses_config(tmp_path, aws)
    first = start(tmp_path, config, db_dsn, "first")
    try:
        announce(0, 1)
        await wait_copies(db_dsn, first, 2)
        await wait_queue_empty(aws, first)
    finally:
        stop(first)
    announce(2, 3, 4)  # nobody polling
    assert aws.queue_counts() == (3, 0)

    second = start(tmp_path, config, db_dsn, "second")
    try:
        await wait_copies(db_dsn, second, 5)
        announce(5)
        await wait_copies(db_dsn, second, 6)
        await wait_queue_empty(aws, second)
        stored = await fetch(db_dsn, "SELECT external_id FROM message_copies ORDER BY 1")
        assert [r[0] for r in stored] == sorted(ids)
        assert await fetchval(db_dsn, "SELECT count(*) FROM messages") == 6
        assert await fetchval(db_dsn, "SELECT count(*) FROM dead_items") == 0
        for daemon in (first, second):  # batches it deleted itself are no visibility lost
            assert "ses_visibility_lost" not in daemon.log_path.read_text()
    finally:
        stop(second)


async def test_sigterm_while_a_batch_cannot_commit_releases_it_and_a_restart_stores_it_once(
    tmp_path: Path, db_dsn: str, aws: Aws
) -> None:
    ids = [f"held-{i}" for i in range(32)]
    put_raw(aws, [(f"held/{i}", raw) for i, raw in enumerate(generated_messages(32, tag="held"))])
    config = ses_config(tmp_path, aws, shutdown_deadline_s=SHORT_DEADLINE_S)
    first = start(tmp_path, config, db_dsn, "first")
    port = first.port or 0
    lock = await asyncpg.connect(db_dsn)
    lock_tx = None
    try:
        send_batch(
            aws, [ses_notification(aws.bucket, f"held/{i}", ids[i], [SUPPORT]) for i in (0, 1)]
        )
        await wait_copies(db_dsn, first, 2)
        await wait_queue_empty(aws, first)
        # inserts of new messages wait behind this lock: batches are held mid-ingest
        lock_tx = lock.transaction()
        await lock_tx.start()
        await lock.execute("LOCK TABLE messages IN SHARE ROW EXCLUSIVE MODE")
        for start_at in range(2, 32, SQS_SEND_BATCH):
            send_batch(
                aws,
                [
                    ses_notification(aws.bucket, f"held/{i}", ids[i], [SUPPORT])
                    for i in range(start_at, min(start_at + SQS_SEND_BATCH, 32))
                ],
            )
        # (a long poll answers with what has arrived so far: a batch may be 1 message)
        await first.eventually(
            aws.queue_counts, WAIT_S, what="a batch in flight", until=lambda c: c[1] >= 1
        )
        # held past their visibility timeout: the heartbeat keeps them ours, so none
        # became visible again (nor was received twice)
        held_since = time.monotonic()
        await first.eventually(
            lambda: time.monotonic() - held_since,
            VISIBILITY_S * 3,
            what="one and a half visibility timeouts",
            until=lambda held_s: held_s > VISIBILITY_S * 1.5,
        )
        visible, in_flight = aws.queue_counts()
        assert (await door_counters(port)).get("received") == 2 + in_flight
        assert visible + in_flight == 30
        first.signal(signal.SIGTERM)
        code = await anyio.to_thread.run_sync(first.wait_exit, SHORT_DEADLINE_S + 30)
        assert code == 0, first.log_tail()
        # released at the deadline, not deleted: all visible again at once
        assert aws.queue_counts() == (30, 0), first.log_tail()
        assert await copies(db_dsn) == 2
    finally:
        if lock_tx is not None:
            await lock_tx.rollback()
        await lock.close()
        first.kill()

    second = start(tmp_path, config, db_dsn, "second")
    try:
        await wait_copies(db_dsn, second, 32)
        await wait_queue_empty(aws, second)
        stored = await fetch(db_dsn, "SELECT external_id FROM message_copies ORDER BY 1")
        assert [r[0] for r in stored] == sorted(ids)
        assert await fetchval(db_dsn, "SELECT count(*) FROM messages") == 32
        assert await fetchval(db_dsn, "SELECT count(*) FROM dead_items") == 0
    finally:
        stop(second)


async def test_sigterm_mid_stream_loses_nothing_and_deletes_only_what_was_stored(
    tmp_path: Path, db_dsn: str, aws: Aws
) -> None:
    total = 120
    raws = generated_messages(total, tag="term")
    put_raw(aws, [(f"term/{i}", raw) for i, raw in enumerate(raws)])
    ids = [f"term-{i}" for i in range(total)]
    for start_at in range(0, total, SQS_SEND_BATCH):
        send_batch(
            aws,
            [
                ses_notification(aws.bucket, f"term/{i}", ids[i], [SUPPORT])
                for i in range(start_at, start_at + SQS_SEND_BATCH)
            ],
        )
    config = ses_config(tmp_path, aws)
    first = start(tmp_path, config, db_dsn, "first")
    try:
        await first.eventually(lambda: copies(db_dsn), WAIT_S, what="the first rows")
        first.signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(first.wait_exit, 60) == 0, first.log_tail()
    finally:
        first.kill()
    stored_at_exit = await copies(db_dsn)
    visible, in_flight = aws.queue_counts()
    assert stored_at_exit < total  # stopped mid-stream
    # every message is stored or still in the queue; none deleted without its rows
    assert stored_at_exit + visible + in_flight >= total

    second = start(tmp_path, config, db_dsn, "second")
    try:
        # messages a cut-short receive took stay hidden for their visibility timeout
        await wait_copies(db_dsn, second, total, timeout_s=VISIBILITY_S + WAIT_S)
        await wait_queue_empty(aws, second)
        stored = await fetch(db_dsn, "SELECT external_id FROM message_copies ORDER BY 1")
        assert [r[0] for r in stored] == sorted(ids)
        assert await fetchval(db_dsn, "SELECT count(*) FROM messages") == total
    finally:
        stop(second)


# --- 8. the poller in `inboxd status` and /metrics ----------------------------------------


async def test_status_and_metrics_show_the_poller(tmp_path: Path, db_dsn: str, aws: Aws) -> None:
    raws = generated_messages(2, tag="seen")
    put_raw(aws, [("in/0", raws[0]), ("in/1", raws[1])])
    send_batch(
        aws,
        [
            ses_notification(aws.bucket, "in/0", "ses-0", [SUPPORT]),
            ses_notification(aws.bucket, "in/1", "ses-1", [SUPPORT]),
            ses_notification(aws.bucket, "in/gone", "ses-gone", [SUPPORT]),
            {"neither": "shape"},
        ],
    )
    daemon = start(tmp_path, ses_config(tmp_path, aws), db_dsn)
    try:
        await wait_copies(db_dsn, daemon, 2)
        await wait_queue_empty(aws, daemon)
        counters = await door_counters(daemon.port or 0)
        assert {k: counters.get(k) for k in ("received", "stored", "dead", "unrouted")} == {
            "received": 4,
            "stored": 2,
            "dead": 1,
            "unrouted": 1,
        }
        assert counters["deleted"] == 4

        door = f"ses:{aws.queue_url.rsplit('/', 1)[-1]}"

        async def pollers() -> list[dict[str, Any]]:
            return orjson.loads((await status(tmp_path, db_dsn, "--queues", "--json")).stdout)

        (row,) = await daemon.eventually(
            pollers,
            WAIT_S,
            what="the poller's totals in inboxd status",
            until=lambda rows: len(rows) == 1 and rows[0]["received"] == 4,
        )
        assert row["door"] == door
        assert {
            k: row[k]
            for k in ("stored", "duplicates", "dead", "unrouted", "unrouted_open", "left_for_retry")
        } == {
            "stored": 2,
            "duplicates": 0,
            "dead": 1,
            "unrouted": 1,
            "unrouted_open": 1,
            "left_for_retry": 0,
        }
        assert row["last_error"] is None
        # the plain table: mailboxes, then the pollers
        text = (await status(tmp_path, db_dsn)).stdout
        assert "support" in text
        header, line = text.split("QUEUE", 1)[1].splitlines()[:2]
        assert "RECEIVED" in header and "UNROUTED" in header
        assert line.split()[0] == door and line.split()[2:6] == ["4", "2", "0", "1"]
    finally:
        stop(daemon)
