"""Object-store adapters: S3 (aioboto3) and the factory that picks a store from config.

`S3Store` loads on first use (PEP 562): aioboto3 costs ~0.5 s of imports, which a
command on a local store (`inboxd import`, the default) should not pay.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import ObjectStoreConfig, open_object_store

if TYPE_CHECKING:
    from .s3 import S3Store

__all__ = ["ObjectStoreConfig", "S3Store", "open_object_store"]


def __getattr__(name: str) -> Any:
    if name == "S3Store":
        from .s3 import S3Store

        return S3Store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
