"""Outlook door settings: the tenant's `[outlook]` table and one outlook `[[mailboxes]]` entry.

    [outlook]                                  # OutlookSettings, once per tenant file
    directory_id = "0c9e…"                     # the Entra tenant (GUID or verified domain)
    client_id = "5f1a…"                        # the app registration (GUID)
    client_secret = "env:GRAPH_SECRET"         # secret reference; or certificate = "file:…"
    notification_url = "https://inboxd.example.org"   # public base of this daemon's
                                               # listener; absent: no subscriptions (poll)
    # graph_url, authority_url: Microsoft's by default; tests and national clouds
    # point them elsewhere

    [[mailboxes]]                              # OutlookMailbox, provider = "outlook"
    address = "ops@example.org"                # user principal name or user id
    # refresh_token = "file:/run/secrets/ops"  # delegated access; absent: app-only
    folders = ["inbox", "sentitems"]
    backfill = 30                              # days, or "all", or "none"

Every error is an `OutlookConfigError` (a ValueError) whose message starts with the
key and never quotes a value (adapters/settings.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from urllib.parse import urlsplit

from inboxd.adapters import settings as readers
from inboxd.adapters.outlook.errors import OutlookConfigError
from inboxd.adapters.settings import Backfill, Revealable

__all__ = [
    "DEFAULT_AUTHORITY_URL",
    "DEFAULT_FOLDERS",
    "DEFAULT_GRAPH_URL",
    "SENT_FOLDER",
    "OutlookMailbox",
    "OutlookSettings",
]

# Microsoft's endpoints (Graph "national cloud deployments" lists the others).
DEFAULT_GRAPH_URL = "https://graph.microsoft.com/v1.0"
DEFAULT_AUTHORITY_URL = "https://login.microsoftonline.com"
DEFAULT_FOLDERS = ("inbox", "sentitems")
SENT_FOLDER = "sentitems"
#: Days of mail a first sync reads when `backfill` is not set (as for Gmail).
DEFAULT_BACKFILL_DAYS = 30
#: Graph's per-app, per-mailbox limit: 10,000 API requests in a 10-minute period
#: ("Microsoft Graph service-specific throttling limits", Outlook service).
GRAPH_REQUESTS_PER_10_MIN = 10_000
#: ... and 4 concurrent requests (same page).
GRAPH_CONCURRENT_REQUESTS = 4

# An Entra tenant: its GUID, or one of its verified domains.
_GUID = re.compile(r"[0-9a-fA-F]{8}-([0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}")
_DOMAIN = re.compile(r"(?=.{4,253}$)([A-Za-z0-9-]{1,63}\.)+[A-Za-z]{2,63}")
# A well-known folder name (inbox, sentitems, archive …) or a folder id (base64url-ish).
_FOLDER = re.compile(r"[A-Za-z0-9_=+/-]{1,512}")
_SETTINGS_KEYS = frozenset(
    {
        "directory_id",
        "client_id",
        "client_secret",
        "certificate",
        "notification_url",
        "graph_url",
        "authority_url",
        "requests_per_10_min",
        "concurrent_requests",
    }
)
_MAILBOX_KEYS = frozenset({"address", "refresh_token", "folders", "backfill"})


@dataclass(frozen=True, slots=True)
class OutlookSettings:
    """The tenant's `[outlook]` table (module docstring).

    `client_secret` or `certificate` authenticates the app (client credentials, and
    the confidential client of delegated refresh tokens); neither is allowed only
    when every mailbox is delegated through a public client. `notification_url`
    None means no subscriptions: mailboxes are polled. `requests_per_10_min` and
    `concurrent_requests` are Graph's per-mailbox limits, configurable only
    because Microsoft may change them.
    """

    directory_id: str
    client_id: str
    client_secret: Revealable | None = None
    certificate: Revealable | None = None
    notification_url: str | None = None
    graph_url: str = DEFAULT_GRAPH_URL
    authority_url: str = DEFAULT_AUTHORITY_URL
    requests_per_10_min: int = GRAPH_REQUESTS_PER_10_MIN
    concurrent_requests: int = GRAPH_CONCURRENT_REQUESTS

    @classmethod
    def from_settings(cls, settings: Mapping[str, object]) -> OutlookSettings:
        """The `[outlook]` table; OutlookConfigError naming the first unusable key."""
        readers.refuse_unknown(settings, _SETTINGS_KEYS, "[outlook]", OutlookConfigError)
        directory_id = _text(settings, "directory_id")
        if directory_id is None or not (
            _GUID.fullmatch(directory_id) or _DOMAIN.fullmatch(directory_id)
        ):
            raise OutlookConfigError(
                "directory_id: expected the Entra tenant id (a GUID) or a verified domain"
            )
        client_id = _text(settings, "client_id")
        if client_id is None or not _GUID.fullmatch(client_id):
            raise OutlookConfigError("client_id: expected the app registration's id (a GUID)")
        secret = readers.optional_secret(settings, "client_secret", OutlookConfigError)
        certificate = readers.optional_secret(settings, "certificate", OutlookConfigError)
        if secret is not None and certificate is not None:
            raise OutlookConfigError("certificate: set client_secret or certificate, not both")
        notification_url = settings.get("notification_url")
        return cls(
            directory_id=directory_id,
            client_id=client_id,
            client_secret=secret,
            certificate=certificate,
            notification_url=(
                None
                if notification_url is None
                else readers.url(settings, "notification_url", "", OutlookConfigError)
            ),
            graph_url=readers.url(settings, "graph_url", DEFAULT_GRAPH_URL, OutlookConfigError),
            authority_url=readers.url(
                settings, "authority_url", DEFAULT_AUTHORITY_URL, OutlookConfigError
            ),
            requests_per_10_min=_int(settings, "requests_per_10_min", GRAPH_REQUESTS_PER_10_MIN),
            concurrent_requests=_int(settings, "concurrent_requests", GRAPH_CONCURRENT_REQUESTS),
        )

    @property
    def graph_scope(self) -> str:
        """`{graph resource}/.default`: the app's permissions on the Graph of graph_url
        (https://graph.microsoft.com/v1.0 → https://graph.microsoft.com/.default)."""
        graph = urlsplit(self.graph_url)
        return f"{graph.scheme}://{graph.netloc}/.default"

    @property
    def token_url(self) -> str:
        """The v2.0 token endpoint of the directory (Microsoft identity platform)."""
        return f"{self.authority_url}/{self.directory_id}/oauth2/v2.0/token"

    @property
    def device_code_url(self) -> str:
        return f"{self.authority_url}/{self.directory_id}/oauth2/v2.0/devicecode"

    def push_urls(self, tenant_id: str) -> tuple[str, str] | None:
        """(notificationUrl, lifecycleNotificationUrl) of this tenant's subscriptions."""
        if self.notification_url is None:
            return None
        base = f"{self.notification_url}/push/outlook/{tenant_id}"
        return base, f"{base}/lifecycle"


@dataclass(frozen=True, slots=True)
class OutlookMailbox:
    """One Outlook mailbox: whose (`address`: UPN or user id), delegated access
    (`refresh_token`, a secret reference) or app-only (None), which folders to sync
    (well-known names or folder ids; `sentitems` copies are outbound), and how far
    back a first sync reads (`backfill`: days, "all", or "none")."""

    address: str
    refresh_token: Revealable | None = None
    folders: tuple[str, ...] = DEFAULT_FOLDERS
    backfill: Backfill = DEFAULT_BACKFILL_DAYS

    @classmethod
    def from_settings(
        cls, settings: Mapping[str, object], *, address: str | None = None
    ) -> OutlookMailbox:
        """The mailbox's provider keys; `address` (the generic mailbox key) wins."""
        readers.refuse_unknown(settings, _MAILBOX_KEYS, "outlook mailbox", OutlookConfigError)
        address = address if address is not None else _text(settings, "address")
        if not address or any(c.isspace() for c in address):
            raise OutlookConfigError(
                "address: an outlook mailbox needs its user principal name or user id"
            )
        return cls(
            address=address,
            refresh_token=readers.optional_secret(settings, "refresh_token", OutlookConfigError),
            folders=_folders(settings),
            backfill=readers.backfill(settings, DEFAULT_BACKFILL_DAYS, OutlookConfigError),
        )

    @property
    def delegated(self) -> bool:
        return self.refresh_token is not None

    def connected(self, settings: OutlookSettings) -> bool:
        """A credential serves it: a delegated refresh token, or the app's own for
        app-only access. Neither yet is valid configuration, not connected."""
        return (
            self.delegated
            or settings.client_secret is not None
            or (settings.certificate is not None)
        )

    def received_since(self, now: datetime | None = None) -> datetime | None:
        """The first round's `receivedDateTime ge` bound; None for "all" (and "none",
        where the first round lists nothing)."""
        if not isinstance(self.backfill, int):
            return None
        now = now or datetime.now(UTC)
        return (now - timedelta(days=self.backfill)).replace(microsecond=0)

    def check_against(self, settings: OutlookSettings) -> None:
        """Nothing of `[outlook]` makes this mailbox invalid: without a refresh token
        and without the app's own credential it is not connected yet (`connected`),
        which `inboxd connect outlook` or [outlook] client_secret/certificate mends."""


def _text(settings: Mapping[str, object], key: str) -> str | None:
    return readers.optional_text(settings, key, OutlookConfigError)


def _int(settings: Mapping[str, object], key: str, default: int) -> int:
    value = settings.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= default * 10:
        raise OutlookConfigError(f"{key}: expected a whole number from 1 to {default * 10}")
    return value


def _folders(settings: Mapping[str, object]) -> tuple[str, ...]:
    value = settings.get("folders")
    if value is None:
        return DEFAULT_FOLDERS
    if (
        not isinstance(value, list | tuple)
        or not value
        or not all(isinstance(v, str) and _FOLDER.fullmatch(v) for v in value)
    ):
        raise OutlookConfigError(
            'folders: expected a non-empty list of folder names or ids, e.g. ["inbox", "sentitems"]'
        )
    # well-known names are case-insensitive in Graph; keep ids as written
    return tuple(dict.fromkeys(v.lower() if v.isalpha() else v for v in value))
