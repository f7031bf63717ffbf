"""The process's bound on IMAP IDLE connections.

An IDLE connection is the one per-mailbox resource no pool can share: it is a TLS
socket held open to the server for as long as the mailbox listens (one file handle
and the TLS session's buffers, per mailbox, per replica). `[sync] max_imap_idle`
bounds them; the mailboxes past the bound are polled every `poll_interval_s`, in
push mode too, and ask again for a slot at each poll, so one frees when a mailbox
leaves the configuration (docs/providers/imap.md "Many mailboxes").

One event loop takes and gives back slots, so a counter is enough: no lock.
"""

from __future__ import annotations

__all__ = ["IdleSlots"]


class IdleSlots:
    """At most `limit` IDLE connections at once in this process."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"max_imap_idle must be 0 or more, got {limit}")
        self.limit = limit
        self.held = 0

    def try_take(self) -> bool:
        """Take a slot if one is free; False when the bound is reached."""
        if self.held >= self.limit:
            return False
        self.held += 1
        return True

    def give_back(self) -> None:
        """Return a slot taken with `try_take`."""
        self.held -= 1
