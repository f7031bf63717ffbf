"""Object-store adapters: S3 (aioboto3) and the factory that picks a store from config."""

from __future__ import annotations

from .config import ObjectStoreConfig, open_object_store
from .s3 import S3Store

__all__ = ["ObjectStoreConfig", "S3Store", "open_object_store"]
