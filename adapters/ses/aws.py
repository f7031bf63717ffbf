"""The two AWS services of the SES door, through aioboto3: SQS (the queue) and S3 (the
objects). The only module of the door that speaks to the SDK.

One aiobotocore client per service lives as long as the poller set. botocore's own
retries are off (one failed request is one error here): the queue is the retry
mechanism for a message (redelivery after the visibility timeout), and the few
calls retried in place (deletes, visibility changes) go through tenacity with
jitter (CONTRIBUTING.md rule 8). Credentials and region come from botocore's chain.

Object GETs skip the SDK's per-call machinery (`ObjectReader`): botocore spent
≈ 2.5 ms of CPU on each GetObject (endpoint rules evaluated again for every key,
hooks, response parsing: 75 % of the door's process, bench/README.md ses.py),
which bounded the door on a busy core. Each bucket's endpoint and signing region
are resolved once, by the SDK (a GetObject of a probe key built, signed and stopped
before it is sent); every GET is then
signed with botocore's own S3 SigV4 signer (the client's credentials, refreshed as
the SDK refreshes them) and sent on aiohttp. A bucket whose GET answers anything
but an object, a missing key, throttling or a server error (a redirect to another
region, a refusal) is read through the SDK from then on, which knows what to do.
"""

from __future__ import annotations

import contextvars
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, Self
from urllib.parse import quote, urlsplit

import aioboto3
import aiohttp
import anyio
import structlog
import yarl
from aiobotocore.config import AioConfig
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.exceptions import BotoCoreError, ClientError
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
    wait_random,
)

from inboxd.adapters.ses.config import SesSettings
from inboxd.adapters.ses.errors import SesPermanent, SesTransient

__all__ = ["AwsClients", "ObjectReader", "QueueMessage"]

log = structlog.get_logger(__name__)

# TCP/TLS connect; an endpoint silent for 5 s is down (botocore's default is 60 s).
AWS_CONNECT_TIMEOUT_S = 5.0
# A request's answer beyond the long poll itself: SQS and S3 answer in well under a
# second; 30 s means the connection is stuck.
AWS_CALL_TIMEOUT_S = 30.0
# Object bodies are read in chunks of this size, so a size limit is enforced as
# the bytes arrive, not after they are all in memory.
S3_READ_CHUNK_BYTES = 256 * 1024
# Slowest transfer accepted for an object body: 1 MiB/s on top of the fixed part.
S3_MIN_THROUGHPUT_BYTES_PER_S = 1024 * 1024
# Connections per client, at least: the S3 client holds fetch_concurrency GETs and
# the object deletes; the SQS client the receive loops, the deletes, the heartbeat
# (poller.py). AWS_SPARE_CONNECTIONS covers the deletes and the rest.
AWS_MAX_POOL_CONNECTIONS = 32
AWS_SPARE_CONNECTIONS = 8
# DeleteMessageBatch / ChangeMessageVisibilityBatch take at most 10 entries (SQS API).
SQS_BATCH_ENTRIES = 10
# Attempts for the entries of a batch call that failed on the server's side.
SQS_BATCH_ATTEMPTS = 4
# Closing a client drains aiohttp's pool; never allowed to hang a shutdown.
AWS_CLOSE_TIMEOUT_S = 5.0

# The key of the presigned URL that gives a bucket's endpoint (never fetched).
_PROBE_KEY = "inboxd-endpoint-probe"
# An error answer's body is read this far for its <Code>.
_ERROR_BODY_BYTES = 64 * 1024

# S3 answers these when the object (or its bucket) is not there: permanent for the
# message that points at it. AccessDenied is left transient on purpose: it is an
# operator's policy to fix, and the message becomes poison if it never is.
_MISSING_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "404", "NotFound"})
# SQS entries that can never succeed: the receipt handle is stale (another consumer
# holds the message now) or the message is already gone.
_STALE_HANDLE_CODES = frozenset(
    {"ReceiptHandleIsInvalid", "InvalidParameterValue", "MessageNotInflight"}
)


@dataclass(frozen=True, slots=True)
class QueueMessage:
    """One received SQS message."""

    message_id: str
    receipt_handle: str
    body: str
    receive_count: int


class AwsClients:
    """The SQS and S3 clients of one poller set: `async with AwsClients(settings) as aws`."""

    def __init__(self, settings: SesSettings, session: aioboto3.Session | None = None) -> None:
        self.settings = settings
        self._session = session if session is not None else aioboto3.Session()
        self._stack: AsyncExitStack | None = None
        self._sqs: Any = None
        self._s3: Any = None
        self._objects: ObjectReader | None = None

    async def __aenter__(self) -> Self:
        stack = AsyncExitStack()
        settings = self.settings
        base = {
            "connect_timeout": AWS_CONNECT_TIMEOUT_S,
            "max_pool_connections": max(
                AWS_MAX_POOL_CONNECTIONS,
                settings.fetch_concurrency + settings.pollers + AWS_SPARE_CONNECTIONS,
            ),
            "retries": {"mode": "standard", "total_max_attempts": 1},
        }
        try:
            self._sqs = await stack.enter_async_context(
                self._session.client(
                    "sqs",
                    endpoint_url=self.settings.endpoint_url,
                    region_name=self.settings.region,
                    # the long poll holds the answer up to wait_time_s
                    config=AioConfig(
                        read_timeout=self.settings.wait_time_s + AWS_CALL_TIMEOUT_S, **base
                    ),
                )
            )
            self._s3 = await stack.enter_async_context(
                self._session.client(
                    "s3",
                    endpoint_url=self.settings.endpoint_url,
                    region_name=self.settings.region,
                    config=AioConfig(
                        read_timeout=AWS_CALL_TIMEOUT_S,
                        request_checksum_calculation="when_required",
                        response_checksum_validation="when_required",
                        **base,
                    ),
                )
            )
            self._objects = ObjectReader(self._s3, base["max_pool_connections"])  # type: ignore[arg-type]
            stack.push_async_callback(self._objects.close)
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            with anyio.CancelScope(shield=True), anyio.move_on_after(AWS_CLOSE_TIMEOUT_S):
                await stack.aclose()

    # --- SQS ------------------------------------------------------------------------------

    async def receive(self) -> list[QueueMessage]:
        """One long poll: up to max_messages, waiting up to wait_time_s for the first."""
        s = self.settings
        answer = await self._sqs_call(
            "receive_message",
            QueueUrl=s.queue_url,
            MaxNumberOfMessages=s.max_messages,
            WaitTimeSeconds=s.wait_time_s,
            VisibilityTimeout=s.visibility_timeout_s,
            AttributeNames=["ApproximateReceiveCount"],
        )
        out = []
        for m in answer.get("Messages", []):
            count = m.get("Attributes", {}).get("ApproximateReceiveCount", "1")
            out.append(
                QueueMessage(
                    message_id=m["MessageId"],
                    receipt_handle=m["ReceiptHandle"],
                    body=m.get("Body", ""),
                    receive_count=int(count) if str(count).isdigit() else 1,
                )
            )
        return out

    async def delete(self, messages: Sequence[QueueMessage]) -> list[QueueMessage]:
        """DeleteMessageBatch in tens, retrying entries that failed on SQS's side;
        answers the messages that could not be deleted (they will come back and the
        cascade answers duplicate)."""
        return await self._batch("delete_message_batch", messages, {})

    async def set_visibility(
        self, messages: Sequence[QueueMessage], seconds: int
    ) -> list[QueueMessage]:
        """ChangeMessageVisibilityBatch: extend (still working) or release (0) them."""
        return await self._batch(
            "change_message_visibility_batch", messages, {"VisibilityTimeout": seconds}
        )

    async def _batch(
        self, operation: str, messages: Sequence[QueueMessage], extra: dict[str, Any]
    ) -> list[QueueMessage]:
        failed: list[QueueMessage] = []
        for start in range(0, len(messages), SQS_BATCH_ENTRIES):
            pending = {str(i): m for i, m in enumerate(messages[start : start + SQS_BATCH_ENTRIES])}
            try:
                async for attempt in AsyncRetrying(
                    stop=stop_after_attempt(SQS_BATCH_ATTEMPTS),
                    wait=wait_exponential(multiplier=0.2, max=5) + wait_random(0, 0.2),
                    retry=retry_if_exception_type(SesTransient),
                    reraise=True,
                ):
                    with attempt:
                        pending = await self._batch_once(operation, pending, extra, failed)
                        if pending:
                            raise SesTransient(f"sqs {operation}: {len(pending)} entries failed")
            except SesTransient:
                failed.extend(pending.values())
        return failed

    async def _batch_once(
        self,
        operation: str,
        chunk: dict[str, QueueMessage],
        extra: dict[str, Any],
        failed: list[QueueMessage],
    ) -> dict[str, QueueMessage]:
        """One batch call. Entries that can never succeed (stale handle) go to
        `failed`; answers those worth another try (failed on SQS's side)."""
        entries = [{"Id": i, "ReceiptHandle": m.receipt_handle, **extra} for i, m in chunk.items()]
        answer = await self._sqs_call(operation, QueueUrl=self.settings.queue_url, Entries=entries)
        retry: dict[str, QueueMessage] = {}
        for entry in answer.get("Failed", []):
            message = chunk.get(entry.get("Id", ""))
            if message is None:
                continue
            if entry.get("SenderFault") or entry.get("Code") in _STALE_HANDLE_CODES:
                failed.append(message)
            else:
                retry[entry["Id"]] = message
        return retry

    async def _sqs_call(self, operation: str, **params: Any) -> dict[str, Any]:
        try:
            result: dict[str, Any] = await getattr(self._sqs, operation)(**params)
            return result
        except ClientError as exc:
            raise SesTransient(f"sqs {operation}: {_code(exc)}") from exc
        except (BotoCoreError, aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise SesTransient(f"sqs {operation}: {type(exc).__name__}") from exc

    # --- S3 -------------------------------------------------------------------------------

    async def fetch(self, bucket: str, key: str, *, max_bytes: int) -> bytes:
        """The object's bytes, streamed; SesPermanent when it is missing or larger than
        `max_bytes` (refused from Content-Length before reading, or as soon as the
        stream passes the limit); SesTransient for throttling, 5xx, network."""
        assert self._objects is not None
        if bucket not in self._objects.sdk_buckets:
            answer = await self._objects.fetch(bucket, key, max_bytes=max_bytes)
            if answer is not None:
                return answer
        return await self._fetch_sdk(bucket, key, max_bytes=max_bytes)

    async def _fetch_sdk(self, bucket: str, key: str, *, max_bytes: int) -> bytes:
        where = f"s3://{bucket}/{key}"
        try:
            with anyio.fail_after(AWS_CALL_TIMEOUT_S):
                response = await self._s3.get_object(Bucket=bucket, Key=key)
        except ClientError as exc:
            code = _code(exc)
            if code in _MISSING_CODES:
                raise SesPermanent("object_missing", f"{where}: {code}") from None
            raise SesTransient(f"s3 get {where}: {code}") from exc
        except (BotoCoreError, aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise SesTransient(f"s3 get {where}: {type(exc).__name__}") from exc
        size = int(response.get("ContentLength") or 0)
        body = response["Body"]  # aiobotocore's StreamingBody: read(amt) streams
        try:
            _refuse_size(where, size, max_bytes)
            return await _read_limited(body.read, where, size, max_bytes)
        finally:
            body.close()  # an unread remainder is dropped with the connection

    async def delete_object(self, bucket: str, key: str) -> None:
        try:
            with anyio.fail_after(AWS_CALL_TIMEOUT_S):
                await self._s3.delete_object(Bucket=bucket, Key=key)
        except ClientError as exc:
            raise SesTransient(f"s3 delete s3://{bucket}/{key}: {_code(exc)}") from exc
        except (BotoCoreError, aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise SesTransient(f"s3 delete s3://{bucket}/{key}: {type(exc).__name__}") from exc


def _refuse_size(where: str, size: int, max_bytes: int) -> None:
    if size > max_bytes:
        raise SesPermanent(
            "too_large", f"{where}: {size} bytes, over max_message_bytes {max_bytes}"
        )


async def _read_limited(read: Any, where: str, size: int, max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    try:
        with anyio.fail_after(AWS_CALL_TIMEOUT_S + size / S3_MIN_THROUGHPUT_BYTES_PER_S):
            while chunk := await read(S3_READ_CHUNK_BYTES):
                total += len(chunk)
                if total > max_bytes:  # Content-Length lied or was absent
                    raise SesPermanent("too_large", f"{where}: over max_message_bytes {max_bytes}")
                chunks.append(chunk)
    except (BotoCoreError, aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise SesTransient(f"s3 get {where}: body: {type(exc).__name__}") from exc
    return b"".join(chunks)


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code") or "error")


# Set while ObjectReader._base has the SDK build a GetObject that is not to be sent.
_DRY_RUN: contextvars.ContextVar[bool] = contextvars.ContextVar("ses_s3_dry_run", default=False)


class _Resolved(Exception):
    """A dry-run GetObject, stopped before it was sent: its URL and Authorization."""

    def __init__(self, url: str, authorization: str) -> None:
        super().__init__(url)
        self.url, self.authorization = url, authorization


def _stop_dry_run(request: Any, **_: Any) -> None:
    """botocore's before-send hook: a dry run's request goes no further."""
    if _DRY_RUN.get():
        authorization = request.headers.get("Authorization", b"")
        if isinstance(authorization, bytes):
            authorization = authorization.decode("ascii", "replace")
        raise _Resolved(str(request.url), authorization)


class ObjectReader:
    """S3 GetObject on aiohttp, signed by botocore's S3 SigV4 signer (module docstring).

    `fetch` answers None when the SDK should read the object instead (the bucket's
    endpoint could not be resolved, or it answered something only the SDK handles);
    the bucket joins `sdk_buckets` then and is not tried here again."""

    def __init__(self, client: Any, connections: int) -> None:
        self._client = client
        client.meta.events.register("before-send.s3.GetObject", _stop_dry_run)
        self._session = aiohttp.ClientSession(
            connector=_connector_like(client, connections),
            timeout=aiohttp.ClientTimeout(sock_connect=AWS_CONNECT_TIMEOUT_S),
            auto_decompress=False,
            trust_env=True,  # HTTPS_PROXY / NO_PROXY, as botocore honours them
        )
        self._bases: dict[str, tuple[str, str]] = {}  # bucket → (URL before the key, region)
        self.sdk_buckets: set[str] = set()

    async def close(self) -> None:
        await self._session.close()

    async def _base(self, bucket: str) -> tuple[str, str]:
        """The URL a key of `bucket` is appended to and the region to sign for, exactly
        as the SDK's GetObject resolves them (path or virtual-hosted style, the
        regional endpoint, FIPS, a custom endpoint_url): one GetObject of a probe key
        is built and signed by the SDK and stopped before it is sent."""
        base = self._bases.get(bucket)
        if base is None:
            token = _DRY_RUN.set(True)
            try:
                await self._client.get_object(Bucket=bucket, Key=_PROBE_KEY)
            except _Resolved as resolved:
                url, authorization = resolved.url, resolved.authorization
            else:  # pragma: no cover (the hook always stops it)
                raise ValueError("the SDK's GetObject was not stopped before it was sent")
            finally:
                _DRY_RUN.reset(token)
            parts = urlsplit(url)
            if not parts.path.endswith("/" + _PROBE_KEY):
                raise ValueError("unexpected GetObject URL shape")
            # "AWS4-HMAC-SHA256 Credential=key/date/region/s3/aws4_request, …"
            scope = authorization.split("Credential=", 1)[1].split(",", 1)[0].split("/")
            if scope[3] != "s3":
                raise ValueError("not signed for s3")
            prefix = f"{parts.scheme}://{parts.netloc}{parts.path[: -len(_PROBE_KEY)]}"
            base = self._bases[bucket] = (prefix, scope[2])
        return base

    async def _signed(self, bucket: str, key: str) -> tuple[str, dict[str, str]]:
        prefix, region = await self._base(bucket)
        # the key as the SDK puts it in the path (its S3 signer signs the path as sent)
        url = prefix + quote(key, safe="/~")
        credentials = await self._client._request_signer._credentials.get_frozen_credentials()
        request = AWSRequest(method="GET", url=url)
        S3SigV4Auth(credentials, "s3", region).add_auth(request)
        return url, dict(request.headers.items())

    async def fetch(self, bucket: str, key: str, *, max_bytes: int) -> bytes | None:
        where = f"s3://{bucket}/{key}"
        try:
            url, headers = await self._signed(bucket, key)
        except (BotoCoreError, ClientError, ValueError, KeyError, IndexError, AttributeError):
            self.sdk_buckets.add(bucket)  # no endpoint or credentials here: the SDK says why
            return None
        try:
            with anyio.fail_after(AWS_CALL_TIMEOUT_S):
                response = await self._session.get(
                    yarl.URL(url, encoded=True), headers=headers, allow_redirects=False
                )
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise SesTransient(f"s3 get {where}: {type(exc).__name__}") from exc
        try:
            if response.status != 200:
                await self._refused(bucket, where, response)  # raises, or: the SDK's turn
                response.release()
                return None
            size = response.content_length or 0
            _refuse_size(where, size, max_bytes)
            raw = await _read_limited(response.content.read, where, size, max_bytes)
        except BaseException:
            response.close()  # an unread remainder is dropped with the connection
            raise
        response.release()
        return raw

    async def _refused(self, bucket: str, where: str, response: aiohttp.ClientResponse) -> None:
        """An answer other than the object: missing (permanent), throttled or a server
        error (transient, like the SDK's), or one for the SDK to handle (None)."""
        try:
            with anyio.fail_after(AWS_CALL_TIMEOUT_S):
                text = await response.content.read(_ERROR_BODY_BYTES)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise SesTransient(f"s3 get {where}: {type(exc).__name__}") from exc
        code = _xml_code(text) or str(response.status)
        if response.status == 404 and code == "NoSuchKey":
            raise SesPermanent("object_missing", f"{where}: {code}")
        # anything else permanent (NoSuchBucket: the wrong endpoint?) the SDK confirms
        if response.status == 503 or response.status >= 500:
            raise SesTransient(f"s3 get {where}: {code}")
        log.info("ses_object_read_through_sdk", bucket=bucket, status=response.status, code=code)
        self.sdk_buckets.add(bucket)
        return None


def _connector_like(client: Any, connections: int) -> aiohttp.TCPConnector:
    """A connector with the client's own TLS settings (AWS_CA_BUNDLE, `ca_bundle`, a
    client certificate, verification off), built by aiobotocore's HTTP session as it
    builds its own; a plain one (system trust store) if that is not to be had."""
    http = getattr(getattr(client, "_endpoint", None), "http_session", None)
    build = getattr(http, "_create_connector", None)
    if build is not None:
        try:
            connector = build(None)
        except Exception:  # an aiobotocore of another shape: the defaults  # noqa: S110
            pass
        else:
            if isinstance(connector, aiohttp.TCPConnector):
                return connector
    return aiohttp.TCPConnector(limit=connections)


def _xml_code(body: bytes) -> str | None:
    """The <Code> of an S3 error document."""
    start = body.find(b"<Code>")
    end = body.find(b"</Code>", start)
    if start < 0 or end < 0:
        return None
    return body[start + len("<Code>") : end].decode("utf-8", "replace").strip() or None
