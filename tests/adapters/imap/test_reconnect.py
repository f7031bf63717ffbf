"""The IDLE watch's reconnect backoff (issue 22 #9): full jitter, reset after a session
that lasted — driven with a fake clock, then against Dovecot restarted under a watch."""

from __future__ import annotations

import anyio
import pytest
from helpers.dovecot import DovecotServer
from helpers.secrets import PlainSecret
from helpers.waiting import eventually

from inboxd.adapters.imap import reconnect, source
from inboxd.adapters.imap.config import ImapMailbox
from inboxd.adapters.imap.reconnect import IDLE_BACKOFF_MAX_S, IDLE_BACKOFF_MIN_S, IdleBackoff
from inboxd.adapters.imap.source import ImapSource

ISSUE_82 = "django-mailbox/email_issue_82.eml"
# Draws per step: enough that a jitter which is not full (always near the cap) or
# not there at all (always the cap) shows.
DRAWS = 200


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _delays(backoff: IdleBackoff, n: int) -> list[float]:
    return [backoff.next_delay() for _ in range(n)]


def test_failures_in_a_row_double_the_bound_up_to_the_cap_with_full_jitter() -> None:
    for _ in range(DRAWS // 20):
        delays = _delays(IdleBackoff(clock=_Clock()), 12)
        for n, delay in enumerate(delays):
            assert 0 <= delay <= min(IDLE_BACKOFF_MIN_S * 2**n, IDLE_BACKOFF_MAX_S)
    firsts = [IdleBackoff(clock=_Clock()).next_delay() for _ in range(DRAWS)]
    # full jitter: spread over [0, initial], not pinned at it
    assert min(firsts) < IDLE_BACKOFF_MIN_S / 4 and max(firsts) > IDLE_BACKOFF_MIN_S * 3 / 4


def test_a_session_that_lasted_resets_the_backoff_and_a_short_one_does_not() -> None:
    clock = _Clock()
    backoff = IdleBackoff(clock=clock, healthy_after_s=60)
    _delays(backoff, 9)  # a server down for a while: the bound is at the 5 min cap
    short = []
    for _ in range(DRAWS):
        backoff.connected()
        clock.now += 59  # up, but not long enough to count as healthy
        short.append(backoff.next_delay())
    assert max(short) > 4 * IDLE_BACKOFF_MIN_S  # still backing off
    lasted = []
    for _ in range(DRAWS):
        backoff.connected()
        clock.now += 60  # a healthy session, then a drop
        lasted.append(backoff.next_delay())
    assert max(lasted) <= IDLE_BACKOFF_MIN_S


# A session this long counts as healthy in the test below (60 s in production).
HEALTHY_S = 0.5
# Restarts in a row: the doubling without a reset would wait 1, 2, 4, 8, 16 s.
RESTARTS = 5
# Connect, log in, EXAMINE on a busy machine, on top of the backoff's bound: a
# restart that is not over when the first try comes doubles it once (2 s).
RECONNECT_SLACK_S = 3.0


@pytest.mark.slow
async def test_the_watch_reconnects_at_once_after_each_healthy_session(
    dovecot: DovecotServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reconnect, "IDLE_HEALTHY_SESSION_S", HEALTHY_S)
    user = dovecot.new_user()
    mailbox = ImapMailbox.from_settings(
        {
            "host": dovecot.host,
            "port": dovecot.plain_port,
            "security": "none",
            "username": user.username,
            "password": PlainSecret(user.password),
        }
    )
    source = ImapSource("acme", "imap", mailbox)
    rings: list[float] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(source.watch, lambda: rings.append(anyio.current_time()))
        await eventually(lambda: len(rings), 30, what="the IDLE watch listening")
        for restart in range(RESTARTS):
            seen = len(rings)
            await anyio.sleep(HEALTHY_S)  # the session lasts: the condition under test
            await anyio.to_thread.run_sync(dovecot.restart)
            back = anyio.current_time()
            bound = 2 * IDLE_BACKOFF_MIN_S + RECONNECT_SLACK_S
            await eventually(
                lambda seen=seen: len(rings) > seen,
                bound,
                what=f"the watch listening again within {bound} s after restart {restart + 1}",
            )
        tg.cancel_scope.cancel()
    assert rings[-1] - back <= bound


@pytest.mark.slow
async def test_the_watch_outlives_a_refused_login_while_the_sync_connection_holds(
    dovecot: DovecotServer, corpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The IDLE connection is dropped and its new login refused ([AUTHENTICATIONFAILED])
    while the sync's pooled connection, logged in before, may stay up and keep the
    mailbox healthy (the watch alone here): the watch used to return for good, so mail
    after the server accepted the login again waited for the next poll (an hour in
    push mode). It tries again."""
    monkeypatch.setattr(source, "IDLE_REFUSED_RETRY_S", 0.5, raising=False)
    user = dovecot.new_user()
    mailbox = ImapMailbox.from_settings(
        {
            "host": dovecot.host,
            "port": dovecot.plain_port,
            "security": "none",
            "username": user.username,
            "password": PlainSecret(user.password),
        }
    )
    watcher = ImapSource("acme", "imap", mailbox)
    sessions: list[float] = []  # IDLE sessions up (the backoff told of each)
    connected = reconnect.IdleBackoff.connected

    def counting(backoff: reconnect.IdleBackoff) -> None:
        sessions.append(anyio.current_time())
        connected(backoff)

    monkeypatch.setattr(reconnect.IdleBackoff, "connected", counting)
    rings: list[float] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(watcher.watch, lambda: rings.append(anyio.current_time()))
        await eventually(lambda: len(rings), 30, what="the IDLE watch listening")
        await anyio.to_thread.run_sync(dovecot.add_user, user.username, "rotated-elsewhere")
        await anyio.to_thread.run_sync(dovecot.restart)  # the IDLE connection drops
        await eventually(
            lambda: "auth failed" in dovecot.log_tail().lower(),
            30,
            what="the watch's login refused",
        )
        # a refusal rings too: the sync run then finds out (and needs attention)
        await eventually(lambda: len(rings) > 1, 30, what="a ring for the refusal")
        await anyio.to_thread.run_sync(dovecot.add_user, user.username, user.password)
        await eventually(lambda: len(sessions) > 1, 30, what="the watch listening again")
        listening = len(rings)
        dovecot.deliver(user.username, "INBOX", (corpus / "mime" / ISSUE_82).read_bytes())
        await eventually(lambda: len(rings) > listening, 30, what="a ring for the new mail")
        tg.cancel_scope.cancel()
