"""LocalDirectoryStore: the ``ObjectStore`` on a local directory, with grouped fsync.

The default store when no S3 is configured (docs/architecture.md §3). It keeps the contract
in ``inboxd.pipeline.objectstore.store`` (key rules, errors, idempotent atomic ``put``,
per-item ``put_many``) and adds what only a disk needs: the fan-out layout below
each key directory, temp file + fsync + rename writes, and ``put_many``'s grouped
durability (write and rename every object, then fsync each file and each distinct
directory once, concurrently). Standard library and anyio only (CONTRIBUTING.md rule 3).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

import anyio
import anyio.to_thread
import asyncpg

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

__all__ = ["LOCAL_IO_CONCURRENCY", "LocalDirectoryStore"]

# Worker threads one LocalDirectoryStore may occupy at once. Its writes end in
# fsync, which a single disk serialises anyway, so a handful of threads keeps the
# device queue busy; a bound of its own keeps an attachment burst from taking all
# 40 tokens of anyio's process-wide default thread limiter (anyio docs,
# "Working with threads": default limiter = 40), which DNS lookups and other
# to_thread users share.
LOCAL_IO_CONCURRENCY = 8

# New files: owner read/write, group read (the application reading attachments may
# run as another user in the same group), nothing for others: these are people's
# emails. The process umask still applies on top.
_FILE_MODE = 0o640
_DIR_MODE = 0o750
# Marks fan-out directories and temporary files. "+" is outside the key alphabet,
# so no key can name a fan-out directory or a temporary file, and no object file
# can collide with a directory another key needs (see LocalDirectoryStore).
_FAN_MARK = "+"

# Read errors about one file, not the store (get → ObjectUnreadable, reported per
# object): a directory in its place (EISDIR), its permissions (EACCES, EPERM), a
# symlink loop, a bad block (EIO) or a failed checksum (ext4 returns EFSBADCRC =
# EBADMSG and EFSCORRUPTED = EUCLEAN, linux fs/ext4/ext4.h). Any other
# errno (EMFILE, ENOMEM, ESTALE or ENOTCONN of a network mount gone) stays an
# ObjectStoreError: the store is failing, every read would.
OBJECT_READ_ERRNOS = frozenset(
    {errno.EISDIR, errno.EACCES, errno.EPERM, errno.ELOOP, errno.EIO, errno.EBADMSG, errno.EUCLEAN}
)

# Concurrent fsyncs in put_many: the journal folds concurrent fsyncs into one
# commit, so more in flight means fewer commits per object (16-64 measured alike).
SYNC_CONCURRENCY = 32

_R = TypeVar("_R")


class LocalDirectoryStore(StoreContext):
    """``ObjectStore`` on a local directory: the default when no S3 is configured.

    Layout: key ``<dirs>/<name>`` lives at ``root/<dirs>/+<h0h1>/<name>``, where
    ``h`` is the hex SHA-256 of the whole key. One level of 256 directories keeps
    a directory to ~40k entries at 10M objects (ext4's htree handles that) while
    a batch of 500 puts touches ~220 directories, not 500 fresh two-level ones
    whose creation fsyncs dominated ingest (bench/README.md); ``att/<tenant>/``
    stays a directory an
    operator can ``du`` or back up per tenant. Because ``+`` never appears in a
    key, an object file can never sit where another key needs a directory: ``a/b``
    and ``a/b/c`` may both exist, as on S3.

    Writes go to ``<name>+<random>.tmp`` beside the final file, are fsynced and
    then renamed over the final name (``rename(2)`` is atomic within a directory),
    and every directory up to the root is fsynced so the rename survives power loss
    (one may be another writer's, created and not synced yet). A put of bytes the
    file already holds does not rewrite it, and fsyncs it and its directories
    alike. A crash can leave a ``*.tmp`` file behind; it is never visible as an
    object and may be deleted by anyone once it is older than the longest write.

    ``content_type`` is accepted for the protocol and not stored: a local
    directory never serves the bytes over HTTP itself (``url_for`` is ``None``).
    All file I/O runs in worker threads, at most ``LOCAL_IO_CONCURRENCY`` at once.
    """

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        # anyio >= 4.2 creates limiters outside an event loop (agronholm/anyio#651),
        # so a store can be built at config time.
        self._limiter = anyio.CapacityLimiter(LOCAL_IO_CONCURRENCY)
        self._sync_limiter = anyio.CapacityLimiter(SYNC_CONCURRENCY)

    def __repr__(self) -> str:
        return f"LocalDirectoryStore({str(self.root)!r})"

    async def start(self) -> None:
        """Create the directory when missing and prove it takes a file: a store that
        cannot be written (no permission, a read-only mount, a file in the way) fails
        the start with its path and the OS error, not the first message's ingest."""
        try:
            await anyio.to_thread.run_sync(_probe_writable, self.root)
        except OSError as exc:
            raise ObjectStoreError(f"object store {self.root} cannot be written: {exc}") from exc

    def path_for(self, key: str) -> Path:
        """The file that holds (or would hold) ``key``; raises ``ValueError`` for a bad key."""
        validate_key(key)
        digest = hashlib.sha256(key.encode("ascii")).hexdigest()
        dirs, _, name = key.rpartition("/")
        base = self.root / dirs if dirs else self.root
        return base / f"{_FAN_MARK}{digest[:2]}" / name

    async def put(
        self,
        key: str,
        data: bytes,
        *,
        content_type: str = "application/octet-stream",  # noqa: ARG002 - files keep no type
    ) -> None:
        path = self.path_for(key)
        data = object_bytes(data)
        try:
            await self._in_thread(_put_durable, path, data, self.root)
        except OSError as exc:
            raise ObjectStoreError(f"writing object {key!r} failed: {exc}") from exc

    async def put_many(
        self,
        items: Sequence[tuple[str, bytes, str]],
        *,
        conn: asyncpg.Connection | None = None,  # noqa: ARG002 - the store contract's
    ) -> list[BaseException | None]:
        """Write every object, then make them durable together before returning.

        Per-object fsync of file and directory, one object after another, cost
        0.6-1.0 ms of kernel time each and capped ingest near 1,200 messages/s
        (bench/README.md). Here all objects are written and renamed first, then
        every file and every distinct directory is fsynced concurrently, which
        the filesystem journal folds into few commits. Nothing is reported
        stored before its fsyncs return; a crash before that can leave a file
        whose bytes differ from what its key should hold, which the next put of
        that key rewrites (`_same_content`), and no row points at it yet. A file
        that already holds the bytes is fsynced all the same: another batch may
        have renamed it and not synced it yet.
        """
        results: list[BaseException | None] = [None] * len(items)
        jobs: list[tuple[int, Path, bytes]] = []
        for i, (key, data, _content_type) in enumerate(items):
            try:
                data = object_bytes(data)
                jobs.append((i, self.path_for(key), data))
            except (ValueError, TypeError) as exc:
                results[i] = exc
        if not jobs:
            return results
        written = await self._in_thread(_write_unsynced, jobs, self.root)
        to_sync: dict[Path, list[int]] = {}
        for i, outcome in written.items():
            if isinstance(outcome, OSError):
                results[i] = ObjectStoreError(f"writing object {items[i][0]!r} failed: {outcome}")
            else:
                for path in outcome:
                    to_sync.setdefault(path, []).append(i)
        paths = list(to_sync)
        synced = await run_bounded(
            lambda path: anyio.to_thread.run_sync(_fsync_path, path, limiter=self._sync_limiter),
            paths,
            concurrency=SYNC_CONCURRENCY,
        )
        for path, sync_outcome in zip(paths, synced, strict=True):
            if isinstance(sync_outcome, BaseException):
                for i in to_sync[path]:
                    results[i] = ObjectStoreError(
                        f"syncing object {items[i][0]!r} failed: {sync_outcome}"
                    )
        return results

    async def get(self, key: str) -> bytes:
        path = self.path_for(key)
        try:
            return await self._in_thread(path.read_bytes)
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise ObjectNotFound(key) from exc
        except OSError as exc:
            if exc.errno in OBJECT_READ_ERRNOS:
                raise ObjectUnreadable(key, str(exc)) from exc
            raise ObjectStoreError(f"reading object {key!r} failed: {exc}") from exc

    async def exists(self, key: str) -> bool:
        return bool(await self.exists_many([key]))

    async def exists_many(self, keys: Iterable[str]) -> set[str]:
        wanted = {key: self.path_for(key) for key in keys}
        if not wanted:
            return set()
        try:
            return await self._in_thread(_existing, wanted)
        except OSError as exc:
            raise ObjectStoreError(f"checking {len(wanted)} objects failed: {exc}") from exc

    async def url_for(self, key: str, *, expires_s: int) -> str | None:
        validate_key(key)
        validate_url_expiry(expires_s)
        return None

    async def _in_thread(self, fn: Callable[..., _R], *args: object) -> _R:
        # abandon_on_cancel=False (the default): a cancelled caller still waits for
        # the thread, so a write finishes or cleans up its temporary file before
        # cancellation propagates.
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)


def _existing(wanted: dict[str, Path]) -> set[str]:
    return {key for key, path in wanted.items() if path.is_file()}


def _same_content(path: Path, data: bytes) -> bool:
    try:
        if path.stat().st_size != len(data):
            return False
        return path.read_bytes() == data
    except (FileNotFoundError, NotADirectoryError):
        return False


def _write_unsynced(
    jobs: list[tuple[int, Path, bytes]], root: Path
) -> dict[int, list[Path] | OSError]:
    """Write and rename each object without fsync, unless it already holds its bytes.

    Returns per job the paths to fsync before it is durable (the file and every
    directory from its own up to ``root``: `_dirs_up_to`), or the OSError that
    stopped it. A file that already held the bytes is synced too: they may be
    another writer's, renamed and not yet fsynced.
    """
    out: dict[int, list[Path] | OSError] = {}
    for i, path, data in jobs:
        try:
            if not _same_content(path, data):
                _makedirs(path.parent)
                _write_atomic(path, data, durable=False)
            out[i] = [path, *_dirs_up_to(path.parent, root)]
        except OSError as exc:
            out[i] = exc
    return out


def _put_durable(path: Path, data: bytes, root: Path) -> None:
    """``put``: make ``path`` hold ``data``, durable before it returns.

    Bytes already there are fsynced rather than trusted: another writer may have
    renamed them and not synced them yet (put_many syncs after renaming), and
    nothing is answered stored before its bytes are durable (docs/architecture.md §3).
    """
    if _same_content(path, data):
        _fsync_path(path)  # no rewrite: the same inode, synced in place
    else:
        _makedirs(path.parent)
        _write_atomic(path, data)
    for directory in _dirs_up_to(path.parent, root):
        _fsync_dir(directory)


def _dirs_up_to(directory: Path, root: Path) -> list[Path]:
    """``directory`` and each parent up to and including ``root``.

    A file is durable only once every directory on its way has its entry on disk,
    and one that exists may have been created by another writer that has not
    synced it yet (``_makedirs`` answers "already there" either way): each is
    fsynced; put_many fsyncs each distinct one once per batch.
    """
    chain = [directory]
    while chain[-1] != root and chain[-1] != chain[-1].parent:
        chain.append(chain[-1].parent)
    return chain


def _probe_writable(root: Path) -> None:
    """`_makedirs(root)`, then a file created, written and removed in it; OSError else."""
    _makedirs(root)
    probe = root / f".inboxd-probe-{secrets.token_hex(6)}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, b"probe")
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(probe)


def unwritable_reason(root: Path) -> str | None:
    """Why a local store at `root` could not be written, or None; creates nothing (for
    check-config). A missing directory counts as writable when its nearest existing
    ancestor is a directory this user may create entries in."""
    current = root
    while not current.exists():
        if current == current.parent:
            return f"{root}: no existing parent directory"
        current = current.parent
    if not current.is_dir():
        return f"{current} is not a directory"
    if not os.access(current, os.W_OK | os.X_OK):
        # access(2) answers EROFS for a read-only mount and EACCES for permissions
        error = errno.EROFS if _read_only(current) else errno.EACCES
        return f"{current}: {os.strerror(error)}"
    return None


def _read_only(path: Path) -> bool:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


def _makedirs(directory: Path) -> None:
    """``mkdir -p``, each new directory with ``_DIR_MODE`` (not synced: `_dirs_up_to`)."""
    missing: list[Path] = []
    current = directory
    while not current.is_dir():
        missing.append(current)
        if current == current.parent:
            break
        current = current.parent
    for new_dir in reversed(missing):
        with contextlib.suppress(FileExistsError):
            new_dir.mkdir(mode=_DIR_MODE)


def _fsync_path(path: Path) -> None:
    if path.is_dir():
        _fsync_dir(path)
        return
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Make ``path`` hold ``data`` via temp file (+ fsync when ``durable``) + rename.

    The directories are the caller's to fsync (`_dirs_up_to`).
    """
    tmp = path.with_name(f"{path.name}{_FAN_MARK}{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, _FILE_MODE)
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some filesystems (e.g. certain network mounts) refuse fsync on a
        # directory; the data file itself is already fsynced.
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)
