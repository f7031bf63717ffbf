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


async def test_a_long_run_passes_its_turn_on_only_when_others_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(turns_module, "TURN_S", 0.0)  # every run is "long"
    turns = SyncTurns(1)
    order: list[str] = []

    async def short_run() -> None:
        async with turns.turn():
            order.append("short")

    async with turns.turn() as long_turn:
        assert not await long_turn.pass_on_if_due()  # nobody waits: keep it
        async with anyio.create_task_group() as tg:
            tg.start_soon(short_run)
            await eventually(lambda: turns.waiting == 1, DEADLINE_S, what="one waits")
            assert await long_turn.pass_on_if_due()  # the short run goes first
            order.append("long again")
        assert turns.working == 1
    assert order == ["short", "long again"]
    assert turns.working == 0


async def test_a_run_that_held_its_turn_briefly_keeps_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(turns_module, "TURN_S", 3600.0)
    turns = SyncTurns(1)
    async with turns.turn() as turn, anyio.create_task_group() as tg:
        tg.start_soon(_wait_for_a_turn, turns)
        await eventually(lambda: turns.waiting == 1, DEADLINE_S, what="one waits")
        assert not await turn.pass_on_if_due()
        tg.cancel_scope.cancel()


async def _wait_for_a_turn(turns: SyncTurns) -> None:
    async with turns.turn():
        pass


async def test_cancelled_while_waiting_again_a_run_holds_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stop (SIGTERM, a reload) while a run waits in line after passing its turn on:
    the turn it no longer holds is not given back twice."""
    monkeypatch.setattr(turns_module, "TURN_S", 0.0)
    turns = SyncTurns(1)
    other_holds = anyio.Event()
    let_go = anyio.Event()

    async def other() -> None:
        async with turns.turn():
            other_holds.set()
            await let_go.wait()

    async with anyio.create_task_group() as tg:
        with anyio.CancelScope() as waiting_again:
            async with turns.turn() as turn:
                tg.start_soon(other)
                await eventually(lambda: turns.waiting == 1, DEADLINE_S, what="one waits")

                async def cancel_once_other_holds() -> None:
                    await other_holds.wait()
                    waiting_again.cancel()

                tg.start_soon(cancel_once_other_holds)
                await turn.pass_on_if_due()  # waits in line behind `other`: cancelled
        assert waiting_again.cancelled_caught
        assert turns.working == 1  # `other` only
        let_go.set()
    assert (turns.working, turns.waiting) == (0, 0)
    async with turns.turn():  # the limiter is whole again
        assert turns.working == 1


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
