"""The parse worker processes (anyio.to_process) of a process, seen from outside
through /proc: which they are, which signals they ignore, whether one holds its
parent waiting.

A test that must kill a worker *mid-chunk* stops the workers (SIGSTOP) and waits
until one of them holds the parent (`holds_the_parent`): then it kills them.
A stopped worker is never let go again: a SIGSTOP that lands in the middle of
its answer's write() cuts the write short, and anyio's worker does not write the
rest (an unbuffered `stdout.buffer.write`), so its parent would wait forever.
"""

from __future__ import annotations

import fcntl
import os
import platform
import signal
import sys
import termios
from pathlib import Path

# What anyio puts on a worker's command line (`python -u -m anyio.to_process`).
WORKER_MARK = b"anyio.to_process"
# read(2)'s number in /proc/PID/syscall, by machine (asm/unistd.h).
READ_SYSCALL = {"x86_64": 0, "aarch64": 63}.get(platform.machine())


def parse_workers(parent: int) -> list[int]:
    """Pids of the live anyio worker processes whose parent is `parent`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid …": comm may hold spaces and parentheses
        state, ppid = stat.rpartition(")")[2].split()[:2]
        if int(ppid) == parent and state != "Z" and WORKER_MARK in cmdline:
            pids.append(int(entry.name))
    return sorted(pids)


def ignored_signals(pid: int) -> set[signal.Signals]:
    """The signals `pid` ignores (SigIgn of /proc/PID/status: bit N-1 for signal N)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            mask = int(line.split()[1], 16)
            return {s for s in signal.Signals if mask >> (s.value - 1) & 1}
    raise AssertionError(f"no SigIgn line for {pid}")


def pending_input(pid: int) -> int:
    """Bytes written to `pid`'s stdin pipe and not read yet (0 when it is gone)."""
    try:
        fd = os.open(f"/proc/{pid}/fd/0", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return 0
    try:
        answer = fcntl.ioctl(fd, termios.FIONREAD, bytes(4))
    finally:
        os.close(fd)
    return int.from_bytes(answer, sys.byteorder)


def waits_for_a_chunk(pid: int) -> bool:
    """Whether `pid` sits in read(0, …): between chunks, waiting for the next one."""
    fields = Path(f"/proc/{pid}/syscall").read_text().split()
    return fields[:2] == [str(READ_SYSCALL), "0x0"]


def stopped(pid: int) -> bool:
    """Whether `pid` has stopped (a SIGSTOP is delivered at its next kernel exit)."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "T"


def holds_the_parent(pid: int) -> bool:
    """Whether the worker `pid`, stopped, keeps its parent waiting for an answer: a
    chunk waits in its stdin, or it stopped outside its read of the next chunk
    (parsing one, or writing the answer). Only a worker stopped in the few
    instructions between an answer written and the next read looks busy and is not."""
    if not stopped(pid):  # not yet: where it is says nothing
        return False
    return pending_input(pid) > 0 or not waits_for_a_chunk(pid)


def signal_all(pids: list[int], signum: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
