"""IMAP door errors, in pipeline/errors.py's tree.

    ImapConfigError (ConfigError, ValueError)   a mailbox entry the door cannot use
                                                ("key: why", never a value)
    ImapAuthError (AuthError)                   the server refused the credentials
                                                (LOGIN/AUTHENTICATE answered NO): the
                                                mailbox needs attention, with the
                                                server's text, and is not retried
    ImapUnavailable (RetriableError)            connect, TLS, timeout, BYE, a dropped
                                                connection: retried with backoff
    ImapProtocolError (RetriableError)          an answer we could not read, a NO/BAD
                                                to SELECT or SEARCH: retried, logged

Messages name the host, folder and command, never a password or a token.
"""

from __future__ import annotations

from inboxd.pipeline.errors import AuthError, ConfigError, RetriableError

__all__ = ["ImapAuthError", "ImapConfigError", "ImapProtocolError", "ImapUnavailable"]


class ImapConfigError(ConfigError, ValueError):
    """An imap mailbox entry the door cannot use ("key: why")."""


class ImapAuthError(AuthError):
    """Credentials refused for good: a person must act."""


class ImapUnavailable(RetriableError):
    """The server could not be reached or dropped us; try again later."""


class ImapProtocolError(RetriableError):
    """The server answered something we cannot use for this command."""
