"""The two AWS services of the SES door, through aioboto3: SQS (the queue) and S3 (the
objects). The only module of the door that speaks to the SDK.

One aiobotocore client per service lives as long as the poller set. botocore's own
retries are off (one failed request is one error here): the queue is the retry
mechanism for a message (redelivery after the visibility timeout), and the few
calls retried in place (deletes, visibility changes) go through tenacity with
jitter (CONTRIBUTING.md rule 8). Credentials and region come from botocore's chain.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, Self

import aioboto3
import aiohttp
import anyio
from aiobotocore.config import AioConfig
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

__all__ = ["AwsClients", "QueueMessage"]

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
            if size > max_bytes:
                raise SesPermanent(
                    "too_large", f"{where}: {size} bytes, over max_message_bytes {max_bytes}"
                )
            return await _read_limited(body, where, size, max_bytes)
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


async def _read_limited(stream: Any, where: str, size: int, max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    try:
        with anyio.fail_after(AWS_CALL_TIMEOUT_S + size / S3_MIN_THROUGHPUT_BYTES_PER_S):
            while chunk := await stream.read(S3_READ_CHUNK_BYTES):
                total += len(chunk)
                if total > max_bytes:  # Content-Length lied or was absent
                    raise SesPermanent("too_large", f"{where}: over max_message_bytes {max_bytes}")
                chunks.append(chunk)
    except (BotoCoreError, aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise SesTransient(f"s3 get {where}: body: {type(exc).__name__}") from exc
    return b"".join(chunks)


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code") or "error")
