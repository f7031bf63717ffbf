"""The provider-specific keys of a tenant file's `[[mailboxes]]` entry: `maildir`'s
path, `ses`'s and `imap`'s keys checked by their adapter's config.py, so that
check-config names the file and key (daemon/config/tenant.py parses the generic keys)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from inboxd.adapters.imap.config import MAILBOX_KEYS as IMAP_KEYS
from inboxd.adapters.imap.config import ImapMailbox
from inboxd.adapters.imap.errors import ImapConfigError
from inboxd.adapters.ses.config import MAILBOX_KEYS, SesMailbox
from inboxd.adapters.ses.errors import SesConfigError
from inboxd.daemon.config.provider_tables import with_stand_ins
from inboxd.daemon.config.reader import Reader, join_key, relative_to

__all__ = ["GENERIC_MAILBOX_KEYS", "imap_settings", "maildir_settings", "ses_settings"]

# The keys every mailbox has, whatever its provider.
GENERIC_MAILBOX_KEYS = ("id", "provider", "address", "sync_mode", "poll_interval_s")


def maildir_settings(r: Reader, table: dict[str, Any], prefix: str, base: Path) -> dict[str, Any]:
    text = r.string(table, "path", prefix, required=True, nonempty=True)
    if text is None:
        return {}
    path = relative_to(base, text)
    # A missing directory is created when the door starts; a file in its place is not
    # something we should turn into a Maildir.
    if path.exists() and not path.is_dir():
        r.problem(join_key(prefix, "path"), f"{path} exists and is not a directory")
    return {"path": path}


def ses_settings(r: Reader, extra: dict[str, Any], prefix: str) -> Mapping[str, Any]:
    """An ses mailbox's keys, checked by the adapter; kept normalised (addresses
    lower-cased) so that routing and the duplicate check compare like with like."""
    r.unknown_keys(
        extra, GENERIC_MAILBOX_KEYS + MAILBOX_KEYS, prefix, what='key for provider "ses"'
    )
    try:
        mailbox = SesMailbox.from_settings({k: v for k, v in extra.items() if k in MAILBOX_KEYS})
    except SesConfigError as exc:
        key, _, why = str(exc).partition(": ")
        r.problem(join_key(prefix, key), why)
        return MappingProxyType({})
    return MappingProxyType(
        {
            "addresses": mailbox.addresses,
            "allowed_senders": mailbox.allowed_senders,
            "keep_objects": mailbox.keep_objects,
        }
    )


def imap_settings(r: Reader, extra: dict[str, Any], prefix: str) -> Mapping[str, Any]:
    """An imap mailbox's keys, checked by the adapter (secrets wrapped first)."""
    r.unknown_keys(
        extra, GENERIC_MAILBOX_KEYS + tuple(IMAP_KEYS), prefix, what='key for provider "imap"'
    )
    # every key's secrets checked (a literal password under a misspelt key is still
    # refused), the adapter's keys kept
    frozen = MappingProxyType({k: v for k, v in r.freeze(extra, prefix).items() if k in IMAP_KEYS})
    try:
        ImapMailbox.from_settings(with_stand_ins(frozen))
    except ImapConfigError as exc:
        key, _, why = str(exc).partition(": ")
        r.problem(join_key(prefix, key), why)
    return frozen
