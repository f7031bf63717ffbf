"""The process's bound on IMAP IDLE connections (`[sync] max_imap_idle`), against
Dovecot: a mailbox past the bound polls at its interval and takes the slot another
mailbox frees."""

from __future__ import annotations

import anyio
from helpers.dovecot import DovecotServer
from helpers.secrets import PlainSecret
from helpers.waiting import eventually

from inboxd.adapters.imap.config import ImapMailbox
from inboxd.adapters.imap.idle_slots import IdleSlots
from inboxd.adapters.imap.source import ImapSource

POLL_INTERVAL_S = 0.2
DEADLINE_S = 30


def _source(dovecot: DovecotServer, name: str, slots: IdleSlots) -> ImapSource:
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
    return ImapSource("acme", name, mailbox, idle_slots=slots, poll_interval_s=POLL_INTERVAL_S)


async def test_a_mailbox_past_the_bound_polls_until_a_slot_frees(dovecot: DovecotServer) -> None:
    slots = IdleSlots(1)
    first, second = _source(dovecot, "first", slots), _source(dovecot, "second", slots)
    first_rings: list[float] = []
    second_rings: list[float] = []
    async with anyio.create_task_group() as tg:
        first_scope = anyio.CancelScope()

        async def first_watch() -> None:
            with first_scope:
                await first.watch(lambda: first_rings.append(anyio.current_time()))

        tg.start_soon(first_watch)
        # IDLE rings once on connecting (whatever arrived while not listening)
        await eventually(lambda: len(first_rings), DEADLINE_S, what="the first IDLE")
        assert slots.held == 1
        tg.start_soon(second.watch, lambda: second_rings.append(anyio.current_time()))
        # past the bound: a ring per poll interval, no slot taken
        await eventually(lambda: len(second_rings) >= 3, DEADLINE_S, what="polls")
        assert slots.held == 1
        first_scope.cancel()  # the first mailbox leaves: its slot frees...
        await eventually(lambda: slots.held == 0, DEADLINE_S, what="the slot given back")
        # ...and the second takes it at its next poll, to listen with IDLE
        await eventually(lambda: slots.held == 1, DEADLINE_S, what="the slot taken again")
        taken_at = len(second_rings)
        # no more polls: the next ring is IDLE's own, once it listens
        await eventually(lambda: len(second_rings) > taken_at, DEADLINE_S, what="the IDLE")
        tg.cancel_scope.cancel()
    assert slots.held == 0  # every slot given back when the watches end
