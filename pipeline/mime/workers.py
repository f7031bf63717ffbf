"""Parsing raw MIME off the event loop, in worker processes, for the raw-MIME doors.

parse_raw is CPU work (0.4-0.5 ms per typical message, bench/README.md). In a
thread it holds the GIL against the database and object-store work of the same
process, and glibc gives every parsing thread its own malloc arena, which grew
the daemon's RSS without bound during a 100k backfill. In worker processes it
overlaps with that work instead: bench/ingest.py (e) measured 1,645 msg/s with
one worker process against 1,061 with a thread. There is one worker per core
(PARSE_WORKERS), shared by every caller of the process through one limiter; a
caller's chunks run side by side, at most PARSE_WORKERS of them queued at once.

Workers send back MessageData without the raw bytes (the parent has them) and
the parent re-attaches them, so each message crosses the process boundary once.
They send it pickled by `_dumps_parsed`: each MessageData, Address and
AttachmentData as its class and field values, rebuilt by its own constructor.
The dataclasses' default pickling (`__getstate__`/`__setstate__`, which walk
`dataclasses.fields()` for every object) cost 10.1 µs per 2 KB message in the
worker and 8.3 µs in the parent's event loop; this costs 6.4 and 3.3 (chunks of
50 generated 2 KB messages, measured in one process; bench/README.md, gmail.py).

Workers ignore SIGINT, SIGTERM and SIGTSTP from their first chunk on: the parent
decides when they end. `inboxd import` and `inboxd reprocess` start them with the
three blocked already (daemon.commands.stopping.held_from_children: a child
inherits the signal mask of the thread that forks it), so a Ctrl-C while one
starts, 100-150 ms before its first chunk, does not reach it either; in the
daemon, one that a signal reaches while it starts dies like a killed one while
its parent stops anyway. A Ctrl-C, and the SIGTERM that
systemd's control-group kill, Docker and `timeout` send, reach the whole process
group; the parent stops gracefully, and a worker dying of the same signal
mid-chunk would turn that stop into a crash. A Ctrl-Z (SIGTSTP) that stopped a
worker while it wrote its answer cut that write short (anyio's worker writes its
answer with one unbuffered write and no retry), and the parent waited forever
for the rest after `fg`: the import hung. They still end
with the parent: anyio SIGKILLs its pool when the event loop closes (and idle
workers after 5 minutes), and a worker whose parent is gone reads the end of
its stdin and exits. A worker that dies anyway (the OOM killer's SIGKILL) fails
the call with one `anyio.BrokenWorkerProcess` saying so.
"""

from __future__ import annotations

import copyreg
import dataclasses
import functools
import io
import os
import pickle
import signal
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.to_process
import anyio.to_thread

from inboxd.pipeline.message import Address, AttachmentData, DeadItem, MessageData
from inboxd.pipeline.mime.parse import parse_raw

Item = MessageData | DeadItem

# Messages per call into a worker: pickling overhead stays negligible, and a
# cancelled caller waits for at most one chunk (~25 ms).
PARSE_CHUNK_SIZE = 50
# Worker processes parsing at once in this process: one per core, at most
# PARSE_WORKERS_MAX (each costs ≈ 28 MB). One was faster when the local object store
# spent a core on files and fsyncs; with small objects in PostgreSQL
# (pipeline/objectstore/database_tier.py) parsing is the bound, and on the 2-core VM twenty Gmail
# mailboxes reached 0.76 × quota with one worker and 0.87 with two, the parse
# workers at 81 % and 90 % of a core (bench/README.md, gmail.py).
PARSE_WORKERS_MAX = 8
PARSE_WORKERS = max(1, min(os.cpu_count() or 1, PARSE_WORKERS_MAX))

_limiter: anyio.CapacityLimiter | None = None
# What reaches a whole process group to stop or suspend it: the parent's to handle,
# not a worker's (module docstring).
_LEFT_TO_THE_PARENT = (signal.SIGINT, signal.SIGTERM, signal.SIGTSTP)
WORKER_DIED = (
    "a parse worker process died (killed from outside: the out-of-memory killer, or a SIGKILL)"
)


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
) -> bytes:
    """parse_many in a worker process, which leaves SIGINT, SIGTERM and SIGTSTP to
    its parent (module docstring); the items come back pickled by `_dumps_parsed`
    (`pickle.loads` reads them)."""
    for signum in _LEFT_TO_THE_PARENT:
        signal.signal(signum, signal.SIG_IGN)
    return _dumps_parsed(parse_many(raws, tenant_id, mailbox_id, source, keep_raw=False))


def _init_fields(cls: type) -> tuple[str, ...]:
    """A dataclass's fields in constructor order (every one an __init__ parameter)."""
    fields = dataclasses.fields(cls)
    if not all(f.init for f in fields):
        raise TypeError(f"{cls.__name__} has fields its constructor does not take")
    return tuple(f.name for f in fields)


def _by_constructor(cls: type) -> Callable[[Any], tuple[type, tuple[Any, ...]]]:
    names = _init_fields(cls)
    return lambda obj: (cls, tuple([getattr(obj, name) for name in names]))


class _ParsedPickler(pickle.Pickler):
    """Pickles the parsed dataclasses as constructor calls (module docstring)."""

    dispatch_table = copyreg.dispatch_table | {
        cls: _by_constructor(cls) for cls in (MessageData, Address, AttachmentData)
    }


def _dumps_parsed(items: list[Item]) -> bytes:
    buffer = io.BytesIO()
    _ParsedPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(items)
    return buffer.getvalue()


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
    """Parse off the event loop, in order, at most PARSE_WORKERS chunks at once in
    this process (one caller's chunks run side by side, so one mailbox's page uses
    every core; several callers share the same workers).

    In worker processes by default (raw bytes re-attached); `in_thread` parses in
    a worker thread instead, for small inputs where starting a worker process is
    not repaid (a one-off import of a few hundred messages).
    """
    global _limiter
    if _limiter is None:
        _limiter = anyio.CapacityLimiter(PARSE_WORKERS)
    limiter = _limiter
    chunks = [list(raws[i : i + PARSE_CHUNK_SIZE]) for i in range(0, len(raws), PARSE_CHUNK_SIZE)]
    parsed: list[list[Item]] = [[] for _ in chunks]

    async def parse_chunk(index: int) -> None:
        chunk = chunks[index]
        if in_thread:
            parsed[index] = await anyio.to_thread.run_sync(
                functools.partial(parse_many, keep_raw=True),
                chunk,
                tenant_id,
                mailbox_id,
                source,
                limiter=limiter,
            )
            return
        pickled = await anyio.to_process.run_sync(
            parse_many_in_worker, chunk, tenant_id, mailbox_id, source, limiter=limiter
        )
        items: list[Item] = pickle.loads(pickled)  # noqa: S301 - our own worker's bytes
        parsed[index] = [with_raw(item, raw) for item, raw in zip(items, chunk, strict=True)]

    pending = iter(range(len(chunks)))

    async def drain() -> None:
        # shared iterator: each chunk taken once; a caller queues at most
        # PARSE_WORKERS chunks on the limiter, so other mailboxes' chunks interleave
        for index in pending:
            await parse_chunk(index)

    try:
        if len(chunks) == 1:
            await parse_chunk(0)
        elif chunks:
            async with anyio.create_task_group() as tg:
                for _ in range(min(PARSE_WORKERS, len(chunks))):
                    tg.start_soon(drain)
    except* anyio.BrokenWorkerProcess as lost:
        # one error however many workers died (all of them, when a whole process
        # group is killed), saying what happened (anyio's has no message)
        raise anyio.BrokenWorkerProcess(WORKER_DIED) from lost.exceptions[0]
    return [item for part in parsed for item in part]
