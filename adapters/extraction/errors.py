"""Parse-backend errors, in the pipeline's tree (CONTRIBUTING.md rule 4).

    ExtractionError
    ├── ExtractionRetryable (RetriableError)   the same call may succeed later:
    │   │                                      the claim protocol's fail_retryable,
    │   │                                      never earlier than `retry_after_s`
    │   └── ExtractionMisconfigured            the endpoint is not usable as configured
    │       │                                  (wrong URL: 3xx, 404, 405): pause the
    │       │                                  processor, the job is not charged
    │       └── ExtractionUnauthorized         the endpoint refused our token (401/403)
    └── ExtractionTerminal (PermanentError)    the message cannot give a valid result:
                                               fail_terminal → needs_review with `reason`
    ProcessorConfigError (ConfigError)         a [[processors]] table is wrong; names the key

A backend raises exactly one of the first two per failed call, with `reason` a
short single line (pipeline/extraction/claims.py stores it as the job's reason);
a backend never retries by itself (one call = one attempt).
"""

from __future__ import annotations

from inboxd.pipeline.errors import ConfigError, InboxdError, PermanentError, RetriableError


class ExtractionError(InboxdError):
    """Base of the failures a parse backend reports for one message."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ExtractionRetryable(ExtractionError, RetriableError):
    """Network, timeout, 429, 5xx: retry later, not before `retry_after_s` seconds
    (the server's Retry-After, None when it sent none)."""

    def __init__(self, reason: str, retry_after_s: float | None = None) -> None:
        super().__init__(reason)
        self.retry_after_s = retry_after_s


class ExtractionMisconfigured(ExtractionRetryable):
    """The endpoint cannot serve any message as configured (a wrong URL: 3xx, 404,
    405). An operator's problem, not the message's: retryable with a long wait,
    never needs_review of the message by itself; a daemon stage pauses the whole
    processor for `retry_after_s` and releases the job uncharged."""


class ExtractionUnauthorized(ExtractionMisconfigured):
    """The endpoint rejected the bearer token (401/403): misconfigured likewise."""


class ExtractionTerminal(ExtractionError, PermanentError):
    """The result does not validate, or the endpoint says the request is invalid:
    retrying the same message cannot help (needs_review with `reason`)."""


class ProcessorConfigError(ConfigError):
    """A `[[processors]]` table is invalid; the message names the processor and key."""
