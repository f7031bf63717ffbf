"""Fixtures of the fake's own contract tests: a FakeGraph with two users on a
hand-moved clock, an app-only token, and an aiohttp session to call it with."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from fakes.graph import FakeGraph
from fakes.graph.testkit import ALICE, BOB, ManualClock


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def fake(clock: ManualClock) -> AsyncIterator[FakeGraph]:
    async with FakeGraph([ALICE, BOB], clock=clock) as server:
        yield server


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session
