"""sd_notify(3) without libsystemd: READY=1, STOPPING=1, WATCHDOG=1, STATUS=….

The protocol is one datagram per state change to the AF_UNIX socket named by
$NOTIFY_SOCKET (a leading "@" means the abstract namespace). Outside systemd
the variable is unset and every call is a no-op.
"""

from __future__ import annotations

import os
import socket

import anyio

# Ping at half the interval systemd expects (sd_watchdog_enabled(3) advice).
WATCHDOG_FRACTION = 0.5


def notify(state: str) -> bool:
    """Send one state string; False when not running under systemd or it failed."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError:
        return False
    return True


def watchdog_interval_s() -> float | None:
    """Seconds between WATCHDOG=1 pings, or None when the watchdog is off."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 1_000_000 * WATCHDOG_FRACTION
    except ValueError:
        return None


async def run_watchdog(healthy: object) -> None:
    """Ping the watchdog while `healthy()` (an async callable) says so; never returns."""
    interval_s = watchdog_interval_s()
    if interval_s is None:
        return
    while True:
        if await healthy():  # type: ignore[operator]
            notify("WATCHDOG=1")
        await anyio.sleep(interval_s)
