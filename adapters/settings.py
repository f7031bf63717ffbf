"""Readers of a door's settings tables, shared by the doors' config.py modules.

Every reader takes the door's config error class (a ValueError subclass, e.g.
GmailConfigError) and raises it with a message that starts with the key and never
quotes a value: the daemon turns "key: message" into a problem at file.key
(daemon/config/tenant.py), and a value may be a credential written inline.

Secrets arrive as reference objects (the daemon builds them from `env:` / `file:`
strings) and are revealed only when a token is requested; adapters do not import
the daemon, so any object with `reveal() -> str` will do (`Revealable`).
"""

from __future__ import annotations

from collections.abc import Mapping
from ipaddress import ip_address
from typing import Literal, Protocol, runtime_checkable
from urllib.parse import urlsplit

__all__ = [
    "MAX_BACKFILL_DAYS",
    "Backfill",
    "Revealable",
    "backfill",
    "is_loopback",
    "optional_secret",
    "optional_text",
    "refuse_unknown",
    "url",
]

#: Longest backfill in days that is still a number (about 50 years); use "all" beyond.
MAX_BACKFILL_DAYS = 20_000

Backfill = Literal["all", "none"] | int
ConfigErrorType = type[ValueError]


@runtime_checkable
class Revealable(Protocol):
    """A secret reference: the value is read on `reveal()`, never stored in config."""

    def reveal(self) -> str: ...


def refuse_unknown(
    settings: Mapping[str, object], known: frozenset[str], where: str, error: ConfigErrorType
) -> None:
    unknown = sorted(set(settings) - known)
    if unknown:
        raise error(
            f"{', '.join(unknown)}: unknown key(s) in {where} (known: {', '.join(sorted(known))})"
        )


def optional_text(settings: Mapping[str, object], key: str, error: ConfigErrorType) -> str | None:
    value = settings.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise error(f"{key}: expected a non-empty string")
    return value.strip()


def optional_secret(
    settings: Mapping[str, object], key: str, error: ConfigErrorType
) -> Revealable | None:
    value = settings.get(key)
    if value is None:
        return None
    if not isinstance(value, Revealable):
        # A plain string here is an inline credential (or a reference the daemon
        # did not resolve): refuse it without echoing it (docs/architecture.md §5).
        raise error(f'{key}: use a secret reference, "env:NAME" or "file:/path"')
    return value


def url(settings: Mapping[str, object], key: str, default: str, error: ConfigErrorType) -> str:
    """An https URL without its trailing slash; plain http only to this machine."""
    value = optional_text(settings, key, error)
    if value is None:
        return default
    parts = urlsplit(value)
    if parts.scheme == "https" and parts.hostname:
        return value.rstrip("/")
    if parts.scheme == "http" and parts.hostname and is_loopback(parts.hostname):
        # Plain http only to this machine (test fakes): tokens never cross a network
        # in clear text.
        return value.rstrip("/")
    raise error(f"{key}: expected an https:// URL (http:// only for loopback)")


def is_loopback(host: str) -> bool:
    """localhost or a loopback address: traffic that never leaves this machine."""
    if host == "localhost":
        return True
    try:
        return ip_address(host).is_loopback
    except ValueError:
        return False


def backfill(settings: Mapping[str, object], default: int, error: ConfigErrorType) -> Backfill:
    """`backfill`: "all", "none" (only mail from now on) or a number of days."""
    value = settings.get("backfill", default)
    if value == "all":
        return "all"
    if value == "none":
        return "none"
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_BACKFILL_DAYS:
        return value
    raise error(
        f'backfill: expected "all", "none" or a number of days from 1 to {MAX_BACKFILL_DAYS}'
    )
