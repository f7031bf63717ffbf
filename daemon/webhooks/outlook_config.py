"""Turning the tenants' `[outlook]` tables into the served Graph notification table.

A tenant is served at `POST /push/outlook/<tenant>` (and `…/lifecycle`) when it
has an `[outlook]` table that parses. `notification_url` is not required: without
it no new subscription is created, but those created before it was removed keep
notifying until they expire, and their notifications still verify against their
rows (adapters/outlook/notifications.py). Nothing here is a secret: each notification is
checked against its subscription's `client_state` in the database, so a tenant's
entry is only its id and its Outlook mailboxes.
"""

from __future__ import annotations

from collections.abc import Mapping

from inboxd.adapters.outlook.config import OutlookSettings
from inboxd.adapters.outlook.errors import OutlookConfigError
from inboxd.adapters.outlook.notifications import OutlookPushTenant
from inboxd.daemon.config.reader import ConfigProblem
from inboxd.daemon.config.tenant import TenantConfig

__all__ = ["build_outlook_push"]


def build_outlook_push(
    tenants: Mapping[str, TenantConfig],
) -> tuple[dict[str, OutlookPushTenant], list[ConfigProblem]]:
    """The served tenants, and a problem per `[outlook]` table that cannot be served
    (check-config has reported it already; a daemon logs it)."""
    served: dict[str, OutlookPushTenant] = {}
    problems: list[ConfigProblem] = []
    for tenant in sorted(tenants.values(), key=lambda t: t.tenant_id):
        if tenant.outlook is None:
            continue
        try:
            OutlookSettings.from_settings(tenant.outlook)
        except OutlookConfigError as exc:
            key, sep, message = str(exc).partition(": ")
            where = f"outlook.{key}" if sep else "outlook"
            problems.append(ConfigProblem(tenant.source_file, where, message or str(exc)))
            continue
        mailboxes = frozenset(m.mailbox_id for m in tenant.mailboxes if m.provider == "outlook")
        served[tenant.tenant_id] = OutlookPushTenant(tenant.tenant_id, mailboxes)
    return served, problems
