"""Stopping a batch command (`inboxd import`, `inboxd reprocess`) on SIGINT/SIGTERM.

before the work starts   a signal abandons at once (nothing written yet)
while working            the first signal asks the command to stop after the
                         batch in progress (it commits or rolls back whole);
                         `stop` is set and `on_stop` runs (e.g. to stop waiting
                         for the next batch)
a second signal          abandons the batch in progress too: the main scope is
                         cancelled and `aborted` tells the summary it rolled back

While a command runs, its event-loop thread blocks SIGINT, SIGTERM and SIGTSTP
and one thread of its own, which does nothing else, takes them instead
(`held_from_children`). A child inherits the signal mask of the thread that
forks it, so the parse worker processes (pipeline.mime.workers, spawned from the
event loop) start with the three blocked, before their interpreter runs a line:
a Ctrl-C to the process group while one starts no longer reaches it. Before,
they ignored them only from their first chunk on, 100-150 ms after they
appeared; a Ctrl-C in that window killed the worker or its answer (a
KeyboardInterrupt raised in the parent, or a worker reading the rest of a
half-read chunk as new ones: the command hung), never the summary (issue 22).
The command itself still sees every signal: Python runs its handlers in the
main thread whichever thread the kernel hands the signal to, and a SIGTSTP
taken by that thread stops the whole process as before.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

import anyio
import structlog

from inboxd.daemon.commands.common import CommandError

log = structlog.get_logger(__name__)

# What a terminal or a service manager sends the whole process group to stop or
# suspend it: the command's to handle, never a parse worker's (pipeline.mime.workers).
GROUP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGTSTP})


@contextmanager
def held_from_children() -> Iterator[None]:
    """Block GROUP_SIGNALS in the calling thread (the event loop's) and every thread
    and child process it starts meanwhile; one thread started first, with them
    unblocked, takes them for the process (module docstring). On exit the mask is
    restored, and a signal still pending is delivered then."""
    done = threading.Event()
    receiver = threading.Thread(target=done.wait, name="inboxd-signals", daemon=True)
    receiver.start()  # before the block: it keeps the signals unblocked
    before = signal.pthread_sigmask(signal.SIG_BLOCK, GROUP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
        done.set()
        receiver.join()


class StopSignals:
    """The two-signal stop of one command run (module docstring); `command` names its
    log events (`<command>_stopping`, `<command>_aborted`)."""

    def __init__(self, command: str, *, on_stop: Callable[[], None] | None = None) -> None:
        self.command = command
        self.on_stop = on_stop
        self.stop = anyio.Event()
        self.working = False  # set by the command once it writes
        self.aborted = False

    async def watch(self, main_scope: anyio.CancelScope) -> None:
        """Serve signals until the run ends (start it in the run's task group)."""
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                name = signal.Signals(signum).name
                if not self.working or self.stop.is_set():
                    log.warning(f"{self.command}_aborted", signal=name)
                    self.aborted = True
                    self.stop.set()
                    main_scope.cancel()
                    return
                log.warning(f"{self.command}_stopping", signal=name)
                if sys.stderr.isatty():
                    print(
                        "inboxd: stopping after the current batch "
                        "(press Ctrl-C again to abandon it)",
                        file=sys.stderr,
                    )
                self.stop.set()
                if self.on_stop is not None:
                    self.on_stop()

    async def run(self, work: Callable[[], Awaitable[None]]) -> None:
        """Run `work` with signals served and held from the worker processes it starts
        (`held_from_children`); its CommandError comes out as itself (not in an
        exception group). A second signal cancels `work` and returns normally
        (`aborted` says so)."""
        error: CommandError | None = None
        with held_from_children():
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.watch, tg.cancel_scope)
                try:
                    await work()
                except CommandError as exc:
                    error = exc
                finally:
                    tg.cancel_scope.cancel()
        if error is not None:
            raise error
