"""Pacing one mailbox's Gmail calls in quota units, so the door never draws its own 429.

Gmail meters every call in *quota units* (Usage limits,
https://developers.google.com/gmail/api/reference/quota): per user 250 units
per second as a moving average that "allows short bursts" (the page's current
wording: 15,000 units per user per minute). The per-method costs we use are
the constants below; a batch costs the sum of its calls ("a set of n requests
batched together counts toward your usage limit as n requests", batch guide).

`QuotaPacer` is the shared token bucket (adapters/pacing.py) in those units, at
Gmail's per-user rate with the burst below.
"""

from __future__ import annotations

import time

import anyio

from inboxd.adapters.pacing import Clock, Sleep, TokenBucket

__all__ = [
    "BATCH_UNITS_PER_CALL",
    "DEFAULT_BURST_UNITS",
    "GET_PROFILE_UNITS",
    "GMAIL_USER_UNITS_PER_S",
    "HISTORY_LIST_UNITS",
    "MESSAGES_GET_UNITS",
    "MESSAGES_LIST_UNITS",
    "STOP_UNITS",
    "WATCH_UNITS",
    "QuotaPacer",
]

# Per-method quota units, "Per-method quota usage" table of the Usage limits page.
GET_PROFILE_UNITS = 1  # users.getProfile
HISTORY_LIST_UNITS = 2  # users.history.list
MESSAGES_LIST_UNITS = 5  # users.messages.list
MESSAGES_GET_UNITS = 5  # users.messages.get (any format, raw included)
WATCH_UNITS = 100  # users.watch
STOP_UNITS = 50  # users.stop
#: A batch costs the sum of its calls; the door batches only messages.get.
BATCH_UNITS_PER_CALL = MESSAGES_GET_UNITS

#: Per-user rate limit: 250 quota units per user per second (15,000 per minute).
GMAIL_USER_UNITS_PER_S = 250.0
#: Largest burst in units. Gmail's bucket holds about one second's worth (250), but
#: we spend when a call leaves and Gmail charges when it arrives: if a later call
#: travels faster than an earlier one, Gmail has seen less refill time than we have.
#: Keeping our bucket 100 units shallower than Gmail's absorbs 100 / 250 = 0.4 s of
#: such variation, so our pacing alone never draws a 429. It must still hold the
#: largest single spend (a watch, 100 units; a batch of 20 messages.get, 100 units).
DEFAULT_BURST_UNITS = 150.0


class QuotaPacer(TokenBucket):
    """A token bucket of Gmail quota units for one mailbox (module docstring)."""

    def __init__(
        self,
        units_per_s: float = GMAIL_USER_UNITS_PER_S,
        burst_units: float | None = None,
        *,
        clock: Clock = time.monotonic,
        sleep: Sleep = anyio.sleep,
    ) -> None:
        burst = DEFAULT_BURST_UNITS if burst_units is None else burst_units
        super().__init__(units_per_s, burst, clock=clock, sleep=sleep)
