"""The Outlook door under `inboxd run`: mail that arrives while the cursor is stale.

Issue 22, item 3 and the "every door, every backfill setting" property: the daemon
is stopped (or runs, but Graph's notifications are lost), mail arrives, Graph
forgets every delta state of the mailbox (410 resyncRequired on the stored
deltaLinks), and the daemon starts again (or is asked to sync). For each
`backfill` value the door accepts, the mail that came meanwhile is stored after
the reset, exactly once, with no body downloaded twice and nothing dead-lettered.
With `backfill = "none"` the fresh round used to filter `receivedDateTime ge <the
reset>` and lost it.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from harness import generated_messages
from helpers import eventually
from outlook_rig import OPS, Box, equals, outlook_daemon, state_is

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.slow,
    pytest.mark.own_database,  # daemon subprocesses (tests/conftest.py)
]

#: Graph's $filter takes whole seconds: the stale mail is received at least this
#: long before the daemon starts again, so "ge <the reset>" would leave it out.
FILTER_GRANULARITY_S = 1.0


@pytest.mark.parametrize("stale", ["daemon_down", "pushes_lost"])
@pytest.mark.parametrize("backfill", ["none", 30, "all"])
async def test_mail_that_arrived_while_the_cursor_was_stale_is_stored_after_the_reset(
    tmp_path, db_dsn, backfill, stale
) -> None:
    boxes = [Box("ops", OPS, backfill=backfill)]
    async with outlook_daemon(tmp_path, db_dsn, {}, boxes) as run:
        box = run.fake.mailbox(OPS)
        live = [
            box.add_message(raw, received=datetime.now(UTC))
            for raw in generated_messages(2, tag="live")
        ]
        assert await run.fake.notify(OPS, "inbox") == [202]
        await run.eventually(lambda: equals(run.rows("ops"), 2), "the live mail")
        await run.eventually(run.idle, "the runs ended")
        cursor_before = await run.cursor("ops")
        stale: list = []

        async def while_down() -> None:
            arrived = datetime.now(UTC)
            for raw in generated_messages(3, tag="stale"):
                stale.append(box.add_message(raw, received=arrived))
            sent = box.add_message(
                generated_messages(1, tag="stale-sent")[0], folder="sentitems", received=arrived
            )
            stale.append(sent)
            box.expire_delta_tokens()  # every stored nextLink/deltaLink answers 410 now
            later = arrived + timedelta(seconds=FILTER_GRANULARITY_S + 0.1)
            await eventually(lambda: datetime.now(UTC) > later, 10, what="a second passed")

        if stale == "daemon_down":
            await run.restart(while_down)
        else:  # the daemon runs, Graph's notifications never came: an operator's sync
            await while_down()
            await run.sync_now("ops")
        await run.eventually(
            lambda: equals(run.events_count("mailbox.cursor_reset", "ops"), 2),
            "both folders reset",
        )
        await run.eventually(lambda: equals(run.rows("ops"), 6), "the stale mail stored")
        await run.eventually(run.idle, "the runs ended")
        for message in [*live, *stale]:
            assert await run.has_copy("ops", message.immutable_id)
        assert await run.rows("ops") == 6
        assert await run.fetchval("SELECT count(*) FROM messages") == 6
        assert await run.fetchval("SELECT count(*) FROM dead_items") == 0
        assert run.fake.counters.max_downloads() == 1  # nothing downloaded twice
        assert await run.cursor("ops") != cursor_before
        assert await state_is(run, "ops", "idle")
        # new mail to the application, not history: one message.created event each
        created = await run.fetchval(
            "SELECT count(*) FROM events e JOIN message_copies c"
            " ON c.tenant_id = e.tenant_id AND c.message_id = e.message_id"
            " WHERE e.kind = 'message.created' AND c.external_id = ANY($1::text[])",
            [m.immutable_id for m in stale],
        )
        assert created == len(stale)

        # the reset round's state goes on: later mail comes by delta again
        newer = box.add_message(generated_messages(1, tag="after")[0], received=datetime.now(UTC))
        assert await run.fake.notify(OPS, "inbox") == [202]
        await run.eventually(lambda: run.has_copy("ops", newer.immutable_id), "later mail")
        assert run.fake.counters.max_downloads() == 1
