"""The lease keeper (daemon/sync/lease_keeper.py): every lease of the process renewed
on a connection of its own, a lost one reported to its run, on a real server.

Waits are on database conditions with a deadline, never on a guessed sleep.
"""

from __future__ import annotations

from functools import partial

import anyio
import asyncpg
from helpers import eventually

from inboxd.daemon.sync.lease_keeper import LeaseKeeper
from inboxd.pipeline.mailbox import leases

T = "acme"
OWNER = "keeper-test"
# Renewals every 0.2 s: a test sees several within its deadline.
TTL_S = 0.6
DEADLINE_S = 20.0
RECONNECT_TTL_S = 9.0


async def expires_at(pool: asyncpg.Pool | asyncpg.Connection, mailbox: str) -> object:
    return await pool.fetchval(
        "SELECT lease_expires_at FROM mailboxes WHERE tenant_id = $1 AND mailbox_id = $2",
        T,
        mailbox,
    )


async def renewed_past(
    pool: asyncpg.Pool | asyncpg.Connection, mailbox: str, moment: object
) -> bool:
    """The lease is still ours and its expiry moved past `moment` (database clock)."""
    return bool(
        await pool.fetchval(
            "SELECT lease_owner = $3 AND lease_expires_at > $4 AND lease_expires_at > now() "
            "FROM mailboxes WHERE tenant_id = $1 AND mailbox_id = $2",
            T,
            mailbox,
            OWNER,
            moment,
        )
    )


async def test_a_lost_lease_cancels_its_run_and_a_held_one_is_renewed(pool, db_dsn, make_mailbox):
    for mailbox in ("kept", "taken", "ended"):
        await make_mailbox(T, mailbox)
    keeper = LeaseKeeper(db_dsn, OWNER, TTL_S)
    tokens = {m: await leases.acquire_lease(pool, T, m, OWNER, TTL_S) for m in ("kept", "taken")}
    lost: list[str] = []
    first_expiry = await expires_at(pool, "kept")

    async with anyio.create_task_group() as tg:
        await tg.start(keeper.run)
        with (
            keeper.holding((T, "kept"), tokens["kept"], lambda: lost.append("kept")),
            keeper.holding((T, "taken"), tokens["taken"], lambda: lost.append("taken")),
        ):
            # a run that ended (left its block) is not reported, whatever the database says
            with keeper.holding((T, "ended"), 99, lambda: lost.append("ended")):
                pass
            # another replica takes "taken" over: its token moves on
            await pool.execute(
                "UPDATE mailboxes SET lease_owner = 'other', lease_token = lease_token + 1 "
                "WHERE tenant_id = $1 AND mailbox_id = 'taken'",
                T,
            )
            await eventually(lambda: lost == ["taken"], DEADLINE_S, what="the lost lease reported")
            # "kept" outlives several TTLs while it is held
            await eventually(
                lambda: renewed_past(pool, "kept", first_expiry), DEADLINE_S, what="renewal"
            )
            third_expiry = await expires_at(pool, "kept")
            await eventually(
                lambda: renewed_past(pool, "kept", third_expiry), DEADLINE_S, what="renewal"
            )
        tg.cancel_scope.cancel()
    assert lost == ["taken"]  # reported once, and nothing else


async def test_renewals_do_not_wait_for_the_pool(db_dsn, make_mailbox):
    """Every connection of the daemon's pool busy (thousands of syncs at start): the
    leases are renewed all the same — a renewal that queued there let them expire and
    another replica take them (issue 25)."""
    await make_mailbox(T, "busy")
    keeper = LeaseKeeper(db_dsn, OWNER, TTL_S)
    pool = await asyncpg.create_pool(db_dsn, min_size=1, max_size=1)
    observer = await asyncpg.connect(db_dsn)
    try:
        token = await leases.acquire_lease(pool, T, "busy", OWNER, TTL_S)
        assert token is not None
        first_expiry = await expires_at(pool, "busy")
        async with pool.acquire(), anyio.create_task_group() as tg:  # the pool is exhausted
            await tg.start(keeper.run)
            with keeper.holding((T, "busy"), token, lambda: None):
                for _ in range(3):  # three renewals: more than a TTL went by
                    await eventually(
                        partial(renewed_past, observer, "busy", first_expiry),
                        DEADLINE_S,
                        what="renewal with the pool exhausted",
                    )
                    first_expiry = await expires_at(observer, "busy")
            tg.cancel_scope.cancel()
    finally:
        await observer.close()
        await pool.close()


# What pg_stat_activity shows for the keeper's backend once it renewed (its last query).
KEEPER_QUERY = "%unnest($2::text[], $3::text[], $4::bigint[])%"


async def test_the_keeper_reconnects_after_losing_its_connection(pool, db_dsn, make_mailbox):
    """A failover, a restarted server, an idle-connection killer: the keeper's own
    connection is gone, and the next renewals come through a new one."""
    await make_mailbox(T, "inbox")
    # long enough to outlive the reconnect pause (KEEPER_RECONNECT_S) and a tick
    keeper = LeaseKeeper(db_dsn, OWNER, RECONNECT_TTL_S)
    token = await leases.acquire_lease(pool, T, "inbox", OWNER, 30.0)
    assert token is not None

    async def keeper_backends() -> list[int]:
        rows = await pool.fetch(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND query LIKE $1",
            KEEPER_QUERY,
        )
        return [r["pid"] for r in rows]

    async with anyio.create_task_group() as tg:
        await tg.start(keeper.run)
        with keeper.holding((T, "inbox"), token, lambda: None):

            async def the_keeper_backend() -> int | None:
                pids = await keeper_backends()  # one: its connection renewed once
                return pids[0] if len(pids) == 1 else None

            old_pid = await eventually(
                the_keeper_backend, DEADLINE_S, what="the keeper's first renewal"
            )
            assert await pool.fetchval("SELECT pg_terminate_backend($1)", old_pid)
            moment = await expires_at(pool, "inbox")
            await eventually(
                lambda: renewed_past(pool, "inbox", moment), DEADLINE_S, what="renewal again"
            )
            assert old_pid not in await keeper_backends()
        tg.cancel_scope.cancel()
