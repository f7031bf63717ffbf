"""A stand-in for the SQS and S3 the SES door uses, in memory, with a latency per
call that the caller sets (issue 25: the door at the database's pace, measured
against a queue whose every call costs what AWS's does, not moto's CPU).

    async with FakeSesAws(latency_s=0.01) as fake:     # in this event loop
        fake.put("bucket", "in/1", raw)                 # or PutObject over HTTP
        fake.send(queue_url, body)                      # or SendMessage(Batch)
        fake.hold["in/1"] = anyio.Event()               # GET of in/1 waits for it
        fake.throttle["in/2"] = 1                       # one GET of in/2: 503 SlowDown
        ... fake.url is the endpoint_url of [ses] (S3 and SQS both) ...

    python tests/fakes/ses_aws.py --latency-ms 10 [--port P]   # a process of its own
        prints "listening on http://127.0.0.1:PORT" once it answers

What it speaks, as botocore sends it to an `endpoint_url`:

    SQS, JSON protocol (X-Amz-Target: AmazonSQS.<Action>, application/x-amz-json-1.0):
        CreateQueue, GetQueueUrl, GetQueueAttributes (approximate counts),
        SendMessage, SendMessageBatch, ReceiveMessage (MaxNumberOfMessages,
        WaitTimeSeconds long poll, VisibilityTimeout, ApproximateReceiveCount),
        DeleteMessage(Batch), ChangeMessageVisibility(Batch), PurgeQueue
    S3, path style: CreateBucket (PUT /b), PutObject (PUT /b/k), GetObject and
        HeadObject (GET/HEAD /b/k; NoSuchKey 404), DeleteObject (DELETE /b/k)

SQS semantics kept: a received message is invisible for its visibility timeout
and then received again (its ApproximateReceiveCount up by one, a new receipt
handle); only the current receipt handle deletes or changes it (an older one
answers ReceiptHandleIsInvalid, SenderFault — what real SQS says of a handle whose
message was received again); a long poll answers as soon as one message is
visible. Every request waits `latency_s` first (concurrent requests wait side
by side, as independent round trips do). With `secret_key`, every request's
SigV4 signature is computed again with botocore's signer and a wrong one is
refused (403 SignatureDoesNotMatch); without, none is checked. No MD5 of
attributes, no FIFO, no redrive. Counters for tests: `gets` per key,
`receives` (message ids per ReceiveMessage), `deletes` (message ids per
DeleteMessageBatch / DeleteMessage call).
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import itertools
import signal
import sys
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import Any

import anyio
import orjson
from aiohttp import web

__all__ = ["FakeSesAws"]

ACCOUNT = "123456789012"
_JSON = "application/x-amz-json-1.0"
# A long poll looks again this often for messages whose visibility ran out.
_POLL_S = 0.05
# Requests still open at exit (a client's idle keep-alive) are cut after this.
_SHUTDOWN_S = 1.0


@dataclass(slots=True)
class _Message:
    id: str
    body: str
    md5: str
    receive_count: int = 0
    handle: str | None = None  # the current receipt handle while in flight
    deadline: float = 0.0  # in flight until (monotonic)


@dataclass
class _Queue:
    name: str
    url: str
    messages: dict[str, _Message] = field(default_factory=dict)
    visible: OrderedDict[str, None] = field(default_factory=OrderedDict)
    in_flight: set[str] = field(default_factory=set)
    deadlines: list[tuple[float, int, str]] = field(default_factory=list)  # heap, lazy
    handles: dict[str, str] = field(default_factory=dict)  # current handle → message id
    arrived: anyio.Event = field(default_factory=anyio.Event)

    def expire(self, now: float) -> None:
        """Messages whose visibility ran out are visible again."""
        while self.deadlines and self.deadlines[0][0] <= now:
            deadline, _, mid = heapq.heappop(self.deadlines)
            m = self.messages.get(mid)
            if m is None or mid not in self.in_flight or m.deadline != deadline:
                continue  # deleted, or its visibility was changed since
            self._show(m)

    def _show(self, m: _Message) -> None:
        self.in_flight.discard(m.id)
        if m.handle is not None:
            self.handles.pop(m.handle, None)
            m.handle = None
        self.visible[m.id] = None
        self.arrived.set()
        self.arrived = anyio.Event()

    def hide(self, m: _Message, seconds: float, now: float) -> None:
        if seconds <= 0:
            self._show(m)
            return
        m.deadline = now + seconds
        heapq.heappush(self.deadlines, (m.deadline, next(_ticket), m.id))

    def send(self, body: str) -> _Message:
        m = _Message(str(uuid.uuid4()), body, hashlib.md5(body.encode()).hexdigest())  # noqa: S324 (SQS's MD5OfMessageBody)
        self.messages[m.id] = m
        self._show(m)
        return m

    def take(self, n: int, visibility: float, now: float) -> list[_Message]:
        self.expire(now)
        out = []
        while self.visible and len(out) < n:
            mid, _ = self.visible.popitem(last=False)
            m = self.messages[mid]
            m.receive_count += 1
            m.handle = uuid.uuid4().hex
            self.handles[m.handle] = mid
            self.in_flight.add(mid)
            self.hide(m, visibility, now)
            out.append(m)
        return out

    def delete(self, handle: str) -> bool:
        mid = self.handles.pop(handle, None)
        if mid is None:
            return False
        self.in_flight.discard(mid)
        self.visible.pop(mid, None)
        del self.messages[mid]
        return True


_ticket = itertools.count()


class SqsError(Exception):
    def __init__(self, code: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.code, self.message, self.status = code, message, status


class FakeSesAws:
    """SQS queues and S3 buckets in memory behind one HTTP endpoint (module docstring)."""

    def __init__(
        self,
        *,
        latency_s: float = 0.0,
        host: str = "127.0.0.1",
        port: int = 0,
        secret_key: str | None = None,
    ) -> None:
        self.latency_s = latency_s
        # Set: every request must carry a SigV4 signature made with this secret key
        # (checked with botocore's own signer), else 403 SignatureDoesNotMatch.
        self.secret_key = secret_key
        self.signed = 0  # requests whose signature was checked
        self.host, self.port = host, port
        self.url = ""
        self.queues: dict[str, _Queue] = {}  # by name
        self.buckets: dict[str, dict[str, bytes]] = {}
        self.hold: dict[str, anyio.Event] = {}  # object key → GET waits until set
        self.throttle: dict[str, int] = {}  # object key → GETs answered 503 SlowDown
        self.gets: dict[str, int] = {}
        self.receives: list[list[str]] = []
        self.deletes: list[list[str]] = []
        self.requests = 0
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> FakeSesAws:
        app = web.Application(client_max_size=1024**3)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # held GETs are let go at exit; a connection left open is not waited for
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=_SHUTDOWN_S)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = self._runner.addresses[0][1]
        self.url = f"http://{self.host}:{self.port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        for event in self.hold.values():
            event.set()
        if self._runner is not None:
            await self._runner.cleanup()

    # --- direct access (tests) -----------------------------------------------------------------

    def create_queue(self, name: str) -> str:
        if name not in self.queues:
            self.queues[name] = _Queue(name, f"{self.url}/{ACCOUNT}/{name}")
        return self.queues[name].url

    def put(self, bucket: str, key: str, raw: bytes) -> None:
        self.buckets.setdefault(bucket, {})[key] = raw

    def send(self, queue_url: str, body: str) -> str:
        return self._queue(queue_url).send(body).id

    def counts(self, queue_url: str) -> tuple[int, int]:
        """(visible, in flight) messages of the queue."""
        q = self._queue(queue_url)
        q.expire(time.monotonic())
        return len(q.visible), len(q.in_flight)

    def _queue(self, url: str) -> _Queue:
        name = str(url).rstrip("/").rsplit("/", 1)[-1]
        q = self.queues.get(name)
        if q is None:
            raise SqsError("AWS.SimpleQueueService.NonExistentQueue", "no such queue")
        return q

    # --- HTTP ----------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        body = await request.read()
        if self.latency_s:
            await anyio.sleep(self.latency_s)
        target = request.headers.get("X-Amz-Target", "")
        if self.secret_key is not None and not self._signature_holds(request, body):
            if target:
                return web.Response(
                    status=403,
                    body=orjson.dumps(
                        {"__type": "com.amazonaws.sqs#SignatureDoesNotMatch", "message": "no"}
                    ),
                    content_type=_JSON,
                )
            return _s3_error(403, "SignatureDoesNotMatch", request.path)
        if target.startswith("AmazonSQS."):
            return await self._sqs(target.removeprefix("AmazonSQS."), body)
        return await self._s3(request, body)

    def _signature_holds(self, request: web.Request, body: bytes) -> bool:
        """The request's SigV4 signature, computed again by botocore's signer from the
        headers it says it signed, the path as sent and this secret key."""
        from botocore.auth import S3SigV4Auth, SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials

        auth = request.headers.get("Authorization", "")
        if not auth.startswith("AWS4-HMAC-SHA256 "):
            return False
        fields = dict(
            part.strip().split("=", 1) for part in auth.removeprefix("AWS4-HMAC-SHA256 ").split(",")
        )
        access_key, _date, region, service, _ = fields["Credential"].split("/")
        signed = fields["SignedHeaders"].split(";")
        headers = {name: request.headers.get(name, "") for name in signed}
        url = f"http://{request.headers.get('Host', '')}{request.raw_path}"
        aws_request = AWSRequest(method=request.method, url=url, headers=headers, data=body)
        aws_request.context["timestamp"] = request.headers.get("X-Amz-Date", "")
        signer_class = S3SigV4Auth if service == "s3" else SigV4Auth
        signer = signer_class(Credentials(access_key, self.secret_key), service, region)
        canonical = signer.canonical_request(aws_request)
        expected = signer.signature(signer.string_to_sign(aws_request, canonical), aws_request)
        self.signed += 1
        return bool(expected == fields["Signature"])

    async def _sqs(self, action: str, body: bytes) -> web.Response:
        params: dict[str, Any] = orjson.loads(body) if body else {}
        handler = getattr(self, f"_sqs_{action}", None)
        try:
            if handler is None:
                raise SqsError("UnsupportedOperation", f"{action} is not supported here")
            answer = await handler(params)
        except SqsError as exc:
            return web.Response(
                status=exc.status,
                body=orjson.dumps(
                    {"__type": f"com.amazonaws.sqs#{exc.code}", "message": exc.message}
                ),
                content_type=_JSON,
                headers={"x-amzn-query-error": f"{exc.code};Sender"},
            )
        return web.Response(body=orjson.dumps(answer), content_type=_JSON)

    async def _sqs_CreateQueue(self, p: dict[str, Any]) -> dict[str, Any]:
        return {"QueueUrl": self.create_queue(p["QueueName"])}

    async def _sqs_GetQueueUrl(self, p: dict[str, Any]) -> dict[str, Any]:
        q = self.queues.get(p["QueueName"])
        if q is None:
            raise SqsError("AWS.SimpleQueueService.NonExistentQueue", "no such queue")
        return {"QueueUrl": q.url}

    async def _sqs_GetQueueAttributes(self, p: dict[str, Any]) -> dict[str, Any]:
        visible, in_flight = self.counts(p["QueueUrl"])
        return {
            "Attributes": {
                "ApproximateNumberOfMessages": str(visible),
                "ApproximateNumberOfMessagesNotVisible": str(in_flight),
                "ApproximateNumberOfMessagesDelayed": "0",
            }
        }

    async def _sqs_PurgeQueue(self, p: dict[str, Any]) -> dict[str, Any]:
        q = self._queue(p["QueueUrl"])
        self.queues[q.name] = _Queue(q.name, q.url)
        return {}

    async def _sqs_SendMessage(self, p: dict[str, Any]) -> dict[str, Any]:
        m = self._queue(p["QueueUrl"]).send(p["MessageBody"])
        return {"MessageId": m.id, "MD5OfMessageBody": m.md5}

    async def _sqs_SendMessageBatch(self, p: dict[str, Any]) -> dict[str, Any]:
        q = self._queue(p["QueueUrl"])
        done = []
        for entry in p.get("Entries", []):
            m = q.send(entry["MessageBody"])
            done.append({"Id": entry["Id"], "MessageId": m.id, "MD5OfMessageBody": m.md5})
        return {"Successful": done, "Failed": []}

    async def _sqs_ReceiveMessage(self, p: dict[str, Any]) -> dict[str, Any]:
        q = self._queue(p["QueueUrl"])
        n = int(p.get("MaxNumberOfMessages", 1))
        visibility = float(p.get("VisibilityTimeout", 30))
        until = time.monotonic() + float(p.get("WaitTimeSeconds", 0))
        while True:
            now = time.monotonic()
            got = q.take(n, visibility, now)
            if got or now >= until:
                break
            with anyio.move_on_after(min(_POLL_S, until - now)):
                await q.arrived.wait()
        self.receives.append([m.id for m in got])
        if not got:
            return {}
        return {
            "Messages": [
                {
                    "MessageId": m.id,
                    "ReceiptHandle": m.handle,
                    "MD5OfBody": m.md5,
                    "Body": m.body,
                    "Attributes": {"ApproximateReceiveCount": str(m.receive_count)},
                }
                for m in got
            ]
        }

    async def _sqs_DeleteMessage(self, p: dict[str, Any]) -> dict[str, Any]:
        q = self._queue(p["QueueUrl"])
        mid = q.handles.get(p["ReceiptHandle"])
        if not q.delete(p["ReceiptHandle"]):
            raise SqsError("ReceiptHandleIsInvalid", "the receipt handle is not current")
        self.deletes.append([mid] if mid else [])
        return {}

    async def _sqs_DeleteMessageBatch(self, p: dict[str, Any]) -> dict[str, Any]:
        q = self._queue(p["QueueUrl"])
        ok, failed, ids = [], [], []
        for entry in p.get("Entries", []):
            mid = q.handles.get(entry["ReceiptHandle"])
            if q.delete(entry["ReceiptHandle"]):
                ok.append({"Id": entry["Id"]})
                ids.append(mid)
            else:
                failed.append(_stale(entry["Id"]))
        self.deletes.append(ids)
        return {"Successful": ok, "Failed": failed}

    async def _sqs_ChangeMessageVisibility(self, p: dict[str, Any]) -> dict[str, Any]:
        q = self._queue(p["QueueUrl"])
        if not self._change(q, p["ReceiptHandle"], float(p["VisibilityTimeout"])):
            raise SqsError("ReceiptHandleIsInvalid", "the receipt handle is not current")
        return {}

    async def _sqs_ChangeMessageVisibilityBatch(self, p: dict[str, Any]) -> dict[str, Any]:
        q = self._queue(p["QueueUrl"])
        ok, failed = [], []
        for entry in p.get("Entries", []):
            if self._change(q, entry["ReceiptHandle"], float(entry.get("VisibilityTimeout", 0))):
                ok.append({"Id": entry["Id"]})
            else:
                failed.append(_stale(entry["Id"]))
        return {"Successful": ok, "Failed": failed}

    @staticmethod
    def _change(q: _Queue, handle: str, seconds: float) -> bool:
        now = time.monotonic()
        q.expire(now)
        mid = q.handles.get(handle)
        if mid is None or mid not in q.in_flight:
            return False
        q.hide(q.messages[mid], seconds, now)
        return True

    # --- S3 ------------------------------------------------------------------------------------

    async def _s3(self, request: web.Request, body: bytes) -> web.StreamResponse:
        bucket, _, key = request.path.lstrip("/").partition("/")
        from urllib.parse import unquote

        key = unquote(key)
        if request.method == "PUT" and not key:
            self.buckets.setdefault(bucket, {})
            return web.Response(status=200, headers={"Location": f"/{bucket}"})
        objects = self.buckets.get(bucket)
        if objects is None:
            return _s3_error(404, "NoSuchBucket", bucket)
        if request.method == "PUT":
            objects[key] = _unchunk(body, request.headers)
            return web.Response(status=200, headers={"ETag": _etag(objects[key])})
        if request.method == "DELETE":
            objects.pop(key, None)
            return web.Response(status=204)
        if request.method in ("GET", "HEAD"):
            if request.method == "GET":
                self.gets[key] = self.gets.get(key, 0) + 1
                held = self.hold.get(key)
                if held is not None:
                    await held.wait()
                if self.throttle.get(key, 0) > 0:
                    self.throttle[key] -= 1
                    return _s3_error(503, "SlowDown", key)
            raw = objects.get(key)
            if raw is None:
                return _s3_error(404, "NoSuchKey", key)
            headers = {
                "ETag": _etag(raw),
                "Last-Modified": formatdate(usegmt=True),
                "Content-Type": "message/rfc822",
            }
            if request.method == "HEAD":
                headers["Content-Length"] = str(len(raw))
                return web.Response(status=200, headers=headers)
            return web.Response(status=200, body=raw, headers=headers)
        return _s3_error(405, "MethodNotAllowed", request.method)


def _stale(entry_id: str) -> dict[str, Any]:
    return {
        "Id": entry_id,
        "SenderFault": True,
        "Code": "ReceiptHandleIsInvalid",
        "Message": "The receipt handle is not current",
    }


def _etag(raw: bytes) -> str:
    return '"' + hashlib.md5(raw).hexdigest() + '"'  # noqa: S324 (S3's ETag)


def _s3_error(status: int, code: str, what: str) -> web.Response:
    xml = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
        f"<Message>{code}</Message><Resource>{what}</Resource><RequestId>F1</RequestId></Error>"
    )
    return web.Response(status=status, body=xml.encode(), content_type="application/xml")


def _unchunk(body: bytes, headers: Any) -> bytes:
    """An aws-chunked upload body (botocore's streaming checksums) → its bytes."""
    if "aws-chunked" not in headers.get("Content-Encoding", ""):
        return body
    out, rest = [], body
    while rest:
        line, _, rest = rest.partition(b"\r\n")
        size = int(line.split(b";", 1)[0], 16)
        if size == 0:
            break
        out.append(rest[:size])
        rest = rest[size + 2 :]
    return b"".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--latency-ms", type=float, default=0.0)
    args = parser.parse_args()

    async def serve() -> None:
        async with FakeSesAws(
            latency_s=args.latency_ms / 1000, host=args.host, port=args.port
        ) as fake:
            print(f"listening on {fake.url}", flush=True)
            # SIGTERM (the benchmark stopping it) ends it like SIGINT, at once
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    return

    try:
        anyio.run(serve)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
