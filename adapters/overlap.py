"""Two-stage page pipelines for provider doors: download page k+1 while page k is
finished (parsed), then yield page k.

    downloads   an async generator of a door's raw pages: the provider's listing
                call and the body downloads (the quota-bound stage)
    finish      turns one raw page into a Page (parsing: the CPU-bound stage, which
                waits for the process's shared parse worker)

    ┌ iteration k ──────────────────────────────────────────────┐
    │ task group: anext(downloads) → raw k+1  ║  finish(raw k)  │ → yield page k
    └───────────────────────────────────────────────────────────┘

A door that parsed a page before listing the next one left its quota unspent
whenever other mailboxes held the parse worker (bench/README.md, Gmail: 0.57 ×
quota with 20 mailboxes). No task group is open across a `yield`: both stages
run inside the iteration and are joined before the page leaves, so the
generator can be closed or cancelled at any yield like any other. At most two
raw pages (k being finished, k+1 downloaded) are held at once.

Errors come out as themselves (not wrapped in an exception group), so a door's
`except HistoryExpired` around its pages keeps working. A failed finish cancels
the download; a failed download lets the current page finish and be yielded
first, so the pages before an error are never fetched twice.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, TypeVar

import anyio

from inboxd.adapters.base import Page

__all__ = ["gather", "overlapped_pages"]

R = TypeVar("R")


async def overlapped_pages(
    downloads: AsyncGenerator[R, None], finish: Callable[[R], Awaitable[Page]]
) -> AsyncGenerator[Page, None]:
    """`finish(raw)` for every raw page of `downloads`, in order, the next raw page
    downloading while the current one is finished (module docstring). When the
    next download fails, the current page is still finished and yielded first."""
    async with aclosing(downloads):
        current = await _next(downloads)
        while current is not None:
            page, after, failed = await _finish_and_fetch(
                functools.partial(finish, current), functools.partial(_next, downloads)
            )
            yield page
            if failed is not None:
                raise failed
            current = after


async def _finish_and_fetch(
    finish: Callable[[], Awaitable[Page]], fetch: Callable[[], Awaitable[R | None]]
) -> tuple[Page, R | None, Exception | None]:
    """Both at once. finish's error cancels the fetch and is raised; fetch's error is
    answered beside the finished page (work done is not thrown away)."""
    done: dict[str, Any] = {}
    errors: dict[str, Exception] = {}

    async with anyio.create_task_group() as tg:

        async def run_finish() -> None:
            try:
                done["page"] = await finish()
            except Exception as exc:
                errors["finish"] = exc
                tg.cancel_scope.cancel()

        async def run_fetch() -> None:
            try:
                done["next"] = await fetch()
            except Exception as exc:
                errors["fetch"] = exc

        tg.start_soon(run_finish)
        tg.start_soon(run_fetch)
    if "finish" in errors:
        raise errors["finish"]
    return done["page"], done.get("next"), errors.get("fetch")


async def _next(downloads: AsyncGenerator[R, None]) -> R | None:
    try:
        return await downloads.__anext__()
    except StopAsyncIteration:
        return None


async def gather(*works: Callable[[], Awaitable[object]]) -> list[object]:
    """Run `works` concurrently and answer their results in order; the first error
    cancels the others and is raised as itself (not wrapped in an exception group)."""
    results: list[object] = [None] * len(works)
    errors: list[Exception] = []

    async with anyio.create_task_group() as tg:

        async def run(index: int, work: Callable[[], Awaitable[object]]) -> None:
            try:
                results[index] = await work()
            except Exception as exc:
                errors.append(exc)
                tg.cancel_scope.cancel()

        for index, work in enumerate(works):
            tg.start_soon(run, index, work)
    if errors:
        raise errors[0]
    return results
