"""Outlook's per-mailbox throttling: a request-rate window and a concurrency cap.

"Microsoft Graph service-specific throttling limits", Outlook service limits:
"10,000 API requests in a 10 minute period" and "4 concurrent requests", per
app ID and mailbox combination ("If an application exceeds the limit in one
mailbox, it does not affect the ability to access another mailbox"). Over
either limit Graph answers 429 with Retry-After; Outlook's body code is
`ApplicationThrottled` ("Application is over its MailboxConcurrency limit.",
as quoted in github.com/magodo/terraform-provider-outlook/issues/21 and
alcionai/corso#3695).

- every request counts toward the window, refused ones too ("Microsoft Graph
  throttling guidance": avoid immediate retries, "because all requests accrue
  against your usage limits"); the window slides, so Retry-After is the time
  until enough old requests leave it;
- concurrency is measured honestly: a request holds its mailbox slot from
  admission until its answer is computed (service latency and fault holds
  included); one that arrives while `concurrent_per_mailbox` are in flight is
  refused at once. Inner requests of a $batch take slots like any other
  (batch.py runs at most 4 of them in parallel, as Outlook does);
- `window_s` scales the 10-minute window for benchmarks, and `clock` is
  injectable (testkit.ManualClock) so tests never sleep.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio

from .counters import Counters
from .errors import Answer, graph_error

REQUESTS_PER_WINDOW = 10_000  # Outlook: per app per mailbox per 10 minutes
WINDOW_S = 600.0  # the 10-minute period
CONCURRENT_PER_MAILBOX = 4  # Outlook: concurrent requests
CONCURRENCY_RETRY_AFTER_S = 1  # a slot frees when any request in flight answers


class Throttle:
    def __init__(
        self,
        counters: Counters,
        *,
        requests_per_window: int | None = REQUESTS_PER_WINDOW,
        window_s: float = WINDOW_S,
        concurrent_per_mailbox: int | None = CONCURRENT_PER_MAILBOX,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.counters = counters
        self.requests_per_window = requests_per_window
        self.window_s = window_s
        self.concurrent_per_mailbox = concurrent_per_mailbox
        self.clock = clock
        self.in_flight: dict[str, int] = {}
        self._stamps: dict[str, deque[float]] = {}
        self._changed = anyio.Event()

    @asynccontextmanager
    async def slot(self, user: str) -> AsyncIterator[Answer | None]:
        """Admit one request to `user`'s mailbox: yields None while it holds a
        slot, or the 429 to answer instead."""
        refusal = self._over_rate(user) or self._over_concurrency(user)
        if refusal is not None:
            self.counters.throttled[user] += 1
            yield refusal
            return
        self.in_flight[user] = self.in_flight.get(user, 0) + 1
        self.counters.max_concurrency[user] = max(
            self.counters.max_concurrency[user], self.in_flight[user]
        )
        self._notify()
        try:
            yield None
        finally:
            self.in_flight[user] -= 1
            self._notify()

    async def wait_in_flight(self, user: str, count: int, timeout_s: float = 5.0) -> None:
        """Return once `count` requests to `user` are in flight (tests' overlap barrier)."""
        with anyio.fail_after(timeout_s):
            while self.in_flight.get(user, 0) < count:
                await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def _over_rate(self, user: str) -> Answer | None:
        limit = self.requests_per_window
        now = self.clock()
        stamps = self._stamps.setdefault(user, deque())
        while stamps and stamps[0] <= now - self.window_s:
            stamps.popleft()
        stamps.append(now)
        if limit is None or len(stamps) <= limit:
            return None
        wait_s = stamps[len(stamps) - limit] + self.window_s - now
        return graph_error(
            429,
            "ApplicationThrottled",
            "Application is over its MailboxRequestRate limit.",
            retry_after_s=max(1, math.ceil(wait_s)),
        )

    def _over_concurrency(self, user: str) -> Answer | None:
        limit = self.concurrent_per_mailbox
        if limit is None or self.in_flight.get(user, 0) < limit:
            return None
        return graph_error(
            429,
            "ApplicationThrottled",
            "Application is over its MailboxConcurrency limit.",
            retry_after_s=CONCURRENCY_RETRY_AFTER_S,
        )
