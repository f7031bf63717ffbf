"""Which mailboxes the poll scanner may claim (daemon/sync/fleet.py `polled`), and how
many per pass (daemon/sync/scanner.py)."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any, cast

from inboxd.daemon.config.tenant import MailboxConfig
from inboxd.daemon.sync.fleet import MailboxFleet
from inboxd.daemon.sync.runner import MailboxRunner, RunnerDeps
from inboxd.daemon.sync.scanner import POLL_CLAIM_FLOOR, SCAN_JITTER, claim_limit, jittered
from inboxd.pipeline.mailbox.scheduling import PUSH_SAFETY_SYNC_S


def _runner(mailbox: str, sync_mode: str) -> MailboxRunner:
    source = SimpleNamespace(tenant_id="acme", mailbox_id=mailbox, provider="maildir")
    config = MailboxConfig("acme", mailbox, "maildir", sync_mode=cast(Any, sync_mode))
    return MailboxRunner(cast(Any, source), cast(RunnerDeps, None), config)


async def test_a_mailbox_whose_sync_runs_or_is_asked_for_is_not_polled() -> None:
    fleet = MailboxFleet(cast(RunnerDeps, None), dsn="", page_size=1, poll_scan_interval_s=1)
    idle, asked, pushed = _runner("idle", "poll"), _runner("asked", "auto"), _runner("p", "push")
    for runner in (idle, asked, pushed):
        fleet.runners[runner.key] = runner
    assert {key for key, _ in fleet.polled()} == {idle.key, asked.key, pushed.key}
    # its first sync asked for at start, or running: a poll now would only queue a
    # second sync right after it
    asked.ring()
    assert asked.busy
    assert {key for key, _ in fleet.polled()} == {idle.key, pushed.key}


async def test_a_push_mailbox_is_polled_at_the_daily_safety_sync() -> None:
    fleet = MailboxFleet(cast(RunnerDeps, None), dsn="", page_size=1, poll_scan_interval_s=1)
    polled, pushed = _runner("polled", "poll"), _runner("pushed", "push")
    for runner in (polled, pushed):
        fleet.runners[runner.key] = runner
    every = dict(fleet.polled())
    assert every[polled.key] == polled.config.poll_interval_s
    assert every[pushed.key] == PUSH_SAFETY_SYNC_S


def test_a_pass_claims_in_proportion_to_what_is_due() -> None:
    # 10,000 mailboxes at 60 s and a pass every 5 s: 833 fall due per pass; twice
    # that may be claimed, so a backlog drains in half an interval.
    assert claim_limit([60.0] * 10_000, 5.0) == 1_667
    # a small fleet keeps the floor, so nothing due waits for a later pass
    assert claim_limit([300.0] * 10, 5.0) == POLL_CLAIM_FLOOR
    assert claim_limit([], 5.0) == POLL_CLAIM_FLOOR


def test_scan_passes_are_jittered_within_bounds() -> None:
    rng = random.Random(7)
    waits = [jittered(5.0, rng) for _ in range(1_000)]
    assert all(5.0 * (1 - SCAN_JITTER) <= w <= 5.0 * (1 + SCAN_JITTER) for w in waits)
    assert max(waits) - min(waits) > 5.0 * SCAN_JITTER  # they do vary
