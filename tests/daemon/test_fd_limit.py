"""The open-file limit against the configured mailboxes (daemon/fd_limit.py), as an
operator meets it: `inboxd run` started under a low limit raises it or says so."""

from __future__ import annotations

import resource
import signal
import subprocess
from pathlib import Path

import orjson
import pytest
from harness import write_config
from helpers import cli_argv, wait_for

from inboxd.daemon.fd_limit import FDS_BASE, FDS_PER_MAILBOX

REPO = Path(__file__).resolve().parents[2]
MAILBOXES = 100
NEEDED = FDS_BASE + MAILBOXES * FDS_PER_MAILBOX["maildir"]
READY_TIMEOUT_S = 120.0

pytestmark = [pytest.mark.slow, pytest.mark.own_database]  # daemon subprocesses (tests/conftest.py)


def _events_of_run(tmp: Path, dsn: str, soft: int, hard: int) -> list[dict]:
    """`inboxd run` with RLIMIT_NOFILE (soft, hard), until ready, then SIGTERM; its log."""
    config = write_config(tmp, tenants={"acme": [f"box{i}" for i in range(MAILBOXES)]})
    log = tmp / "daemon.log"

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    with log.open("wb") as sink:
        proc = subprocess.Popen(
            cli_argv("run", "--config", config, "--dsn", dsn),
            stdout=subprocess.DEVNULL,
            stderr=sink,
            preexec_fn=limited,
        )
        try:
            wait_for(
                lambda: b'"daemon_ready"' in log.read_bytes(),
                READY_TIMEOUT_S,
                what="daemon_ready",
                abort=lambda: None if proc.poll() is None else f"exited {proc.returncode}",
                context=lambda: log.read_text(errors="replace")[-3000:],
            )
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    events = []
    for line in log.read_bytes().splitlines():
        try:
            events.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            continue
    return events


def test_a_soft_limit_below_what_the_mailboxes_need_is_raised(tmp_path: Path, db_dsn: str) -> None:
    events = _events_of_run(tmp_path, db_dsn, soft=NEEDED - 100, hard=NEEDED + 1000)
    [raised] = [e for e in events if e["event"] == "open_file_limit_raised"]
    assert (raised["before"], raised["now"], raised["needed"]) == (NEEDED - 100, NEEDED, NEEDED)
    assert not [e for e in events if e["event"] == "open_file_limit_too_low"]


def test_a_hard_limit_too_low_is_said_with_the_figure_needed(tmp_path: Path, db_dsn: str) -> None:
    events = _events_of_run(tmp_path, db_dsn, soft=NEEDED - 10, hard=NEEDED - 10)
    [low] = [e for e in events if e["event"] == "open_file_limit_too_low"]
    assert (low["limit"], low["needed"]) == (NEEDED - 10, NEEDED)
    assert f"LimitNOFILE={NEEDED}" in low["hint"]


def test_the_units_give_the_daemon_room_for_ten_thousand_mailboxes() -> None:
    for unit in ("inboxd.service", "inboxd@.service"):
        lines = (REPO / "systemd" / unit).read_text().splitlines()
        [limit] = [line for line in lines if line.startswith("LimitNOFILE=")]
        assert int(limit.partition("=")[2]) >= FDS_BASE + 10_000 * max(FDS_PER_MAILBOX.values())
