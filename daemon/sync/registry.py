"""Which adapter serves which provider: the daemon's one registry of doors.

Adding a provider = one adapter folder (adapters/<name>/, see adapters/base.py)
plus one line here.
"""

from __future__ import annotations

from collections.abc import Callable

from inboxd.adapters.base import Source
from inboxd.adapters.maildir import MaildirSource
from inboxd.adapters.maildir.config import MaildirConfig
from inboxd.daemon.tenant_config import MailboxConfig
from inboxd.pipeline.errors import ConfigError


def _maildir(mailbox: MailboxConfig, page_size: int) -> Source:
    source = MaildirSource(
        mailbox.tenant_id,
        mailbox.mailbox_id,
        MaildirConfig.from_settings(mailbox.settings),
        page_size=page_size,
    )
    source.ensure_layout()
    return source


_BUILDERS: dict[str, Callable[[MailboxConfig, int], Source]] = {
    "maildir": _maildir,
}


def build_source(mailbox: MailboxConfig, *, page_size: int) -> Source:
    """The Source for a configured mailbox; ConfigError for providers not built yet.

    `page_size`: items per page, i.e. per ingest transaction ([workers] batch_size).
    """
    builder = _BUILDERS.get(mailbox.provider)
    if builder is None:
        raise ConfigError(
            f"provider {mailbox.provider!r} is not available in this version of inboxd"
        )
    return builder(mailbox, page_size)
