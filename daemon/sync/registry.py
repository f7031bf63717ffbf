"""Which adapter serves which provider: the daemon's one registry of doors.

Adding a provider = one adapter folder (adapters/<name>/, see adapters/base.py)
plus one line here. `SourceDeps` is what the daemon lends a door beyond its
config: the pool, for the Gmail door's "which ids are stored already" question
and its users.watch bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from inboxd.adapters.base import Source
from inboxd.adapters.http_fetch import SharedSessions
from inboxd.adapters.imap.idle_slots import IdleSlots
from inboxd.daemon.config.tenant import MailboxConfig
from inboxd.pipeline.copies import known_copies, live_copies_under
from inboxd.pipeline.errors import ConfigError, NotConnected
from inboxd.pipeline.mailbox.scheduling import record_watch_expiry

__all__ = ["SourceDeps", "build_source"]


@dataclass(frozen=True, slots=True)
class SourceDeps:
    """What a door may use of the daemon (fleet.py passes RunnerDeps' pool)."""

    pool: asyncpg.Pool
    # The process's bound on IMAP IDLE connections ([sync] max_imap_idle); None: none.
    imap_idle: IdleSlots | None = None
    # One HTTP session per door for every mailbox of the process; None: each its own.
    http: SharedSessions | None = None


# Each builder imports its door when a configured mailbox uses it: a daemon without
# Outlook mailboxes never loads msgraph-sdk (docs/architecture.md "The Outlook door").


def _maildir(mailbox: MailboxConfig, page_size: int, _deps: SourceDeps) -> Source:
    from inboxd.adapters.maildir import MaildirSource
    from inboxd.adapters.maildir.config import MaildirConfig

    source = MaildirSource(
        mailbox.tenant_id,
        mailbox.mailbox_id,
        MaildirConfig.from_settings(mailbox.settings),
        page_size=page_size,
    )
    source.ensure_layout()
    return source


def _gmail(mailbox: MailboxConfig, _page_size: int, deps: SourceDeps) -> Source:
    # Pages follow Gmail's own list/history pages (≤ 500 ids), not [workers] batch_size.
    from inboxd.adapters.gmail.config import GmailMailbox, GmailSettings
    from inboxd.adapters.gmail.source import GmailSource, shared_connections, shared_session

    tenant, mailbox_id = mailbox.tenant_id, mailbox.mailbox_id
    settings = GmailSettings.from_settings(mailbox.tenant_settings)
    gmail = GmailMailbox.from_settings(mailbox.settings, address=mailbox.address or None)
    gmail.check_against(settings)
    if not gmail.connected:
        raise NotConnected(
            f"not connected: run 'inboxd connect gmail --tenant {tenant} --mailbox "
            f"{mailbox_id}' and add the refresh_token line it prints (or set "
            "service_account), then reload"
        )

    async def known(ids: Sequence[str]) -> set[str]:
        return await known_copies(deps.pool, tenant, mailbox_id, ids)

    async def record_watch(expires_at: datetime) -> None:
        await record_watch_expiry(deps.pool, tenant, mailbox_id, expires_at)

    return GmailSource(
        tenant,
        mailbox_id,
        settings,
        gmail,
        known,
        record_watch=record_watch,
        units_per_s=settings.quota_units_per_s,
        session=deps.http.session("gmail", shared_session) if deps.http else None,
        connections=deps.http.limiter("gmail", shared_connections) if deps.http else None,
    )


def _outlook(mailbox: MailboxConfig, _page_size: int, deps: SourceDeps) -> Source:
    # Pages follow Graph's delta pages (Prefer: odata.maxpagesize), not [workers] batch_size.
    from inboxd.adapters.outlook.config import OutlookMailbox, OutlookSettings
    from inboxd.adapters.outlook.source import OutlookSource

    tenant, mailbox_id = mailbox.tenant_id, mailbox.mailbox_id
    settings = OutlookSettings.from_settings(mailbox.tenant_settings)
    outlook = OutlookMailbox.from_settings(mailbox.settings, address=mailbox.address or None)
    outlook.check_against(settings)
    if not outlook.connected(settings):
        raise NotConnected(
            f"not connected: run 'inboxd connect outlook --tenant {tenant} --mailbox "
            f"{mailbox_id}' and add the refresh_token line it prints (or set [outlook] "
            "client_secret or certificate for app-only access), then reload"
        )

    async def known(ids: Sequence[str]) -> set[str]:
        return await known_copies(deps.pool, tenant, mailbox_id, ids)

    async def record_watch(expires_at: datetime | None) -> None:
        await record_watch_expiry(deps.pool, tenant, mailbox_id, expires_at)

    return OutlookSource(
        tenant, mailbox_id, settings, outlook, known, deps.pool, record_watch=record_watch
    )


def _imap(mailbox: MailboxConfig, _page_size: int, deps: SourceDeps) -> Source:
    # Pages are UID windows (adapters/imap/source.py IMAP_WINDOW), not [workers] batch_size.
    from inboxd.adapters.imap.config import ImapMailbox
    from inboxd.adapters.imap.source import ImapSource

    tenant, mailbox_id = mailbox.tenant_id, mailbox.mailbox_id

    async def stored_under(prefix: str) -> list[str]:
        return await live_copies_under(deps.pool, tenant, mailbox_id, prefix)

    return ImapSource(
        tenant,
        mailbox_id,
        ImapMailbox.from_settings(mailbox.settings),
        stored_under=stored_under,
        idle_slots=deps.imap_idle,
        poll_interval_s=mailbox.poll_interval_s,
    )


_BUILDERS: dict[str, Callable[[MailboxConfig, int, SourceDeps], Source]] = {
    "maildir": _maildir,
    "gmail": _gmail,
    "outlook": _outlook,
    "imap": _imap,
}


def build_source(mailbox: MailboxConfig, deps: SourceDeps, *, page_size: int) -> Source:
    """The Source for a configured mailbox; ConfigError for providers not built yet
    (and the adapter's own config errors, e.g. GmailConfigError).

    `page_size`: items per page, i.e. per ingest transaction ([workers] batch_size),
    for doors that choose their page size.
    """
    builder = _BUILDERS.get(mailbox.provider)
    if builder is None:
        raise ConfigError(
            f"provider {mailbox.provider!r} is not available in this version of inboxd"
        )
    return builder(mailbox, page_size, deps)
