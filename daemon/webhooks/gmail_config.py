"""Turning the tenants' `[gmail]` tables into the served Gmail push table (the
route is adapters/gmail/push_route.py).

A tenant is served at `POST /push/gmail/<tenant>` when its `[gmail]` table has
both `push_audience` (the audience of its Pub/Sub push subscription) and
`push_service_account` (the account the subscription signs as): without them
nothing could be verified, so the route answers 404 for the tenant. Its Gmail
mailboxes are looked up by address, the `emailAddress` of a Gmail push.

One `GoogleCerts` per certificate URL is shared by every tenant of one build, so
a hundred tenants cost one certificate fetch, not a hundred.
"""

from __future__ import annotations

from collections.abc import Mapping

from inboxd.adapters.gmail.config import GmailSettings
from inboxd.adapters.gmail.errors import GmailConfigError
from inboxd.adapters.gmail.push import GoogleCerts, PushVerifier
from inboxd.adapters.gmail.push_route import GmailPushTenant
from inboxd.daemon.config.reader import ConfigProblem
from inboxd.daemon.config.tenant import TenantConfig

__all__ = ["build_gmail_push"]


def build_gmail_push(
    tenants: Mapping[str, TenantConfig],
) -> tuple[dict[str, GmailPushTenant], list[ConfigProblem]]:
    """The served tenants, and a problem per `[gmail]` table that cannot be served
    (check-config has reported it already; a daemon logs it)."""
    served: dict[str, GmailPushTenant] = {}
    problems: list[ConfigProblem] = []
    certs: dict[str, GoogleCerts] = {}
    for tenant in sorted(tenants.values(), key=lambda t: t.tenant_id):
        if tenant.gmail is None:
            continue
        try:
            settings = GmailSettings.from_settings(tenant.gmail)
        except GmailConfigError as exc:
            key, sep, message = str(exc).partition(": ")
            where = f"gmail.{key}" if sep else "gmail"
            problems.append(ConfigProblem(tenant.source_file, where, message or str(exc)))
            continue
        if settings.push_audience is None or settings.push_service_account is None:
            continue  # polled (or watched without push): nothing to verify against
        if settings.certs_url not in certs:
            certs[settings.certs_url] = GoogleCerts(settings.certs_url)
        verifier = PushVerifier(
            certs[settings.certs_url], settings.push_audience, settings.push_service_account
        )
        mailboxes = {
            m.address.strip().lower(): m.mailbox_id
            for m in tenant.mailboxes
            if m.provider == "gmail" and m.address
        }
        served[tenant.tenant_id] = GmailPushTenant(tenant.tenant_id, verifier, mailboxes)
    return served, problems
