"""Maildir door errors, translated into the pipeline's tree at the boundary."""

from __future__ import annotations

from inboxd.pipeline.errors import ConfigError, RetriableError


class MaildirMissing(ConfigError):
    """The configured path is not a Maildir and cannot be made one."""


class MaildirUnavailable(RetriableError):
    """Listing or reading the Maildir failed (I/O error, permissions changed)."""
