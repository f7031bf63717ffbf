"""Import door errors: what `inboxd import` reports about the paths it was given."""

from __future__ import annotations


class SourceError(Exception):
    """A path cannot be read: missing, unreadable, or not a file or directory.

    The message is one line and names the path. Raised by `plan_import` before
    anything is read, and by `iter_messages` when a file changes under us.
    """
