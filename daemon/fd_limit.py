"""The open-file limit against the configured mailboxes, checked when the daemon starts.

Every connection is a file handle: the PostgreSQL pool, the listener and its clients,
the parse workers' pipes, and each mailbox's own connections (an IMAP mailbox holds
`max_connections` sockets, one of them IDLE for its whole life; a provider door's
HTTP session keeps its sockets between syncs). A daemon past its limit fails with
EMFILE wherever the next socket happens to be opened — a sync, a webhook, a
database reconnect — so the limit is checked before anything starts:

    soft limit ≥ needed           → nothing to say
    soft < needed ≤ hard          → the soft limit is raised (setrlimit), logged
    hard < needed                 → raised to the hard limit, and a warning names the
                                    figure needed and how to give it (LimitNOFILE= in
                                    the systemd unit, --ulimit nofile= for a container)

systemd's default soft limit is 1,024 (hard 524,288): raising the soft limit to the
hard one is what systemd itself recommends of programs that need more (systemd.exec(5),
LimitNOFILE=); the units here set LimitNOFILE=65536 all the same.
"""

from __future__ import annotations

import resource
from collections.abc import Iterable
from dataclasses import dataclass

import structlog

from inboxd.daemon.config.tenant import MailboxConfig

log = structlog.get_logger(__name__)

#: Handles the daemon holds whatever its mailboxes: the PostgreSQL pool and its
#: LISTEN connections, the listener and a burst of client connections, the parse
#: workers' pipes, log and object-store files in flight.
FDS_BASE = 512
#: Handles per mailbox, by provider: a provider door's HTTP session keeps a few sockets
#: between syncs (1,000 Gmail mailboxes held 1,029 handles in a full sync, issue 25);
#: Graph allows 4 concurrent requests per mailbox; a Maildir scan opens files one page
#: at a time. IMAP is its own `max_connections` (below); SES shares the door's pollers.
FDS_PER_MAILBOX = {"gmail": 2, "outlook": 4, "maildir": 1, "ses": 0}
#: An IMAP mailbox without `max_connections` in its table (adapters/imap/config.py).
IMAP_DEFAULT_CONNECTIONS = 2


@dataclass(frozen=True, slots=True)
class FdLimit:
    """What the check found: handles `needed` for the mailboxes, the soft limit
    before and after, and the hard limit."""

    needed: int
    soft_before: int
    soft: int
    hard: int

    @property
    def enough(self) -> bool:
        return self.soft >= self.needed


def handles_needed(mailboxes: Iterable[MailboxConfig]) -> int:
    """FDS_BASE plus each mailbox's own handles."""
    total = FDS_BASE
    for mailbox in mailboxes:
        if mailbox.provider == "imap":
            value = mailbox.settings.get("max_connections", IMAP_DEFAULT_CONNECTIONS)
            total += value if isinstance(value, int) else IMAP_DEFAULT_CONNECTIONS
        else:
            total += FDS_PER_MAILBOX.get(mailbox.provider, 1)
    return total


def ensure_fd_limit(mailboxes: Iterable[MailboxConfig]) -> FdLimit:
    """Raise the soft open-file limit towards what the mailboxes need (up to the hard
    limit); log what was done, and warn when even the hard limit is too low."""
    needed = handles_needed(mailboxes)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    raised = soft
    if soft != resource.RLIM_INFINITY and soft < needed:
        ceiling = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (ceiling, hard))
            raised = ceiling
        except (ValueError, OSError) as exc:  # a sandbox may refuse even within the hard one
            log.warning("open_file_limit_not_raised", soft=soft, hard=hard, error=str(exc))
    found = FdLimit(needed=needed, soft_before=soft, soft=raised, hard=hard)
    if raised == resource.RLIM_INFINITY or raised >= needed:
        if raised != soft:
            log.info("open_file_limit_raised", before=soft, now=raised, needed=needed)
        return found
    log.warning(
        "open_file_limit_too_low",
        limit=raised,
        hard=hard,
        needed=needed,
        hint=f"give the daemon at least {needed} open files: LimitNOFILE={needed} in its "
        f"systemd unit, or --ulimit nofile={needed}:{needed} for its container",
    )
    return found
