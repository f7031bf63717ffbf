"""Which mailboxes the poll scanner may claim (daemon/sync/fleet.py `polled`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from inboxd.daemon.config.tenant import MailboxConfig
from inboxd.daemon.sync.fleet import MailboxFleet
from inboxd.daemon.sync.runner import MailboxRunner, RunnerDeps


def _runner(mailbox: str, sync_mode: str) -> MailboxRunner:
    source = SimpleNamespace(tenant_id="acme", mailbox_id=mailbox, provider="maildir")
    config = MailboxConfig("acme", mailbox, "maildir", sync_mode=cast(Any, sync_mode))
    return MailboxRunner(cast(Any, source), cast(RunnerDeps, None), config)


async def test_a_mailbox_whose_sync_runs_or_is_asked_for_is_not_polled() -> None:
    fleet = MailboxFleet(cast(RunnerDeps, None), dsn="", page_size=1, poll_scan_interval_s=1)
    idle, asked, pushed = _runner("idle", "poll"), _runner("asked", "auto"), _runner("p", "push")
    for runner in (idle, asked, pushed):
        fleet.runners[runner.key] = runner
    assert set(fleet.polled()) == {idle.key, asked.key, pushed.key}
    # its first sync asked for at start, or running: a poll now would only queue a
    # second sync right after it
    asked.ring()
    assert asked.busy
    assert set(fleet.polled()) == {idle.key, pushed.key}
