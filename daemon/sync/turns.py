"""How many sync runs of this process work at once, and how a long one takes turns.

    ring ──▶ wait for a turn ──▶ lease, pages … ─┬─ run ends ──▶ turn given back
                   ▲                             │ after a committed page: held
                   │                             │ ≥ TURN_S and others wait
                   └──── back of the line ◀──────┘

Every mailbox is rung at start, and a poll wave rings thousands at once. Without a
bound, 10,000 runs queued on one 15-connection pool: every step of every run waited
behind a step of all the others, so no run finished before nearly all did (first
syncs of 10,000 Gmail mailboxes all ended at 223 s; with two replicas none had
ended after 7 minutes, and the scanner's claims and the delivery worker timed out
in the same queue — bench/README.md, fleet.py). With `[sync] max_syncs_at_once`
runs working, the pool's queue stays short and a run ends in its own time.

A run keeps its lease while it waits (the lease keeper renews it), so taking turns
moves no cursor and gives no mailbox away. The line is first come, first served
(anyio's CapacityLimiter wakes its waiters in order), and a run that has held its
turn for TURN_S passes it on after a committed page when others wait: a backfill
of a large mailbox, or a thousand after a cursor reset, cannot hold every turn
while the polls of mailboxes that are up to date wait behind them for hours.
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
# A run holding its turn this long passes it on at its next committed page when
# others wait. A backfill page of 500 Gmail messages at the per-user quota takes
# a few seconds: 10 s lets a run commit some pages per turn instead of one.
TURN_S = 10.0


class Turn:
    """One run's hold on a turn (SyncTurns.turn)."""

    def __init__(self, limiter: anyio.CapacityLimiter) -> None:
        self._limiter = limiter
        self._since = anyio.current_time()
        self.held = False

    async def take(self) -> None:
        await self._limiter.acquire_on_behalf_of(self)
        self.held = True
        self._since = anyio.current_time()

    def give_back(self) -> None:
        if self.held:
            self.held = False
            self._limiter.release_on_behalf_of(self)

    async def pass_on_if_due(self) -> bool:
        """At a point where the run may pause (a page committed): when held ≥ TURN_S
        and another run waits, give the turn to it and wait in line again. True when
        the turn was passed on. Cancelled while waiting, the run holds no turn."""
        if anyio.current_time() - self._since < TURN_S:
            return False
        if self._limiter.statistics().tasks_waiting == 0:
            return False
        self.give_back()
        await self.take()
        return True


class SyncTurns:
    """At most `limit` sync runs of this process at work; the others wait in line."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"max_syncs_at_once must be at least 1, got {limit}")
        self._limiter = anyio.CapacityLimiter(limit)

    @property
    def limit(self) -> int:
        return int(self._limiter.total_tokens)

    @property
    def working(self) -> int:
        return int(self._limiter.borrowed_tokens)

    @property
    def waiting(self) -> int:
        return self._limiter.statistics().tasks_waiting

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[Turn]:
        """Wait for a turn; hold it inside the block (passing it on when due)."""
        turn = Turn(self._limiter)
        await turn.take()
        try:
            yield turn
        finally:
            turn.give_back()
