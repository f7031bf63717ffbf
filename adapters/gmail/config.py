"""Gmail door settings: the tenant's `[gmail]` table and one Gmail `[[mailboxes]]` entry.

    [gmail]                                   # GmailSettings, once per tenant file
    client_id = "1234.apps.googleusercontent.com"
    client_secret = "env:GMAIL_CLIENT_SECRET"   # secret reference (daemon/config/secrets.py)
    topic = "projects/P/topics/T"               # Pub/Sub topic of users.watch; absent: poll only
    push_audience = "https://inboxd.example.org/hooks/gmail"
    push_service_account = "push@P.iam.gserviceaccount.com"
    # api_url, token_url, certs_url: Google's by default; tests point them at fakes

    [[mailboxes]]                             # GmailMailbox, provider = "gmail"
    address = "ops@example.org"
    refresh_token = "file:/run/secrets/ops"     # either this (OAuth consent) …
    # service_account = "file:/run/secrets/sa.json"   # … or a key with domain-wide delegation
    labels = ["INBOX", "SENT"]
    backfill = 30                               # days, or "all", or "none"

Secrets arrive as reference objects (`Revealable`, adapters/settings.py) and are
revealed only when a token is requested (auth.py). Every error is a
`GmailConfigError` (a ValueError) whose message starts with the key and never
quotes a value.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from inboxd.adapters import settings as readers
from inboxd.adapters.gmail.errors import GmailConfigError
from inboxd.adapters.settings import Backfill, Revealable

__all__ = [
    "DEFAULT_API_URL",
    "DEFAULT_BACKFILL_DAYS",
    "DEFAULT_CERTS_URL",
    "DEFAULT_LABELS",
    "DEFAULT_TOKEN_URL",
    "Backfill",
    "GmailMailbox",
    "GmailSettings",
    "Revealable",
]

# Google's endpoints (Gmail API reference "Service endpoint"; OAuth 2.0 for server
# to server applications; Pub/Sub push authentication's signing certificates).
DEFAULT_API_URL = "https://gmail.googleapis.com"
DEFAULT_TOKEN_URL = "https://oauth2.googleapis.com/token"  # noqa: S105 - a URL, no secret
DEFAULT_CERTS_URL = "https://www.googleapis.com/oauth2/v1/certs"
DEFAULT_LABELS = ("INBOX", "SENT")
#: Days of mail a first sync reads when `backfill` is not set: recent enough to be
#: useful at once, small enough that a first sync of a large mailbox stays minutes.
DEFAULT_BACKFILL_DAYS = 30
#: Gmail's per-user quota, units per second (Gmail API usage limits).
DEFAULT_QUOTA_UNITS_PER_S = 250.0
#: A sanity bound on a raised quota (a typo of 2500000 is not a quota).
MAX_QUOTA_UNITS_PER_S = 100_000.0

# users.watch: "projects/my-project-identifier/topics/my-topic-name" (Pub/Sub v1 naming:
# project ids 6-30 chars, topic names 3-255 chars starting with a letter).
_TOPIC = re.compile(r"projects/[a-z][a-z0-9-]{4,28}[a-z0-9]/topics/[A-Za-z][\w.~+%-]{2,254}")
# Gmail label ids: system ids (INBOX, CATEGORY_SOCIAL) or user ids (Label_123).
_LABEL = re.compile(r"[A-Za-z0-9_-]{1,225}")
_SETTINGS_KEYS = frozenset(
    {
        "client_id",
        "client_secret",
        "topic",
        "push_audience",
        "push_service_account",
        "api_url",
        "token_url",
        "certs_url",
        "quota_units_per_s",
    }
)
_MAILBOX_KEYS = frozenset({"address", "refresh_token", "service_account", "labels", "backfill"})


@dataclass(frozen=True, slots=True)
class GmailSettings:
    """The tenant's `[gmail]` table (module docstring).

    `client_id`/`client_secret` are the OAuth client of refresh-token mailboxes
    (None when every mailbox uses a service account); `topic` None means no
    users.watch (the mailbox is polled); `push_audience` and
    `push_service_account` are what push.py checks in a Pub/Sub push's JWT.
    """

    client_id: str | None = None
    client_secret: Revealable | None = None
    topic: str | None = None
    push_audience: str | None = None
    push_service_account: str | None = None
    api_url: str = DEFAULT_API_URL
    token_url: str = DEFAULT_TOKEN_URL
    certs_url: str = DEFAULT_CERTS_URL
    # Each mailbox's pace in Gmail quota units per second (pacer.py): Google's
    # per-user limit unless the project was granted more.
    quota_units_per_s: float = DEFAULT_QUOTA_UNITS_PER_S

    @classmethod
    def from_settings(cls, settings: Mapping[str, object]) -> GmailSettings:
        """The `[gmail]` table; GmailConfigError naming the first unusable key."""
        _refuse_unknown(settings, _SETTINGS_KEYS, "[gmail]")
        client_id = _optional_text(settings, "client_id")
        client_secret = _optional_secret(settings, "client_secret")
        if (client_id is None) != (client_secret is None):
            missing = "client_secret" if client_secret is None else "client_id"
            raise GmailConfigError(f"{missing}: client_id and client_secret go together")
        topic = _optional_text(settings, "topic")
        if topic is not None and not _TOPIC.fullmatch(topic):
            raise GmailConfigError("topic: expected projects/PROJECT/topics/TOPIC")
        push_service_account = _optional_text(settings, "push_service_account")
        if push_service_account is not None and "@" not in push_service_account:
            raise GmailConfigError("push_service_account: expected a service account email")
        return cls(
            client_id=client_id,
            client_secret=client_secret,
            topic=topic,
            push_audience=_optional_text(settings, "push_audience"),
            push_service_account=push_service_account,
            api_url=_url(settings, "api_url", DEFAULT_API_URL),
            token_url=_url(settings, "token_url", DEFAULT_TOKEN_URL),
            certs_url=_url(settings, "certs_url", DEFAULT_CERTS_URL),
            quota_units_per_s=_quota(settings),
        )


@dataclass(frozen=True, slots=True)
class GmailMailbox:
    """One Gmail mailbox: whose (`address`), how we act for it (one of
    `refresh_token` and `service_account`, both secret references; the latter is
    a service-account key JSON with domain-wide delegation, impersonating
    `address`; neither yet: valid, not connected — `inboxd connect gmail` writes the
    refresh token), which labels to sync, and how far back a first sync reads
    (`backfill`: days, "all", or "none" = only mail from now on)."""

    address: str
    refresh_token: Revealable | None = None
    service_account: Revealable | None = None
    labels: tuple[str, ...] = DEFAULT_LABELS
    backfill: Backfill = DEFAULT_BACKFILL_DAYS

    @classmethod
    def from_settings(
        cls, settings: Mapping[str, object], *, address: str | None = None
    ) -> GmailMailbox:
        """The mailbox's provider keys; `address` (the generic mailbox key) wins
        over an `address` in `settings`. GmailConfigError naming the key."""
        _refuse_unknown(settings, _MAILBOX_KEYS, "gmail mailbox")
        address = address if address is not None else _optional_text(settings, "address")
        if not address or "@" not in address or any(c.isspace() for c in address):
            raise GmailConfigError("address: a Gmail mailbox needs its email address")
        refresh_token = _optional_secret(settings, "refresh_token")
        service_account = _optional_secret(settings, "service_account")
        if refresh_token is not None and service_account is not None:
            raise GmailConfigError(
                "refresh_token: set only one of refresh_token and service_account"
            )
        return cls(
            address=address,
            refresh_token=refresh_token,
            service_account=service_account,
            labels=_labels(settings),
            backfill=_backfill(settings),
        )

    @property
    def connected(self) -> bool:
        """A credential is configured (refresh_token or service_account)."""
        return self.refresh_token is not None or self.service_account is not None

    @property
    def backfill_query(self) -> str | None:
        """The messages.list `q` of a first sync: `newer_than:Nd` for a number of
        days (Gmail search operators, support.google.com/mail/answer/7190), None
        for "all". Meaningless for "none", where a first sync lists nothing."""
        if isinstance(self.backfill, int):
            return f"newer_than:{self.backfill}d"
        return None

    def check_against(self, settings: GmailSettings) -> None:
        """GmailConfigError when the tenant's `[gmail]` table cannot serve this
        mailbox (a refresh token needs the OAuth client that issued it)."""
        if self.refresh_token is not None and settings.client_id is None:
            raise GmailConfigError(
                "refresh_token: a refresh_token mailbox needs [gmail] client_id and client_secret"
            )


# --- readers -------------------------------------------------------------------------------


def _refuse_unknown(settings: Mapping[str, object], known: frozenset[str], where: str) -> None:
    readers.refuse_unknown(settings, known, where, GmailConfigError)


def _optional_text(settings: Mapping[str, object], key: str) -> str | None:
    return readers.optional_text(settings, key, GmailConfigError)


def _optional_secret(settings: Mapping[str, object], key: str) -> Revealable | None:
    return readers.optional_secret(settings, key, GmailConfigError)


def _url(settings: Mapping[str, object], key: str, default: str) -> str:
    return readers.url(settings, key, default, GmailConfigError)


def _backfill(settings: Mapping[str, object]) -> Backfill:
    return readers.backfill(settings, DEFAULT_BACKFILL_DAYS, GmailConfigError)


def _quota(settings: Mapping[str, object]) -> float:
    value = settings.get("quota_units_per_s", DEFAULT_QUOTA_UNITS_PER_S)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 1 <= value <= MAX_QUOTA_UNITS_PER_S
    ):
        raise GmailConfigError(
            f"quota_units_per_s: expected a number of Gmail quota units per second "
            f"from 1 to {MAX_QUOTA_UNITS_PER_S:g}"
        )
    return float(value)


def _labels(settings: Mapping[str, object]) -> tuple[str, ...]:
    value = settings.get("labels")
    if value is None:
        return DEFAULT_LABELS
    if (
        not isinstance(value, list | tuple)
        or not value
        or not all(isinstance(v, str) and _LABEL.fullmatch(v) for v in value)
    ):
        raise GmailConfigError(
            'labels: expected a non-empty list of Gmail label ids, e.g. ["INBOX", "SENT"]'
        )
    return tuple(dict.fromkeys(value))  # order kept, duplicates dropped
