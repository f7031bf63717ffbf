"""One exception tree for inboxd (CONTRIBUTING.md rule 4).

    InboxdError
    ├── PermanentError        this item can never succeed: record a dead item, move on
    │   └── UnparseableMessage
    ├── RetriableError        may succeed later: back off and retry, never advance a cursor
    │   ├── DatabaseUnavailableError
    │   ├── StoreUnavailableError
    │   └── CursorExpired     the provider forgot the cursor: full resync (the runner)
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

from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum

import asyncpg
from asyncpg.exceptions import _base as asyncpg_base


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


class CursorExpired(RetriableError):
    """The provider no longer knows the cursor (Gmail history 404, Graph 410,
    IMAP UIDVALIDITY change). Raised by a source's `pages`; the runner resets the
    cursor with the lease's token (a `mailbox.cursor_reset` event) and resyncs
    from the beginning in the same run — idempotent through the cascade.

    `restart_from`: a source whose cursor is several independent positions (one
    delta link per Outlook folder) restarts only the part that expired: the
    cursor is reset to this value instead of nothing, and the resync starts there.
    A door whose first sync is windowed by `backfill` names a cursor of its own
    meaning "reset: everything not stored" (Gmail's RELIST_CURSOR) the same way.
    """

    def __init__(self, message: str, *, restart_from: str | None = None) -> None:
        super().__init__(message)
        self.restart_from = restart_from


class AttentionError(InboxdError):
    """An operator must fix something; syncing this mailbox stops until then."""


class AuthError(AttentionError):
    """Credentials were rejected or revoked."""


class ConfigError(AttentionError):
    """Configuration is invalid; the message names the file and key."""


class NotConnected(AttentionError):
    """A provider mailbox has no credential yet (valid configuration: it is connected
    with `inboxd connect` afterwards). Its state is needs_connect, and the message
    says which command connects it."""


# --- classifying and describing errors ---------------------------------------------------

# SQLSTATE classes that can be caused by one item's content: data exception (22),
# integrity constraint violation (23), program limit exceeded (54, e.g. a row or
# index entry too big). Anything else says nothing about the items.
DATA_SQLSTATE_CLASSES = ("22", "23", "54")
#: Longest error text kept in a row or a log line.
DESCRIBE_MAX_CHARS = 300


# --- the database-error boundary --------------------------------------------------------
#
# Every caller that talks to PostgreSQL asks this section what an exception means,
# the way httpx maps transport errors in one place; nobody keeps a tuple of its own.
#
#     unavailable  the server or the connection is gone, starting, restarting or out
#                  of resources, or asyncpg's connection state broke with it
#                  (InterfaceError, InternalClientError "cannot switch to state …"
#                  after a dropped connection): nothing was committed, the same call
#                  may succeed later → back off and retry; /readyz answers 503
#     race         serialization failure or deadlock (SQLSTATE class 40), lock not
#                  available (55P03): retry soon, the data is fine
#     data         the content written: a data exception (22, asyncpg's own argument
#                  encoding errors included), integrity (23), program limit (54) →
#                  the request's or the item's fault, never an outage
#     bug          anything else (42 undefined table, …): a defect, logged with its
#                  traceback; retried with backoff like a crash


class DbFault(StrEnum):
    UNAVAILABLE = "unavailable"
    RACE = "race"
    DATA = "data"
    BUG = "bug"


#: Every exception a database call raises that is not a bug of the caller's own
#: Python: for `except DATABASE_ERRORS as exc:` followed by `db_fault(exc)`.
DATABASE_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg_base.InternalClientError,
)
# SQLSTATE classes of a server that cannot serve now: connection exception (08),
# insufficient resources (53), operator intervention (57: shutdown, restart,
# query cancelled), system error (58), internal error (XX).
UNAVAILABLE_SQLSTATE_CLASSES = ("08", "53", "57", "58", "XX")
RACE_SQLSTATES = ("55P03",)
RACE_SQLSTATE_CLASSES = ("40",)


def db_fault(exc: BaseException) -> DbFault:
    """What a database exception means for the caller (table above)."""
    if isinstance(exc, asyncpg_base.DataError):  # an argument asyncpg could not encode
        return DbFault.DATA
    if isinstance(exc, asyncpg.PostgresError):
        sqlstate = getattr(exc, "sqlstate", None) or ""
        if sqlstate[:2] in DATA_SQLSTATE_CLASSES:
            return DbFault.DATA
        if sqlstate[:2] in RACE_SQLSTATE_CLASSES or sqlstate in RACE_SQLSTATES:
            return DbFault.RACE
        if sqlstate[:2] in UNAVAILABLE_SQLSTATE_CLASSES:
            return DbFault.UNAVAILABLE
        return DbFault.BUG
    if isinstance(exc, OSError | TimeoutError | asyncpg.InterfaceError):
        return DbFault.UNAVAILABLE
    if isinstance(exc, asyncpg_base.InternalClientError):
        return DbFault.UNAVAILABLE
    return DbFault.BUG


def is_transient(exc: BaseException) -> bool:
    """True when the same database call may well succeed later (unavailable or race)."""
    return isinstance(exc, DATABASE_ERRORS) and db_fault(exc) in (
        DbFault.UNAVAILABLE,
        DbFault.RACE,
    )


def blames_the_data(exc: BaseException) -> bool:
    """True when a database error can be caused by the content written (so
    writing the items one by one isolates the culprit); False for anything
    that says nothing about them (connection, lock, server trouble)."""
    return isinstance(exc, DATABASE_ERRORS) and db_fault(exc) is DbFault.DATA


@contextmanager
def database_unavailable_as_retriable() -> Iterator[None]:
    """Turn a transient database error into `DatabaseUnavailableError` (a
    RetriableError), so code above this boundary decides by family alone."""
    try:
        yield
    except DATABASE_ERRORS as exc:
        if not is_transient(exc):
            raise
        raise DatabaseUnavailableError(describe(exc)) from exc


# --- what the supervisor does about an error ----------------------------------------------


class Family(StrEnum):
    """The three families of the tree, plus `crash` for what is none of them."""

    PERMANENT = "permanent"  # record and move on
    RETRIABLE = "retriable"  # back off and retry
    ATTENTION = "attention"  # mark the mailbox needs_attention, stop syncing it
    CRASH = "crash"  # a defect: log with traceback, then back off and retry


def family_of(exc: BaseException) -> Family:
    """The one mapping from an exception to what a sync loop does about it."""
    if isinstance(exc, AttentionError):
        return Family.ATTENTION
    if isinstance(exc, PermanentError):
        return Family.PERMANENT
    if isinstance(exc, RetriableError) or is_transient(exc):
        return Family.RETRIABLE
    return Family.CRASH


def describe(exc: BaseException) -> str:
    """The error on one line (whitespace runs collapsed), at most DESCRIBE_MAX_CHARS."""
    return (" ".join(str(exc).split()) or type(exc).__name__)[:DESCRIBE_MAX_CHARS]
