"""Mailbox leases, fenced cursors, cancel flag, throttle and poll claims, on a real server.

Lease expiry is waited for by polling the database clock with a deadline
(`wait_for_db`), never by sleeping a guessed amount.
"""

from __future__ import annotations

import anyio
import asyncpg
import orjson
import pytest
from helpers import eventually

from inboxd.pipeline.doorbell import DOORBELL_CHANNEL, parse_doorbell, ring
from inboxd.pipeline.mailbox import leases, presence, scheduling
from inboxd.pipeline.mailbox import status as mailbox_status
from inboxd.pipeline.mailbox.leases import MailboxNotFound
from inboxd.pipeline.mailbox.scheduling import MailboxRow
from inboxd.pipeline.outbox import NOTIFY_CHANNEL

T, M = "acme", "inbox"
# A lease short enough to expire during a test; waits for it are bounded below.
SHORT_TTL_S = 0.2
LONG_TTL_S = 60.0
# Longest a test waits for a database-clock condition (a 0.2 s lease to expire).
DB_WAIT_DEADLINE_S = 10.0
DB_POLL_S = 0.02
NOTIFY_DEADLINE_S = 10.0


@pytest.fixture
async def inbox(make_mailbox) -> tuple[str, str]:
    return await make_mailbox(T, M)


async def wait_for_db(pool: asyncpg.Pool, condition_sql: str, *args: object) -> None:
    """Poll a boolean SQL expression (database clock) until true; fail after the deadline."""
    await eventually(
        lambda: pool.fetchval(f"SELECT ({condition_sql})", *args),
        DB_WAIT_DEADLINE_S,
        what=f"{condition_sql} {args}",
        poll_s=DB_POLL_S,
    )


async def wait_lease_expired(pool: asyncpg.Pool, tenant: str = T, mailbox: str = M) -> None:
    await wait_for_db(
        pool,
        "SELECT lease_expires_at <= now() FROM mailboxes WHERE tenant_id = $1 AND mailbox_id = $2",
        tenant,
        mailbox,
    )


async def row(pool: asyncpg.Pool, tenant: str = T, mailbox: str = M) -> asyncpg.Record:
    return await pool.fetchrow(
        "SELECT * FROM mailboxes WHERE tenant_id = $1 AND mailbox_id = $2", tenant, mailbox
    )


# --- leases ------------------------------------------------------------------------------


async def test_tokens_increase_on_every_acquisition(pool, inbox) -> None:
    first = await leases.acquire_lease(pool, T, M, "a", LONG_TTL_S)
    again = await leases.acquire_lease(pool, T, M, "a", LONG_TTL_S)  # same owner, still valid
    assert first == 1 and again == 2
    await leases.release_lease(pool, T, M, "a", again)
    assert (await row(pool))["lease_owner"] is None
    after_release = await leases.acquire_lease(pool, T, M, "b", SHORT_TTL_S)
    assert after_release == 3
    await wait_lease_expired(pool)
    # the same owner re-acquiring after expiry still gets a new token
    assert await leases.acquire_lease(pool, T, M, "b", LONG_TTL_S) == 4
    # the superseded token of that same owner is stale
    assert not await leases.renew_lease(pool, T, M, "b", 3, LONG_TTL_S)
    assert not await leases.commit_cursor(pool, T, M, 3, "c-old")


async def test_second_owner_refused_while_valid_then_takes_over(pool, inbox) -> None:
    token_a = await leases.acquire_lease(pool, T, M, "a", SHORT_TTL_S)
    assert token_a is not None
    assert await leases.acquire_lease(pool, T, M, "b", LONG_TTL_S) is None
    assert await leases.commit_cursor(pool, T, M, token_a, "100")
    await wait_lease_expired(pool)
    # expired: renewing is too late, and the owner's cursor write is refused
    assert not await leases.renew_lease(pool, T, M, "a", token_a, LONG_TTL_S)
    assert not await leases.commit_cursor(pool, T, M, token_a, "150")
    token_b = await leases.acquire_lease(pool, T, M, "b", LONG_TTL_S)
    assert token_b == token_a + 1
    assert await leases.commit_cursor(pool, T, M, token_b, "200")
    # the stalled owner wakes up: every fenced write is rejected, nothing changes
    assert not await leases.commit_cursor(pool, T, M, token_a, "101")
    assert not await leases.reset_cursor(pool, T, M, token_a, "stale")
    assert not await scheduling.set_sync_state(pool, T, M, "syncing", token=token_a)
    await leases.release_lease(pool, T, M, "a", token_a)  # no-op for a stale holder
    state = await row(pool)
    assert (state["cursor"], state["lease_owner"], state["lease_token"]) == ("200", "b", token_b)
    assert await pool.fetchval("SELECT count(*) FROM events") == 0


async def test_a_holder_whose_presence_lock_is_gone_loses_the_lease_at_once(
    pool, db_dsn, inbox
) -> None:
    """A killed daemon's mailboxes are taken over without waiting out a long TTL."""
    owner = "host-a:1:dead"
    key = presence.presence_key(owner)
    session = await asyncpg.connect(db_dsn)
    await presence.hold_presence(session, key)
    first = await leases.acquire_lease(pool, T, M, owner, LONG_TTL_S, session_key=key)
    assert first is not None
    # while the holder's session lives, nobody else gets the lease
    assert await leases.acquire_lease(pool, T, M, "host-b:2:live", LONG_TTL_S) is None
    await session.close()  # the process died: PostgreSQL drops its lock with it

    second = await leases.acquire_lease(pool, T, M, "host-b:2:live", LONG_TTL_S)
    assert second is not None and second > first
    # fencing is untouched: the old holder's cursor write is refused
    assert not await leases.commit_cursor(pool, T, M, first, "c-1")
    assert await leases.commit_cursor(pool, T, M, second, "c-1")


async def test_a_lease_without_presence_waits_for_its_expiry(pool, db_dsn, inbox) -> None:
    assert await leases.acquire_lease(pool, T, M, "old-daemon", LONG_TTL_S) is not None
    assert await leases.acquire_lease(pool, T, M, "new-daemon", LONG_TTL_S) is None
    # a presence lock somebody else holds does not make an unkeyed lease stealable
    other = await asyncpg.connect(db_dsn)
    try:
        await presence.hold_presence(other, presence.presence_key("new-daemon"))
        assert await leases.acquire_lease(pool, T, M, "new-daemon", LONG_TTL_S) is None
    finally:
        await other.close()


async def test_a_presence_key_cannot_be_held_twice(db_dsn) -> None:
    key = presence.presence_key("same-owner")
    first, second = await asyncpg.connect(db_dsn), await asyncpg.connect(db_dsn)
    try:
        await presence.hold_presence(first, key)
        with pytest.raises(RuntimeError, match="unique"):
            await presence.hold_presence(second, key)
    finally:
        await first.close()
        await second.close()


async def test_renew_extends_and_release_frees(pool, inbox) -> None:
    token = await leases.acquire_lease(pool, T, M, "a", 5.0)
    before = (await row(pool))["lease_expires_at"]
    assert await leases.renew_lease(pool, T, M, "a", token, LONG_TTL_S)
    assert (await row(pool))["lease_expires_at"] > before
    assert not await leases.renew_lease(pool, T, M, "b", token, LONG_TTL_S)  # wrong owner
    await leases.release_lease(pool, T, M, "a", token)
    assert not await leases.commit_cursor(pool, T, M, token, "1")  # released: not held
    assert await leases.acquire_lease(pool, T, M, "b", LONG_TTL_S) == token + 1


async def test_renew_leases_renews_what_the_owner_still_holds(pool, make_mailbox) -> None:
    """One statement for every lease of an owner: a lease taken over (token moved on),
    released or expired is reported lost; another tenant's mailbox of the same name is
    a separate lease."""
    for tenant, mailbox in [(T, "kept"), (T, "taken"), (T, "released"), (T, "expired")]:
        await make_mailbox(tenant, mailbox)
    await make_mailbox("other", "kept")
    kept = await leases.acquire_lease(pool, T, "kept", "a", 5.0)
    other_kept = await leases.acquire_lease(pool, "other", "kept", "a", 5.0)
    taken = await leases.acquire_lease(pool, T, "taken", "a", 5.0)
    released = await leases.acquire_lease(pool, T, "released", "a", 5.0)
    expired = await leases.acquire_lease(pool, T, "expired", "a", SHORT_TTL_S)
    assert None not in (kept, other_kept, taken, released, expired)
    await wait_lease_expired(pool, T, "expired")
    await pool.execute(  # another replica's acquisition after an expiry: the token moves on
        "UPDATE mailboxes SET lease_owner = 'b', lease_token = lease_token + 1 "
        "WHERE tenant_id = $1 AND mailbox_id = 'taken'",
        T,
    )
    await leases.release_lease(pool, T, "released", "a", released)
    before = (await row(pool, T, "kept"))["lease_expires_at"]

    renewed = await leases.renew_leases(
        pool,
        "a",
        [
            (T, "kept", kept),
            ("other", "kept", other_kept),
            (T, "taken", taken),
            (T, "released", released),
            (T, "expired", expired),
        ],
        LONG_TTL_S,
    )

    assert renewed == {(T, "kept"), ("other", "kept")}
    assert (await row(pool, T, "kept"))["lease_expires_at"] > before
    assert (await row(pool, T, "taken"))["lease_owner"] == "b"
    assert await leases.renew_leases(pool, "a", [], LONG_TTL_S) == set()
    # a stale token of the same owner is lost too
    assert await leases.renew_leases(pool, "a", [(T, "kept", kept - 1)], LONG_TTL_S) == set()


async def test_concurrent_acquire_gives_exactly_one_token(pool, db_dsn, inbox) -> None:
    contenders = 10
    connected: list[str] = []
    all_connected, go = anyio.Event(), anyio.Event()
    results: dict[str, int | None] = {}

    async def contender(owner: str) -> None:
        conn = await asyncpg.connect(db_dsn)
        try:
            connected.append(owner)
            if len(connected) == contenders:
                all_connected.set()
            await go.wait()  # all ten race from open connections
            results[owner] = await leases.acquire_lease(conn, T, M, owner, LONG_TTL_S)
        finally:
            await conn.close()

    with anyio.fail_after(DB_WAIT_DEADLINE_S):
        async with anyio.create_task_group() as tg:
            for i in range(contenders):
                tg.start_soon(contender, f"owner-{i}")
            await all_connected.wait()
            go.set()
    winners = {owner: token for owner, token in results.items() if token is not None}
    assert len(results) == contenders
    assert list(winners.values()) == [1]
    assert (await row(pool))["lease_owner"] == next(iter(winners))


async def test_missing_mailbox_and_bad_arguments(pool, inbox) -> None:
    with pytest.raises(MailboxNotFound):
        await leases.acquire_lease(pool, T, "nope", "a", LONG_TTL_S)
    with pytest.raises(MailboxNotFound):
        await leases.acquire_lease(pool, "other", M, "a", LONG_TTL_S)  # scoped by tenant
    with pytest.raises(ValueError, match="ttl_s"):
        await leases.acquire_lease(pool, T, M, "a", 0)
    with pytest.raises(ValueError, match="owner"):
        await leases.acquire_lease(pool, T, M, "", LONG_TTL_S)
    token = await leases.acquire_lease(pool, T, M, "a", LONG_TTL_S)
    with pytest.raises(ValueError, match="cursor"):
        await leases.commit_cursor(pool, T, M, token, "")
    with pytest.raises(MailboxNotFound):
        await scheduling.record_failure(pool, T, "nope", "x")
    with pytest.raises(MailboxNotFound):
        await scheduling.record_success(pool, T, "nope")
    with pytest.raises(ValueError, match="sync state"):
        await scheduling.set_sync_state(pool, T, M, "busy")  # type: ignore[arg-type]


# --- cursor ------------------------------------------------------------------------------


async def test_commit_cursor_only_stamps_a_moved_cursor(pool, inbox) -> None:
    token = await leases.acquire_lease(pool, T, M, "a", LONG_TTL_S)
    assert await leases.commit_cursor(pool, T, M, token, "uidv1:10")
    stamped = (await row(pool))["cursor_updated_at"]
    await wait_for_db(pool, "now() > $1", stamped)
    assert await leases.commit_cursor(pool, T, M, token, "uidv1:10")
    assert (await row(pool))["cursor_updated_at"] == stamped
    assert await leases.commit_cursor(pool, T, M, token, "uidv1:11")
    moved = await row(pool)
    assert moved["cursor"] == "uidv1:11" and moved["cursor_updated_at"] > stamped


async def test_commit_cursor_inside_the_callers_transaction(pool, inbox) -> None:
    token = await leases.acquire_lease(pool, T, M, "a", LONG_TTL_S)
    async with pool.acquire() as conn:
        tx = conn.transaction()
        await tx.start()
        assert await leases.commit_cursor(conn, T, M, token, "42")
        await tx.rollback()
    assert (await row(pool))["cursor"] is None


async def test_reset_cursor_clears_it_and_writes_an_event(pool, db_dsn, inbox) -> None:
    token = await leases.acquire_lease(pool, T, M, "a", LONG_TTL_S)
    assert await leases.commit_cursor(pool, T, M, token, "history-900")
    notified = anyio.Event()
    payloads: list[str] = []

    def on_notify(_conn: object, _pid: int, _channel: str, payload: str) -> None:
        payloads.append(payload)
        notified.set()

    listener = await asyncpg.connect(db_dsn)
    try:
        await listener.add_listener(NOTIFY_CHANNEL, on_notify)
        assert await leases.reset_cursor(
            pool, T, M, token, "Gmail history 404:\nstartHistoryId too old"
        )
        with anyio.fail_after(NOTIFY_DEADLINE_S):
            await notified.wait()
    finally:
        await listener.close()
    state = await row(pool)
    assert state["cursor"] is None and state["cursor_updated_at"] is not None
    event = await pool.fetchrow("SELECT * FROM events")
    assert (event["tenant_id"], event["mailbox_id"], event["kind"]) == (
        T,
        M,
        "mailbox.cursor_reset",
    )
    assert orjson.loads(event["payload"]) == {"reason": "Gmail history 404: startHistoryId too old"}
    assert orjson.loads(payloads[0]) == {"tenant": T, "last_event_id": event["event_id"]}


async def test_reset_cursor_rolls_back_with_the_callers_transaction(pool, inbox) -> None:
    token = await leases.acquire_lease(pool, T, M, "a", LONG_TTL_S)
    assert await leases.commit_cursor(pool, T, M, token, "7")
    async with pool.acquire() as conn:
        tx = conn.transaction()
        await tx.start()
        assert await leases.reset_cursor(conn, T, M, token, "uidvalidity changed")
        await tx.rollback()
    assert (await row(pool))["cursor"] == "7"
    assert await pool.fetchval("SELECT count(*) FROM events") == 0


# --- cancel flag -------------------------------------------------------------------------


async def test_cancel_flag_round_trip(pool, inbox) -> None:
    assert not await leases.cancel_requested(pool, T, M)
    assert await leases.request_cancel(pool, T, M)
    assert await leases.cancel_requested(pool, T, M)
    await leases.clear_cancel(pool, T, M)
    assert not await leases.cancel_requested(pool, T, M)
    assert await leases.request_cancel(pool, T, M)
    assert await leases.take_cancel(pool, T, M)  # seen and cleared at once
    assert not await leases.take_cancel(pool, T, M)
    assert not await leases.cancel_requested(pool, T, M)
    assert not await leases.request_cancel(pool, T, "nope")
    assert not await leases.request_cancel(pool, "other", M)
    assert not await leases.cancel_requested(pool, T, "nope")


# --- throttle and health -----------------------------------------------------------------


async def throttle_left_s(pool: asyncpg.Pool) -> float:
    return await pool.fetchval(
        "SELECT extract(epoch FROM throttle_until - now())::float8 FROM mailboxes "
        "WHERE tenant_id = $1 AND mailbox_id = $2",
        T,
        M,
    )


async def test_backoff_doubles_to_one_hour_and_one_success_resets_it(pool, inbox) -> None:
    steps = []
    for _ in range(10):
        until = await scheduling.record_failure(pool, T, M, "HTTP 503 from provider")
        state = await row(pool)
        assert state["throttle_until"] == until
        steps.append(state["throttle_backoff_s"])
        assert state["throttle_backoff_s"] - 5 < await throttle_left_s(pool) <= steps[-1]
    assert steps == [30, 60, 120, 240, 480, 960, 1920, 3600, 3600, 3600]
    await scheduling.record_success(pool, T, M)
    state = await row(pool)
    assert (state["throttle_backoff_s"], state["throttle_until"], state["sync_state"]) == (
        0,
        None,
        "idle",
    )
    assert state["last_success_at"] is not None
    assert state["last_error"] == "HTTP 503 from provider"  # kept for the operator
    await scheduling.record_failure(pool, T, M, "again")
    assert (await row(pool))["throttle_backoff_s"] == 30


async def test_retry_after_wins_when_larger(pool, inbox) -> None:
    await scheduling.record_failure(pool, T, M, "429", retry_after_s=600)
    state = await row(pool)
    assert state["throttle_backoff_s"] == 30
    assert 590 < await throttle_left_s(pool) <= 600
    await scheduling.record_success(pool, T, M)
    await scheduling.record_failure(pool, T, M, "429", retry_after_s=5)  # smaller: backoff wins
    assert 25 < await throttle_left_s(pool) <= 30
    # a later, shorter backoff never moves an existing throttle earlier
    await scheduling.record_failure(pool, T, M, "429", retry_after_s=900)
    await scheduling.record_failure(pool, T, M, "503")
    assert 890 < await throttle_left_s(pool) <= 900
    assert (await row(pool))["throttle_backoff_s"] == 120
    with pytest.raises(ValueError, match="retry_after_s"):
        await scheduling.record_failure(pool, T, M, "x", retry_after_s=-1)


async def test_attention_state_and_error_line(pool, inbox) -> None:
    long_error = "invalid_grant:\n  Token has been expired or revoked. " + "x" * 400
    await scheduling.record_failure(pool, T, M, long_error, attention=True)
    state = await row(pool)
    assert state["sync_state"] == "needs_attention"
    assert "\n" not in state["last_error"] and len(state["last_error"]) == 300
    assert state["last_error"].startswith("invalid_grant: Token has been expired")
    assert state["last_error_at"] is not None
    await scheduling.record_failure(pool, T, M, "timeout")  # not attention: state stays
    assert (await row(pool))["sync_state"] == "needs_attention"
    await scheduling.record_failure(pool, T, M, long_error, attention=True)  # still: no new event
    announced = await pool.fetch(
        "SELECT payload FROM events WHERE kind = $1", scheduling.NEEDS_ATTENTION_EVENT
    )
    assert len(announced) == 1  # once, when the mailbox started needing attention
    assert "invalid_grant" in str(announced[0]["payload"])
    assert await scheduling.set_sync_state(pool, T, M, "idle")
    token = await leases.acquire_lease(pool, T, M, "a", LONG_TTL_S)
    assert await scheduling.set_sync_state(pool, T, M, "backfilling", token=token)
    assert (await row(pool))["sync_state"] == "backfilling"
    await scheduling.record_success(pool, T, M)
    assert (await row(pool))["sync_state"] == "idle"


# --- poll scheduling ---------------------------------------------------------------------


async def test_claim_due_rules(pool, make_mailbox) -> None:
    names = ["fresh", "throttled", "leased", "mine", "unlisted"]
    for name in names:
        await make_mailbox(T, name)
    await scheduling.record_failure(pool, T, "throttled", "503")
    assert await leases.acquire_lease(pool, T, "leased", "other", LONG_TTL_S)
    assert await leases.acquire_lease(pool, T, "mine", "me", LONG_TTL_S)
    listed = [(T, n) for n in names if n != "unlisted"] + [(T, "no-such-mailbox")]
    claimed = await scheduling.claim_due(pool, "me", mailboxes=listed, cooldown_s=60, limit=10)
    assert claimed == [(T, "fresh"), (T, "mine")]
    # claimed: neither the cooldown nor the interval (300 s default) has passed
    assert await scheduling.claim_due(pool, "me", mailboxes=listed, cooldown_s=60, limit=10) == []
    assert await scheduling.claim_due(pool, "me", mailboxes=[], cooldown_s=60, limit=10) == []


async def test_claim_due_honours_interval_cooldown_and_recent_success(pool, make_mailbox) -> None:
    await scheduling.upsert_configured_mailboxes(
        pool,
        [
            MailboxRow(T, "fast", "imap", poll_interval_s=0.2),
            MailboxRow(T, "pushed", "gmail", sync_mode="auto", poll_interval_s=0.2),
        ],
    )
    fast, pushed = [(T, "fast")], [(T, "pushed")]
    assert await scheduling.claim_due(pool, "me", mailboxes=fast, cooldown_s=0, limit=1) == fast
    assert await scheduling.claim_due(pool, "me", mailboxes=fast, cooldown_s=0, limit=1) == []
    await wait_for_db(
        pool,
        "SELECT last_polled_at + interval '0.2 s' <= now() FROM mailboxes "
        "WHERE mailbox_id = 'fast'",
    )
    assert await scheduling.claim_due(pool, "me", mailboxes=fast, cooldown_s=60, limit=1) == fast
    await wait_for_db(
        pool,
        "SELECT last_polled_at + interval '0.2 s' <= now() FROM mailboxes "
        "WHERE mailbox_id = 'fast'",
    )
    # interval passed, but the 60 s claim cooldown has not
    assert await scheduling.claim_due(pool, "me", mailboxes=fast, cooldown_s=60, limit=1) == []
    # a sync that just succeeded (push) counts as a poll
    await scheduling.record_success(pool, T, "pushed")
    assert await scheduling.claim_due(pool, "me", mailboxes=pushed, cooldown_s=0, limit=1) == []
    await wait_for_db(
        pool,
        "SELECT last_success_at + interval '0.2 s' <= now() FROM mailboxes "
        "WHERE mailbox_id = 'pushed'",
    )
    assert await scheduling.claim_due(pool, "me", mailboxes=pushed, cooldown_s=0, limit=1) == pushed


async def set_times(pool: asyncpg.Pool, mailbox: str, **ago_s: float | None) -> None:
    """Set timestamp columns to `now() - seconds` (None: NULL), on the database clock."""
    for column, seconds in ago_s.items():
        assert column in ("last_polled_at", "sync_started_at", "last_success_at")
        await pool.execute(
            f"UPDATE mailboxes SET {column} = now() - make_interval(secs => $3) "
            "WHERE tenant_id = $1 AND mailbox_id = $2",
            T,
            mailbox,
            seconds,
        )


async def test_a_poll_is_due_an_interval_after_its_clean_run_started_not_ended(
    pool, make_mailbox
) -> None:
    """Polled 61 s ago with a 60 s interval, a run of 59.5 s that ended a second ago:
    the mailbox was in sync as of the run's start, so it is due now. Counting from the
    end stretched every period by the run's length (issue 25: polls on time 0.89)."""
    names = ["long-clean-run", "run-since-success", "row-before-the-column"]
    await scheduling.upsert_configured_mailboxes(
        pool, [MailboxRow(T, n, "imap", sync_mode="poll", poll_interval_s=60) for n in names]
    )
    await set_times(
        pool, "long-clean-run", last_polled_at=61, sync_started_at=60.5, last_success_at=1
    )
    # a run started after the last success is under way or failed: the success counts
    await set_times(
        pool, "run-since-success", last_polled_at=61, last_success_at=1, sync_started_at=0.5
    )
    await set_times(pool, "row-before-the-column", last_polled_at=61, last_success_at=1)
    await pool.execute(
        "UPDATE mailboxes SET sync_started_at = NULL WHERE mailbox_id = $1", names[2]
    )

    claimed = await scheduling.claim_due(
        pool, "me", mailboxes=[(T, n) for n in names], cooldown_s=5, limit=10
    )

    assert claimed == [(T, "long-clean-run")]


async def test_a_run_begins_in_one_statement_unless_throttled_or_held(pool, inbox) -> None:
    assert await leases.begin_run(pool, T, M, "a", LONG_TTL_S) == leases.RunStart(1, None)
    assert await leases.commit_page(pool, T, M, 1, "h-42") is False  # committed, no cancel
    assert await leases.begin_run(pool, T, M, "b", LONG_TTL_S) == leases.RunStart(None)  # held
    await leases.release_lease(pool, T, M, "a", 1)
    assert await leases.begin_run(pool, T, M, "b", LONG_TTL_S) == leases.RunStart(2, "h-42")
    await leases.release_lease(pool, T, M, "b", 2)
    until = await scheduling.record_failure(pool, T, M, "503")  # throttled ~30 s
    assert until is not None
    throttled = await leases.begin_run(pool, T, M, "b", LONG_TTL_S)
    assert throttled.token is None
    assert throttled.throttled_for_s is not None and 0 < throttled.throttled_for_s <= 30
    assert (await row(pool))["lease_owner"] is None  # not taken while throttled
    # acquire_lease itself does not look at the throttle (the status command's, tests')
    assert await leases.acquire_lease(pool, T, M, "c", LONG_TTL_S) == 3
    with pytest.raises(MailboxNotFound):
        await leases.begin_run(pool, T, "no-such-mailbox", "b", LONG_TTL_S)


async def test_a_page_commits_its_cursor_and_takes_the_cancel_flag_in_one_statement(
    pool, inbox
) -> None:
    token = await leases.acquire_lease(pool, T, M, "a", LONG_TTL_S)
    assert token is not None
    assert await leases.commit_page(pool, T, M, token, "c1") is False
    assert await leases.read_cursor(pool, T, M) == "c1"
    assert await leases.cancel_running_sync(pool, T, M)
    assert await leases.commit_page(pool, T, M, token, None) is True  # no cursor: kept
    assert await leases.read_cursor(pool, T, M) == "c1"
    assert not await leases.cancel_requested(pool, T, M)  # taken: cleared
    assert await leases.commit_page(pool, T, M, token - 1, "stale") is None  # fenced
    assert await leases.read_cursor(pool, T, M) == "c1"
    with pytest.raises(ValueError):
        await leases.commit_page(pool, T, M, token, "")


async def test_a_clean_run_ends_recorded_and_released_in_one_statement(pool, inbox) -> None:
    await scheduling.record_failure(pool, T, M, "503")
    await pool.execute("UPDATE mailboxes SET throttle_until = now() WHERE tenant_id = $1", T)
    token = await leases.acquire_lease(pool, T, M, "a", LONG_TTL_S)
    assert token is not None
    assert not await leases.finish_run(pool, T, M, "b", token)  # not b's lease
    assert (await row(pool))["last_success_at"] is None
    assert await leases.finish_run(pool, T, M, "a", token)
    after = await row(pool)
    assert after["lease_owner"] is None and after["last_success_at"] is not None
    assert (after["throttle_backoff_s"], after["throttle_until"]) == (0, None)
    assert not await leases.finish_run(pool, T, M, "a", token)  # released already


async def test_acquiring_the_lease_marks_the_run_start(pool, inbox) -> None:
    assert (await row(pool))["sync_started_at"] is None
    assert await leases.acquire_lease(pool, T, M, "a", LONG_TTL_S) is not None
    first = (await row(pool))["sync_started_at"]
    assert first is not None
    assert await leases.acquire_lease(pool, T, M, "b", LONG_TTL_S) is None  # not taken: kept
    assert (await row(pool))["sync_started_at"] == first
    assert await leases.acquire_lease(pool, T, M, "a", LONG_TTL_S) is not None
    assert (await row(pool))["sync_started_at"] > first


async def test_a_run_answering_a_claim_counts_from_the_claim(pool, make_mailbox) -> None:
    """A claimed run that waited 5 s for a turn: the mailbox is due an interval after
    the claim, not after the run's start (at 10,000 mailboxes the wait for a turn
    stretched every period by 5 s on average: polls on time 0.92)."""
    await scheduling.upsert_configured_mailboxes(
        pool, [MailboxRow(T, n, "imap", sync_mode="poll", poll_interval_s=60) for n in "ab"]
    )
    for name, from_claim in (("a", True), ("b", False)):
        await set_times(pool, name, last_polled_at=5)  # claimed 5 s ago
        start = await leases.begin_run(pool, T, name, "me", LONG_TTL_S, from_claim=from_claim)
        assert start.token is not None
        assert await leases.finish_run(pool, T, name, "me", start.token)
    started = {
        r["mailbox_id"]: r["from_claim"]
        for r in await pool.fetch(
            "SELECT mailbox_id, sync_started_at = last_polled_at AS from_claim FROM mailboxes"
        )
    }
    assert started == {"a": True, "b": False}
    # a falls due 55 s from now, b 60: with 57.5 s ahead, only a is claimed
    claimed = await scheduling.claim_due(
        pool, "me", mailboxes=[(T, "a"), (T, "b")], cooldown_s=1, limit=10, ahead_s=57.5
    )
    assert claimed == [(T, "a")]


async def test_a_mailbox_falling_due_before_the_next_pass_is_claimed_now(
    pool, make_mailbox
) -> None:
    """With `ahead_s` (half the scan period), a poll falls in the pass nearest to its
    due time: otherwise every poll was late by up to a whole period."""
    await scheduling.upsert_configured_mailboxes(
        pool,
        [
            MailboxRow(T, n, "imap", sync_mode="poll", poll_interval_s=60)
            for n in ("due-in-2s", "due-in-10s")
        ],
    )
    await set_times(pool, "due-in-2s", last_polled_at=58)
    await set_times(pool, "due-in-10s", last_polled_at=50)
    both = [(T, "due-in-2s"), (T, "due-in-10s")]

    assert await scheduling.claim_due(pool, "me", mailboxes=both, cooldown_s=5, limit=10) == []
    claimed = await scheduling.claim_due(
        pool, "me", mailboxes=both, cooldown_s=5, limit=10, ahead_s=2.5
    )
    assert claimed == [(T, "due-in-2s")]
    with pytest.raises(ValueError, match="ahead_s"):
        await scheduling.claim_due(pool, "me", mailboxes=both, cooldown_s=5, limit=1, ahead_s=-1)


async def test_an_auto_mailbox_is_polled_only_once_its_pushes_are_quiet(
    pool, db_dsn, make_mailbox
) -> None:
    await scheduling.upsert_configured_mailboxes(
        pool,
        [
            MailboxRow(T, "auto", "gmail", sync_mode="auto", poll_interval_s=0.01),
            MailboxRow(T, "poll", "imap", sync_mode="poll", poll_interval_s=0.01),
        ],
    )
    listener = await asyncpg.connect(db_dsn)
    rung: list[str] = []
    await listener.add_listener(DOORBELL_CHANNEL, lambda *a: rung.append(a[-1]))
    try:
        async with pool.acquire() as conn:
            assert await scheduling.record_push(conn, T, "auto", hint="4242")
            assert await scheduling.record_push(conn, T, "poll", hint=None)
            assert not await scheduling.record_push(conn, T, "missing")
        await eventually(
            lambda: len(rung), NOTIFY_DEADLINE_S, what="two rings", until=lambda n: n == 2
        )
        assert {parse_doorbell(p) for p in rung} == {(T, "auto"), (T, "poll")}
        assert (
            await pool.fetchval("SELECT push_hint FROM mailboxes WHERE mailbox_id = 'auto'")
            == "4242"
        )
        both = [(T, "auto"), (T, "poll")]
        # pushes arrived just now: the auto mailbox is not polled, the poll one is
        claimed = await scheduling.claim_due(
            pool, "me", mailboxes=both, cooldown_s=0, limit=5, push_quiet_after_s=60
        )
        assert claimed == [(T, "poll")]
        # once push has been quiet long enough, auto falls back to polling
        await wait_for_db(
            pool,
            "SELECT last_push_at + interval '0.2 s' <= now() FROM mailboxes "
            "WHERE mailbox_id = 'auto'",
        )
        claimed = await scheduling.claim_due(
            pool, "me", mailboxes=both, cooldown_s=0, limit=5, push_quiet_after_s=0.2
        )
        assert (T, "auto") in claimed
    finally:
        await listener.close()


async def test_a_push_mailbox_gets_only_a_daily_safety_sync(pool, make_mailbox) -> None:
    await scheduling.upsert_configured_mailboxes(
        pool, [MailboxRow(T, "push", "gmail", sync_mode="push", poll_interval_s=0.01)]
    )
    pushed = [(T, "push")]
    # never synced: due at once (the first sync)
    assert await scheduling.claim_due(pool, "me", mailboxes=pushed, cooldown_s=0, limit=1) == pushed
    # synced an hour ago: not due, whatever its poll interval says
    await pool.execute(
        "UPDATE mailboxes SET last_polled_at = now() - interval '1 hour', "
        "last_success_at = now() - interval '1 hour'"
    )
    assert await scheduling.claim_due(pool, "me", mailboxes=pushed, cooldown_s=0, limit=1) == []
    # a day without any sync: the safety sync is due (and renews a Gmail watch)
    await pool.execute(
        "UPDATE mailboxes SET last_polled_at = now() - interval '25 hours', "
        "last_success_at = now() - interval '25 hours'"
    )
    assert await scheduling.claim_due(pool, "me", mailboxes=pushed, cooldown_s=0, limit=1) == pushed


async def test_claim_due_limit_takes_most_overdue_first(pool, make_mailbox) -> None:
    for name in ("a", "b", "c"):
        await make_mailbox(T, name)
    every = [(T, "a"), (T, "b"), (T, "c")]
    await pool.execute(
        "UPDATE mailboxes SET last_polled_at = now() - interval '1 hour' WHERE mailbox_id = 'a'"
    )
    # b and c were never polled: they come first, in key order
    assert await scheduling.claim_due(pool, "me", mailboxes=every, cooldown_s=60, limit=2) == [
        (T, "b"),
        (T, "c"),
    ]
    assert await scheduling.claim_due(pool, "me", mailboxes=every, cooldown_s=60, limit=2) == [
        (T, "a")
    ]


async def test_claim_due_limit_serves_every_tenant_before_a_backlog(pool) -> None:
    # "big" has 50 mailboxes long overdue; "small" has one that only just became due.
    # Most-overdue-first alone would spend a limit of 10 on "big" alone.
    rows = [MailboxRow("big", f"mb-{i:02d}", "imap") for i in range(50)]
    rows.append(MailboxRow("small", "only", "imap"))
    await scheduling.upsert_configured_mailboxes(pool, rows)
    await pool.execute(
        "UPDATE mailboxes SET last_polled_at = now() - interval '1 day' WHERE tenant_id = 'big'"
    )
    await pool.execute(
        "UPDATE mailboxes SET last_polled_at = now() - interval '301 seconds'"
        " WHERE tenant_id = 'small'"
    )
    every = [(r.tenant_id, r.mailbox_id) for r in rows]
    claimed = await scheduling.claim_due(pool, "me", mailboxes=every, cooldown_s=60, limit=10)
    assert ("small", "only") in claimed
    assert len(claimed) == 10


async def test_concurrent_scanners_never_claim_one_mailbox_twice(
    pool, db_dsn, make_mailbox
) -> None:
    rows = [MailboxRow(t, f"mb-{i:03d}", "imap") for t in ("acme", "globex") for i in range(60)]
    await scheduling.upsert_configured_mailboxes(pool, rows)
    every = [(r.tenant_id, r.mailbox_id) for r in rows]
    claims: dict[str, list[tuple[str, str]]] = {"s1": [], "s2": []}
    go = anyio.Event()

    async def scanner(name: str) -> None:
        conn = await asyncpg.connect(db_dsn)
        try:
            await go.wait()
            while got := await scheduling.claim_due(
                conn, name, mailboxes=every, cooldown_s=60, limit=7
            ):
                claims[name].extend(got)
        finally:
            await conn.close()

    with anyio.fail_after(DB_WAIT_DEADLINE_S * 3):
        async with anyio.create_task_group() as tg:
            tg.start_soon(scanner, "s1")
            tg.start_soon(scanner, "s2")
            go.set()
    together = claims["s1"] + claims["s2"]
    assert len(together) == len(set(together))  # never the same mailbox twice
    assert sorted(together) == sorted(every)  # and every due mailbox claimed once


# --- configuration and status ------------------------------------------------------------


async def test_upsert_configured_mailboxes_keeps_sync_state(pool) -> None:
    rows = [
        MailboxRow("acme", "support", "gmail", "support@acme.test", "push", 120),
        MailboxRow("globex", "inbox", "imap", "in@globex.test", "poll", 60),
    ]
    assert await scheduling.upsert_configured_mailboxes(pool, rows) == 2
    token = await leases.acquire_lease(pool, "acme", "support", "a", LONG_TTL_S)
    assert await leases.commit_cursor(pool, "acme", "support", token, "h-1")
    await scheduling.record_failure(pool, "acme", "support", "503")
    assert await scheduling.upsert_configured_mailboxes(pool, rows) == 0  # unchanged: no writes
    changed = [MailboxRow("acme", "support", "gmail", "help@acme.test", "auto", 30)]
    assert await scheduling.upsert_configured_mailboxes(pool, changed) == 1
    state = await row(pool, "acme", "support")
    assert (state["address"], state["sync_mode"], state["poll_interval_s"]) == (
        "help@acme.test",
        "auto",
        30.0,
    )
    assert (state["cursor"], state["lease_owner"], state["lease_token"]) == ("h-1", "a", token)
    assert state["throttle_backoff_s"] == 30
    assert await pool.fetchval("SELECT count(*) FROM tenants") == 2
    with pytest.raises(ValueError, match="twice"):
        await scheduling.upsert_configured_mailboxes(pool, rows + rows[:1])
    with pytest.raises(ValueError, match="sync_mode"):
        MailboxRow("acme", "x", "imap", sync_mode="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="poll_interval_s"):
        MailboxRow("acme", "x", "imap", poll_interval_s=0)
    with pytest.raises(ValueError, match="invalid mailbox id"):
        MailboxRow("acme", "Bad Id", "imap")


async def test_mailbox_status(pool, make_mailbox) -> None:
    await make_mailbox("acme", "support", provider="gmail")
    await make_mailbox("globex", "inbox", provider="imap")
    token = await leases.acquire_lease(pool, "acme", "support", "host:1", LONG_TTL_S)
    assert await leases.commit_cursor(pool, "acme", "support", token, "h-77")
    await scheduling.record_success(pool, "acme", "support")
    await scheduling.record_failure(pool, "globex", "inbox", "auth failed", attention=True)
    every = await mailbox_status.mailbox_status(pool)
    assert [(s.tenant_id, s.mailbox_id) for s in every] == [
        ("acme", "support"),
        ("globex", "inbox"),
    ]
    support, inbox = every
    assert (support.provider, support.sync_mode, support.cursor) == ("gmail", "auto", "h-77")
    assert support.lag_s is not None and 0 <= support.lag_s < 60
    assert (support.leased, support.lease_owner, support.throttled) == (True, "host:1", False)
    assert (inbox.lag_s, inbox.last_success_at, inbox.cursor) == (None, None, None)
    assert (inbox.throttled, inbox.sync_state, inbox.last_error) == (
        True,
        "needs_attention",
        "auth failed",
    )
    only = await mailbox_status.mailbox_status(pool, "globex")
    assert [s.mailbox_id for s in only] == ["inbox"]
    assert await mailbox_status.mailbox_status(pool, "acme", mailbox_id="inbox") == []
    assert await mailbox_status.tenants_of_mailbox(pool, "inbox") == ["globex"]


# --- doorbell ----------------------------------------------------------------------------


async def test_doorbell_ring_and_parse(pool, db_dsn) -> None:
    got: list[str] = []
    arrived = anyio.Event()

    def on_notify(_conn: object, _pid: int, _channel: str, payload: str) -> None:
        got.append(payload)
        arrived.set()

    listener = await asyncpg.connect(db_dsn)
    try:
        await listener.add_listener(DOORBELL_CHANNEL, on_notify)
        await ring(pool, "acme", "support")
        with anyio.fail_after(NOTIFY_DEADLINE_S):
            await arrived.wait()
    finally:
        await listener.close()
    assert parse_doorbell(got[0]) == ("acme", "support")
    for junk in (
        "",
        "not json",
        "[]",
        '{"tenant": "acme"}',
        '{"tenant": 1, "mailbox": "x"}',
        '{"tenant": "ACME!", "mailbox": "x"}',
    ):
        assert parse_doorbell(junk) is None
    with pytest.raises(ValueError):
        await ring(pool, "acme", "Bad Id")


async def test_reset_cursor_to_a_partial_restart_keeps_what_did_not_expire(pool, inbox) -> None:
    token = await leases.acquire_lease(pool, T, M, "a", LONG_TTL_S)
    assert await leases.commit_cursor(pool, T, M, token, '{"inbox": "d1", "sentitems": "d2"}')
    restart = '{"sentitems": "d2"}'  # inbox's delta link expired; sentitems' did not
    assert await leases.reset_cursor(pool, T, M, token, "inbox: 410", restart_from=restart)
    assert (await row(pool))["cursor"] == restart
    kinds = await pool.fetch("SELECT kind FROM events")
    assert [k["kind"] for k in kinds] == ["mailbox.cursor_reset"]
