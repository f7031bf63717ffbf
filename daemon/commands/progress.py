"""The progress bar of a batch command (`inboxd reprocess`, `inboxd extract backfill`).

Messages done of those in scope, plus one running count the command names
(updated, queued), on stderr and only when stderr is a terminal: piped or
logged runs get the summary alone, never escape codes.
"""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.progress import Progress


class ProgressBar:
    """`label` heads the bar ("reprocessing"); `counted` names the running count shown
    beside it ("updated")."""

    def __init__(self, label: str, counted: str) -> None:
        self._label = label
        self._counted = counted
        self._progress: Progress | None = None
        self._task: Any = None

    def open(self, total: int) -> AbstractContextManager[Any]:
        """Draw the bar for `total` messages while the context is open (a terminal only)."""
        if not sys.stderr.isatty():
            return nullcontext()
        # Imported here: only a terminal needs rich.
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn(self._label),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[counted]} " + self._counted),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        self._task = self._progress.add_task(self._label, total=total, counted=0)
        return self._progress

    def advance(self, messages: int, counted: int) -> None:
        """`messages` more are done; `counted` is the running count's new total."""
        if self._progress is not None:
            self._progress.update(self._task, advance=messages, counted=counted)
