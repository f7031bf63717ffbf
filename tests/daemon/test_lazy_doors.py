"""A door's SDK is loaded only when a configured mailbox uses that door.

msgraph-sdk costs 0.2 s and 5 MB to load (docs/architecture.md "The Outlook
door"): everything `inboxd run` and `inboxd check-config` import at start must
leave it unloaded; `daemon/sync/registry.py` loads it in the Outlook builder.
Run in a fresh interpreter, since this test process has imported everything.
"""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
import inboxd.daemon.cli
import inboxd.daemon.commands.check_config
import inboxd.daemon.commands.run
import inboxd.daemon.supervisor
import inboxd.daemon.sync.registry
print(",".join(sorted(m for m in ("msgraph", "kiota_http", "aioimaplib") if m in sys.modules)))
import inboxd.adapters.outlook.source
print("msgraph" in sys.modules)
"""


def test_the_daemon_starts_without_loading_msgraph_until_an_outlook_mailbox_needs_it() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    before, after = done.stdout.splitlines()
    assert before == ""
    assert after == "True"
