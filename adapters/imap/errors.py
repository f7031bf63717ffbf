"""IMAP door errors, in pipeline/errors.py's tree.

    ImapConfigError (ConfigError, ValueError)   a mailbox entry the door cannot use
                                                ("key: why", never a value)
    ImapAuthError (AuthError)                   the server refused the credentials
                                                (LOGIN answered NO [AUTHENTICATIONFAILED]
                                                or [AUTHORIZATIONFAILED], or a NO without
                                                a code several times in a row): the
                                                mailbox needs attention, with the
                                                server's text, and is not retried
    ImapCertificateError (AttentionError)       the server's certificate failed
                                                verification: an operator's problem
                                                (CA, host name), not an outage
    ImapNotTls (AttentionError)                 `security = "tls"` and the server
                                                answered the handshake in clear (the
                                                STARTTLS or plain port): the port or
                                                the setting is wrong
    ImapUnavailable (RetriableError)            connect, timeout, BYE, a dropped
                                                connection, a login answered NO
                                                [UNAVAILABLE]/[SERVERBUG]/[LIMIT]/[INUSE]
                                                (RFC 5530: temporary): retried with backoff
    ImapLoginRefused (ImapUnavailable)          a login answered NO without a code we
                                                know: retried, an auth error after
                                                LOGIN_REFUSED_ATTEMPTS in a row (source.py)
    ImapProtocolError (RetriableError)          an answer we could not read, a NO/BAD
                                                to SELECT or SEARCH: retried, logged
    ImapFolderMissing (ImapProtocolError)       EXAMINE of a folder the server does not
                                                have: the other folders sync (source.py)
    ImapFolderRefused (ImapProtocolError)       EXAMINE of a folder that exists answered
                                                NO (no rights, [SERVERBUG], [INUSE] ...):
                                                the other folders sync too

Messages name the host, folder and command, never a password or a token.
"""

from __future__ import annotations

from inboxd.pipeline.errors import AttentionError, AuthError, ConfigError, RetriableError

__all__ = [
    "ImapAuthError",
    "ImapCertificateError",
    "ImapConfigError",
    "ImapFolderMissing",
    "ImapFolderRefused",
    "ImapLoginRefused",
    "ImapNotTls",
    "ImapProtocolError",
    "ImapUnavailable",
]


class ImapConfigError(ConfigError, ValueError):
    """An imap mailbox entry the door cannot use ("key: why")."""


class ImapAuthError(AuthError):
    """Credentials refused for good: a person must act."""


class ImapCertificateError(AttentionError):
    """The server's certificate failed verification: a person must act."""


class ImapNotTls(AttentionError):
    """The port does not speak TLS at once: an operator's setting, not an outage."""


class ImapUnavailable(RetriableError):
    """The server could not be reached, dropped us or cannot log us in now; try again later."""


class ImapLoginRefused(ImapUnavailable):
    """A login answered NO without saying why: the credential is wrong only if it lasts."""


class ImapProtocolError(RetriableError):
    """The server answered something we cannot use for this command."""


class ImapFolderMissing(ImapProtocolError):
    """A configured folder the server does not have (EXAMINE answered NO, LIST empty)."""

    def __init__(self, message: str, folder: str) -> None:
        super().__init__(message)
        self.folder = folder


class ImapFolderRefused(ImapProtocolError):
    """A configured folder the server has but will not open (EXAMINE answered NO);
    `temporary` when its response code says so (RFC 5530 [UNAVAILABLE], [LIMIT],
    [INUSE]): then it never puts the mailbox in needs_attention."""

    def __init__(
        self, message: str, folder: str, *, temporary: bool, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.folder = folder
        self.temporary = temporary
        self.code = code  # the NO's response code, when it had one
