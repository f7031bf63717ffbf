"""Tests that run one after another on one pytest-xdist worker (`make test`: -n, --dist loadgroup).

`make test` spreads the suite test by test over worker processes. The tests under a
prefix of SERIAL_GROUPS instead go to one worker as one unit, in order, while the
other workers run the rest: for tests that each load both cores by themselves and
would starve each other next to one another.

Why not `@pytest.mark.xdist_group`: pytest-xdist 3.8 groups by appending "@group" to a
test's node id on the worker, which pytest 9.2 no longer lets it do; the marks are then
silently ignored (pytest-dev/pytest-xdist#1386). The controller, which schedules, sees
node ids only, so the groups are named here by node-id prefix. tests/conftest.py
registers this module as a plugin; without -n (or without xdist) it does nothing.
"""

from __future__ import annotations

from typing import Any

import pytest

#: node-id prefix → group. Every benchmark smoke run starts worker processes, a daemon
#: or a fake provider of its own and loads both cores; with -n 4 and no group they ran
#: beside each other and bench/ses.py ran out of its 150 s deadline (77 s with -n 2).
SERIAL_GROUPS = {
    "tests/bench/": "bench",
}


def group_of(nodeid: str) -> str | None:
    """The group `nodeid` belongs to, or None for a test scheduled on its own."""
    for prefix, group in SERIAL_GROUPS.items():
        if nodeid.startswith(prefix):
            return group
    return None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under --dist loadgroup: xdist's loadgroup scheduler, with SERIAL_GROUPS as groups."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class PrefixGroupScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            group = group_of(nodeid)
            return f"group:{group}" if group is not None else str(super()._split_scope(nodeid))

    return PrefixGroupScheduling(config, log)
