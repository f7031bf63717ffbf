"""Gmail door errors: the provider's answers translated into pipeline/errors.py's tree.

`client.py` and `auth.py` raise only these (CONTRIBUTING.md rule 4,
docs/architecture.md §8), always `raise … from` the aiohttp exception or the
HTTP answer that caused them:

    GmailConfigError (ConfigError, ValueError)   a `[gmail]` table or mailbox entry
                                                 the door cannot use; names the key
    GmailAuthError (AuthError)                   invalid_grant, revoked or missing
                                                 scope, 401 after a fresh token, 403
                                                 that is not a rate limit
    GmailRetriable (RetriableError)              may succeed later; `retry_after_s`
    ├── GmailRateLimited                         429, or 403 rateLimitExceeded /
    │                                            userRateLimitExceeded
    └── GmailUnavailable                         5xx, connection error, deadline
    GmailRequestRejected (PermanentError)        any other 4xx of one call (a bad
                                                 id, a 400): retrying cannot help
    HistoryExpired                               history.list 404: the cursor is
                                                 too old; the source resets it

Messages name the call, the status and Google's `reason`, never a token, a
secret or a message body (CONTRIBUTING.md rule 11).
"""

from __future__ import annotations

from inboxd.pipeline.errors import (
    AuthError,
    ConfigError,
    InboxdError,
    PermanentError,
    RetriableError,
)

__all__ = [
    "GmailAuthError",
    "GmailConfigError",
    "GmailRateLimited",
    "GmailRequestRejected",
    "GmailRetriable",
    "GmailUnavailable",
    "HistoryExpired",
]


class GmailConfigError(ConfigError, ValueError):
    """A `[gmail]` table or Gmail mailbox entry the door cannot use. The message
    starts with the key (`labels: …`) and never quotes a value: it may be a secret."""


class GmailAuthError(AuthError):
    """Google refused the credentials: the refresh token or service account was
    revoked (`invalid_grant`), the client is unknown, domain-wide delegation is
    not granted, or the token lacks the Gmail scope. An operator must act."""


class GmailRetriable(RetriableError):
    """A transient failure. `retry_after_s` is the provider's Retry-After in
    seconds when it sent one (None otherwise); the runner backs off at least
    that long."""

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class GmailRateLimited(GmailRetriable):
    """429, or 403 with reason rateLimitExceeded / userRateLimitExceeded
    (https://developers.google.com/gmail/api/guides/handle-errors)."""


class GmailUnavailable(GmailRetriable):
    """5xx, a dropped connection or a deadline: Gmail or the network is unwell."""


class GmailRequestRejected(PermanentError):
    """A 4xx of one call that is neither auth nor rate limit nor an expired
    cursor (e.g. 400 invalidArgument for a malformed id). `status` and `reason`
    are Google's."""

    def __init__(self, message: str, *, status: int, reason: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


class HistoryExpired(InboxdError):
    """history.list answered 404: `startHistoryId` is older than the history Gmail
    keeps ("typically valid for at least a week, but in some rare circumstances …
    only a few hours", users.history.list reference). Not a family of its own on
    purpose: the source catches it and restarts a full sync through
    `pipeline.mailbox.leases.reset_cursor` (docs/architecture.md §4); one that escapes is a
    source bug and `family_of` reports it as a crash."""
