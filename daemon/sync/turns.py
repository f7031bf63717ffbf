"""How many sync runs of this process work at once, and where a long one goes on.

    ring ──▶ wait for a turn ──▶ lease, pages … ──────────────────▶ run ends: turn back
            (max_syncs_at_once)        │ a page committed after LONG_RUN_S:
                                       ▼ the turn is given back
                                 wait for a long turn ──▶ pages … ──▶ run ends: long turn back
                                 (max_syncs_at_once / 2)

Every mailbox is rung at start, and a poll wave rings thousands at once. Without a
bound, 10,000 runs queued on one 15-connection pool: every step of every run waited
behind a step of all the others, so no run finished before nearly all did (first
syncs of 10,000 Gmail mailboxes all ended at 223 s; with two replicas none had
ended after 7 minutes, and the scanner's claims and the delivery worker timed out
in the same queue — bench/README.md, fleet.py). With a bounded number of runs at
work, the pool's queue stays short and a run ends in its own time.

Long runs (a large mailbox's backfill, a thousand relists after a cursor reset)
must not keep the turns from the polls of mailboxes that are up to date, which
take milliseconds: a run past LONG_RUN_S moves, at its next committed page, from
the turns to the *long* turns, a line of their own with half as many. So polls
always have every ordinary turn minus the young runs', and long runs always have
the long turns — they never go to the back of a line of thousands of fresh runs
(a first version that sent them there left 2,500 first syncs of 10,000 holding
their leases, their messages stored, waiting to record their end).

A run keeps its lease while it waits (the lease keeper renews it), so waiting moves
no cursor and gives no mailbox away. Each line is first come, first served
(anyio's CapacityLimiter wakes its waiters in order). A run cancelled while it
waits holds nothing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

# `[sync] max_syncs_at_once` when absent. A poll of a Gmail mailbox waits ~0.1-0.3 s
# on the API (history.list) and a few ms on the database: 64 at once sustain the 167
# polls/s of 10,000 mailboxes at a 60 s interval with room to spare, while the
# 15-connection pool's queue stays a few deep; the Gmail door's own bound on requests
# in flight (256) is not the one that binds.
DEFAULT_SYNCS_AT_ONCE = 64
# A run at work this long is a long run: it moves to the long turns at its next
# committed page. A poll takes milliseconds to a second; a backfill page of 500 Gmail
# messages at the per-user quota a few seconds, so 10 s is several pages.
LONG_RUN_S = 10.0
# Long turns, as a share of the ordinary ones (at least one).
LONG_SHARE = 0.5


class Turn:
    """One run's hold on a turn (SyncTurns.turn): an ordinary one, then perhaps a long one."""

    def __init__(self, turns: anyio.CapacityLimiter, long_turns: anyio.CapacityLimiter) -> None:
        self._turns = turns
        self._long_turns = long_turns
        self._holding: anyio.CapacityLimiter | None = None
        self._since = anyio.current_time()

    @property
    def long(self) -> bool:
        return self._holding is self._long_turns

    async def take(self) -> None:
        await self._take(self._turns)

    def give_back(self) -> None:
        if self._holding is not None:
            self._holding.release_on_behalf_of(self)
            self._holding = None

    async def at_page_end(self) -> bool:
        """Where a run may pause (a page committed): past LONG_RUN_S, give the ordinary
        turn back and go on in a long one (waiting for it in its own line). True when
        the run moved. Cancelled while waiting, the run holds no turn."""
        if self.long or anyio.current_time() - self._since < LONG_RUN_S:
            return False
        self.give_back()
        await self._take(self._long_turns)
        return True

    async def _take(self, limiter: anyio.CapacityLimiter) -> None:
        await limiter.acquire_on_behalf_of(self)
        self._holding = limiter
        self._since = anyio.current_time()


class SyncTurns:
    """At most `limit` sync runs at work, and `limit × LONG_SHARE` long ones besides."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"max_syncs_at_once must be at least 1, got {limit}")
        self._turns = anyio.CapacityLimiter(limit)
        self._long_turns = anyio.CapacityLimiter(max(1, int(limit * LONG_SHARE)))

    @property
    def limit(self) -> int:
        return int(self._turns.total_tokens)

    @property
    def long_limit(self) -> int:
        return int(self._long_turns.total_tokens)

    @property
    def working(self) -> int:
        return int(self._turns.borrowed_tokens)

    @property
    def working_long(self) -> int:
        return int(self._long_turns.borrowed_tokens)

    @property
    def waiting(self) -> int:
        return self._turns.statistics().tasks_waiting

    @property
    def waiting_long(self) -> int:
        return self._long_turns.statistics().tasks_waiting

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[Turn]:
        """Wait for a turn; hold it (or the long one it became) inside the block."""
        turn = Turn(self._turns, self._long_turns)
        await turn.take()
        try:
            yield turn
        finally:
            turn.give_back()
