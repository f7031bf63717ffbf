"""The poll scanner: every `poll_scan_interval_s`, claim the mailboxes due for a poll.

Mailboxes in `poll` or `auto` sync mode are polled on their `poll_interval_s`
(for `auto`: once push has been quiet that long; `push` once a day). The claim is
one statement (pipeline/mailbox/scheduling.py `claim_due`) that also stamps the
claim, so several replicas scanning the same database never ring one mailbox
twice per interval. Any database error skips one pass, logged; the loop never
ends before it is cancelled.

How much one pass claims follows what is due, not a constant (issue 25: a fixed
100 per 5 s pass capped a replica at 20 polls a second). `claim_limit` is
CATCH_UP_FACTOR times the polls the candidates need per pass at their intervals
(Σ scan period / interval), at least POLL_CLAIM_FLOOR: in steady state every due
mailbox is claimed in the pass it falls due, and a backlog (the first start, a
replica that took over a dead one's mailboxes) drains within 1/CATCH_UP_FACTOR of
an interval instead of ringing every runner at once. The claim is fair across
tenants when the limit binds. A mailbox falling due before the next pass is
claimed in the pass nearest its due time (CLAIM_AHEAD_SHARE), so polls are as
often early as late. Each pass waits the scan period ± SCAN_JITTER, so
replicas that started together drift apart and take turns claiming: the due
work splits between them over time instead of going to whichever scans first.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

import anyio
import asyncpg
import structlog

from inboxd.pipeline.errors import DATABASE_ERRORS, describe
from inboxd.pipeline.mailbox import scheduling

log = structlog.get_logger(__name__)

# A pass may claim this many times the polls due per pass at the candidates' intervals:
# 2 drains a backlog within half an interval (module docstring).
CATCH_UP_FACTOR = 2.0
# ... and at least this many: the old fixed limit, which a small fleet never reaches.
POLL_CLAIM_FLOOR = 100
# The scan period varies by ± this fraction, so replicas' passes do not stay aligned.
SCAN_JITTER = 0.2
# A mailbox falling due within this share of a scan period is claimed now: half a
# period claims each in the pass nearest to its due time, so a poll is as often
# early as late and the mean period stays its interval (with 0, every poll was late
# by half a period on average: 0.96 of the interval at 60 s with a 5 s scan).
CLAIM_AHEAD_SHARE = 0.5
# One claim is a single small UPDATE; a pass that takes longer is skipped.
POLL_CLAIM_TIMEOUT_S = 10.0

Key = tuple[str, str]


def claim_limit(intervals_s: Sequence[float], scan_interval_s: float) -> int:
    """How many mailboxes one pass may claim, for candidates polled every
    `intervals_s` and a pass every `scan_interval_s` (module docstring)."""
    per_pass = sum(scan_interval_s / i for i in intervals_s if i > 0)
    return max(POLL_CLAIM_FLOOR, math.ceil(CATCH_UP_FACTOR * per_pass))


def jittered(interval_s: float, rng: random.Random) -> float:
    """The wait before the next pass: `interval_s` ± SCAN_JITTER."""
    return interval_s * (1.0 + rng.uniform(-SCAN_JITTER, SCAN_JITTER))


async def run_poll_scanner(
    pool: asyncpg.Pool,
    owner: str,
    interval_s: float,
    polled: Callable[[], Sequence[tuple[Key, float]]],
    ring: Callable[[Key], None],
    push_quiet_after_s: float = 0.0,
) -> None:
    """Until cancelled: each `interval_s` (jittered), ring the due ones among
    `polled()`, (mailbox, its poll interval in seconds) pairs (auto-mode mailboxes
    only once their pushes have been quiet that long)."""
    failing = False
    rng = random.Random()  # noqa: S311 - spreads passes, guards nothing
    while True:
        await anyio.sleep(jittered(interval_s, rng))
        polled_now = list(polled())
        if not polled_now:
            continue
        candidates = [key for key, _ in polled_now]
        limit = claim_limit([every_s for _, every_s in polled_now], interval_s)
        try:
            with anyio.fail_after(POLL_CLAIM_TIMEOUT_S):
                async with pool.acquire() as conn:
                    due = await scheduling.claim_due(
                        conn,
                        owner,
                        mailboxes=candidates,
                        cooldown_s=interval_s,
                        limit=limit,
                        push_quiet_after_s=push_quiet_after_s,
                        ahead_s=interval_s * CLAIM_AHEAD_SHARE,
                    )
        except DATABASE_ERRORS as exc:
            if not failing:  # "unavailable" once, "recovered" once (CONTRIBUTING.md)
                log.warning("poll_scan_failed", error=describe(exc))
            failing = True
            continue
        if failing:
            log.info("poll_scan_recovered")
            failing = False
        for key in due:
            ring(key)
