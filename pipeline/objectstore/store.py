"""The object store: where raw MIME bytes, large HTML bodies and attachments live.

Rows in PostgreSQL stay small and the database stays one you can back up and
replicate; the bytes go here, under keys the pipeline builds itself
(``raw/<sha256>``, ``att/<tenant>/<sha256>``, …). docs/architecture.md §3: S3 through
aioboto3 in production (``inboxd.adapters.objectstore.S3Store``), a local
directory by default (``inboxd.pipeline.objectstore.local.LocalDirectoryStore``).

This module is the contract only (the ``ObjectStore`` protocol, key rules, errors,
``run_bounded`` for ``put_many``) and must stay provider-free (CONTRIBUTING.md rule 3): it
imports no SDK, so the ingest stage that calls it is testable with nothing but a
temporary directory.

Contract, the same for every implementation (``tests/adapters/objectstore``
runs one suite against all of them):

* ``put`` is idempotent: the same key with the same bytes is a no-op success, so
  a retried page never fails on its own earlier upload. A different payload under
  an existing key replaces it (last write wins, like S3); content-addressed keys
  make that case a non-event.
* An object is either absent or complete under its final key: a crash or failure
  mid-write never leaves a truncated object a reader could see.
* ``put_many`` runs uploads concurrently under a bound and reports one result per
  item; one bad item never fails, cancels or delays the others.
* Keys are validated before any I/O (``validate_key``); a bad key is a
  programming error and raises ``ValueError``, never ``ObjectStoreError``.
* ``ObjectStoreError`` is retriable (network, disk, throttling); ``ObjectNotFound``
  is its subclass for a key with no object, ``ObjectUnreadable`` for one object the
  store answers about but cannot give (a directory in its file's place, EIO on its
  file, S3 refusing that key): the store itself works. Cancellation is never caught.
* The pipeline's keys are content-addressed (``<kind>/<tenant>/<sha256 of the
  bytes>``, pipeline/ingest/objects.py): ``read_many`` checks the bytes it reads
  against the key and never hands out bytes that do not match (``holds_its_key``).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Protocol, Self, TypeVar, runtime_checkable

import anyio
import asyncpg
import structlog

from inboxd.pipeline.errors import StoreUnavailableError

__all__ = [
    "MAX_KEY_LENGTH",
    "MAX_KEY_SEGMENT_LENGTH",
    "MAX_URL_EXPIRES_S",
    "ObjectNotFound",
    "ObjectReads",
    "ObjectStore",
    "ObjectStoreError",
    "ObjectUnreadable",
    "StoreContext",
    "holds_its_key",
    "object_bytes",
    "read_many",
    "run_bounded",
    "validate_key",
    "validate_url_expiry",
]

# S3 caps a whole object key at 1024 bytes ("Naming Amazon S3 objects", AWS S3 user
# guide); half of it is left for a store-wide prefix (S3Store(prefix=...)). The
# pipeline's own keys are under 150 characters (att/<tenant>/<64 hex>).
MAX_KEY_LENGTH = 512
# ext4, xfs and btrfs cap one file name at 255 bytes (NAME_MAX); the local store's
# temporary names add 21 characters ("+" + 16 hex + ".tmp"). Applied to
# every store so a key valid on S3 is valid on a local directory too.
MAX_KEY_SEGMENT_LENGTH = 200
# SigV4 presigned URLs live at most 7 days = 604 800 s ("Sharing objects with
# presigned URLs", AWS S3 user guide); the same bound for every store keeps callers
# honest whichever backend is configured.
MAX_URL_EXPIRES_S = 7 * 24 * 3600

# One path segment: lower-case letters, digits, dot, underscore, hyphen.
_SEGMENT_RE = re.compile(r"[a-z0-9._-]+")
# The last segment of a content-addressed key: a hex SHA-256 of the object's bytes.
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")

log = structlog.get_logger(__name__)

_T = TypeVar("_T")
_R = TypeVar("_R")


class ObjectStoreError(StoreUnavailableError):
    """A store operation failed for a reason worth retrying (network, disk, throttling).

    Adapters raise it ``from`` the provider's exception, which stays available as
    ``__cause__`` for logs.
    """


class ObjectNotFound(ObjectStoreError):
    """No object exists under ``key``."""

    def __init__(self, key: str) -> None:
        super().__init__(f"no object under key {key!r}")
        self.key = key


class ObjectUnreadable(ObjectStoreError):
    """The store answers, but this one object cannot be read: a directory where its
    file should be, EIO or a checksum failure on its file, S3 denying that key or
    holding it in an archive class. Other objects stay readable, so a batch reader
    reports it per object (``read_many``) instead of failing the batch; an error of
    the store as a whole (connection, timeout, throttling) is a plain ObjectStoreError.
    """

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"object {key!r} cannot be read: {reason}")
        self.key = key
        self.reason = reason


@runtime_checkable
class ObjectStore(Protocol):
    """What the pipeline needs from a blob store. All methods are coroutines.

    A store is used as ``async with store:`` (or ``await store.start()`` …
    ``await store.aclose()``); implementations without connections make these no-ops.
    """

    async def start(self) -> None:
        """Open connections; must be called (or ``async with`` used) before any I/O."""
        ...

    async def aclose(self) -> None:
        """Release connections. Idempotent; safe to call from a cancelled scope."""
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

    async def put(
        self, key: str, data: bytes, *, content_type: str = "application/octet-stream"
    ) -> None:
        """Store ``data`` under ``key``, atomically and idempotently.

        Raises ``ValueError`` for an invalid key, ``TypeError`` for data that is not
        bytes-like, ``ObjectStoreError`` when the write failed (nothing new is
        visible under ``key`` then).
        """
        ...

    async def put_many(
        self, items: Sequence[tuple[str, bytes, str]], *, conn: asyncpg.Connection | None = None
    ) -> list[BaseException | None]:
        """Store ``(key, data, content_type)`` items concurrently, under a bound.

        Returns one entry per item, in order: ``None`` when stored, else the
        exception ``put`` raised for it (``ValueError``, ``TypeError``,
        ``ObjectStoreError``).
        Raises nothing itself except cancellation.

        ``conn``: a connection inside the caller's transaction (the ingest stage's).
        A store that keeps objects in that database (``DatabaseTierStore``) writes
        them there, so they commit or roll back with the caller's rows and need no
        connection of their own; every other store ignores it.
        """
        ...

    async def get(self, key: str) -> bytes:
        """Return the object's bytes; ``ObjectNotFound`` if absent."""
        ...

    async def exists(self, key: str) -> bool:
        """Whether an object is stored under ``key``."""
        ...

    async def exists_many(self, keys: Iterable[str]) -> set[str]:
        """The subset of ``keys`` that have an object.

        Raises ``ValueError`` if any key is invalid (before any I/O) and
        ``ObjectStoreError`` if the answer for any key could not be obtained.
        """
        ...

    async def url_for(self, key: str, *, expires_s: int) -> str | None:
        """A URL that downloads the object for ``expires_s`` seconds, or ``None``.

        ``None`` means the backend cannot hand out URLs (the local store): serve the
        bytes from ``get`` instead. The URL is a bearer credential; never log it.
        Raises ``ValueError`` for a bad key or ``expires_s`` outside
        1..``MAX_URL_EXPIRES_S``. Does not check that the object exists.
        """
        ...


class StoreContext:
    """`async with store:` for the stores here: start on entry, aclose on exit."""

    async def start(self) -> None:
        """Nothing to open."""

    async def aclose(self) -> None:
        """Nothing to release."""

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


def object_bytes(data: object) -> bytes:
    """The bytes of an object to store; TypeError for anything that is not bytes-like."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"object data must be bytes, not {type(data).__name__}")
    return bytes(data)


def validate_key(key: str) -> str:
    """Return ``key`` unchanged if it is a valid object key, else raise ``ValueError``.

    Valid: 1..``MAX_KEY_LENGTH`` characters from ``[a-z0-9/._-]``, segments
    separated by single ``/`` (no leading or trailing slash, no empty segment),
    each at most ``MAX_KEY_SEGMENT_LENGTH`` characters, no ``..`` anywhere and no
    ``.`` segment. The rules keep a key one path on every backend and make path
    traversal out of a local root impossible.
    """
    if not isinstance(key, str):
        raise ValueError(f"object key must be str, not {type(key).__name__}")
    if not key or len(key) > MAX_KEY_LENGTH:
        raise ValueError(f"object key must be 1..{MAX_KEY_LENGTH} characters: {key[:80]!r}")
    if ".." in key:
        raise ValueError(f"object key must not contain '..': {key!r}")
    for segment in key.split("/"):
        if not _SEGMENT_RE.fullmatch(segment) or segment == ".":
            raise ValueError(
                f"object key must be '/'-separated segments of [a-z0-9._-], "
                f"without leading, trailing or double slashes: {key!r}"
            )
        if len(segment) > MAX_KEY_SEGMENT_LENGTH:
            raise ValueError(
                f"object key segment longer than {MAX_KEY_SEGMENT_LENGTH} characters: {key!r}"
            )
    return key


def validate_url_expiry(expires_s: int) -> int:
    """Return ``expires_s`` if it is 1..``MAX_URL_EXPIRES_S`` seconds, else raise ``ValueError``."""
    if isinstance(expires_s, bool) or not isinstance(expires_s, int):
        raise ValueError(f"expires_s must be an int number of seconds, not {expires_s!r}")
    if not 1 <= expires_s <= MAX_URL_EXPIRES_S:
        raise ValueError(f"expires_s must be 1..{MAX_URL_EXPIRES_S} seconds, not {expires_s}")
    return expires_s


#: Object reads at once for a batch (`read_many`): the database tier answers each on a
#: pool connection, files and S3 in parallel; four keeps a batch's reads off the
#: critical path without taking a caller's whole pool (reprocess's pool is sized on it).
READS_AT_ONCE = 4


@dataclass(slots=True)
class ObjectReads:
    """What `read_many` got for each key: its bytes, or why there are none."""

    found: dict[str, bytes] = field(default_factory=dict)
    #: no object under the key (or a key no store takes)
    missing: set[str] = field(default_factory=set)
    #: bytes that do not hash to the sha256 their key names: never handed out
    corrupt: set[str] = field(default_factory=set)
    #: the store could not give this object (ObjectUnreadable)
    unreadable: dict[str, ObjectUnreadable] = field(default_factory=dict)


def holds_its_key(key: str, data: bytes) -> bool:
    """Whether ``data`` hashes to the SHA-256 a content-addressed key ends with
    (``raw/<tenant>/<sha256>``: the raw key is built from messages.raw_sha256);
    True for a key that names no digest. A truncated or overwritten object fails."""
    digest = key.rpartition("/")[2]
    if not _DIGEST_RE.fullmatch(digest):
        return True
    return hashlib.sha256(data).hexdigest() == digest


async def read_many(store: ObjectStore, keys: Iterable[str]) -> ObjectReads:
    """Read every key, each verified against its key (`holds_its_key`).

    Per key: found, missing, corrupt or unreadable (``ObjectReads``); a failure of
    the store as a whole (an ObjectStoreError that is neither ObjectNotFound nor
    ObjectUnreadable) is raised. A store with `get_many` (the database tier: one
    statement for the batch) reads through it; others read one object at a time,
    READS_AT_ONCE at once."""
    unique = sorted(set(keys))
    reads = ObjectReads()
    if not unique:
        return reads
    get_many = getattr(store, "get_many", None)
    if get_many is not None:
        results: dict[str, bytes | Exception] = await get_many(unique)
    else:
        got = await run_bounded(store.get, unique, concurrency=READS_AT_ONCE)
        results = dict(zip(unique, got, strict=True))
    for key in unique:
        result = results.get(key, ObjectNotFound(key))
        if isinstance(result, ObjectNotFound | ValueError):
            reads.missing.add(key)
        elif isinstance(result, ObjectUnreadable):
            reads.unreadable[key] = result
            log.warning("object_unreadable", key=key, reason=result.reason)
        elif isinstance(result, Exception):
            raise result
        elif holds_its_key(key, result):
            reads.found[key] = result
        else:
            reads.corrupt.add(key)
            log.warning("object_corrupt", key=key, size_bytes=len(result))
    return reads


async def run_bounded(
    fn: Callable[[_T], Awaitable[_R]], items: Sequence[_T], *, concurrency: int
) -> list[_R | Exception]:
    """Await ``fn(item)`` for every item, at most ``concurrency`` at a time.

    Returns, in item order, each call's result or the ``Exception`` it raised; one
    failure does not cancel the others. Cancellation and other ``BaseException``s
    propagate (all workers are then cancelled by the task group).
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, not {concurrency}")
    done: dict[int, _R | Exception] = {}
    pending = iter(enumerate(items))

    async def worker() -> None:
        # Workers share one iterator: next() runs between awaits on one event loop
        # thread, so each item is taken exactly once, and no more than
        # `concurrency` tasks exist however long the sequence is.
        for index, item in pending:
            try:
                done[index] = await fn(item)
            except Exception as exc:
                done[index] = exc

    async with anyio.create_task_group() as tg:
        for _ in range(min(concurrency, len(items))):
            tg.start_soon(worker)
    return [done[index] for index in range(len(items))]
