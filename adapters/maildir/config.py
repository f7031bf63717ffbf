"""Maildir door settings, from a tenant file's [[mailboxes]] entry (provider = "maildir")."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from inboxd.adapters.maildir.errors import MaildirMissing


@dataclass(frozen=True, slots=True)
class MaildirConfig:
    """`path`: the Maildir (with cur/ new/ tmp/), created on start when missing."""

    path: Path

    @classmethod
    def from_settings(cls, settings: Mapping[str, object]) -> MaildirConfig:
        path = settings.get("path")
        if not isinstance(path, str | Path) or not str(path):
            raise MaildirMissing("maildir mailbox needs a `path`")
        return cls(Path(path))
