"""Stopping a batch command (`inboxd import`, `inboxd reprocess`) on SIGINT/SIGTERM.

before the work starts   a signal abandons at once (nothing written yet)
while working            the first signal asks the command to stop after the
                         batch in progress (it commits or rolls back whole);
                         `stop` is set and `on_stop` runs (e.g. to stop waiting
                         for the next batch)
a second signal          abandons the batch in progress too: the main scope is
                         cancelled and `aborted` tells the summary it rolled back
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Awaitable, Callable

import anyio
import structlog

from inboxd.daemon.commands.common import CommandError

log = structlog.get_logger(__name__)


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
        """Run `work` with signals served; its CommandError comes out as itself (not in
        an exception group). A second signal cancels `work` and returns normally
        (`aborted` says so)."""
        error: CommandError | None = None
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
