"""adapters/http_fetch.py: bodies arrive whole or not at all, the GET's failures are
the caller's exception, and the cache asks the network as seldom as it promises.

What the SNS and Google certificate tests already show through their callers
(single flight, LRU bound, failure pause, concurrency cap) is not repeated here.
No database: these tests use a local HTTP server and an injected clock.
"""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from inboxd.adapters.http_fetch import (
    READ_CHUNK_BYTES,
    SingleFlightCache,
    get_capped,
    read_capped,
    read_prefix,
)

#: A body longer than one read, so a read that stops early would be seen.
BODY = bytes(range(256)) * (READ_CHUNK_BYTES // 128 + 3)


class Unavailable(Exception):
    pass


@pytest.fixture
async def server():
    async def trickled(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Cache-Control": "max-age=60"})
        await response.prepare(request)  # chunked, in pieces smaller than a read
        for start in range(0, len(BODY), 1000):
            await response.write(BODY[start : start + 1000])
        await response.write_eof()
        return response

    async def declared(request: web.Request) -> web.Response:
        return web.Response(body=BODY)  # with Content-Length

    async def missing(request: web.Request) -> web.Response:
        return web.Response(status=404, text="no")

    app = web.Application()
    app.router.add_get("/trickled", trickled)
    app.router.add_get("/declared", declared)
    app.router.add_get("/missing", missing)
    async with TestServer(app) as test_server:
        yield test_server


async def read_with(server: TestServer, path: str, read, limit: int):
    async with (
        aiohttp.ClientSession() as session,
        session.get(str(server.make_url(path))) as response,
    ):
        return await read(response, limit)


@pytest.mark.parametrize("path", ["/trickled", "/declared"])
async def test_read_capped_gives_the_whole_body_or_none(server: TestServer, path: str) -> None:
    assert await read_with(server, path, read_capped, len(BODY)) == BODY
    assert await read_with(server, path, read_capped, len(BODY) - 1) is None


async def test_read_prefix_keeps_the_start_and_one_byte_more(server: TestServer) -> None:
    assert await read_with(server, "/trickled", read_prefix, 100) == BODY[:101]
    assert await read_with(server, "/trickled", read_prefix, len(BODY)) == BODY


async def test_get_capped_gives_body_and_headers(server: TestServer) -> None:
    fetched = await get_capped(
        str(server.make_url("/trickled")),
        timeout_s=5.0,
        max_bytes=len(BODY),
        what="thing",
        failure=Unavailable,
    )
    assert fetched.body == BODY
    assert fetched.headers.get("cache-control") == "max-age=60"


@pytest.mark.parametrize(
    ("path", "max_bytes", "reason"),
    [("/missing", len(BODY), "thing: HTTP 404"), ("/declared", 10, "thing: response too large")],
)
async def test_get_capped_failures_are_the_callers_exception(
    server: TestServer, path: str, max_bytes: int, reason: str
) -> None:
    with pytest.raises(Unavailable, match=reason):
        await get_capped(
            str(server.make_url(path)),
            timeout_s=5.0,
            max_bytes=max_bytes,
            what="thing",
            failure=Unavailable,
        )


class Source:
    """Answers from a list, in turn; an Unavailable instance is raised."""

    def __init__(self, *answers: int | Unavailable) -> None:
        self.answers = list(answers)
        self.calls = 0

    async def __call__(self, key: str) -> int:
        self.calls += 1
        answer = self.answers.pop(0)
        if isinstance(answer, Unavailable):
            raise answer
        return answer


def make_cache(source: Source, now: list[float]) -> SingleFlightCache[str, int]:
    return SingleFlightCache(
        source,
        ttl_s=lambda value: float(value),  # each value says its own life
        failure_ttl_s=5.0,
        max_entries=4,
        failure=Unavailable,
        what="thing",
        clock=lambda: now[0],
    )


async def test_life_comes_from_the_value() -> None:
    now = [0.0]
    source = Source(30, 100)
    cache = make_cache(source, now)
    assert await cache.get("k") == 30
    now[0] = 29.0
    assert await cache.get("k") == 30
    now[0] = 30.0
    assert await cache.get("k") == 100
    assert source.calls == 2


async def test_refetch_of_a_fresh_value_at_most_once_per_interval() -> None:
    now = [0.0]
    source = Source(1000, Unavailable("down"), 2000)
    cache = make_cache(source, now)
    assert await cache.get("k", refetch_after_s=60.0) == 1000
    now[0] = 59.0
    assert await cache.get("k", refetch_after_s=60.0) == 1000  # too soon: no request
    now[0] = 60.0
    with pytest.raises(Unavailable, match="down"):
        await cache.get("k", refetch_after_s=60.0)
    # The failed refetch counts as one: the fresh value serves, nothing is asked...
    now[0] = 119.0
    assert await cache.get("k", refetch_after_s=60.0) == 1000
    assert await cache.get("k") == 1000
    assert source.calls == 2
    # ...until an interval after the failure.
    now[0] = 120.0
    assert await cache.get("k", refetch_after_s=60.0) == 2000
    assert source.calls == 3
    assert cache.flights == 0
