"""A token bucket: the per-source request rate of webhook routes (429 past it)."""

from __future__ import annotations

import time


class RateLimiter:
    """Token bucket: `rate` requests per second, bursts of up to `burst`."""

    __slots__ = ("_burst", "_rate", "_stamp", "_tokens")

    def __init__(self, rate: float, burst: float) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self._rate, self._burst = rate, burst
        self._tokens, self._stamp = burst, time.monotonic()

    @property
    def settings(self) -> tuple[float, float]:
        """(rate per second, burst)."""
        return self._rate, self._burst

    def take(self) -> bool:
        """Spend one token; False when the bucket is empty."""
        now = time.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._stamp) * self._rate)
        self._stamp = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True
