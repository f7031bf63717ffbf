"""Sync turns (daemon/sync/turns.py): at most `[sync] max_syncs_at_once` runs at work,
first come first served, a long run passing its turn on when others wait."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from helpers import eventually

from inboxd.daemon.config.main import ConfigError, load_main
from inboxd.daemon.sync import turns as turns_module
from inboxd.daemon.sync.turns import DEFAULT_SYNCS_AT_ONCE, SyncTurns

DEADLINE_S = 10.0


async def test_no_more_than_the_limit_work_and_the_rest_wait_in_order() -> None:
    turns = SyncTurns(2)
    started: list[int] = []
    release = anyio.Event()

    async def run(i: int) -> None:
        async with turns.turn():
            started.append(i)
            await release.wait()

    async with anyio.create_task_group() as tg:
        for i in range(5):
            tg.start_soon(run, i)
            await eventually(
                lambda n=i + 1: len(started) + turns.waiting == n, DEADLINE_S, what="in line"
            )
        assert (turns.working, turns.waiting) == (2, 3)
        assert started == [0, 1]
        release.set()
    assert started == [0, 1, 2, 3, 4]  # the line is first come, first served
    assert (turns.working, turns.waiting) == (0, 0)


async def test_a_long_run_goes_on_in_a_long_turn_and_frees_its_turn_for_polls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One ordinary turn, held by a backfill: past LONG_RUN_S, at its next committed
    page, the backfill moves to a long turn and a poll waiting in line gets the
    ordinary one while the backfill goes on."""
    monkeypatch.setattr(turns_module, "LONG_RUN_S", 0.0)  # every run is long at once
    turns = SyncTurns(1)
    assert turns.long_limit == 1
    polled = anyio.Event()

    async def poll() -> None:
        async with turns.turn():
            polled.set()

    async with turns.turn() as backfill, anyio.create_task_group() as tg:
        tg.start_soon(poll)
        await eventually(lambda: turns.waiting == 1, DEADLINE_S, what="the poll waits")
        assert await backfill.at_page_end()
        assert backfill.long and (turns.working_long, turns.waiting_long) == (1, 0)
        with anyio.fail_after(DEADLINE_S):
            await polled.wait()  # the poll ran while the backfill holds its long turn
        assert not await backfill.at_page_end()  # once long, it stays where it is
    assert (turns.working, turns.working_long) == (0, 0)


async def test_long_runs_wait_in_a_line_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """More long runs than long turns: the second waits for the first's long turn,
    not behind every fresh run in the ordinary line, and holds no ordinary turn."""
    monkeypatch.setattr(turns_module, "LONG_RUN_S", 0.0)
    turns = SyncTurns(2)  # one long turn
    first_done = anyio.Event()
    order: list[str] = []

    async def long_run(name: str, done: anyio.Event | None) -> None:
        async with turns.turn() as turn:
            await turn.at_page_end()
            order.append(name)
            if done is not None:
                await done.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(long_run, "first", first_done)
        await eventually(lambda: turns.working_long == 1, DEADLINE_S, what="first long")
        tg.start_soon(long_run, "second", None)
        await eventually(lambda: turns.waiting_long == 1, DEADLINE_S, what="second waits")
        assert turns.working == 0  # waiting for a long turn, it holds no ordinary one
        first_done.set()
    assert order == ["first", "second"]


async def test_a_young_run_keeps_its_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(turns_module, "LONG_RUN_S", 3600.0)
    turns = SyncTurns(1)
    async with turns.turn() as turn:
        assert not await turn.at_page_end()
        assert not turn.long and turns.working == 1


async def test_cancelled_while_waiting_for_a_long_turn_a_run_holds_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stop (SIGTERM, a reload) while a run waits for a long turn: it gives back
    nothing it does not hold, and every turn is free afterwards."""
    monkeypatch.setattr(turns_module, "LONG_RUN_S", 0.0)
    turns = SyncTurns(2)  # one long turn
    let_go = anyio.Event()

    async def holder() -> None:
        async with turns.turn() as turn:
            await turn.at_page_end()
            await let_go.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(holder)
        await eventually(lambda: turns.working_long == 1, DEADLINE_S, what="long turn taken")
        with anyio.CancelScope() as waiting:
            async with turns.turn() as turn:
                tg.start_soon(_cancel_when, waiting, lambda: turns.waiting_long == 1)
                await turn.at_page_end()
        assert waiting.cancelled_caught
        assert (turns.working, turns.working_long) == (0, 1)  # the holder's only
        let_go.set()
    assert (turns.working, turns.working_long, turns.waiting, turns.waiting_long) == (0, 0, 0, 0)


async def _cancel_when(scope: anyio.CancelScope, condition) -> None:
    await eventually(condition, DEADLINE_S, what="waiting in line")
    scope.cancel()


def test_the_setting_and_its_default(tmp_path: Path) -> None:
    config = tmp_path / "inboxd.toml"
    config.write_text("[sync]\nmax_syncs_at_once = 8\n")
    (tmp_path / "tenants").mkdir()
    assert load_main(config).max_syncs_at_once == 8
    config.write_text("")
    assert load_main(config).max_syncs_at_once == DEFAULT_SYNCS_AT_ONCE
    config.write_text("[sync]\nmax_syncs_at_once = 0\n")
    with pytest.raises(ConfigError, match="max_syncs_at_once"):
        load_main(config)
    with pytest.raises(ValueError, match="at least 1"):
        SyncTurns(0)
