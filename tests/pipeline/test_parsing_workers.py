"""The parse worker processes: they leave stopping to their parent, and one that is
killed anyway fails the call with one error that says so.

Workers are seen from outside through /proc (helpers.parse_workers). To kill one
mid-chunk, the test stops the workers, waits until a chunk waits in their stdin,
and kills them then: no timing is guessed.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import anyio
import pytest
from helpers import eventually
from helpers.parse_workers import ignored_signals, parse_workers, pending_input, signal_all

from inboxd.pipeline.mime import workers as parsing
from inboxd.pipeline.mime.workers import PARSE_CHUNK_SIZE, parse_in_workers

SAMPLE = "axllent-mailpit/plain-text.eml"
# A worker that was sent a chunk shows it in its stdin within milliseconds.
PENDING_TIMEOUT_S = 30.0

pytestmark = pytest.mark.slow  # worker processes


async def parsed_in_workers(raws: list[bytes]) -> bool:
    """Whether `raws` parsed in workers. The test runner keeps one event loop for
    many tests, and anyio kills a loop's pool when the task that first used it
    ends, without taking the workers out of the pool: the next test may be handed
    one of those dead workers once (never so under `anyio.run`, one task)."""
    try:
        return len(await parse_in_workers(raws, "t", "m", "gmail")) == len(raws)
    except anyio.BrokenWorkerProcess:
        return False


async def test_workers_leave_stop_signals_to_the_parent(corpus: Path) -> None:
    raw = (corpus / "mime" / SAMPLE).read_bytes()
    await eventually(lambda: parsed_in_workers([raw]), PENDING_TIMEOUT_S, what="a live worker")

    workers = parse_workers(os.getpid())
    assert workers
    for pid in workers:
        # a Ctrl-C, a SIGTERM or a Ctrl-Z to the whole process group is the parent's
        assert {signal.SIGINT, signal.SIGTERM, signal.SIGTSTP} <= ignored_signals(pid)


async def test_killed_workers_fail_the_call_with_one_error_that_says_so(
    corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(parsing, "PARSE_WORKERS", 2)
    monkeypatch.setattr(parsing, "_limiter", None)  # a limiter of PARSE_WORKERS
    raws = [(corpus / "mime" / SAMPLE).read_bytes()] * (PARSE_CHUNK_SIZE * 2)
    await eventually(lambda: parsed_in_workers(raws), PENDING_TIMEOUT_S, what="live workers")
    workers = parse_workers(os.getpid())
    signal_all(workers, signal.SIGSTOP)
    failure: list[BaseException] = []

    async def parse() -> None:
        try:
            await parse_in_workers(raws, "t", "m", "gmail")
        except BaseException as exc:  # what the caller gets, an exception group or not
            failure.append(exc)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(parse)
            await eventually(
                lambda: sum(pending_input(pid) > 0 for pid in workers),
                PENDING_TIMEOUT_S,
                what="both chunks sent to the stopped workers",
                until=lambda busy: busy >= 2,
            )
            signal_all(workers, signal.SIGKILL)  # the OOM killer, mid-chunk
    finally:
        signal_all(workers, signal.SIGKILL)

    [error] = failure
    assert type(error) is anyio.BrokenWorkerProcess, repr(error)
    assert str(error) == parsing.WORKER_DIED
    # later calls start new workers
    await eventually(lambda: parsed_in_workers(raws), PENDING_TIMEOUT_S, what="new workers")
