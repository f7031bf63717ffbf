"""adapters/overlap.py: page k+1 downloads while page k is finished; order, errors
and early close behave as a plain generator's would."""

from __future__ import annotations

from collections.abc import AsyncGenerator

import anyio
import anyio.lowlevel
import pytest

from inboxd.adapters.base import Page
from inboxd.adapters.overlap import gather, overlapped_pages


class Boom(Exception):
    pass


async def _downloads(
    n: int, log: list[str], fail_at: int | None = None
) -> AsyncGenerator[int, None]:
    try:
        for k in range(n):
            if k == fail_at:
                raise Boom(f"download {k}")
            log.append(f"downloaded {k}")
            yield k
    finally:
        log.append("downloads closed")


async def test_pages_come_in_order_and_the_next_download_overlaps_the_finish() -> None:
    log: list[str] = []
    page_1_downloaded = anyio.Event()

    async def downloads() -> AsyncGenerator[int, None]:
        for k in range(3):
            log.append(f"downloaded {k}")
            if k == 1:
                page_1_downloaded.set()
            yield k

    async def finish(k: int) -> Page:
        if k == 0:
            # page 0 cannot finish before page 1 is downloaded: without the
            # overlap this would time out
            with anyio.fail_after(5):
                await page_1_downloaded.wait()
        log.append(f"finished {k}")
        return Page(items=[], cursor_after=str(k))

    pages = [p.cursor_after async for p in overlapped_pages(downloads(), finish)]
    assert pages == ["0", "1", "2"]
    assert log.index("downloaded 1") < log.index("finished 0")


async def test_a_download_error_is_raised_as_itself_after_the_pages_before_it() -> None:
    log: list[str] = []

    async def finish(k: int) -> Page:
        return Page(items=[], cursor_after=str(k))

    got: list[str | None] = []
    with pytest.raises(Boom, match="download 2"):
        async for page in overlapped_pages(_downloads(5, log, fail_at=2), finish):
            got.append(page.cursor_after)
    # page 1 is finished while page 2's download fails: page 1 still comes out
    # first (its bodies are not fetched again by the next run), then the error
    assert got == ["0", "1"]


async def test_a_finish_error_cancels_the_download_and_is_raised_as_itself() -> None:
    log: list[str] = []
    downloading = anyio.Event()

    async def slow_downloads() -> AsyncGenerator[int, None]:
        try:
            yield 0
            downloading.set()
            await anyio.sleep_forever()
            yield 1
        finally:
            log.append("downloads closed")

    async def finish(k: int) -> Page:
        await downloading.wait()
        raise Boom("parse")

    with anyio.fail_after(5), pytest.raises(Boom, match="parse"):
        async for _ in overlapped_pages(slow_downloads(), finish):
            pass
    assert log == ["downloads closed"]


async def test_leaving_early_closes_the_downloads() -> None:
    log: list[str] = []

    async def finish(k: int) -> Page:
        return Page(items=[], cursor_after=str(k))

    pages = overlapped_pages(_downloads(10, log), finish)
    async for page in pages:
        assert page.cursor_after == "0"
        break
    await pages.aclose()
    assert log[-1] == "downloads closed"
    assert "downloaded 5" not in log


async def test_gather_answers_in_order_and_raises_the_first_error_as_itself() -> None:
    async def value(x: int) -> int:
        await anyio.lowlevel.checkpoint()
        return x

    assert await gather(lambda: value(1), lambda: value(2)) == [1, 2]

    async def fails() -> int:
        raise Boom("one")

    async def hangs() -> int:
        await anyio.sleep_forever()
        return 0

    with anyio.fail_after(5), pytest.raises(Boom, match="one"):
        await gather(hangs, fails)
