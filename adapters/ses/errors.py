"""SES door errors, in pipeline/errors.py's tree.

    SesConfigError (ConfigError, ValueError)   a `[ses]` table or ses mailbox entry the
                                               door cannot use; names the key, never a value
    SesPermanent (PermanentError)              this SQS message can never succeed: it is
                                               recorded as dead and deleted from the queue.
                                               `reason` is the dead item's reason code.
    SesTransient (RetriableError)              may succeed later: the SQS message is left
                                               for SQS to redeliver after its visibility
                                               timeout (S3 5xx, throttling, network)

Messages name the bucket and key, never an object's bytes or a credential.
"""

from __future__ import annotations

from inboxd.pipeline.errors import ConfigError, PermanentError, RetriableError

__all__ = ["SesConfigError", "SesPermanent", "SesTransient"]


class SesConfigError(ConfigError, ValueError):
    """A `[ses]` table or ses mailbox entry the door cannot use ("key: why")."""


class SesPermanent(PermanentError):
    """Permanent for this message; `reason` is a short machine-readable code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class SesTransient(RetriableError):
    """Worth another try after SQS redelivers the message."""
