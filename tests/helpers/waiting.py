"""Wait for a condition with a deadline: the one poller of the suite.

`wait_for` (sync) and `eventually` (async) call `check` every `poll_s` until
`until(value)` holds (default: the value is truthy) and return that value. At
the deadline they fail with an AssertionError naming what was awaited and the
last value seen. `abort` is asked between polls and may return a reason to stop
waiting at once (a process that exited); `context` adds text to any failure (a
log tail). The pause between polls is a polling interval, never a way to
synchronise: every wait ends as soon as the condition holds.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

T = TypeVar("T")

POLL_S = 0.05


class WaitTimeout(AssertionError):
    """A condition did not hold by its deadline (or waiting was aborted)."""


def _truthy(value: object) -> bool:
    return bool(value)


def _message(
    head: str, what: str, polls: int, last: object, context: Callable[[], str] | None
) -> str:
    seen = f"last value seen: {last!r}" if polls else "the condition was never evaluated"
    text = f"{head} waiting for {what} ({polls} polls; {seen})"
    extra = context() if context is not None else ""
    return f"{text}\n{extra}" if extra else text


def wait_for(
    check: Callable[[], T],
    timeout_s: float,
    *,
    what: str,
    until: Callable[[T], object] = _truthy,
    poll_s: float = POLL_S,
    abort: Callable[[], str | None] | None = None,
    context: Callable[[], str] | None = None,
) -> T:
    """Poll `check()` until `until(value)`; return that value or fail at the deadline."""
    deadline = time.monotonic() + timeout_s
    polls, last = 0, None
    while True:
        last = check()
        polls += 1
        if until(last):
            return last
        reason = abort() if abort is not None else None
        if reason:
            raise WaitTimeout(_message(reason, what, polls, last, context))
        if time.monotonic() > deadline:
            raise WaitTimeout(
                _message(f"timed out after {timeout_s} s", what, polls, last, context)
            )
        time.sleep(poll_s)  # polling interval of a condition with a deadline


async def eventually(
    check: Callable[[], Awaitable[T] | T],
    timeout_s: float,
    *,
    what: str,
    until: Callable[[T], object] = _truthy,
    poll_s: float = POLL_S,
    abort: Callable[[], str | None] | None = None,
    context: Callable[[], str] | None = None,
) -> T:
    """Async `wait_for`: `check` may be sync or async; a check that hangs is cut off too."""
    polls, last = 0, None
    reason: str | None = None
    with anyio.move_on_after(timeout_s):
        while True:
            value: Any = check()
            if inspect.isawaitable(value):
                value = await value
            last = value
            polls += 1
            if until(value):
                return value
            reason = abort() if abort is not None else None
            if reason:
                break
            await anyio.sleep(poll_s)  # polling interval of a condition with a deadline
    head = reason or f"timed out after {timeout_s} s"
    raise WaitTimeout(_message(head, what, polls, last, context))
