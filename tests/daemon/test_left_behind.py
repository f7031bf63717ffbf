"""Nothing is left behind silently: dead items are logged with their reason and
counted per mailbox in `inboxd status`, through `inboxd run` as a process."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from harness import DaemonProcess, deliver, generated_messages, maildir, write_config
from helpers import run_cli_async
from helpers.db import count

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.slow,
    pytest.mark.own_database,  # daemon subprocesses (tests/conftest.py)
]

# An Outlook .msg (CFB) file saved as .eml: not RFC 5322 mail, so a dead item.
NOT_MAIL = Path(__file__).parents[1] / "corpus/mime/spamscope-mail-parser/mail_outlook_1.eml"


async def test_a_dead_item_is_logged_with_its_reason_and_counted_in_status(
    tmp_path: Path, db_dsn: str
) -> None:
    config = write_config(tmp_path)
    box = maildir(tmp_path, "acme", "inbox")
    deliver(box, [*generated_messages(2, tag="ok"), NOT_MAIL.read_bytes()])
    daemon = DaemonProcess(config, db_dsn, tmp_path / "daemon.log")
    try:
        daemon.wait_ready()
        await daemon.eventually(
            lambda: count(db_dsn, "SELECT count(*) FROM dead_items"), 60, what="a dead item"
        )
        logged = await daemon.eventually(
            lambda: [e for e in daemon.events() if e.get("event") == "dead_item"],
            30,
            what="the dead item logged",
        )
        assert len(logged) == 1
        assert logged[0]["mailbox"] == "inbox" and "not_mime" in logged[0]["reason"]

        status = await run_cli_async("status", "--json", "--dsn", db_dsn)
        assert status.code == 0, status.stderr
        [row] = status.json
        assert (row["dead_items"], row["attachments_pending"]) == (1, 0)
        table = await run_cli_async("status", "--dsn", db_dsn)
        assert table.stdout.splitlines()[0].startswith("daemons: 1 running")
        assert "DEAD" in table.stdout.splitlines()[1]
    finally:
        daemon.signal(signal.SIGTERM)
        assert daemon.wait_exit(60) == 0, daemon.log_tail()
