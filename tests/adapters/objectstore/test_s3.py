"""The ObjectStore contract, run against every store, plus S3Store's own behaviour.

The contract tests take the parametrized ``store`` fixture (conftest.py), so
``LocalDirectoryStore``, ``DatabaseTierStore`` (small objects in PostgreSQL) and
``S3Store`` (against moto's server) must pass the same assertions; local-only
mechanics (atomic rename, fan-out, threads) are tested in
tests/pipeline/test_objectstore_local.py, the tier's own in test_objectstore_db.py.
"""

from __future__ import annotations

import base64
import hashlib
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import asyncpg
import pytest
from botocore.exceptions import ClientError

import inboxd.adapters.objectstore.s3 as s3_module
from inboxd.adapters.objectstore import ObjectStoreConfig, S3Store, open_object_store
from inboxd.pipeline.objectstore.database_tier import DatabaseTierStore
from inboxd.pipeline.objectstore.local import LocalDirectoryStore
from inboxd.pipeline.objectstore.store import (
    MAX_URL_EXPIRES_S,
    ObjectNotFound,
    ObjectStore,
    ObjectStoreError,
    ObjectUnreadable,
    read_many,
)

# Every byte value, a CRLF pair and a NUL: anything that re-encodes, strips or
# normalises line endings on the way fails the byte-exact comparison.
BINARY = bytes(range(256)) + b"\r\n\x00" + "caf\u00e9 \u2603".encode()

INVALID_KEYS = [
    "",
    "/raw/abc",
    "raw/abc/",
    "raw//abc",
    "raw/../etc/passwd",
    "..",
    "raw/./abc",
    "Raw/ABC",
    "raw/a b",
    "raw/a+b",
    "raw\\abc",
    "att/tenant/\u00e9",
    "x" * 600,
    "raw/" + "y" * 201,
]

TEST_REGION = "us-east-1"
# The download of a presigned URL is a local HTTP request to moto.
DOWNLOAD_TIMEOUT_S = 10.0


def sha_key(prefix: str, data: bytes) -> str:
    return f"{prefix}/{hashlib.sha256(data).hexdigest()}"


# --- contract: every store --------------------------------------------------------


async def test_is_an_object_store(store: ObjectStore) -> None:
    assert isinstance(store, ObjectStore)


@pytest.mark.parametrize("size", [0, 1, len(BINARY), 3 * 1024 * 1024 + 7])
async def test_round_trip_is_byte_exact(store: ObjectStore, size: int) -> None:
    data = (BINARY * (size // len(BINARY) + 1))[:size]
    key = sha_key("raw", data)
    await store.put(key, data, content_type="message/rfc822")
    assert await store.get(key) == data


async def test_put_is_idempotent(store: ObjectStore) -> None:
    key = sha_key("att/tenant-1", BINARY)
    await store.put(key, BINARY)
    await store.put(key, BINARY)
    assert await store.get(key) == BINARY


async def test_put_new_bytes_replaces(store: ObjectStore) -> None:
    await store.put("html/message-1", b"<p>first</p>", content_type="text/html")
    await store.put("html/message-1", b"<p>second, longer</p>", content_type="text/html")
    assert await store.get("html/message-1") == b"<p>second, longer</p>"


async def test_key_and_its_prefix_can_both_exist(store: ObjectStore) -> None:
    # S3 keys are flat; the local layout must not turn "a/b" into a directory that
    # blocks the object "a/b".
    await store.put("nest/a", b"outer")
    await store.put("nest/a/b", b"inner")
    assert await store.get("nest/a") == b"outer"
    assert await store.get("nest/a/b") == b"inner"


async def test_missing_key_raises_object_not_found(store: ObjectStore) -> None:
    with pytest.raises(ObjectNotFound) as info:
        await store.get("raw/" + "0" * 64)
    assert isinstance(info.value, ObjectStoreError)
    assert info.value.key == "raw/" + "0" * 64


async def test_exists_and_exists_many(store: ObjectStore) -> None:
    await store.put("att/t1/one", b"1")
    await store.put("att/t1/two", b"2")
    assert await store.exists("att/t1/one")
    assert not await store.exists("att/t1/three")
    found = await store.exists_many(["att/t1/one", "att/t1/three", "att/t1/two", "att/t1/one"])
    assert found == {"att/t1/one", "att/t1/two"}
    assert await store.exists_many([]) == set()
    # A directory-like prefix of stored keys is not an object.
    assert not await store.exists("att/t1")


async def test_put_many_isolates_bad_items(store: ObjectStore) -> None:
    good = [(f"att/t2/item-{i}", f"payload {i}".encode(), "text/plain") for i in range(40)]
    bad_key = ("att/t2/../escape", b"nope", "text/plain")
    not_bytes: Any = ("att/t2/not-bytes", 12345, "text/plain")
    items = [*good[:10], bad_key, *good[10:30], not_bytes, *good[30:]]

    results = await store.put_many(items)

    assert len(results) == len(items)
    assert isinstance(results[10], ValueError)
    assert isinstance(results[31], TypeError)
    assert [r for i, r in enumerate(results) if i not in (10, 31)] == [None] * len(good)
    for key, data, _ in good:
        assert await store.get(key) == data
    assert not await store.exists("att/t2/not-bytes")


async def test_put_many_empty(store: ObjectStore) -> None:
    assert await store.put_many([]) == []


@pytest.mark.parametrize("key", INVALID_KEYS)
async def test_invalid_keys_are_rejected(store: ObjectStore, key: str) -> None:
    with pytest.raises(ValueError):
        await store.put(key, b"x")
    with pytest.raises(ValueError):
        await store.get(key)
    with pytest.raises(ValueError):
        await store.exists(key)
    with pytest.raises(ValueError):
        await store.exists_many(["raw/fine", key])
    with pytest.raises(ValueError):
        await store.url_for(key, expires_s=60)


@pytest.mark.parametrize("expires_s", [0, -1, MAX_URL_EXPIRES_S + 1])
async def test_url_expiry_is_bounded(store: ObjectStore, expires_s: int) -> None:
    with pytest.raises(ValueError):
        await store.url_for("raw/abc", expires_s=expires_s)


async def test_url_for(store: ObjectStore) -> None:
    data = BINARY * 3
    key = sha_key("att/t3", data)
    await store.put(key, data, content_type="application/pdf")
    url = await store.url_for(key, expires_s=300)
    if isinstance(store, LocalDirectoryStore | DatabaseTierStore):
        assert url is None  # served from get(): no URL to hand out
        return
    assert url is not None
    assert "Signature=" in url or "X-Amz-Signature=" in url
    with anyio.fail_after(DOWNLOAD_TIMEOUT_S):
        async with aiohttp.ClientSession() as http, http.get(url) as response:
            assert response.status == 200
            assert response.headers["Content-Type"] == "application/pdf"
            assert await response.read() == data


# --- S3Store only -----------------------------------------------------------------


def digest_key(data: bytes) -> str:
    """The pipeline's key for ``data``: content-addressed, as ingest builds it."""
    return f"raw/acme/{hashlib.sha256(data).hexdigest()}"


async def test_read_many_hands_out_only_bytes_that_hash_to_their_key(store: ObjectStore) -> None:
    real = b"From: a@example.com\r\nSubject: the real bytes\r\n\r\nbody\r\n"
    intact, torn, gone = digest_key(real), digest_key(real + b"!"), digest_key(b"never stored")
    await store.put(intact, real)
    await store.put(torn, real[:20])  # what a truncated copy leaves under the key
    await store.put("html/acme/not-a-digest", b"<p>")  # names no digest: nothing to check

    reads = await read_many(store, [intact, torn, gone, "html/acme/not-a-digest"])

    assert reads.found == {intact: real, "html/acme/not-a-digest": b"<p>"}
    assert (reads.corrupt, reads.missing, reads.unreadable) == ({torn}, {gone}, {})


async def make_unreadable(store: ObjectStore, key: str) -> None:
    """An object the store answers about but cannot give: archived (S3: needs a
    restore), a directory where its file goes (a local directory, the tier's large store)."""
    if isinstance(store, S3Store):
        await store._client.put_object(
            Bucket=store.bucket, Key=store.prefix + key, Body=b"x", StorageClass="GLACIER"
        )
        return
    local = store.large if isinstance(store, DatabaseTierStore) else store
    assert isinstance(local, LocalDirectoryStore)
    local.path_for(key).mkdir(parents=True)


async def test_one_unreadable_object_is_reported_and_the_others_read(store: ObjectStore) -> None:
    data = b"readable"
    bad, good = digest_key(b"archived or shadowed"), digest_key(data)
    await make_unreadable(store, bad)
    await store.put(good, data)

    with pytest.raises(ObjectUnreadable) as info:
        await store.get(bad)
    reads = await read_many(store, [bad, good])

    assert info.value.key == bad
    assert reads.found == {good: data} and list(reads.unreadable) == [bad]
    assert not reads.missing and not reads.corrupt


@pytest.mark.slow
async def test_put_sends_content_md5(s3_store: S3Store) -> None:
    # moto records but does not verify checksums (moto/s3/responses.py,
    # _get_checksum: "TODO: AWS computes the provided value and verifies it"), so
    # check that the header S3 verifies (BadDigest on mismatch) is on the wire.
    sent: list[dict[str, str]] = []

    def capture(request: Any, **_: Any) -> None:
        sent.append(dict(request.headers))

    data = BINARY * 10
    s3_store._client.meta.events.register("before-send.s3.PutObject", capture)
    await s3_store.put("raw/md5-check", data)
    expected = base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()
    assert len(sent) == 1
    headers = {k.lower(): v.decode() if isinstance(v, bytes) else v for k, v in sent[0].items()}
    assert headers["content-md5"] == expected
    # No automatic CRC32 checksum/aws-chunked trailer: S3-compatible servers that
    # predate botocore 1.36's defaults reject those.
    assert not [h for h in headers if h.startswith("x-amz-checksum-")]
    assert "aws-chunked" not in headers.get("content-encoding", "")


@pytest.mark.slow
async def test_prefix_is_applied(s3_store: S3Store, moto_endpoint: str, s3_bucket: str) -> None:
    await s3_store.put("raw/prefixed", b"data")
    response = await s3_store._client.head_object(
        Bucket=s3_bucket, Key=f"{s3_store.prefix}raw/prefixed"
    )
    assert response["ContentLength"] == 4


@pytest.mark.slow
async def test_missing_bucket_is_an_error_not_a_missing_object(
    moto_endpoint: str,
) -> None:
    async with S3Store(
        "no-such-bucket-here", endpoint_url=moto_endpoint, region=TEST_REGION
    ) as store:
        with pytest.raises(ObjectStoreError) as info:
            await store.get("raw/abc")
        assert not isinstance(info.value, ObjectNotFound)
        with pytest.raises(ObjectStoreError):
            await store.put("raw/abc", b"x")
        results = await store.put_many([("raw/abc", b"x", "text/plain")])
        assert isinstance(results[0], ObjectStoreError)


@pytest.fixture
def refused_endpoint() -> str:
    # A port that was just free: nothing listens, so connecting is refused at once.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.mark.slow
async def test_unreachable_endpoint_is_retriable_error(
    moto_endpoint: str, refused_endpoint: str
) -> None:
    async with S3Store("bucket", endpoint_url=refused_endpoint, region=TEST_REGION) as store:
        with pytest.raises(ObjectStoreError) as info:
            await store.put("raw/abc", b"x")
        assert info.value.__cause__ is not None
        with pytest.raises(ObjectStoreError):
            await store.exists_many(["raw/abc", "raw/def"])


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    # Listens (the kernel completes the TCP handshake from the backlog) but never
    # answers: the request must end at the store's deadline, not hang.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.slow
async def test_stuck_server_hits_the_deadline(
    moto_endpoint: str, silent_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(s3_module, "S3_CALL_TIMEOUT_S", 0.3)
    async with S3Store("bucket", endpoint_url=silent_endpoint, region=TEST_REGION) as store:
        with anyio.fail_after(10):
            with pytest.raises(ObjectStoreError, match="no answer within"):
                await store.get("raw/abc")
            with pytest.raises(ObjectStoreError, match="no answer within"):
                await store.put("raw/abc", b"x")


class _Refusing:
    """An S3 client whose GetObject answers one error code."""

    def __init__(self, code: str, status: int) -> None:
        self.code, self.status = code, status

    async def get_object(self, **params: Any) -> Any:
        error = {"Error": {"Code": self.code}, "ResponseMetadata": {"HTTPStatusCode": self.status}}
        raise ClientError(error, "GetObject")


@pytest.mark.parametrize(
    ("code", "status", "one_object"),
    [
        ("AccessDenied", 403, True),
        ("InvalidObjectState", 403, True),
        ("ExpiredToken", 400, False),
        ("InvalidAccessKeyId", 403, False),
        ("SlowDown", 503, False),
        ("InternalError", 500, False),
    ],
)
async def test_errors_about_one_object_are_told_from_errors_of_the_store(
    code: str, status: int, one_object: bool
) -> None:
    store = S3Store("bucket", endpoint_url="http://127.0.0.1:9")
    store._client = _Refusing(code, status)  # answers without a server

    with pytest.raises(ObjectStoreError) as info:
        await store.get("raw/abc")

    assert isinstance(info.value, ObjectUnreadable) is one_object
    assert code in str(info.value)


async def test_not_started_is_a_programming_error() -> None:
    store = S3Store("bucket", endpoint_url="http://127.0.0.1:9")
    with pytest.raises(RuntimeError, match="not started"):
        await store.get("raw/abc")
    await store.aclose()  # idempotent, also when never started


@pytest.mark.slow
async def test_start_twice_is_refused(s3_store: S3Store) -> None:
    with pytest.raises(RuntimeError, match="already started"):
        await s3_store.start()


def test_prefix_follows_key_rules() -> None:
    assert S3Store("b", prefix="inboxd/prod/").prefix == "inboxd/prod/"
    assert S3Store("b", prefix="").prefix == ""
    with pytest.raises(ValueError):
        S3Store("b", prefix="../other")
    with pytest.raises(ValueError):
        S3Store("")


# --- factory ----------------------------------------------------------------------


def test_open_object_store_local(tmp_path: Path) -> None:
    store = open_object_store({"kind": "local", "path": str(tmp_path / "objects")})
    assert isinstance(store, LocalDirectoryStore)
    assert store.root == tmp_path / "objects"


def test_open_object_store_s3() -> None:
    store = open_object_store(
        {
            "kind": "s3",
            "bucket": "mail-blobs",
            "prefix": "inboxd",
            "endpoint_url": "http://minio:9000",
            "region": "eu-west-1",
        }
    )
    assert isinstance(store, S3Store)
    assert (store.bucket, store.prefix, store.endpoint_url, store.region) == (
        "mail-blobs",
        "inboxd/",
        "http://minio:9000",
        "eu-west-1",
    )


@pytest.mark.parametrize(
    "spec",
    [
        {},
        {"kind": "gcs", "bucket": "x"},
        {"kind": "local"},
        {"kind": "local", "path": "/x", "bucket": "typo"},
        {"kind": "s3"},
        {"kind": "s3", "bucket": "x", "endpoint": "http://typo"},
        {"kind": "s3", "bucket": 42},
        {"kind": "local", "path": "/x", "database_max_bytes": -1},
        {"kind": "local", "path": "/x", "database_max_bytes": "64k"},
        {"kind": "s3", "bucket": "x", "database_max_bytes": 1 << 30},
    ],
)
def test_open_object_store_rejects_bad_specs(spec: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        open_object_store(spec)


async def test_open_object_store_puts_small_objects_in_the_database(
    tmp_path: Path, pool: asyncpg.Pool
) -> None:
    local = open_object_store({"kind": "local", "path": str(tmp_path / "o")}, pool=pool)
    assert isinstance(local, DatabaseTierStore)
    assert local.max_bytes == 64 * 1024
    assert isinstance(local.large, LocalDirectoryStore)
    # the tier off still reads the table (objects stored while it was on)
    off = {"kind": "local", "path": str(tmp_path / "o"), "database_max_bytes": 0}
    reading = open_object_store(off, pool=pool)
    assert isinstance(reading, DatabaseTierStore) and reading.max_bytes == 0
    # S3 keeps one object per message unless asked otherwise
    s3 = open_object_store({"kind": "s3", "bucket": "b"}, pool=pool)
    assert isinstance(s3, DatabaseTierStore) and s3.max_bytes == 0
    assert isinstance(s3.large, S3Store)
    tiered = open_object_store({"kind": "s3", "bucket": "b", "database_max_bytes": 4096}, pool=pool)
    assert isinstance(tiered, DatabaseTierStore)
    assert (tiered.max_bytes, type(tiered.large)) == (4096, S3Store)


def test_config_checks_itself() -> None:
    with pytest.raises(ValueError):
        ObjectStoreConfig(kind="s3")
