"""Per-user quota: units per second, as a token bucket, answering 429 when spent.

Usage limits page (https://developers.google.com/gmail/api/reference/quota):
per-method units (below) and a per-user rate limit — "250 quota units per user
per second, moving average (allows short bursts)" in the older text, "15,000
quota units per user per minute" (reason userRateLimitExceeded) in the current
one. A token bucket of `units_per_s` refilled continuously, holding at most
`burst_s` seconds of units, is that moving average: a client that paces itself
at or under the rate (with no larger burst) never draws a 429 here.
A batch is charged per call ("a set of n requests batched together counts
toward your usage limit as n requests", batch guide), so parts are charged
one by one and the ones past the budget answer 429 inside the 200.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_UNITS_PER_S = 250.0  # usage limits page, per user
DEFAULT_BURST_S = 1.0  # bucket depth: one second of units
# Per-method quota units, usage limits page.
METHOD_UNITS = {
    "users.getProfile": 1,
    "users.labels.list": 1,
    "users.labels.get": 1,
    "users.history.list": 2,
    "users.messages.list": 5,
    "users.messages.get": 5,
    "users.watch": 100,
    "users.stop": 50,
}


@dataclass
class _Bucket:
    level: float
    stamp: float


class Quota:
    """Token buckets per user; `clock` is injectable so tests never sleep."""

    def __init__(
        self,
        units_per_s: float | None = DEFAULT_UNITS_PER_S,
        burst_s: float = DEFAULT_BURST_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.units_per_s = units_per_s
        self.burst_s = burst_s
        self.clock = clock
        self.per_user: dict[str, float | None] = {}
        self._buckets: dict[str, _Bucket] = {}

    def set_rate(self, user: str, units_per_s: float | None) -> None:
        """Override one user's rate (None: unlimited)."""
        self.per_user[user] = units_per_s
        self._buckets.pop(user, None)

    def try_spend(self, user: str, units: int) -> int | None:
        """Spend `units` for `user`: None when allowed, else the Retry-After in seconds."""
        rate = self.per_user.get(user, self.units_per_s)
        if rate is None:
            return None
        capacity = max(rate * self.burst_s, float(units))
        now = self.clock()
        bucket = self._buckets.setdefault(user, _Bucket(capacity, now))
        bucket.level = min(capacity, bucket.level + (now - bucket.stamp) * rate)
        bucket.stamp = now
        if bucket.level >= units:
            bucket.level -= units
            return None
        return max(1, math.ceil((units - bucket.level) / rate))
