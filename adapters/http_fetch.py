"""Fetching over HTTP within bounds (aiohttp), and caching what was fetched.

One helper for every adapter that reads an answer it does not trust to be small
or quick (Gmail's API and token endpoint, the extraction backend, the SNS and
Google signing certificates):

    read_capped(response, n)   the whole body, or None once it is known to exceed n
                               bytes (declared Content-Length or bytes received)
    read_prefix(response, n)   at most n + 1 bytes of the body: longer than n means
                               it was cut (an error page of which only the start
                               is wanted)
    get_capped(url, ...)       one GET with a deadline, no redirects, status 200 and a
                               body cap; every failure is the caller's exception type
    SingleFlightCache          values by key, fetched once however many ask:

        fresh entry (and refetch_after_s not passed)  → the value, no fetch
        failed within failure_ttl_s                    → failure, no fetch
        max_concurrent_fetches running (all keys)      → failure, no fetch
        otherwise                                      → one fetch per key, the
                                                         others wait for it, then
                                                         read what it stored

`StreamReader.read(n)` returns *up to* n bytes, whatever has arrived so far, so it
cannot be used to read "the body, at most n bytes": a JSON answer split across
TCP segments would come back cut. Both reads go to the end (or the cap), so a
runaway answer cannot fill memory.

Only exceptions of the cache's `failure` type are remembered as failures; a
cancelled fetch records nothing, so the next caller fetches. Entries and failures
are each bounded to `max_entries`, least recently used first out.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import aiohttp
import anyio

__all__ = [
    "READ_CHUNK_BYTES",
    "FetchedBody",
    "SharedSessions",
    "SingleFlightCache",
    "get_capped",
    "read_capped",
    "read_prefix",
]

#: Bytes per read from the connection while collecting a body: aiohttp's own
#: stream buffer size (2**16), so a read takes what one buffer holds.
READ_CHUNK_BYTES = 64 * 1024

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


async def read_prefix(response: aiohttp.ClientResponse, limit_bytes: int) -> bytes:
    """The body of `response` up to `limit_bytes` + 1 bytes: one more than the
    limit says "too large", and nothing past it is read."""
    body = bytearray()
    async for chunk in response.content.iter_chunked(READ_CHUNK_BYTES):
        body += chunk
        if len(body) > limit_bytes:
            break
    return bytes(body[: limit_bytes + 1])


async def read_capped(response: aiohttp.ClientResponse, limit_bytes: int) -> bytes | None:
    """The whole body of `response`, or None when it is longer than `limit_bytes`."""
    declared = response.content_length
    if declared is not None and declared > limit_bytes:
        return None
    body = await read_prefix(response, limit_bytes)
    return None if len(body) > limit_bytes else body


@dataclass(frozen=True, slots=True)
class FetchedBody:
    """A 200 answer: its whole body and its headers (case-insensitive)."""

    body: bytes
    headers: Mapping[str, str]


async def get_capped(
    url: str, *, timeout_s: float, max_bytes: int, what: str, failure: type[Exception]
) -> FetchedBody:
    """GET `url` on a session of its own (no redirects, `timeout_s` for the whole
    exchange, body read included; CONTRIBUTING.md rule 7). Any failure (network,
    timeout, status other than 200, body over `max_bytes`) raises
    `failure("<what>: <reason>")`; no retry here, the caller's caller retries."""
    try:
        with anyio.fail_after(timeout_s):
            timeout = aiohttp.ClientTimeout(total=timeout_s)
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.get(url, allow_redirects=False) as response,
            ):
                if response.status != 200:
                    raise failure(f"{what}: HTTP {response.status}")
                body = await read_capped(response, max_bytes)
                if body is None:
                    raise failure(f"{what}: response too large")
                return FetchedBody(body, response.headers)
    except TimeoutError as exc:
        raise failure(f"{what}: fetch timed out") from exc
    except aiohttp.ClientError as exc:
        raise failure(f"{what}: {type(exc).__name__}") from exc


@dataclass(slots=True)
class _Entry(Generic[V]):
    value: V
    expires_at: float
    attempted_at: float  # when the last fetch of this key ended, either way


@dataclass(slots=True)
class _Flight:
    """One key's fetch lock and how many callers hold or wait for it."""

    lock: anyio.Lock = field(default_factory=anyio.Lock)
    users: int = 0


class SingleFlightCache(Generic[K, V]):
    """Values by key from `fetch`, single flight, expiring (module docstring).

    `ttl_s` is the life of a fetched value, seconds: a number, or a function of the
    value (a life the answer itself states). `failure` is the exception type a
    failed fetch raises; it is remembered for `failure_ttl_s`, and the cache's own
    refusals are `failure("<what>: <reason>")`. `clock` is monotonic seconds,
    injectable for tests.
    """

    def __init__(
        self,
        fetch: Callable[[K], Awaitable[V]],
        *,
        ttl_s: float | Callable[[V], float],
        failure_ttl_s: float,
        max_entries: int,
        failure: type[Exception],
        what: str,
        max_concurrent_fetches: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fetch = fetch
        self._ttl_s = ttl_s
        self._failure_ttl_s = failure_ttl_s
        self._max_entries = max_entries
        self._failure = failure
        self._what = what
        self._max_fetches = max_concurrent_fetches
        self._clock = clock
        self._entries: OrderedDict[K, _Entry[V]] = OrderedDict()
        self._failed: OrderedDict[K, float] = OrderedDict()  # key → retry not before
        self._flights: dict[K, _Flight] = {}
        self._fetching = 0

    @property
    def flights(self) -> int:
        """Keys with a fetch running or waited for (0 when idle: no lock is kept)."""
        return len(self._flights)

    async def get(self, key: K, *, refetch_after_s: float | None = None) -> V:
        """The value for `key`, fetched when it has none fresh. With
        `refetch_after_s`, a fresh value is fetched again when the last fetch of
        `key` (successful or not) ended at least that long ago: at most one
        refetch per interval, whoever asks.

        Raises the `failure` type when the fetch fails, failed lately, or too many
        fetches run already."""
        entry = self._usable(key, refetch_after_s)
        if entry is not None:
            return entry.value
        flight = self._flights.setdefault(key, _Flight())
        flight.users += 1
        try:
            async with flight.lock:
                # Another caller may have fetched it while this one waited.
                entry = self._usable(key, refetch_after_s)
                if entry is not None:
                    return entry.value
                return await self._fetch_once(key)
        finally:
            flight.users -= 1
            if flight.users == 0:
                del self._flights[key]

    async def _fetch_once(self, key: K) -> V:
        """Fetch `key` unless it failed lately or too many fetches run already."""
        retry_at = self._failed.get(key)
        if retry_at is not None and self._clock() < retry_at:
            raise self._failure(f"{self._what}: failed recently, not fetched again yet")
        if self._max_fetches is not None and self._fetching >= self._max_fetches:
            raise self._failure(f"{self._what}: too many fetches at once")
        self._fetching += 1
        try:
            value = await self._fetch(key)
        except self._failure:
            self._remember_failure(key)
            raise
        finally:
            self._fetching -= 1
        self._store(key, value)
        return value

    def _usable(self, key: K, refetch_after_s: float | None) -> _Entry[V] | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        now = self._clock()
        if now >= entry.expires_at:
            del self._entries[key]
            return None
        if refetch_after_s is not None and now >= entry.attempted_at + refetch_after_s:
            return None
        self._entries.move_to_end(key)
        return entry

    def _store(self, key: K, value: V) -> None:
        now = self._clock()
        ttl_s = self._ttl_s(value) if callable(self._ttl_s) else self._ttl_s
        self._entries[key] = _Entry(value, now + ttl_s, now)
        self._entries.move_to_end(key)
        self._failed.pop(key, None)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)

    def _remember_failure(self, key: K) -> None:
        now = self._clock()
        entry = self._entries.get(key)
        if entry is not None:  # a fresh value stays, but counts as just tried
            entry.attempted_at = now
        self._failed[key] = now + self._failure_ttl_s
        self._failed.move_to_end(key)
        while len(self._failed) > self._max_entries:
            self._failed.popitem(last=False)


class SharedSessions:
    """One aiohttp session (one connection pool) per door in this process, shared by
    every mailbox of the door: file handles grow with the requests in flight, not
    with the mailboxes (issue 25: 1,000 Gmail mailboxes held 1,029 handles with a
    session each), and a connection kept alive serves the next mailbox's poll. The
    door makes its session (`make`: its timeouts, its bound per host, its keep-alive);
    the owner (daemon/sync/fleet.py) closes them all when its mailboxes stop."""

    def __init__(self) -> None:
        self._sessions: dict[str, aiohttp.ClientSession] = {}
        self._limiters: dict[str, anyio.CapacityLimiter] = {}

    def limiter(
        self, door: str, make: Callable[[], anyio.CapacityLimiter]
    ) -> anyio.CapacityLimiter:
        """The door's bound on requests in flight through its session, made on first use."""
        limiter = self._limiters.get(door)
        if limiter is None:
            limiter = self._limiters[door] = make()
        return limiter

    def session(
        self, door: str, make: Callable[[], aiohttp.ClientSession]
    ) -> aiohttp.ClientSession:
        """The door's session, made on first use (inside the running event loop)."""
        session = self._sessions.get(door)
        if session is None or session.closed:
            session = self._sessions[door] = make()
        return session

    async def aclose(self) -> None:
        """Close every session; a later `session` call makes a new one."""
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            await session.close()
