"""When the IDLE watch connects again after its connection failed or dropped.

    drop ──▶ wait uniform(0, min(MAX, INITIAL·2^(n-1))) ──▶ connect ──▶ IDLE ...

Full jitter (tenacity's `wait_random_exponential`, "Exponential Backoff And
Jitter", AWS Architecture Blog): the daemon's many mailboxes on one server do not
reconnect in step after the server restarts. `n` counts the failures in a row; a
session that stayed up IDLE_HEALTHY_SESSION_S resets it, so a long-lived daemon
answers a routine disconnect (a server restart, a load balancer's idle timeout)
within INITIAL, not after the minutes its earlier drops had doubled up to.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from tenacity import RetryCallState, wait_random_exponential

__all__ = [
    "IDLE_BACKOFF_MAX_S",
    "IDLE_BACKOFF_MIN_S",
    "IDLE_HEALTHY_SESSION_S",
    "IdleBackoff",
]

# The first wait after a drop is at most this long: 1 s lets a restarting server
# come back before the first try, without leaving a healthy mailbox deaf for long.
IDLE_BACKOFF_MIN_S = 1.0
# A server that stays down is tried at least every 5 min (the bound of the doubling).
IDLE_BACKOFF_MAX_S = 300.0
# A session that stayed up this long had the server working: its drop starts the
# doubling again from IDLE_BACKOFF_MIN_S. A minute is many IDLE round trips, and
# longer than a server that accepts then drops every connection lets one live.
IDLE_HEALTHY_SESSION_S = 60.0


@dataclass(frozen=True, slots=True)
class _Attempt:
    """The one field of tenacity's RetryCallState its wait strategies read."""

    attempt_number: int


class IdleBackoff:
    """The waits of one watch: `connected()` when a session is up, `next_delay()`
    after it (or a connection attempt) failed."""

    def __init__(
        self,
        *,
        initial_s: float = IDLE_BACKOFF_MIN_S,
        max_s: float = IDLE_BACKOFF_MAX_S,
        healthy_after_s: float | None = None,  # default: IDLE_HEALTHY_SESSION_S
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._wait = wait_random_exponential(multiplier=initial_s, max=max_s)
        self._healthy_after_s = (
            IDLE_HEALTHY_SESSION_S if healthy_after_s is None else healthy_after_s
        )
        self._clock = clock
        self._failures = 0
        self._since: float | None = None  # when the current session came up

    def connected(self) -> None:
        """A session is up (logged in, folder open, IDLE about to start)."""
        self._since = self._clock()

    def next_delay(self) -> float:
        """Seconds to wait before the next connection, after a failure or a drop."""
        if self._since is not None and self._clock() - self._since >= self._healthy_after_s:
            self._failures = 0
        self._since = None
        self._failures += 1
        state = cast(RetryCallState, _Attempt(self._failures))
        return float(self._wait(state))
