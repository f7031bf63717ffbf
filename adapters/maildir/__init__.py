"""The Maildir door: a directory whose new/ is watched; what lands there is ingested."""

from inboxd.adapters.maildir.source import MaildirSource

__all__ = ["MaildirSource"]
