"""An imap mailbox's keys (tenant file, `[[mailboxes]] provider = "imap"`).

    host = "imap.fastmail.com"
    port = 993                      # default 993 ("tls"), 143 otherwise
    security = "tls"                # "tls" | "starttls" | "none" (loopback hosts only)
    verify_certificate = true       # ca_file = "/etc/ssl/private-ca.pem" to trust a CA
    username = "support@example.com"
    password = "env:FASTMAIL_APP_PASSWORD"     # or oauth2_token (XOAUTH2), a reference
    folders = ["INBOX", {name = "Sent", direction = "outbound"}]
    backfill = 30                   # days, "all" or "none"
    idle = true
    max_connections = 2

Readers raise ImapConfigError("key: why") and never quote a value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

from inboxd.adapters import settings as readers
from inboxd.adapters.imap.errors import ImapConfigError
from inboxd.adapters.settings import Backfill, Revealable

__all__ = ["MAILBOX_KEYS", "Folder", "ImapMailbox"]

MAILBOX_KEYS = frozenset(
    {
        "host",
        "port",
        "security",
        "verify_certificate",
        "ca_file",
        "username",
        "password",
        "oauth2_token",
        "folders",
        "backfill",
        "idle",
        "max_connections",
    }
)
SECURITY = ("tls", "starttls", "none")
DEFAULT_BACKFILL_DAYS = 30
# Connections per account. Providers cap them per account (Gmail 15, Fastmail and
# Dovecot's default mail_max_userip_connections 10); one syncs, one IDLEs.
DEFAULT_MAX_CONNECTIONS = 2
MAX_CONNECTIONS = 10
DIRECTIONS = ("inbound", "outbound")


@dataclass(frozen=True, slots=True)
class Folder:
    """A synced folder and the direction of the mail in it (Sent: outbound)."""

    name: str
    direction: str = "inbound"


@dataclass(frozen=True, slots=True)
class ImapMailbox:
    host: str
    username: str
    port: int = 993
    security: str = "tls"
    verify_certificate: bool = True
    ca_file: Path | None = None
    password: Revealable | None = None
    oauth2_token: Revealable | None = None
    folders: tuple[Folder, ...] = (Folder("INBOX"),)
    backfill: Backfill = DEFAULT_BACKFILL_DAYS
    idle: bool = True
    max_connections: int = DEFAULT_MAX_CONNECTIONS

    @classmethod
    def from_settings(cls, settings: Mapping[str, object]) -> ImapMailbox:
        readers.refuse_unknown(settings, MAILBOX_KEYS, "imap mailbox", ImapConfigError)
        host = readers.optional_text(settings, "host", ImapConfigError)
        if host is None or any(c.isspace() or c in "/:@" for c in host):
            raise ImapConfigError("host: required, a host name or address")
        security = settings.get("security", "tls")
        if security not in SECURITY:
            raise ImapConfigError('security: expected "tls", "starttls" or "none"')
        if security == "none" and not readers.is_loopback(host):
            raise ImapConfigError(
                'security: "none" sends the password in clear text; only for a loopback host'
            )
        port = settings.get("port", 993 if security == "tls" else 143)
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise ImapConfigError("port: expected a port number from 1 to 65535")
        username = readers.optional_text(settings, "username", ImapConfigError)
        if username is None:
            raise ImapConfigError("username: required")
        password = readers.optional_secret(settings, "password", ImapConfigError)
        token = readers.optional_secret(settings, "oauth2_token", ImapConfigError)
        if (password is None) == (token is None):
            raise ImapConfigError("password: set exactly one of password and oauth2_token")
        ca = readers.optional_text(settings, "ca_file", ImapConfigError)
        return cls(
            host=host,
            port=port,
            security=str(security),
            verify_certificate=_flag(settings, "verify_certificate", True),
            ca_file=None if ca is None else Path(ca),
            username=username,
            password=password,
            oauth2_token=token,
            folders=_folders(settings.get("folders")),
            backfill=readers.backfill(settings, DEFAULT_BACKFILL_DAYS, ImapConfigError),
            idle=_flag(settings, "idle", True),
            max_connections=_connections(settings),
        )

    def since(self, today: date | None = None) -> date | None:
        """The first sync's SEARCH SINCE date; None for "all" (and for "none", where
        the first sync only notes where the folder ends)."""
        if not isinstance(self.backfill, int):
            return None
        today = today or datetime.now(UTC).date()
        return today - timedelta(days=self.backfill)


def _flag(settings: Mapping[str, object], key: str, default: bool) -> bool:
    value = settings.get(key, default)
    if not isinstance(value, bool):
        raise ImapConfigError(f"{key}: expected true or false")
    return value


def _connections(settings: Mapping[str, object]) -> int:
    value = settings.get("max_connections", DEFAULT_MAX_CONNECTIONS)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CONNECTIONS:
        raise ImapConfigError(f"max_connections: expected a number from 1 to {MAX_CONNECTIONS}")
    return value


def _folders(value: object) -> tuple[Folder, ...]:
    if value is None:
        return (Folder("INBOX"),)
    if not isinstance(value, list | tuple) or not value:
        raise ImapConfigError("folders: expected a non-empty list of folder names")
    out: dict[str, Folder] = {}
    for entry in value:
        if isinstance(entry, str):
            folder = Folder(entry)
        elif isinstance(entry, Mapping):
            name, direction = entry.get("name"), entry.get("direction", "inbound")
            if set(entry) - {"name", "direction"} or direction not in DIRECTIONS:
                raise ImapConfigError(
                    'folders: a table has `name` and `direction` ("inbound" or "outbound")'
                )
            if not isinstance(name, str):
                raise ImapConfigError("folders: a table's `name` is a folder name")
            folder = Folder(name, str(direction))
        else:
            raise ImapConfigError("folders: expected folder names or {name, direction} tables")
        if not folder.name.strip() or any(c in folder.name for c in "\r\n\x00"):
            raise ImapConfigError("folders: a folder name is a non-empty line of text")
        out.setdefault(folder.name, folder)
    return tuple(out.values())
