"""The Gmail door: Gmail REST client layer (config, tokens, quota pacing, batches).

The Source (sync loop), daemon wiring and push route build on these names;
push verification lives in `inboxd.adapters.gmail.push`.
"""

from inboxd.adapters.gmail.auth import AccessTokens, TokenSource
from inboxd.adapters.gmail.client import (
    GMAIL_BATCH_SIZE,
    GmailClient,
    HistoryPage,
    MessagePage,
    MessageRef,
    Profile,
    RawBatch,
    WatchResult,
)
from inboxd.adapters.gmail.config import GmailMailbox, GmailSettings, Revealable
from inboxd.adapters.gmail.errors import (
    GmailAuthError,
    GmailConfigError,
    GmailRateLimited,
    GmailRequestRejected,
    GmailRetriable,
    GmailUnavailable,
    HistoryExpired,
)
from inboxd.adapters.gmail.pacer import QuotaPacer

__all__ = [
    "GMAIL_BATCH_SIZE",
    "AccessTokens",
    "GmailAuthError",
    "GmailClient",
    "GmailConfigError",
    "GmailMailbox",
    "GmailRateLimited",
    "GmailRequestRejected",
    "GmailRetriable",
    "GmailSettings",
    "GmailUnavailable",
    "HistoryExpired",
    "HistoryPage",
    "MessagePage",
    "MessageRef",
    "Profile",
    "QuotaPacer",
    "RawBatch",
    "Revealable",
    "TokenSource",
    "WatchResult",
]
