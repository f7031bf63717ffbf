"""LocalDirectoryStore mechanics: atomic writes, fan-out layout, threads, key rules.

The behaviour shared with S3 (round trip, idempotence, put_many isolation, …) is
the contract suite in tests/adapters/objectstore/test_s3.py, which runs against this
store too. Here: what only a directory on disk can get wrong.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import stat
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

import inboxd.pipeline.objectstore.local as objectstore
from inboxd.pipeline.objectstore.local import LocalDirectoryStore
from inboxd.pipeline.objectstore.store import (
    ObjectNotFound,
    ObjectStore,
    ObjectStoreError,
    ObjectUnreadable,
    run_bounded,
    validate_key,
)

RAW = b"From: a@example.com\r\nSubject: hi\r\n\r\nbody\r\n"
RAW_KEY = "raw/" + hashlib.sha256(RAW).hexdigest()


@pytest.fixture
def store(tmp_path: Path) -> LocalDirectoryStore:
    return LocalDirectoryStore(tmp_path / "objects")


class _OsProxy:
    """Stands in for the ``os`` module inside inboxd.pipeline.objectstore.local only.

    Records the calls the atomic-write protocol depends on and can fail one of
    them, so the rest of the process keeps the real ``os``.
    """

    def __init__(self, *, fail: str | None = None) -> None:
        self.calls: list[str] = []
        self.fail = fail

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def write(self, fd: int, data: bytes | memoryview) -> int:
        self.calls.append("write")
        if self.fail == "write":
            # Half the payload reaches the file, then the disk fills up.
            view = memoryview(data)
            os.write(fd, view[: len(view) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        return os.write(fd, data)

    def fsync(self, fd: int) -> None:
        self.calls.append("fsync")
        if self.fail == "fsync":
            raise OSError(errno.EIO, "Input/output error")
        os.fsync(fd)

    def replace(self, src: Path, dst: Path) -> None:
        self.calls.append("replace")
        if self.fail == "replace":
            raise OSError(errno.EIO, "Input/output error")
        os.replace(src, dst)


def leftovers(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith(".tmp"))


async def test_satisfies_protocol(store: LocalDirectoryStore) -> None:
    assert isinstance(store, ObjectStore)


async def test_root_is_created_on_demand(store: LocalDirectoryStore) -> None:
    assert not store.root.exists()
    assert not await store.exists(RAW_KEY)
    assert not store.root.exists()
    await store.put(RAW_KEY, RAW)
    assert store.root.is_dir()


async def test_layout_fans_out_below_key_directories(store: LocalDirectoryStore) -> None:
    await store.put(RAW_KEY, RAW)
    path = store.path_for(RAW_KEY)
    digest = hashlib.sha256(RAW_KEY.encode()).hexdigest()
    name = RAW_KEY.split("/")[1]
    assert path == store.root / "raw" / f"+{digest[:2]}" / name
    assert path.read_bytes() == RAW
    # New files are not writable by group or others, nor readable by others: mail.
    assert stat.S_IMODE(path.stat().st_mode) & 0o037 == 0


async def test_idempotent_put_does_not_rewrite(
    store: LocalDirectoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    await store.put(RAW_KEY, RAW)
    before = store.path_for(RAW_KEY).stat()
    proxy = _OsProxy()
    monkeypatch.setattr(objectstore, "os", proxy)
    await store.put(RAW_KEY, RAW)
    after = store.path_for(RAW_KEY).stat()
    assert "write" not in proxy.calls and "replace" not in proxy.calls
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


async def test_write_protocol_is_write_fsync_rename_fsync(
    store: LocalDirectoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    await store.put("raw/warm-up", b"creates the directories")
    proxy = _OsProxy()
    monkeypatch.setattr(objectstore, "os", proxy)
    await store.put("raw/warm-up", b"new content, same directories")
    # Data fsynced before the rename makes it visible; after it, each directory on
    # the way (fan-out, raw/, root), which another writer may have left unsynced.
    assert proxy.calls == ["write", "fsync", "replace", "fsync", "fsync", "fsync"]


class _SyncRecorder(_OsProxy):
    """Records which files and directories (device, inode) were fsynced."""

    def __init__(self) -> None:
        super().__init__()
        self.synced: set[tuple[int, int]] = set()

    def fsync(self, fd: int) -> None:
        info = os.fstat(fd)
        self.synced.add((info.st_dev, info.st_ino))
        super().fsync(fd)


def on_the_way(store: LocalDirectoryStore, key: str) -> set[tuple[int, int]]:
    """The object's file and every directory from its own up to the store's root."""
    path = store.path_for(key)
    paths = [path, *path.parents[: len(path.relative_to(store.root).parts)]]
    return {(p.stat().st_dev, p.stat().st_ino) for p in paths}


@pytest.mark.parametrize("how", ["put", "put_many"])
@pytest.mark.parametrize("same_bytes", [True, False], ids=["same-bytes", "other-bytes"])
async def test_a_put_over_another_writers_unsynced_object_syncs_it_before_answering(
    store: LocalDirectoryStore, monkeypatch: pytest.MonkeyPatch, how: str, same_bytes: bool
) -> None:
    # Another batch's put_many wrote and renamed the object and created its
    # directories, and has not fsynced any of it yet (it fsyncs after renaming all).
    path = store.path_for(RAW_KEY)
    objectstore._makedirs(path.parent)
    objectstore._write_atomic(path, RAW, durable=False)
    recorder = _SyncRecorder()
    monkeypatch.setattr(objectstore, "os", recorder)

    data = RAW if same_bytes else RAW + b"another version\r\n"
    if how == "put":
        await store.put(RAW_KEY, data)
    else:
        assert await store.put_many([(RAW_KEY, data, "message/rfc822")]) == [None]

    # answered stored: the file and every directory entry on its way are durable
    assert on_the_way(store, RAW_KEY) <= recorder.synced
    assert path.read_bytes() == data


@pytest.mark.parametrize("failing_step", ["write", "fsync", "replace"])
async def test_failed_write_leaves_nothing_under_the_key(
    store: LocalDirectoryStore, monkeypatch: pytest.MonkeyPatch, failing_step: str
) -> None:
    await store.put("raw/neighbour", b"already here")  # root exists, so leftovers are visible
    monkeypatch.setattr(objectstore, "os", _OsProxy(fail=failing_step))
    with pytest.raises(ObjectStoreError) as info:
        await store.put(RAW_KEY, RAW * 1000)
    assert isinstance(info.value.__cause__, OSError)
    monkeypatch.undo()

    assert not store.path_for(RAW_KEY).exists()
    assert not await store.exists(RAW_KEY)
    with pytest.raises(ObjectNotFound):
        await store.get(RAW_KEY)
    assert leftovers(store.root) == []
    # The failure was local to that key and the store is still usable.
    await store.put(RAW_KEY, RAW)
    assert await store.get(RAW_KEY) == RAW


async def test_failed_overwrite_keeps_the_previous_object(
    store: LocalDirectoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    await store.put("html/m1", b"<p>version one</p>")
    monkeypatch.setattr(objectstore, "os", _OsProxy(fail="write"))
    with pytest.raises(ObjectStoreError):
        await store.put("html/m1", b"<p>version two, which never lands</p>")
    monkeypatch.undo()
    assert await store.get("html/m1") == b"<p>version one</p>"


async def test_temp_file_left_by_a_crash_is_not_an_object(store: LocalDirectoryStore) -> None:
    # What a power cut between write and rename leaves behind.
    path = store.path_for(RAW_KEY)
    path.parent.mkdir(parents=True)
    path.with_name(f"{path.name}+0123456789abcdef.tmp").write_bytes(RAW[:10])
    assert not await store.exists(RAW_KEY)
    assert await store.exists_many([RAW_KEY]) == set()
    with pytest.raises(ObjectNotFound):
        await store.get(RAW_KEY)
    await store.put(RAW_KEY, RAW)
    assert await store.get(RAW_KEY) == RAW


async def test_unusable_root_is_a_store_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_bytes(b"")
    store = LocalDirectoryStore(blocker / "objects")
    with pytest.raises(ObjectStoreError):
        await store.put(RAW_KEY, RAW)
    results = await store.put_many([(RAW_KEY, RAW, "message/rfc822")])
    assert isinstance(results[0], ObjectStoreError)
    with pytest.raises(ObjectNotFound):
        await store.get(RAW_KEY)


@pytest.mark.parametrize(
    ("code", "one_object"),
    [(errno.EIO, True), (errno.EACCES, True), (errno.EMFILE, False), (errno.ESTALE, False)],
    ids=["EIO", "EACCES", "EMFILE", "ESTALE"],
)
async def test_a_read_error_of_one_file_is_told_from_one_of_the_store(
    store: LocalDirectoryStore, monkeypatch: pytest.MonkeyPatch, code: int, one_object: bool
) -> None:
    await store.put(RAW_KEY, RAW)

    def failing(path: Path) -> bytes:
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(Path, "read_bytes", failing)
    with pytest.raises(ObjectStoreError) as info:
        await store.get(RAW_KEY)

    # one file's bad block or permissions: that object only; too many open files or
    # a network mount gone: every read would fail, the store is down
    assert isinstance(info.value, ObjectUnreadable) is one_object
    assert not isinstance(info.value, ObjectNotFound)


async def test_file_io_runs_in_worker_threads(
    store: LocalDirectoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: set[int] = set()
    real_write = objectstore._write_atomic

    def recording_write(path: Path, data: bytes) -> None:
        seen.add(threading.get_ident())
        real_write(path, data)

    monkeypatch.setattr(objectstore, "_write_atomic", recording_write)
    await store.put(RAW_KEY, RAW)
    assert seen and threading.get_ident() not in seen


async def test_put_many_fsyncs_every_file_and_directory_before_returning(
    store: LocalDirectoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[Path] = []
    real = objectstore._fsync_path

    def record(path: Path) -> None:
        synced.append(path)
        real(path)

    monkeypatch.setattr(objectstore, "_fsync_path", record)
    items = [(f"att/t/{i}", b"x%d" % i, "text/plain") for i in range(40)]
    assert await store.put_many(items) == [None] * 40
    for key, _, _ in items:
        path = store.path_for(key)
        assert path in synced and path.parent in synced
    synced.clear()
    # already there: not rewritten, still synced (the bytes may be another batch's)
    assert await store.put_many(items) == [None] * 40
    for key, _, _ in items:
        path = store.path_for(key)
        assert path in synced and path.parent in synced


async def test_put_many_reports_a_failed_fsync_on_its_item_only(
    store: LocalDirectoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = store.path_for("att/t/bad")
    real = objectstore._fsync_path

    def flaky(path: Path) -> None:
        if path == bad:
            raise OSError(5, "Input/output error")
        real(path)

    monkeypatch.setattr(objectstore, "_fsync_path", flaky)
    results = await store.put_many([("att/t/ok", b"1", "x"), ("att/t/bad", b"2", "x")])
    assert results[0] is None
    assert isinstance(results[1], ObjectStoreError)


async def test_run_bounded_limits_and_orders() -> None:
    gate = anyio.Event()
    in_flight = 0
    peak = 0

    async def work(n: int) -> int:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await gate.wait()
        in_flight -= 1
        if n == 3:
            raise ValueError("item 3 is bad")
        return n * 10

    results: list[int | Exception] = []

    async def run() -> None:
        results.extend(await run_bounded(work, list(range(10)), concurrency=4))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await anyio.wait_all_tasks_blocked()
        assert in_flight == 4
        gate.set()
    assert peak == 4
    assert isinstance(results[3], ValueError)
    assert [r for i, r in enumerate(results) if i != 3] == [0, 10, 20, 40, 50, 60, 70, 80, 90]


async def test_run_bounded_propagates_cancellation() -> None:
    started = 0

    async def forever(_: int) -> None:
        nonlocal started
        started += 1
        await anyio.sleep_forever()

    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(run_bounded, forever, [1, 2, 3], concurrency=2))
            await anyio.wait_all_tasks_blocked()
            scope.cancel()
    assert scope.cancelled_caught
    assert started == 2


async def test_url_for_is_none(store: LocalDirectoryStore) -> None:
    await store.put(RAW_KEY, RAW)
    assert await store.url_for(RAW_KEY, expires_s=60) is None


@pytest.mark.parametrize(
    "key",
    ["raw/" + "a" * 64, "att/tenant-1/" + "b" * 64, "html/m_1.html", "a", "a/b/c/d", ".hidden"],
)
def test_valid_keys(key: str) -> None:
    assert validate_key(key) == key


@pytest.mark.parametrize(
    "key", ["", "/a", "a/", "a//b", "a/../b", "..", "a/..b", "./a", "A", "a b", "a+b", "a:b"]
)
def test_invalid_keys(key: str) -> None:
    with pytest.raises(ValueError):
        validate_key(key)


async def test_a_store_that_cannot_be_written_fails_at_start(tmp_path: Path) -> None:
    (tmp_path / "blocker").write_text("a file where the store's directory should be")
    store = LocalDirectoryStore(tmp_path / "blocker" / "objects")
    with pytest.raises(ObjectStoreError) as raised:
        await store.start()
    assert f"object store {tmp_path / 'blocker' / 'objects'} cannot be written" in str(raised.value)
    assert "Not a directory" in str(raised.value)


async def test_start_creates_the_directory_and_leaves_no_probe(tmp_path: Path) -> None:
    root = tmp_path / "a" / "objects"
    async with LocalDirectoryStore(root):
        assert root.is_dir() and list(root.iterdir()) == []
