"""A token bucket that paces one mailbox's provider requests, so a door never draws
its own 429 (Gmail's quota units, Graph's requests per 10 minutes).

    level    units available now, refilled at `units_per_s`, capped at `burst_units`
    spend(n) waits (FIFO: one lock, anyio's locks are fair) until the bucket holds
             n units and no hold is in force, then takes them; the caller sends
             only after spend returned, so requests never leave early
    hold(s)  after a 429 (or the provider's other "too fast"): nothing is spent for
             s seconds (the Retry-After), and the bucket restarts empty, so requests
             resume at the steady rate instead of a burst into a server that just
             refused

Over any interval of T seconds a bucket lets at most `burst_units + units_per_s * T`
units through. A cancelled `spend` takes nothing. One bucket per mailbox: the
providers' limits are per mailbox, and the door's client is its only user.

The clock and the sleep are injectable so tests can drive time themselves and
assert on units and order rather than on wall-clock sleeps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable

import anyio

__all__ = ["Clock", "Sleep", "TokenBucket"]

#: Units by which a level may fall short of a spend and still pay it (float rounding).
_UNITS_TOLERANCE = 1e-6

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


class TokenBucket:
    """A token bucket of request units for one mailbox (module docstring)."""

    def __init__(
        self,
        units_per_s: float,
        burst_units: float,
        *,
        clock: Clock = time.monotonic,
        sleep: Sleep = anyio.sleep,
    ) -> None:
        burst = burst_units
        if not (math.isfinite(units_per_s) and units_per_s > 0):
            raise ValueError("units_per_s must be a positive number")
        if not (math.isfinite(burst) and burst > 0):
            raise ValueError("burst_units must be a positive number")
        self.units_per_s = float(units_per_s)
        self.burst_units = float(burst)
        self._clock = clock
        self._sleep = sleep
        self._level = self.burst_units  # a fresh mailbox may burst at once
        self._updated_at = clock()
        self._hold_until = -math.inf
        self._lock = anyio.Lock()
        #: Units handed out since construction (tests, metrics).
        self.spent_units = 0.0

    async def spend(self, units: float) -> None:
        """Wait until `units` may be sent, then take them. Callers pay before the
        request leaves. ValueError for a spend the bucket can never hold."""
        if not units > 0:
            raise ValueError("units must be positive")
        if units > self.burst_units:
            raise ValueError(f"a spend of {units:g} units exceeds burst_units {self.burst_units:g}")
        async with self._lock:
            while True:
                now = self._clock()
                self._refill(now)
                if now < self._hold_until:
                    await self._sleep(self._hold_until - now)
                    continue
                # The tolerance keeps float rounding (0.2 s * 100/s = 19.999…) from
                # turning into an endless series of vanishing sleeps.
                if self._level + _UNITS_TOLERANCE >= units:
                    self._level = max(0.0, self._level - units)
                    self.spent_units += units
                    return
                await self._sleep((units - self._level) / self.units_per_s)

    def hold(self, retry_after_s: float) -> None:
        """The provider said "too fast" (429, Gmail's 403 rateLimitExceeded): spend nothing for
        `retry_after_s` seconds, then restart from an empty bucket. Holds only
        extend; a shorter hold inside a longer one changes nothing."""
        if not math.isfinite(retry_after_s) or retry_after_s < 0:
            return
        now = self._clock()
        self._refill(now)
        self._hold_until = max(self._hold_until, now + retry_after_s)
        self._level = 0.0
        # Refill starts when the hold ends, not before: an empty bucket at the end.
        self._updated_at = max(self._updated_at, self._hold_until)

    @property
    def held_until(self) -> float:
        """Clock time before which nothing is spent (-inf when no hold was set)."""
        return self._hold_until

    def _refill(self, now: float) -> None:
        if now > self._updated_at:
            self._level = min(
                self.burst_units, self._level + (now - self._updated_at) * self.units_per_s
            )
            self._updated_at = now
