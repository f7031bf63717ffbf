"""An http processor's gate in front of its endpoint: stop calling while the endpoint,
not the mail, is what fails.

    open ──401/403, wrong URL (Release with pause_s)────────────▶ paused
      │  ──retryable failure with Retry-After, or                    │
      │    PAUSE_AFTER_FAILURES retryable failures in a row ────────▶ │
      ▲                                                               │ time passes
      │                                                               ▼
      └──────────── a call that does not fail retryably ◀───── probing (one call
                                                               at a time; a failure
                                                               pauses again, longer)

While paused, a caller's attempt is a Release (the job back uncharged) without a
call, and the claimer waits (`wait_out`). Without the gate an outage walked the
whole backlog into the failure — every job charged an attempt each time it came
due, the backlog in needs_review after minutes — and a 429 that named its
Retry-After was answered by the next job's call.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

import anyio
import structlog

from inboxd.daemon.extraction.outcomes import Failed, Outcome, Release
from inboxd.pipeline.extraction.claims import RETRY_AFTER_MAX_S

__all__ = ["EndpointGate"]

#: Retryable failures in a row (network, timeout, 429, 5xx) after which the endpoint
#: is taken to be down; fewer may be the messages' own (one slow message timing out).
PAUSE_AFTER_FAILURES = 3
#: The first such pause, doubling with each further failure (one probe call each) up
#: to ENDPOINT_PAUSE_MAX_S: an outage of hours costs about a dozen charged attempts
#: an hour, against MAX_ATTEMPTS = 8 per job.
ENDPOINT_PAUSE_MIN_S = 2.0
ENDPOINT_PAUSE_MAX_S = 300.0


class EndpointGate:
    """Pause and probe state of one processor's endpoint (module docstring)."""

    def __init__(self, logger: structlog.typing.FilteringBoundLogger) -> None:
        self._log = logger
        self.paused_until = -math.inf
        self._reason = ""
        self._failed_in_a_row = 0  # retryable failures since the last call that was not
        self._probing = False
        self._probe = anyio.Lock()

    async def wait_out(self) -> None:
        """Until the pause (if any) is over."""
        wait = self.paused_until - anyio.current_time()
        if wait > 0:
            await anyio.sleep(wait)

    async def attempt(self, call: Callable[[], Awaitable[Outcome]]) -> Outcome:
        """`call`, unless paused (then a Release, not charged); after a pause one call
        at a time until one does not fail retryably."""
        if not self._probing:
            return await self._through(call)
        async with self._probe:
            return await self._through(call)

    async def _through(self, call: Callable[[], Awaitable[Outcome]]) -> Outcome:
        if anyio.current_time() < self.paused_until:
            return Release(f"processor paused: {self._reason}")
        outcome = await call()
        if isinstance(outcome, Release) and outcome.pause_s:
            self._pause(outcome.pause_s, outcome.reason, "extraction_endpoint_misconfigured")
        elif isinstance(outcome, Failed) and not outcome.terminal:
            self._failed_in_a_row += 1
            if self._failed_in_a_row >= PAUSE_AFTER_FAILURES or outcome.retry_after_s:
                self._pause(self._pause_s(outcome), outcome.reason, "extraction_endpoint_failing")
        else:
            self._failed_in_a_row = 0
            self._probing = False
        return outcome

    def _pause_s(self, failed: Failed) -> float:
        """Doubling with each failure past PAUSE_AFTER_FAILURES, never shorter than the
        endpoint's Retry-After."""
        doublings = min(max(0, self._failed_in_a_row - PAUSE_AFTER_FAILURES), 16)
        pause = min(ENDPOINT_PAUSE_MIN_S * 2.0**doublings, ENDPOINT_PAUSE_MAX_S)
        if failed.retry_after_s is not None and math.isfinite(failed.retry_after_s):
            pause = max(pause, failed.retry_after_s)
        return pause

    def _pause(self, pause_s: float, reason: str, event: str) -> None:
        # capped like a job's Retry-After: a header of years must not silence a processor
        pause_s = min(pause_s, RETRY_AFTER_MAX_S)
        now = anyio.current_time()
        if now >= self.paused_until:  # calls in flight when it tripped do not log again
            self._log.error(event, reason=reason, pause_s=round(pause_s, 1))
            self._reason = reason
        self.paused_until = max(self.paused_until, now + pause_s)
        self._probing = True
