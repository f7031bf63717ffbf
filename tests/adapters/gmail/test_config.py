"""The `[gmail]` table and Gmail mailbox entries: what is accepted, and errors that name the key."""

from __future__ import annotations

import pytest

from inboxd.adapters.gmail.config import (
    DEFAULT_API_URL,
    DEFAULT_CERTS_URL,
    DEFAULT_TOKEN_URL,
    GmailMailbox,
    GmailSettings,
)
from inboxd.adapters.gmail.errors import GmailConfigError
from inboxd.pipeline.errors import ConfigError, Family, family_of

from .conftest import Ref

SECRET = "1//super-secret-refresh-token"


def raises_on(key: str):
    """pytest.raises for a GmailConfigError whose message starts with `key`."""
    return pytest.raises(GmailConfigError, match=rf"^{key}\b")


# --- [gmail] ------------------------------------------------------------------------------


def test_settings_defaults_are_googles_endpoints() -> None:
    settings = GmailSettings.from_settings({})
    assert (settings.api_url, settings.token_url, settings.certs_url) == (
        DEFAULT_API_URL,
        DEFAULT_TOKEN_URL,
        DEFAULT_CERTS_URL,
    )
    assert settings.client_id is None and settings.topic is None


def test_settings_full_table() -> None:
    secret = Ref("s3cret")
    settings = GmailSettings.from_settings(
        {
            "client_id": "123.apps.googleusercontent.com",
            "client_secret": secret,
            "topic": "projects/my-project/topics/gmail-push",
            "push_audience": "https://inboxd.example.org/hooks/gmail",
            "push_service_account": "push@my-project.iam.gserviceaccount.com",
            "api_url": "http://127.0.0.1:8080/",
            "token_url": "https://oauth2.example.org/token",
        }
    )
    assert settings.client_secret is secret
    assert settings.topic == "projects/my-project/topics/gmail-push"
    assert settings.api_url == "http://127.0.0.1:8080"  # trailing slash dropped


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ({"client_idd": "x"}, "client_idd"),
        ({"client_id": "x"}, "client_secret"),
        ({"client_secret": Ref("x")}, "client_id"),
        ({"client_id": "x", "client_secret": "inline-secret"}, "client_secret"),
        ({"topic": "my-topic"}, "topic"),
        ({"topic": "projects/p/topics/t"}, "topic"),  # project ids are 6-30 characters
        ({"push_service_account": "nobody"}, "push_service_account"),
        ({"api_url": "http://gmail.example.org"}, "api_url"),  # clear text off this host
        ({"token_url": "ftp://127.0.0.1/token"}, "token_url"),
        ({"certs_url": ""}, "certs_url"),
        ({"client_id": 12}, "client_id"),
    ],
)
def test_settings_errors_name_the_key(table: dict[str, object], key: str) -> None:
    with raises_on(key):
        GmailSettings.from_settings(table)


def test_config_errors_are_value_errors_and_attention() -> None:
    with pytest.raises(GmailConfigError) as caught:
        GmailSettings.from_settings({"topic": "nope"})
    assert isinstance(caught.value, ValueError)
    assert isinstance(caught.value, ConfigError)
    assert family_of(caught.value) is Family.ATTENTION


def test_inline_secret_is_refused_without_echoing_it() -> None:
    with raises_on("client_secret") as caught:
        GmailSettings.from_settings({"client_id": "x", "client_secret": SECRET})
    assert SECRET not in str(caught.value)


# --- mailboxes ----------------------------------------------------------------------------


def test_mailbox_defaults() -> None:
    mailbox = GmailMailbox.from_settings({"refresh_token": Ref(SECRET)}, address="a@example.org")
    assert mailbox.labels == ("INBOX", "SENT")
    assert mailbox.backfill == 30
    assert mailbox.backfill_query == "newer_than:30d"
    assert SECRET not in repr(mailbox)


def test_mailbox_service_account_labels_and_backfill() -> None:
    key = Ref('{"client_email": "sa@p.iam.gserviceaccount.com"}')
    mailbox = GmailMailbox.from_settings(
        {
            "address": "ops@example.org",
            "service_account": key,
            "labels": ["INBOX", "Label_7", "INBOX"],
            "backfill": "all",
        }
    )
    assert mailbox.service_account is key and mailbox.refresh_token is None
    assert mailbox.labels == ("INBOX", "Label_7")
    assert mailbox.backfill == "all" and mailbox.backfill_query is None
    none = GmailMailbox.from_settings(
        {"service_account": key, "backfill": "none"}, address="ops@example.org"
    )
    assert none.backfill == "none"


def test_mailbox_address_keyword_wins() -> None:
    mailbox = GmailMailbox.from_settings(
        {"address": "old@example.org", "refresh_token": Ref("t")}, address="new@example.org"
    )
    assert mailbox.address == "new@example.org"


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ({"refresh_token": Ref("t")}, "address"),
        ({"address": "not-an-address", "refresh_token": Ref("t")}, "address"),
        (
            {"address": "a@example.org", "refresh_token": Ref("t"), "service_account": Ref("k")},
            "refresh_token",
        ),
        ({"address": "a@example.org", "refresh_token": SECRET}, "refresh_token"),
        ({"address": "a@example.org", "service_account": "{}"}, "service_account"),
        ({"address": "a@example.org", "refresh_token": Ref("t"), "labels": []}, "labels"),
        ({"address": "a@example.org", "refresh_token": Ref("t"), "labels": "INBOX"}, "labels"),
        ({"address": "a@example.org", "refresh_token": Ref("t"), "labels": ["IN BOX"]}, "labels"),
        ({"address": "a@example.org", "refresh_token": Ref("t"), "backfill": 0}, "backfill"),
        ({"address": "a@example.org", "refresh_token": Ref("t"), "backfill": True}, "backfill"),
        ({"address": "a@example.org", "refresh_token": Ref("t"), "backfill": "7d"}, "backfill"),
        ({"address": "a@example.org", "refresh_token": Ref("t"), "lables": ["X"]}, "lables"),
    ],
)
def test_mailbox_errors_name_the_key(table: dict[str, object], key: str) -> None:
    with raises_on(key) as caught:
        GmailMailbox.from_settings(table)
    assert SECRET not in str(caught.value)


def test_refresh_token_mailbox_needs_the_oauth_client() -> None:
    mailbox = GmailMailbox.from_settings({"refresh_token": Ref("t")}, address="a@example.org")
    with raises_on("refresh_token"):
        mailbox.check_against(GmailSettings.from_settings({}))
    service = GmailMailbox.from_settings({"service_account": Ref("k")}, address="a@example.org")
    service.check_against(GmailSettings.from_settings({}))  # no OAuth client needed


def test_quota_defaults_to_googles_per_user_limit_and_may_be_raised() -> None:
    assert GmailSettings.from_settings({}).quota_units_per_s == 250.0
    assert GmailSettings.from_settings({"quota_units_per_s": 1000}).quota_units_per_s == 1000.0
    for bad in (0, -5, True, "250", 10**9):
        with pytest.raises(GmailConfigError, match=r"^quota_units_per_s"):
            GmailSettings.from_settings({"quota_units_per_s": bad})


def test_a_mailbox_without_a_credential_is_valid_and_not_connected() -> None:
    """`inboxd connect gmail` comes after the mailbox is in the tenant file."""
    waiting = GmailMailbox.from_settings({"address": "a@example.org"})
    assert not waiting.connected
    assert GmailMailbox.from_settings(
        {"address": "a@example.org", "refresh_token": Ref("t")}
    ).connected
