"""How `make test` (-n, --dist loadgroup) spreads the suite over pytest-xdist workers.

`make test` spreads the suite test by test over worker processes, in the order it
was collected, a few tests ahead per worker, and the run ends when the last worker
does. Two things decide that end:

- Groups. The tests under a prefix of SERIAL_GROUPS go to one worker as one unit,
  in order, while the other workers run the rest: for tests that each load both
  cores by themselves and would starve each other next to one another.
- Order. A long test handed out last makes a tail that one worker runs alone. So
  workers are handed the known-long tests (LONG_FIRST) first, then the other slow
  ones, then the rest, whose seconds even out the end.

Why not `@pytest.mark.xdist_group`: pytest-xdist 3.8 groups by appending "@group" to a
test's node id on the worker, which pytest 9.2 no longer lets it do; the marks are then
silently ignored (pytest-dev/pytest-xdist#1386). The controller, which schedules, sees
node ids only, so the groups are named here by node-id prefix. tests/conftest.py
registers this module as a plugin; without -n (or without xdist) it does nothing.
"""

from __future__ import annotations

from typing import Any

import pytest

_BENCH = "tests/bench/test_bench_smoke.py::test_"

#: node-id prefix → group. Every benchmark smoke run starts worker processes, a daemon
#: or a fake provider of its own and loads both cores; with -n 4 and no group they ran
#: beside each other and bench/ses.py ran out of its 150 s deadline (77 s with -n 2).
#: In one group they were the run's critical path: 13 runs one after another took
#: 1,000 s of a 1,100 s suite beside other work, the other workers idle for the last
#: 300 s. So two groups, at most two benchmarks at once, each about half the seconds
#: (the --durations of that run: ingest 154+24, ses 155, outlook 90, webhooks 85,
#: fleet 93, imap 71, daemon_backfill 56, gmail 46, reimport 30, extraction 29,
#: parse 21; ses standin as ses).
SERIAL_GROUPS = {
    _BENCH + "ingest": "bench-1",
    _BENCH + "ses_standin": "bench-1",
    _BENCH + "outlook": "bench-1",
    _BENCH + "gmail": "bench-1",
    _BENCH + "parse": "bench-1",
    _BENCH + "ses": "bench-2",
    _BENCH + "webhooks": "bench-2",
    _BENCH + "fleet": "bench-2",
    _BENCH + "imap": "bench-2",
    _BENCH + "daemon_backfill": "bench-2",
    _BENCH + "reimport": "bench-2",
    _BENCH + "extraction": "bench-2",
    "tests/bench/": "bench-2",
}

#: Node-id prefixes of the tests that take longest outside the groups (≥ 40 s in a
#: `--durations` run of the suite beside other work, 25-60 s on 2 idle cores),
#: longest first. Handed out before every other test; a test missing here is only
#: handed out later, with the other slow ones.
LONG_FIRST = (
    "tests/daemon/test_run.py::test_database_cancel_flag_stops_between_pages",
    "tests/daemon/test_run.py::test_sigterm_mid_backfill_then_restart",
    "tests/daemon/test_imap_run.py::test_a_server_going_away_fails_the_run_at_once",
    "tests/daemon/test_ses_run.py::test_two_daemons_on_one_queue",
    "tests/daemon/test_resilience.py::",
    "tests/daemon/test_cli_import.py::test_database_lost_midway",
    "tests/daemon/test_package.py::test_a_wheel_installed_into_a_fresh_environment",
    "tests/daemon/test_gmail_run.py::test_a_part_rate_limited_past_every_retry",
    "tests/daemon/test_imap_run.py::test_a_server_stopped_mid_sync_then_back",
    "tests/daemon/test_gmail_reset_run.py::",
    "tests/daemon/test_outlook_faults_run.py::test_a_rotated_refresh_token",
    "tests/daemon/test_ses_run.py::test_a_stored_message_redelivered_past_max_receive",
    "tests/daemon/test_run.py::test_mail_delivered_while_the_daemon_is_down",
    "tests/daemon/test_operator.py::test_db_url_and_stop_from_a_second_shell",
    "tests/daemon/test_operator.py::test_run_help_shows_config_as_required",
    "tests/adapters/ses/test_poller.py::test_an_outage_longer_than_the_receive_budget",
    "tests/daemon/test_cli_parse_workers.py::test_reprocess",
    "tests/daemon/test_left_behind.py::test_a_dead_item_is_logged_with_its_reason",
)

SLOW_MARK = "slow"


def group_of(nodeid: str) -> str | None:
    """The group `nodeid` belongs to, or None for a test scheduled on its own."""
    for prefix, group in SERIAL_GROUPS.items():
        if nodeid.startswith(prefix):
            return group
    return None


def hand_out_rank(item: pytest.Item) -> int:
    """When `item` is handed to a worker: the known-long tests in LONG_FIRST's order,
    then the other slow ones, then the rest."""
    for rank, prefix in enumerate(LONG_FIRST):
        if item.nodeid.startswith(prefix):
            return rank
    return len(LONG_FIRST) + (0 if item.get_closest_marker(SLOW_MARK) is not None else 1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a pytest-xdist worker: the items long ones first (hand_out_rank), otherwise in
    the order collected. Every worker sorts the same collection the same way, so the
    collections the controller compares stay equal; xdist hands out the groups first
    (loadgroup puts larger units ahead), then single tests in this order."""
    if not hasattr(config, "workerinput"):
        return
    items.sort(key=hand_out_rank)  # stable: the collected order within a rank


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
