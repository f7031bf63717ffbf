"""QuotaPacer: units spent, waits and their order, on a clock the test moves.

The pacer's clock and sleep are injected: `sleep(s)` moves the manual clock by
`s` and yields, so the assertions are about units, order and clock readings,
never about how long the test took.
"""

from __future__ import annotations

import random

import anyio
import anyio.lowlevel
import pytest

from inboxd.adapters.gmail.client import GMAIL_BATCH_SIZE
from inboxd.adapters.gmail.pacer import (
    BATCH_UNITS_PER_CALL,
    DEFAULT_BURST_UNITS,
    GMAIL_USER_UNITS_PER_S,
    WATCH_UNITS,
    QuotaPacer,
)


class ManualTime:
    """A clock that moves only when the pacer sleeps; records every sleep."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        await anyio.lowlevel.checkpoint()


def pacer_on(time: ManualTime, units_per_s: float = 100.0, burst: float = 50.0) -> QuotaPacer:
    return QuotaPacer(units_per_s, burst, clock=time, sleep=time.sleep)


def test_defaults_hold_the_largest_spend() -> None:
    pacer = QuotaPacer()
    assert pacer.units_per_s == GMAIL_USER_UNITS_PER_S == 250
    # A full batch and a watch must each fit in one burst, else they could never go.
    assert DEFAULT_BURST_UNITS >= max(GMAIL_BATCH_SIZE * BATCH_UNITS_PER_CALL, WATCH_UNITS)
    # ... and leave headroom under Gmail's one-second bucket (pacer module docstring).
    assert DEFAULT_BURST_UNITS < GMAIL_USER_UNITS_PER_S


async def test_burst_goes_at_once_then_waits_for_refill() -> None:
    time = ManualTime()
    pacer = pacer_on(time)
    await pacer.spend(50)
    assert time.now == 0 and time.sleeps == []
    await pacer.spend(20)  # empty bucket: 20 units at 100/s
    assert time.now == pytest.approx(0.2)
    assert pacer.spent_units == 70


async def test_spenders_are_served_in_arrival_order() -> None:
    time = ManualTime()
    pacer = pacer_on(time)
    finished: list[tuple[int, float]] = []

    async def spender(n: int) -> None:
        await pacer.spend(30)
        finished.append((n, time.now))

    async with anyio.create_task_group() as tg:
        for n in range(5):
            tg.start_soon(spender, n)
            await anyio.lowlevel.checkpoint()  # arrive one after another
    assert [n for n, _ in finished] == [0, 1, 2, 3, 4]
    times = [t for _, t in finished]
    assert times == sorted(times)
    assert pacer.spent_units == 150
    # 50 units of burst, then 100 more at 100/s: the last leaves at 1.0 s, not before.
    assert times[-1] == pytest.approx(1.0)


async def test_never_more_than_burst_plus_rate_in_any_window() -> None:
    time = ManualTime()
    rate, burst = 250.0, 150.0
    pacer = pacer_on(time, rate, burst)
    rng = random.Random(7)
    sent: list[tuple[float, float]] = []
    for _ in range(400):
        units = rng.choice([1, 2, 5, 5, 5, 100, 50])
        if rng.random() < 0.2:
            time.now += rng.random()  # idle a while: the bucket refills
        await pacer.spend(units)
        sent.append((time.now, units))
    for i, (start, _) in enumerate(sent):
        total = 0.0
        for end, units in sent[i:]:
            total += units
            assert total <= burst + rate * (end - start) + 1e-6


async def test_hold_blocks_until_retry_after_then_restarts_empty() -> None:
    time = ManualTime()
    pacer = pacer_on(time)
    await pacer.spend(10)
    pacer.hold(2.0)
    assert pacer.held_until == pytest.approx(2.0)
    await pacer.spend(10)
    # Nothing before 2.0 s, and then an empty bucket: 10 units at 100/s.
    assert time.now == pytest.approx(2.1)
    pacer.hold(0.5)  # a shorter hold inside nothing pending still applies from now
    await pacer.spend(5)
    assert time.now == pytest.approx(2.1 + 0.5 + 0.05)


async def test_holds_only_extend() -> None:
    time = ManualTime()
    pacer = pacer_on(time)
    pacer.hold(5.0)
    pacer.hold(1.0)
    assert pacer.held_until == pytest.approx(5.0)
    pacer.hold(float("nan"))
    pacer.hold(-1)
    assert pacer.held_until == pytest.approx(5.0)


async def test_a_cancelled_spend_takes_nothing() -> None:
    pacer = QuotaPacer(units_per_s=1.0, burst_units=1.0)  # real clock: the wait is 1 s
    await pacer.spend(1)
    with anyio.move_on_after(0.05) as scope:
        await pacer.spend(1)
    assert scope.cancelled_caught
    assert pacer.spent_units == 1


async def test_impossible_spends_are_refused() -> None:
    pacer = QuotaPacer(units_per_s=10, burst_units=20)
    with pytest.raises(ValueError, match="exceeds burst_units"):
        await pacer.spend(21)
    with pytest.raises(ValueError):
        await pacer.spend(0)
    with pytest.raises(ValueError):
        QuotaPacer(units_per_s=0)
    with pytest.raises(ValueError):
        QuotaPacer(burst_units=float("inf"))
