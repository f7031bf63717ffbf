"""Parsing raw MIME off the event loop, in worker processes, for the raw-MIME doors.

parse_raw is CPU work (0.4-0.5 ms per typical message, bench/README.md). In a
thread it holds the GIL against the database and object-store work of the same
process, and glibc gives every parsing thread its own malloc arena, which grew
the daemon's RSS without bound during a 100k backfill. In one worker process it
overlaps with that work instead: bench/ingest.py (e) measured 1,645 msg/s with
one worker process against 1,061 with a thread.

Workers send back MessageData without the raw bytes (the parent has them) and
the parent re-attaches them, so each message crosses the process boundary once.
"""

from __future__ import annotations

import dataclasses
import functools
import signal
from collections.abc import Sequence

import anyio
import anyio.to_process
import anyio.to_thread

from inboxd.pipeline.message import DeadItem, MessageData
from inboxd.pipeline.mime import parse_raw

Item = MessageData | DeadItem

# Messages per call into a worker: pickling overhead stays negligible, and a
# cancelled caller waits for at most one chunk (~25 ms).
PARSE_CHUNK_SIZE = 50
# Worker processes parsing at once in this process. One, on the 2-core target:
# the other core runs the event loop, PostgreSQL's client side and the object
# store; two workers measured no faster (bench/README.md (e)).
PARSE_WORKERS = 1

_limiter: anyio.CapacityLimiter | None = None


def parse_many(
    raws: Sequence[bytes], tenant_id: str, mailbox_id: str, source: str, *, keep_raw: bool
) -> list[Item]:
    """parse_raw each message; without `keep_raw` the raw bytes are left out."""
    items: list[Item] = []
    for raw in raws:
        item = parse_raw(raw, tenant_id=tenant_id, mailbox_id=mailbox_id, source=source)
        if not keep_raw:
            if isinstance(item, DeadItem):
                item = dataclasses.replace(item, raw=None)
            else:
                item.raw = None
        items.append(item)
    return items


def parse_many_in_worker(
    raws: Sequence[bytes], tenant_id: str, mailbox_id: str, source: str
) -> list[Item]:
    """parse_many in a worker process, which leaves Ctrl-C to its parent.

    A terminal's Ctrl-C reaches the whole process group; a worker dying of it
    mid-chunk would turn a graceful stop into a crash.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return parse_many(raws, tenant_id, mailbox_id, source, keep_raw=False)


def with_raw(item: Item, raw: bytes) -> Item:
    """Re-attach the raw bytes a worker left out."""
    if isinstance(item, DeadItem):
        return dataclasses.replace(item, raw=raw)
    item.raw = raw
    return item


async def parse_in_workers(
    raws: Sequence[bytes],
    tenant_id: str,
    mailbox_id: str,
    source: str,
    *,
    in_thread: bool = False,
) -> list[Item]:
    """Parse off the event loop, at most PARSE_WORKERS chunks at once in this process.

    In worker processes by default (raw bytes re-attached); `in_thread` parses in
    a worker thread instead, for small inputs where starting a worker process is
    not repaid (a one-off import of a few hundred messages).
    """
    global _limiter
    if _limiter is None:
        _limiter = anyio.CapacityLimiter(PARSE_WORKERS)
    items: list[Item] = []
    for start in range(0, len(raws), PARSE_CHUNK_SIZE):
        chunk = list(raws[start : start + PARSE_CHUNK_SIZE])
        if in_thread:
            items.extend(
                await anyio.to_thread.run_sync(
                    functools.partial(parse_many, keep_raw=True),
                    chunk,
                    tenant_id,
                    mailbox_id,
                    source,
                    limiter=_limiter,
                )
            )
            continue
        parsed = await anyio.to_process.run_sync(
            parse_many_in_worker, chunk, tenant_id, mailbox_id, source, limiter=_limiter
        )
        items.extend(with_raw(item, raw) for item, raw in zip(parsed, chunk, strict=True))
    return items
