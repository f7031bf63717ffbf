"""What `inboxd import` tells the user: the progress bar, the summary, the closing line.

    progress   a bar on stderr, only when stderr is a terminal: bytes of the planned
               input consumed, messages ingested so far
    summary    ImportSummary: counts by outcome, dead items, skipped files, messages/s,
               printed for humans or as one JSON object (--json)
    closing    for an interrupted, incomplete or failed run, one line on stderr saying
               what is stored and that re-running the same command is safe

The import pipeline (daemon.commands.importer) fills the summary and decides the
status and the exit code; this module only renders them.
"""

from __future__ import annotations

import sys
from collections import Counter
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from inboxd.daemon.commands.common import emit_json
from inboxd.pipeline.outcomes import Outcome

if TYPE_CHECKING:
    from rich.progress import Progress

# Dead items listed in the human summary (all of them are in --json output).
DEAD_ITEMS_SHOWN = 20


@dataclass(slots=True)
class ImportSummary:
    """What an import did; `status` is ok, incomplete, failed or interrupted."""

    tenant: str
    mailbox: str
    files: int
    skipped: list[str]
    outcomes: Counter[str] = field(default_factory=Counter)
    dead: list[tuple[str, str]] = field(default_factory=list)
    not_imported: int = 0
    unread_input: bool = False
    status: str = "ok"
    error: str | None = None
    elapsed_s: float = 0.0

    @property
    def messages(self) -> int:
        return sum(self.outcomes.values())

    @property
    def rate(self) -> float:
        return self.messages / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "command": "import",
            "status": self.status,
            "tenant": self.tenant,
            "mailbox": self.mailbox,
            "messages": self.messages,
            "outcomes": {o.value: self.outcomes.get(o.value, 0) for o in Outcome},
            "not_imported": self.not_imported,
            "input_left_unread": self.unread_input,
            "files": self.files,
            "skipped_files": len(self.skipped),
            "skipped": self.skipped,
            "dead": [{"source": ref, "reason": reason} for ref, reason in self.dead],
            "elapsed_s": round(self.elapsed_s, 3),
            "messages_per_s": round(self.rate, 1),
            "error": self.error,
        }

    def print_human(self) -> None:
        out = sys.stdout
        skipped = f", {plural(len(self.skipped), 'other file')} skipped" if self.skipped else ""
        print(
            f"{self.status_line()}: {plural(self.messages, 'message')} from "
            f"{plural(self.files, 'file')}{skipped} in {self.elapsed_s:.2f} s "
            f"({self.rate:.1f} messages/s)",
            file=out,
        )
        for outcome in Outcome:
            print(f"  {outcome.value:<18} {self.outcomes.get(outcome.value, 0):>8}", file=out)
        if self.dead:
            print(
                f"{plural(len(self.dead), 'dead item')} (not mail; recorded in dead_items, "
                "not retried):",
                file=out,
            )
            for ref, reason in self.dead[:DEAD_ITEMS_SHOWN]:
                print(f"  {ref}: {reason}", file=out)
            if len(self.dead) > DEAD_ITEMS_SHOWN:
                print(
                    f"  … and {len(self.dead) - DEAD_ITEMS_SHOWN} more (--json lists all)", file=out
                )

    def status_line(self) -> str:
        return {
            "ok": "imported",
            "interrupted": "interrupted",
            "incomplete": "incomplete",
            "failed": "stopped",
        }.get(self.status, self.status)


class ProgressBar:
    """Bytes of the planned input consumed and messages ingested, on stderr.

    Shown only while `open(...)` is entered and stderr is a terminal; otherwise
    `advance` does nothing.
    """

    def __init__(self) -> None:
        self._progress: Progress | None = None
        self._task: Any = None

    def open(self, total_bytes: int) -> AbstractContextManager[Any]:
        """The context that shows the bar (a transient one, gone when the run ends)."""
        if not sys.stderr.isatty():
            return nullcontext()
        # Imported here: only a terminal needs rich.
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("importing"),
            BarColumn(),
            DownloadColumn(),
            TextColumn("{task.fields[messages]} messages"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        self._task = self._progress.add_task("import", total=total_bytes, messages=0)
        return self._progress

    def advance(self, span_bytes: int, messages: int) -> None:
        """Move the bar by `span_bytes` of input and show `messages` ingested so far."""
        if self._progress is not None:
            self._progress.update(self._task, advance=span_bytes, messages=messages)


def print_report(summary: ImportSummary, *, as_json: bool, rolled_back: bool) -> None:
    """Print the summary on stdout (human or JSON), then any closing line on stderr.

    `rolled_back` says an interrupted run abandoned the batch it was ingesting.
    """
    if as_json:
        emit_json(summary.as_json())
    else:
        summary.print_human()
    message = closing_message(summary, rolled_back=rolled_back)
    if message:
        sys.stdout.flush()
        print(message, file=sys.stderr)


def closing_message(summary: ImportSummary, *, rolled_back: bool) -> str | None:
    """The stderr line for an interrupted, incomplete or failed run; None when ok."""
    if summary.status == "interrupted":
        abandoned = "the batch in progress was rolled back; " if rolled_back else ""
        return (
            f"inboxd: interrupted: {abandoned}every committed batch is stored; "
            "re-running the same command imports the rest"
        )
    if summary.status == "incomplete":
        return (
            f"inboxd: error: {plural(summary.not_imported, 'message')} not imported "
            f"({summary.error}) and the rest of the input was not read; re-running "
            "the same command is safe (what is stored is reported as duplicate)"
        )
    if summary.status == "failed":
        return (
            f"inboxd: error: {summary.error}; the messages before it are "
            "stored, re-running the same command is safe"
        )
    return None


def plural(count: int, noun: str) -> str:
    """`count` and `noun`, with an s unless `count` is 1."""
    return f"{count} {noun}{'' if count == 1 else 's'}"
