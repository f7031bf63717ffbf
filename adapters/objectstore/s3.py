"""``ObjectStore`` on Amazon S3 (or an S3-compatible server) through aioboto3.

Production deployments keep raw MIME, large HTML bodies and attachments in a
bucket (docs/architecture.md §3) so replicas share them and the disk under PostgreSQL stays
small. This is the only module of the object-store adapter that speaks to the SDK;
everything the pipeline sees is the provider-free contract in
``inboxd.pipeline.objectstore.store``.

Choices an operator should know about:

* One aiobotocore client (and its connection pool) lives as long as the store:
  ``async with S3Store(...) as store`` or ``await store.start()`` … ``aclose()``.
* Every request runs under an ``anyio.fail_after`` deadline that grows with the
  payload size; a stuck connection becomes a retriable ``ObjectStoreError``.
* botocore's own retries are switched off: retries happen only through tenacity
  at the call site, with jitter and bounded attempts (CONTRIBUTING.md rule 8), so one
  failed request is one ``ObjectStoreError`` here.
* Uploads carry ``Content-MD5`` (RFC 1864). S3 recomputes it and refuses a body
  corrupted in transit with ``400 BadDigest`` (S3 API reference, PutObject), which
  surfaces as ``ObjectStoreError``. MD5 rather than ``x-amz-checksum-sha256``
  because every S3-compatible server (MinIO, Ceph RGW, R2, GCS interop) verifies
  it; for the same reason botocore's automatic CRC32 trailers (on by default since
  botocore 1.36) are limited to operations that require a checksum.
* Credentials and region come from botocore's usual chain (environment, shared
  config, instance role); none are passed or logged here.
* S3 answers ``403`` instead of ``404`` for a missing key when the caller lacks
  ``s3:ListBucket``; grant it, or ``exists``/``get`` report ``ObjectStoreError``.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable, Sequence
from contextlib import AsyncExitStack
from typing import Any

import aioboto3
import aiohttp
import anyio
import asyncpg
from aiobotocore.config import AioConfig
from botocore.exceptions import BotoCoreError, ClientError

from inboxd.pipeline.objectstore.store import (
    ObjectNotFound,
    ObjectStoreError,
    ObjectUnreadable,
    StoreContext,
    object_bytes,
    run_bounded,
    validate_key,
    validate_url_expiry,
)

__all__ = [
    "S3_CALL_TIMEOUT_S",
    "S3_CLOSE_TIMEOUT_S",
    "S3_CONNECT_TIMEOUT_S",
    "S3_MAX_POOL_CONNECTIONS",
    "S3_MIN_THROUGHPUT_BYTES_PER_S",
    "S3Store",
]

# Deadline for one request's fixed part (TLS, signing, credential refresh, S3's
# first byte). S3 answers small requests in 100-200 ms (AWS "Performance
# guidelines for Amazon S3"); 30 s means the connection is stuck, not slow, and a
# retry on a fresh connection is the better bet.
S3_CALL_TIMEOUT_S = 30.0
# Payload allowance on top of S3_CALL_TIMEOUT_S: the slowest sustained transfer we
# accept, 1 MiB/s. A 35 MB message (Exchange Online's default size limit; Gmail's
# is 25 MB) then gets 30 s + 33 s.
S3_MIN_THROUGHPUT_BYTES_PER_S = 1024 * 1024
# TCP/TLS connect. botocore's default is 60 s (botocore config reference); an
# endpoint that has not answered a SYN in 5 s is down or blackholed.
S3_CONNECT_TIMEOUT_S = 5.0
# Closing the client drains aiohttp's pool; shielded, but never allowed to hang a
# shutdown (docs/architecture.md §5: exit within a deadline).
S3_CLOSE_TIMEOUT_S = 5.0
# Connections kept to S3, and so the concurrency of put_many/exists_many: more
# concurrent requests than pooled connections only queue inside aiohttp.
# botocore's default pool is 10 (botocore config reference, max_pool_connections);
# S3 itself sustains 3 500 PUT/s per prefix, so the pool is the bound that matters.
S3_MAX_POOL_CONNECTIONS = 16

# Error codes that mean "no such object": GetObject says NoSuchKey; HeadObject has
# no body, so botocore reports the bare status code.
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
# Error codes about one object, not the bucket or the connection (→ ObjectUnreadable,
# reported per object by batch readers): a policy, ACL or KMS key denying this key
# (403 AccessDenied; HeadObject: the bare "403") and an object in an archive storage
# class that needs a restore first (403 InvalidObjectState; S3 API reference,
# GetObject). Bad credentials have codes of their own (InvalidAccessKeyId,
# SignatureDoesNotMatch, ExpiredToken) and stay errors of the store.
_OBJECT_ERROR_CODES = frozenset({"AccessDenied", "403", "InvalidObjectState"})


class S3Store(StoreContext):
    """``ObjectStore`` on one S3 bucket, optionally below a key prefix.

    ``prefix`` (e.g. ``"inboxd/prod"``) is prepended with a ``/`` to every key and
    follows the key rules of ``validate_key``. ``endpoint_url`` points at an
    S3-compatible server (MinIO, moto) and implies path-style addressing;
    ``region`` defaults to botocore's chain. ``session`` lets the daemon share one
    ``aioboto3.Session`` (and its credential cache) between adapters.
    """

    def __init__(
        self,
        bucket: str,
        *,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str | None = None,
        session: aioboto3.Session | None = None,
    ) -> None:
        if not bucket:
            raise ValueError("S3Store needs a bucket name")
        prefix = prefix.strip("/")
        self.bucket = bucket
        self.prefix = f"{validate_key(prefix)}/" if prefix else ""
        self.endpoint_url = endpoint_url
        self.region = region
        self._session = session if session is not None else aioboto3.Session()
        self._client: Any = None
        self._stack: AsyncExitStack | None = None

    def __repr__(self) -> str:
        return f"S3Store(bucket={self.bucket!r}, prefix={self.prefix!r})"

    async def start(self) -> None:
        """Create the client and its connection pool. Raises ``RuntimeError`` if started.

        Makes no request: a bucket that does not exist or a missing permission shows
        up as ``ObjectStoreError`` on first use.
        """
        if self._stack is not None:
            raise RuntimeError(f"{self!r} is already started")
        config = AioConfig(
            connect_timeout=S3_CONNECT_TIMEOUT_S,
            read_timeout=S3_CALL_TIMEOUT_S,
            max_pool_connections=S3_MAX_POOL_CONNECTIONS,
            retries={"mode": "standard", "total_max_attempts": 1},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        stack = AsyncExitStack()
        try:
            self._client = await stack.enter_async_context(
                self._session.client(
                    "s3",
                    endpoint_url=self.endpoint_url,
                    region_name=self.region,
                    config=config,
                )
            )
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack

    async def aclose(self) -> None:
        """Close the client. Idempotent; finishes even when the caller is cancelled."""
        stack, self._stack, self._client = self._stack, None, None
        if stack is None:
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(S3_CLOSE_TIMEOUT_S):
            await stack.aclose()

    async def put(
        self, key: str, data: bytes, *, content_type: str = "application/octet-stream"
    ) -> None:
        """Upload ``data``; S3 replaces objects atomically, so re-puts are harmless."""
        full_key = self._full_key(key)
        data = object_bytes(data)
        content_md5 = base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest())
        await self._call(
            "put_object",
            key,
            _transfer_deadline_s(len(data)),
            Bucket=self.bucket,
            Key=full_key,
            Body=data,
            ContentType=content_type,
            ContentMD5=content_md5.decode("ascii"),
        )

    async def put_many(
        self,
        items: Sequence[tuple[str, bytes, str]],
        *,
        conn: asyncpg.Connection | None = None,  # noqa: ARG002 - the store contract's; S3 has no tier
    ) -> list[BaseException | None]:
        async def put_one(item: tuple[str, bytes, str]) -> None:
            key, data, content_type = item
            await self.put(key, data, content_type=content_type)

        results = await run_bounded(put_one, items, concurrency=S3_MAX_POOL_CONNECTIONS)
        return [r if isinstance(r, BaseException) else None for r in results]

    async def get(self, key: str) -> bytes:
        full_key = self._full_key(key)
        response = await self._call(
            "get_object", key, S3_CALL_TIMEOUT_S, Bucket=self.bucket, Key=full_key
        )
        size = int(response.get("ContentLength") or 0)
        try:
            with anyio.fail_after(_transfer_deadline_s(size)):
                async with response["Body"] as stream:
                    # aiobotocore checks the length against Content-Length and
                    # raises IncompleteReadError on a short body.
                    return bytes(await stream.read())
        except TimeoutError as exc:
            raise ObjectStoreError(f"s3 get {key!r}: body not read in time") from exc
        except (BotoCoreError, aiohttp.ClientError, OSError) as exc:
            raise ObjectStoreError(f"s3 get {key!r}: reading body failed: {exc}") from exc

    async def exists(self, key: str) -> bool:
        full_key = self._full_key(key)
        try:
            await self._call(
                "head_object", key, S3_CALL_TIMEOUT_S, Bucket=self.bucket, Key=full_key
            )
        except ObjectNotFound:
            return False
        return True

    async def exists_many(self, keys: Iterable[str]) -> set[str]:
        unique = list(dict.fromkeys(validate_key(key) for key in keys))
        # One HEAD per key: ListObjectsV2 would need a shared prefix and pages of
        # unrelated keys; HEADs are cheap and run S3_MAX_POOL_CONNECTIONS at a time.
        answers = await run_bounded(self.exists, unique, concurrency=S3_MAX_POOL_CONNECTIONS)
        for answer in answers:
            if isinstance(answer, Exception):
                raise answer
        return {key for key, answer in zip(unique, answers, strict=True) if answer is True}

    async def url_for(self, key: str, *, expires_s: int) -> str | None:
        """A presigned GET URL, valid ``expires_s`` seconds. A bearer credential: never log it."""
        full_key = self._full_key(key)
        validate_url_expiry(expires_s)
        client = self._require_client()
        try:
            # Signing is local, but resolving credentials may call the instance
            # metadata service or STS, hence the deadline.
            with anyio.fail_after(S3_CALL_TIMEOUT_S):
                url: str = await client.generate_presigned_url(
                    "get_object",
                    Params={"Bucket": self.bucket, "Key": full_key},
                    ExpiresIn=expires_s,
                )
        except TimeoutError as exc:
            raise ObjectStoreError(f"s3 presign {key!r}: no credentials in time") from exc
        except (BotoCoreError, ClientError) as exc:
            raise ObjectStoreError(f"s3 presign {key!r} failed: {exc}") from exc
        return url

    def _full_key(self, key: str) -> str:
        return self.prefix + validate_key(key)

    def _require_client(self) -> Any:
        if self._client is None:
            raise RuntimeError(f"{self!r} is not started: use 'async with' or await start()")
        return self._client

    async def _call(self, operation: str, key: str, deadline_s: float, **params: Any) -> Any:
        """Run one S3 operation under ``deadline_s``, translating failures at the boundary."""
        client = self._require_client()
        try:
            with anyio.fail_after(deadline_s):
                return await getattr(client, operation)(**params)
        except TimeoutError as exc:
            raise ObjectStoreError(
                f"s3 {operation} {key!r}: no answer within {deadline_s:.0f} s"
            ) from exc
        except ClientError as exc:
            error = exc.response.get("Error", {})
            code = str(error.get("Code", ""))
            if code in _NOT_FOUND_CODES:
                raise ObjectNotFound(key) from exc
            if code in _OBJECT_ERROR_CODES:
                raise ObjectUnreadable(key, f"s3 {operation}: {code}") from exc
            raise ObjectStoreError(f"s3 {operation} {key!r} failed: {code or exc}") from exc
        except (BotoCoreError, aiohttp.ClientError, OSError) as exc:
            raise ObjectStoreError(f"s3 {operation} {key!r} failed: {exc}") from exc


def _transfer_deadline_s(size_bytes: int) -> float:
    return S3_CALL_TIMEOUT_S + size_bytes / S3_MIN_THROUGHPUT_BYTES_PER_S
