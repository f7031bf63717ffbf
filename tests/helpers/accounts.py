"""The unprivileged account the embedded PostgreSQL runs as when tests run as root
(initdb refuses root; daemon/embedded_pg/run_as.py)."""

from __future__ import annotations

import pwd

import pytest

# Accounts a Debian machine has without any setup, in order of preference.
CANDIDATES = ("nobody", "postgres", "daemon")


def unprivileged_user() -> str:
    """The first non-root account of CANDIDATES; skips the test when there is none."""
    for name in CANDIDATES:
        try:
            if pwd.getpwnam(name).pw_uid != 0:
                return name
        except KeyError:
            continue
    pytest.skip("no unprivileged account in /etc/passwd to run PostgreSQL as")
