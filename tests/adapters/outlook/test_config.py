"""The `[outlook]` table and outlook mailbox entries: what is accepted, and errors that
name the key without quoting a value."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

import pytest

from inboxd.adapters.outlook.config import (
    DEFAULT_AUTHORITY_URL,
    DEFAULT_GRAPH_URL,
    OutlookMailbox,
    OutlookSettings,
)
from inboxd.adapters.outlook.errors import OutlookConfigError
from inboxd.pipeline.errors import Family, family_of

DIRECTORY = "0c9e5a3b-6f2d-4c1e-9b7a-2d4f8e1a3c5b"
CLIENT = "5f1a2b3c-4d5e-6f70-8192-a3b4c5d6e7f8"
INLINE_SECRET = "Xq8~very-secret-client-value"


@dataclass(frozen=True)
class Ref:
    """A secret reference as the daemon passes it (anything with reveal())."""

    value: str

    def reveal(self) -> str:
        return self.value


def raises_on(key: str):
    return pytest.raises(OutlookConfigError, match=rf"^{key}\b")


def table(**extra: object) -> dict[str, object]:
    return {"directory_id": DIRECTORY, "client_id": CLIENT, "client_secret": Ref("s")} | extra


def test_defaults_are_microsofts_endpoints_and_limits() -> None:
    settings = OutlookSettings.from_settings(table())
    assert (settings.graph_url, settings.authority_url) == (
        DEFAULT_GRAPH_URL,
        DEFAULT_AUTHORITY_URL,
    )
    assert settings.token_url == f"{DEFAULT_AUTHORITY_URL}/{DIRECTORY}/oauth2/v2.0/token"
    assert (settings.requests_per_10_min, settings.concurrent_requests) == (10_000, 4)
    assert settings.notification_url is None and settings.push_urls("acme") is None


def test_notification_url_gives_both_push_urls_of_the_tenant() -> None:
    settings = OutlookSettings.from_settings(
        table(notification_url="https://inboxd.acme.example/", graph_url="http://127.0.0.1:9/v1.0")
    )
    assert settings.push_urls("acme") == (
        "https://inboxd.acme.example/push/outlook/acme",
        "https://inboxd.acme.example/push/outlook/acme/lifecycle",
    )
    assert settings.graph_url == "http://127.0.0.1:9/v1.0"


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        ({"client_id": CLIENT}, "directory_id"),
        (table(directory_id="not a tenant"), "directory_id"),
        (table(client_id="my-app"), "client_id"),
        (table(client_secret=INLINE_SECRET), "client_secret"),
        (table(certificate=Ref("c")), "certificate"),
        (table(notification_url="http://inboxd.acme.example"), "notification_url"),
        (table(graph_url="ftp://graph"), "graph_url"),
        (table(requests_per_10_min=0), "requests_per_10_min"),
        (table(concurrent_requests=True), "concurrent_requests"),
        (table(tenant="x"), "tenant"),
    ],
)
def test_a_bad_table_names_the_key_and_never_the_value(settings, key) -> None:
    with raises_on(key) as caught:
        OutlookSettings.from_settings(settings)
    assert INLINE_SECRET not in str(caught.value)
    assert family_of(caught.value) is Family.ATTENTION


def test_a_verified_domain_is_a_directory_id_too() -> None:
    assert OutlookSettings.from_settings(table(directory_id="acme.onmicrosoft.com"))


def test_mailbox_defaults_to_inbox_and_sent_items_app_only_30_days() -> None:
    box = OutlookMailbox.from_settings({}, address="support@acme.example")
    assert box.folders == ("inbox", "sentitems")
    assert not box.delegated and box.backfill == 30
    now = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    assert box.received_since(now) == datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
    assert (
        OutlookMailbox.from_settings({"backfill": "all"}, address="a@b.c").received_since() is None
    )


def test_mailbox_folders_are_kept_in_order_without_duplicates() -> None:
    box = OutlookMailbox.from_settings(
        {"folders": ["Inbox", "AAMkAGI2=", "inbox"], "refresh_token": Ref("r")}, address="a@b.c"
    )
    assert box.folders == ("inbox", "AAMkAGI2=")
    assert box.delegated


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        ({"folders": []}, "folders"),
        ({"folders": ["in box"]}, "folders"),
        ({"backfill": 0}, "backfill"),
        ({"refresh_token": INLINE_SECRET}, "refresh_token"),
        ({"labels": ["INBOX"]}, "labels"),
    ],
)
def test_a_bad_mailbox_names_the_key(settings, key) -> None:
    with raises_on(key) as caught:
        OutlookMailbox.from_settings(settings, address="a@b.c")
    assert INLINE_SECRET not in str(caught.value)


def test_app_only_access_needs_the_apps_own_credential_else_it_is_not_connected() -> None:
    public = OutlookSettings.from_settings({"directory_id": DIRECTORY, "client_id": CLIENT})
    waiting = OutlookMailbox.from_settings({}, address="a@b.c")
    waiting.check_against(public)  # valid configuration: `inboxd connect outlook` comes next
    assert not waiting.connected(public)
    delegated = OutlookMailbox.from_settings({"refresh_token": Ref("r")}, address="a@b.c")
    assert delegated.connected(public)
