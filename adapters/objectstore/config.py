"""Object-store configuration: the ``[object_store]`` table of the main config.

The daemon hands this module the table as a plain mapping; it is parsed into a
frozen dataclass (so a typo fails at startup, not on the first attachment) and
turned into the configured ``ObjectStore``. Local directory is the default kind
(docs/architecture.md §3); credentials are never part of it: S3 takes them from botocore's
chain (environment, shared config, instance role).

    {"kind": "local", "path": "/var/lib/inboxd/objects"}
    {"kind": "s3", "bucket": "mail-blobs", "prefix": "inboxd",
     "endpoint_url": "http://minio:9000", "region": "eu-west-1"}

``database_max_bytes`` (either kind): objects up to that size live in PostgreSQL's
``small_objects`` instead (``pipeline/objectstore/database_tier.py``; 0 turns it off). Default:
64 KiB for a local directory, where it takes a file, a rename and two fsyncs per
message off ingest; 0 for S3, which keeps one object per message (issue 15) unless
the operator asks otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import asyncpg

from inboxd.pipeline.objectstore.database_tier import (
    DEFAULT_MAX_BYTES,
    MAX_MAX_BYTES,
    DatabaseTierStore,
)
from inboxd.pipeline.objectstore.local import LocalDirectoryStore
from inboxd.pipeline.objectstore.store import ObjectStore

__all__ = ["ObjectStoreConfig", "open_object_store"]

_ALLOWED_FIELDS: dict[str, frozenset[str]] = {
    "local": frozenset({"kind", "path", "database_max_bytes"}),
    "s3": frozenset({"kind", "bucket", "prefix", "endpoint_url", "region", "database_max_bytes"}),
}
# database_max_bytes when the table does not say (see the module docstring)
_DEFAULT_DATABASE_MAX_BYTES = {"local": DEFAULT_MAX_BYTES, "s3": 0}


@dataclass(frozen=True, slots=True)
class ObjectStoreConfig:
    """Where objects go. ``path`` is set for ``local``; ``bucket`` (and the rest) for ``s3``."""

    kind: Literal["local", "s3"]
    path: Path | None = None
    bucket: str | None = None
    prefix: str = ""
    endpoint_url: str | None = None
    region: str | None = None
    database_max_bytes: int = 0

    def __post_init__(self) -> None:
        if self.kind not in _ALLOWED_FIELDS:
            raise ValueError(f"object_store.kind must be 'local' or 's3', not {self.kind!r}")
        if self.kind == "local" and self.path is None:
            raise ValueError("object_store (local): 'path' is required")
        if self.kind == "s3" and not self.bucket:
            raise ValueError("object_store (s3): 'bucket' is required")
        size = self.database_max_bytes
        if isinstance(size, bool) or not isinstance(size, int):
            raise ValueError(f"object_store.database_max_bytes must be an integer, not {size!r}")
        if not 0 <= size <= MAX_MAX_BYTES:
            raise ValueError(
                f"object_store.database_max_bytes must be 0..{MAX_MAX_BYTES}, not {size}"
            )

    @classmethod
    def from_mapping(cls, spec: Mapping[str, Any]) -> ObjectStoreConfig:
        """Parse and check ``spec``; raises ``ValueError`` naming the offending field."""
        kind = spec.get("kind")
        if kind not in _ALLOWED_FIELDS:
            raise ValueError(f"object_store.kind must be 'local' or 's3', not {kind!r}")
        unknown = sorted(set(spec) - _ALLOWED_FIELDS[kind])
        if unknown:
            raise ValueError(f"object_store ({kind}): unknown field(s) {', '.join(unknown)}")
        size = spec.get("database_max_bytes", _DEFAULT_DATABASE_MAX_BYTES[kind])
        if kind == "local":
            path = _optional_str(spec, "path")
            return cls(
                kind="local",
                path=Path(path).expanduser() if path else None,
                database_max_bytes=size,
            )
        return cls(
            kind="s3",
            bucket=_optional_str(spec, "bucket"),
            prefix=_optional_str(spec, "prefix") or "",
            endpoint_url=_optional_str(spec, "endpoint_url") or None,
            region=_optional_str(spec, "region") or None,
            database_max_bytes=size,
        )


def open_object_store(
    spec: Mapping[str, Any] | ObjectStoreConfig, *, pool: asyncpg.Pool | None = None
) -> ObjectStore:
    """Build the store ``spec`` describes; raises ``ValueError`` for a bad spec.

    With ``pool``, a ``DatabaseTierStore`` in front of the configured store: objects
    up to ``database_max_bytes`` go to that database, and reads look there first
    whatever the limit (0 included). Without a pool the configured store alone, which
    does not see objects an earlier run put in the database. The result is not
    started: use ``async with open_object_store(spec) as store`` (or ``await
    store.start()`` / ``await store.aclose()``). No I/O happens here.
    """
    config = spec if isinstance(spec, ObjectStoreConfig) else ObjectStoreConfig.from_mapping(spec)
    large = _open_large(config)
    if pool is None:
        return large
    # With the tier off (database_max_bytes = 0) the table is still read: rows stored
    # while it was on point at objects only it holds.
    return DatabaseTierStore(pool, large, max_bytes=config.database_max_bytes)


def _open_large(config: ObjectStoreConfig) -> ObjectStore:
    if config.kind == "local" and config.path is not None:
        return LocalDirectoryStore(config.path)
    if config.kind == "s3" and config.bucket:
        from .s3 import S3Store  # aioboto3: ~0.5 s of imports a local store never needs

        return S3Store(
            config.bucket,
            prefix=config.prefix,
            endpoint_url=config.endpoint_url,
            region=config.region,
        )
    raise ValueError(f"incomplete object_store config: {config!r}")  # __post_init__ forbids


def _optional_str(spec: Mapping[str, Any], field: str) -> str | None:
    value = spec.get(field)
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f"object_store.{field} must be a string, not {type(value).__name__}")
