"""The poll scanner: every `poll_scan_interval_s`, claim the mailboxes due for a poll.

Mailboxes in `poll` or `auto` sync mode are polled on their `poll_interval_s`
(for `auto`: once push has been quiet that long). The claim is one statement
(pipeline/mailbox/scheduling.py `claim_due`) that also stamps the claim, so several
replicas scanning the same database never ring one mailbox twice per
interval. Any database error skips one pass, logged; the loop never ends
before it is cancelled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import anyio
import asyncpg
import structlog

from inboxd.pipeline.errors import DATABASE_ERRORS, describe
from inboxd.pipeline.mailbox import scheduling

log = structlog.get_logger(__name__)

# Mailboxes one scanner claims per pass (more are left for the next pass or replica).
POLL_CLAIM_LIMIT = 100
# One claim is a single small UPDATE; a pass that takes longer is skipped.
POLL_CLAIM_TIMEOUT_S = 10.0

Key = tuple[str, str]


async def run_poll_scanner(
    pool: asyncpg.Pool,
    owner: str,
    interval_s: float,
    polled: Callable[[], Sequence[Key]],
    ring: Callable[[Key], None],
    push_quiet_after_s: float = 0.0,
) -> None:
    """Until cancelled: each `interval_s`, ring the due ones among `polled()`
    (auto-mode mailboxes only once their pushes have been quiet that long)."""
    failing = False
    while True:
        await anyio.sleep(interval_s)
        candidates = list(polled())
        if not candidates:
            continue
        try:
            with anyio.fail_after(POLL_CLAIM_TIMEOUT_S):
                async with pool.acquire() as conn:
                    due = await scheduling.claim_due(
                        conn,
                        owner,
                        mailboxes=candidates,
                        cooldown_s=interval_s,
                        limit=POLL_CLAIM_LIMIT,
                        push_quiet_after_s=push_quiet_after_s,
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
