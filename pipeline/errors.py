"""One exception tree for inboxd (STYLE.md rule 4).

    InboxdError
    ├── PermanentError        this item can never succeed: record a dead item, move on
    │   └── UnparseableMessage
    ├── RetriableError        may succeed later: back off and retry, never advance a cursor
    │   ├── DatabaseUnavailableError
    │   └── StoreUnavailableError
    └── AttentionError        a human must act (credentials revoked, config wrong):
        ├── AuthError             mark the mailbox needs_attention, stop syncing it
        └── ConfigError

Adapters translate provider errors at their boundary (`raise … from exc`);
the supervisor maps the three families to "record and move on", "back off and
retry", "mark mailbox as needing attention" in one place. The ingest stage
itself never raises for item content: it answers per-item Outcomes
(pipeline.outcomes), which are the same three families item by item.
"""

from __future__ import annotations


class InboxdError(Exception):
    """Base of every error inboxd raises on purpose."""


class PermanentError(InboxdError):
    """Retrying cannot help: the item is recorded as dead and does not pin a cursor."""


class UnparseableMessage(PermanentError):
    """Bytes that are not an RFC 5322 message at all."""


class RetriableError(InboxdError):
    """Transient: the same call may succeed later. Cursors stay where they are."""


class DatabaseUnavailableError(RetriableError):
    """PostgreSQL did not answer or dropped the connection."""


class StoreUnavailableError(RetriableError):
    """The object store did not take or give bytes."""


class AttentionError(InboxdError):
    """An operator must fix something; syncing this mailbox stops until then."""


class AuthError(AttentionError):
    """Credentials were rejected or revoked."""


class ConfigError(AttentionError):
    """Configuration is invalid; the message names the file and key."""


# --- classifying and describing errors ---------------------------------------------------

# SQLSTATE classes that can be caused by one item's content: data exception (22),
# integrity constraint violation (23), program limit exceeded (54, e.g. a row or
# index entry too big). Anything else says nothing about the items.
DATA_SQLSTATE_CLASSES = ("22", "23", "54")
#: Longest error text kept in a row or a log line.
DESCRIBE_MAX_CHARS = 300


def blames_the_data(exc: BaseException) -> bool:
    """True when a database error can be caused by the content written (so
    writing the items one by one isolates the culprit); False for anything
    that says nothing about them (connection, lock, server trouble)."""
    sqlstate = getattr(exc, "sqlstate", None) or ""
    return sqlstate[:2] in DATA_SQLSTATE_CLASSES


def describe(exc: BaseException) -> str:
    """The error on one line (whitespace runs collapsed), at most DESCRIBE_MAX_CHARS."""
    return (" ".join(str(exc).split()) or type(exc).__name__)[:DESCRIBE_MAX_CHARS]
