"""Secret references: how a config file names a secret without containing it.

docs/architecture.md §5: secrets are references, never inline, never logged. A reference is

    env:NAME      the value of environment variable NAME
    file:/path    the contents of a file (systemd credentials, Kubernetes/Docker
                  secrets, a 0600 file); `~` is expanded, a relative path is
                  relative to the working directory

Values are read when `Secret.reveal()` is called, not when the config is
loaded, so a rotated file is picked up by the next use, and nothing holds the
value longer than its caller. Surrounding whitespace is stripped (so
`echo … > file` and `KEY=value ` work) and an empty value is an error. DSN
references (`database._dereference`) are resolved here too.

A `Secret` only ever shows its reference: `repr`, `str` and f-strings give
``Secret('env:NAME')``. Error messages here name the reference, the variable or
the path, never a value — and when a config holds a literal where a reference
belongs, the message does not echo the literal either.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from inboxd.pipeline.errors import ConfigError

__all__ = [
    "SECRET_KEY_NAMES",
    "SECRET_KEY_SUFFIXES",
    "Secret",
    "SecretError",
    "is_secret_key",
    "parse_secret_ref",
    "secret_ref_error",
]

_PREFIXES = ("env:", "file:")

# Config keys whose value is a credential and so must be a reference. Exact names,
# plus any key ending in one of the suffixes (`client_secret`, `refresh_token`,
# `smtp_password`, `service_account_credentials`, ...). `service_account` is a
# Gmail mailbox's service-account key JSON (a private key); matched exactly, so
# `push_service_account` (an email address) stays a plain value.
SECRET_KEY_NAMES = frozenset(
    {
        "password",
        "service_account",
        "token",
        "secret",
        "credentials",
        "api_key",
        "private_key",
        "signing_key",
        # an app's certificate and private key, PEM ([outlook] certificate)
        "certificate",
    }
)
SECRET_KEY_SUFFIXES = ("_secret", "_password", "_token", "_credentials")

USE_A_REFERENCE = 'use a secret reference, "env:NAME" or "file:/path"'


class SecretError(ConfigError):
    """A reference that is malformed or cannot be resolved (variable unset, file
    unreadable or empty). The message names the reference, never a value."""


@dataclass(frozen=True, slots=True)
class Secret:
    """A reference to a secret (`env:NAME` or `file:/path`), resolved on `reveal()`.

    Holds only the reference string; safe to log, compare and keep in config
    objects. Build one with `parse_secret_ref` (config input) or directly from a
    known-good reference; a literal raises `SecretError` without echoing it.
    """

    ref: str

    def __post_init__(self) -> None:
        problem = secret_ref_error(self.ref)
        if problem is not None:
            raise SecretError(f"Secret: {problem}")

    @property
    def kind(self) -> str:
        """`env` or `file`."""
        return self.ref.partition(":")[0]

    @property
    def target(self) -> str:
        """The variable name or the path the reference points at."""
        return self.ref.partition(":")[2].strip()

    def reveal(self, environ: Mapping[str, str] | None = None) -> str:
        """Read the secret now (`environ` defaults to `os.environ`).

        Returns the value with surrounding whitespace stripped. Raises `SecretError`
        when the variable is unset or empty, or the file is missing, unreadable,
        not UTF-8 or empty; the message names the reference, never the value.
        """
        if self.kind == "env":
            environ = os.environ if environ is None else environ
            value = environ.get(self.target, "").strip()
            if not value:
                raise SecretError(
                    f"{self.ref}: environment variable {self.target} is not set or empty"
                )
            return value
        path = Path(self.target).expanduser()
        try:
            value = path.read_text(encoding="utf-8").strip()
        except UnicodeDecodeError:
            # The decoder's message quotes the offending byte: do not pass it on.
            raise SecretError(f"{self.ref}: {path} is not UTF-8 text") from None
        except OSError as exc:
            raise SecretError(f"{self.ref}: cannot read {path}: {exc.strerror or exc}") from None
        if not value:
            raise SecretError(f"{self.ref}: {path} is empty")
        return value

    def __repr__(self) -> str:
        return f"Secret({self.ref!r})"

    __str__ = __repr__


def secret_ref_error(value: object) -> str | None:
    """Why `value` is not a usable secret reference, or None when it is one.

    The reason never contains `value` itself (it may be a pasted password).
    """
    if not isinstance(value, str):
        return f'expected a secret reference ("env:NAME" or "file:/path"), got {_type_name(value)}'
    text = value.strip()
    if not text.startswith(_PREFIXES):
        if not text:
            return f"empty value: {USE_A_REFERENCE} (or remove the key)"
        return (
            f"literal secrets are not allowed in config files: {USE_A_REFERENCE} "
            "(the value is not shown)"
        )
    kind, _, target = text.partition(":")
    if not target.strip():
        example = "env:MY_TOKEN" if kind == "env" else "file:/run/secrets/my-token"
        what = "a variable name" if kind == "env" else "a path"
        return f"{kind}: needs {what}, e.g. {example}"
    return None


def parse_secret_ref(value: object, where: str) -> Secret:
    """The `Secret` for a config value; `where` names it in errors (e.g. a key path).

    Raises `SecretError` for anything but `env:NAME` / `file:/path` — literals
    included, with a message that does not contain the literal. Does not resolve
    the reference (see `Secret.reveal`).
    """
    problem = secret_ref_error(value)
    if problem is not None:
        raise SecretError(f"{where}: {problem}")
    assert isinstance(value, str)
    return Secret(value.strip())


def is_secret_key(name: str) -> bool:
    """True when a config key of this name holds a credential (and so a reference)."""
    lowered = name.lower()
    return lowered in SECRET_KEY_NAMES or lowered.endswith(SECRET_KEY_SUFFIXES)


def _type_name(value: object) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, dict | Mapping):
        return "a table"
    if isinstance(value, list | tuple):
        return "an array"
    if isinstance(value, str):
        return "a string"
    return f"a {type(value).__name__}"
