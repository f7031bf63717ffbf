"""Outlook door errors: Microsoft Graph's answers translated into pipeline/errors.py's tree.

    OutlookConfigError (ConfigError, ValueError)   an `[outlook]` table or mailbox entry
                                                   the door cannot use; names the key
    OutlookAuthError (AuthError)                   invalid_grant, invalid_client,
                                                   consent revoked, mailbox not found:
                                                   the mailbox needs attention
    OutlookRetriable (RetriableError)              may succeed later; `retry_after_s`
    ├── OutlookThrottled                           429, or 503 with Retry-After
    └── OutlookUnavailable                         5xx, connection error, deadline
    OutlookRequestRejected (PermanentError)        any other 4xx of one request
    DeltaExpired                                   410 Gone / resyncRequired, 400
                                                   syncStateNotFound: the folder's
                                                   delta state is dead; restart it

Messages name the request, the status and Graph's error code, never a token, a
secret, a clientState or a message body (CONTRIBUTING.md rule 11).
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
    "DeltaExpired",
    "OutlookAuthError",
    "OutlookConfigError",
    "OutlookRequestRejected",
    "OutlookRetriable",
    "OutlookThrottled",
    "OutlookUnavailable",
]


class OutlookConfigError(ConfigError, ValueError):
    """An `[outlook]` table or outlook mailbox entry the door cannot use ("key: why")."""


class OutlookAuthError(AuthError):
    """Credentials refused for good: a person must act (consent, secret, mailbox)."""


class OutlookRetriable(RetriableError):
    """May succeed later; `retry_after_s` is Graph's Retry-After when it sent one."""

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class OutlookThrottled(OutlookRetriable):
    """429 (or 503 with Retry-After): Graph asks us to slow down."""


class OutlookUnavailable(OutlookRetriable):
    """5xx, a dropped connection or a deadline: Graph is not answering well."""


class OutlookRequestRejected(PermanentError):
    """Another 4xx for one request: retrying the same request cannot help."""

    def __init__(self, message: str, *, status: int, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class DeltaExpired(InboxdError):
    """A folder's delta link (or skip token) is no longer valid; start a fresh round."""

    def __init__(self, message: str, *, folder: str) -> None:
        super().__init__(message)
        self.folder = folder
