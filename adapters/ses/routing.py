"""Recipient → (tenant, mailbox): which ses mailbox a forwarded message belongs to.

An address is looked up, in order: exactly (`support@example.com`), without its
sub-address (`support+ticket-42@example.com` → `support@example.com`, RFC 5233),
then as its domain's catch-all (`@example.com`). One recipient reaches at most
one mailbox (check-config refuses two claims of one entry); a message for several
recipients is stored once in each mailbox they reach.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from inboxd.adapters.ses.config import SesMailbox, normalise_address

__all__ = ["Route", "Router"]


@dataclass(frozen=True, slots=True)
class Route:
    tenant_id: str
    mailbox_id: str
    mailbox: SesMailbox


class Router:
    """The routing table of every ses mailbox the daemon serves (swapped whole on SIGHUP)."""

    def __init__(self, mailboxes: Iterable[tuple[str, str, SesMailbox]]) -> None:
        self._table: dict[str, Route] = {}
        for tenant_id, mailbox_id, mailbox in mailboxes:
            route = Route(tenant_id, mailbox_id, mailbox)
            for entry in mailbox.addresses:
                # check-config refuses duplicates; if one slips through, the first wins
                self._table.setdefault(entry, route)

    def __len__(self) -> int:
        return len(self._table)

    def mailboxes(self) -> list[tuple[str, str]]:
        """Every (tenant, mailbox) the table routes to."""
        return list(dict.fromkeys((r.tenant_id, r.mailbox_id) for r in self._table.values()))

    def route(self, recipients: Iterable[str]) -> list[Route]:
        """The mailboxes these recipients reach, each once, in recipient order."""
        found: dict[tuple[str, str], Route] = {}
        for recipient in recipients:
            route = self.lookup(recipient)
            if route is not None:
                found.setdefault((route.tenant_id, route.mailbox_id), route)
        return list(found.values())

    def lookup(self, recipient: str) -> Route | None:
        address = normalise_address(recipient)
        local, at, domain = address.rpartition("@")
        if not at:
            return None
        for candidate in (address, _without_subaddress(local, domain), "@" + domain):
            if candidate and (route := self._table.get(candidate)) is not None:
                return route
        return None


def _without_subaddress(local: str, domain: str) -> str:
    base, plus, _ = local.partition("+")
    return f"{base}@{domain}" if plus and base else ""
