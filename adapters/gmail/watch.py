"""Keeping a Gmail mailbox's users.watch alive, on a schedule of its own.

Gmail publishes a mailbox's changes to Pub/Sub only while its watch lives, and a
watch lapses 7 days after the users.watch call that made it (push guide: "You
must re-call watch at least every 7 days or else you will stop receiving updates
for the user. We recommend calling watch once per day."). A mailbox that gets no
mail gets no push and so no sync: renewal cannot ride on syncs. In push and auto
mode the runner runs `WatchKeeper.run` for the mailbox's whole life
(adapters/base.py, the optional `watch`):

    start ─▶ users.watch ─ok─▶ record_watch(expiry) ─▶ sleep until the next renewal ─┐
      ▲          │ failed (any error)                                                 │
      │          ▼                                                                    │
      │      "gmail_watch_failed" once, tenacity backoff with jitter, call again      │
      │      until it succeeds ("gmail_watch_recovered" once); the failure and the    │
      │      recovery each ring a sync, which records `failing()` in the status       │
      └───────────────────────────────────────────────────────────────────────────────┘

The next renewal comes WATCH_RENEW_PERIOD_S after the last one, or at half of the
watch's remaining life when that is sooner (a watch Gmail gives for less than two
days, or a test's fake that gives seconds), less up to WATCH_RENEW_JITTER of the
wait, so mailboxes started together do not renew together. A renewal that comes
after the previous watch lapsed (Gmail refused renewals for days) rings the
mailbox: changes made meanwhile were published to no one, a sync picks them up.

Renewing never touches the cursor: users.watch's historyId is not used.
`stop` (the mailbox was removed) waits for a users.watch under way, calls
users.stop and ends the schedule: no renewal reaches Gmail after the stop.
In poll mode nothing runs the schedule, and a sync renews a watch that is due
(`renew_if_due`), as before.
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime

import anyio
import structlog
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_never,
    wait_exponential,
    wait_random,
)

from inboxd.adapters.gmail.client import GmailClient
from inboxd.adapters.gmail.errors import GmailAuthError, GmailRequestRejected, GmailRetriable
from inboxd.pipeline.errors import Family, describe, family_of

__all__ = [
    "WATCH_RENEW_BEFORE_S",
    "WATCH_RENEW_JITTER",
    "WATCH_RENEW_PERIOD_S",
    "WatchKeeper",
    "WatchRecorder",
]

log = structlog.get_logger(__name__)

WatchRecorder = Callable[[datetime], Awaitable[None]]

#: Renewal period: once a day (Gmail push guide: "We recommend calling watch once
#: per day"), so a watch has six days to spare when renewals fail.
WATCH_RENEW_PERIOD_S = 24 * 3600.0
#: Fraction of a wait taken off at random: 10 % of a day spreads a fleet's
#: renewals over 2.4 hours.
WATCH_RENEW_JITTER = 0.1
#: A watch that lives for less than this gets renewed at half its remaining life
#: instead of after the period; below this, renewal would be a hot loop.
WATCH_RENEW_MIN_WAIT_S = 1.0
#: In-sync renewal (poll mode, nothing runs the schedule): renew when less than
#: this is left of the 7 days, i.e. at the first sync of each day.
WATCH_RENEW_BEFORE_S = 6 * 24 * 3600.0
#: Backoff between failed renewals (tenacity, exponential with jitter), seconds:
#: a quota hiccup is retried within seconds, a topic without Gmail's publish
#: right (403) is tried hourly until an operator grants it.
WATCH_RETRY_INITIAL_S = 2.0
WATCH_RETRY_MAX_S = 3600.0


class WatchKeeper:
    """The users.watch of one mailbox (module docstring): `run` is the schedule,
    `renew_if_due` the in-sync renewal of poll mode."""

    def __init__(
        self,
        mailbox_id: str,
        topic: str,
        label_ids: Sequence[str],
        record: WatchRecorder | None = None,
        *,
        period_s: float = WATCH_RENEW_PERIOD_S,
        retry_initial_s: float = WATCH_RETRY_INITIAL_S,
        retry_max_s: float = WATCH_RETRY_MAX_S,
    ) -> None:
        self.mailbox_id = mailbox_id
        self.topic = topic
        self.label_ids = list(label_ids)
        self.expires_at: float | None = None  # unix seconds of the watch we made
        self._record = record
        self._period_s = period_s
        self._retry_initial_s = retry_initial_s
        self._retry_max_s = retry_max_s
        self._scheduled = False
        # users.watch and users.stop one at a time, and none after the stop: a
        # renewal on its way must not reach Gmail after users.stop (it would publish
        # a removed mailbox's changes for 7 more days)
        self._calls = anyio.Lock()
        self._stopped = False
        self._failure: tuple[str, bool] | None = None  # (error, permanent) while failing

    async def run(self, client: Callable[[], GmailClient], ring: Callable[[], None]) -> None:
        """Renew now, then on the schedule, until cancelled; never raises otherwise.
        `client` gives the source's client (made lazily); `ring` asks for a sync."""
        self._scheduled = True
        try:
            while not self._stopped:
                lapsed = await self._renew_until_done(client, ring)
                if self._stopped:
                    break
                if lapsed:
                    ring()
                await anyio.sleep(self.next_wait_s(time.time()))
            await anyio.sleep_forever()  # stopped: nothing to keep until cancelled
        finally:
            self._scheduled = False

    async def stop(self, client: GmailClient) -> None:
        """users.stop, after any users.watch already under way, and no users.watch
        from this keeper ever after (the mailbox was removed). Errors propagate."""
        async with self._calls:
            self._stopped = True
            self.expires_at = None
            await client.stop()

    async def renew_if_due(self, client: GmailClient) -> None:
        """Inside a sync, when no schedule runs: users.watch if none was made or less
        than WATCH_RENEW_BEFORE_S is left. A failure is logged; the sync goes on (a
        403 for a topic without Gmail's publish right, a 429): polling still syncs."""
        if self._scheduled or self._stopped:
            return
        if self.expires_at is not None and self.expires_at - time.time() > WATCH_RENEW_BEFORE_S:
            return
        try:
            await self._renew(client)
        except (GmailAuthError, GmailRetriable, GmailRequestRejected) as exc:
            log.warning("gmail_watch_failed", mailbox=self.mailbox_id, error=str(exc)[:200])

    def next_wait_s(self, now: float) -> float:
        """Seconds until the next renewal, jitter included (module docstring)."""
        wait_s = self._period_s
        if self.expires_at is not None:
            wait_s = min(wait_s, (self.expires_at - now) / 2)
        wait_s *= 1 - random.uniform(0, WATCH_RENEW_JITTER)  # noqa: S311 - spread, not secrecy
        return max(wait_s, WATCH_RENEW_MIN_WAIT_S)

    def failing(self) -> tuple[str, bool] | None:
        """While renewals fail: what Gmail answered, and whether an operator must act
        (Gmail refused the watch itself: a topic without Gmail's publish right, a
        malformed or missing topic, credentials; or the last watch has lapsed)."""
        if self._failure is None:
            return None
        error, permanent = self._failure
        lapsed = self.expires_at is not None and self.expires_at <= time.time()
        return error, permanent or lapsed

    async def _renew_until_done(
        self, client: Callable[[], GmailClient], ring: Callable[[], None]
    ) -> bool:
        """users.watch and its record, retried with backoff until both succeed; True
        when the previous watch had lapsed by then. The first failure of a streak and
        the recovery ring the mailbox, so a sync puts them in its status (the
        source's degraded())."""
        failed = 0

        def note(state: RetryCallState) -> None:
            nonlocal failed
            failed += 1
            if failed == 1:
                exc = state.outcome.exception() if state.outcome else None
                error = describe(exc)[:200] if exc else ""
                log.warning("gmail_watch_failed", mailbox=self.mailbox_id, error=error)
                # Gmail refused the watch itself (credentials, a topic without its
                # publish right, a malformed or missing topic): no retry mends it
                permanent = exc is not None and family_of(exc) in (
                    Family.ATTENTION,
                    Family.PERMANENT,
                )
                self._failure = (error, permanent)
                ring()

        retrying = AsyncRetrying(
            stop=stop_never,
            wait=wait_exponential(multiplier=self._retry_initial_s, max=self._retry_max_s)
            + wait_random(0, self._retry_initial_s),
            # any failure: this loop must outlive Gmail's and the database's (rule 8)
            retry=retry_if_exception_type(Exception),
            before_sleep=note,
            reraise=True,
        )
        previous = self.expires_at
        await retrying(self._renew, client())
        if failed:
            log.info("gmail_watch_recovered", mailbox=self.mailbox_id, retries=failed)
            self._failure = None
            ring()
        return previous is not None and previous <= time.time()

    async def _renew(self, client: GmailClient) -> None:
        async with self._calls:
            if self._stopped:
                return
            await self._watch(client)

    async def _watch(self, client: GmailClient) -> None:
        watch = await client.watch(self.topic, self.label_ids)
        self.expires_at = watch.expiration.timestamp()
        log.info("gmail_watch_renewed", mailbox=self.mailbox_id, expires_at=str(watch.expiration))
        if self._record is not None:
            await self._record(watch.expiration)
