"""Fixtures of the Gmail client-layer tests: secret references, an aiohttp session,
and builders for settings, mailboxes, token sources and clients.

Tests that talk HTTP use FakeGmail (tests/fakes/gmail), which follows Gmail's
published contract; they skip with a reason when that package is absent.
"""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from inboxd.adapters.gmail import AccessTokens, GmailClient, GmailMailbox, GmailSettings
from inboxd.adapters.gmail.pacer import QuotaPacer

HAVE_FAKE = (
    importlib.util.find_spec("fakes") is not None
    and importlib.util.find_spec("fakes.gmail") is not None
)
needs_fake = pytest.mark.skipif(
    not HAVE_FAKE, reason="tests/fakes/gmail (the fake Gmail server) is not in this checkout"
)

ALICE = "alice@example.com"
#: Fast retries for tests: the schedule's shape is what matters, not its length.
FAST = {"backoff_initial_s": 0.01, "backoff_max_s": 0.05}


class Ref:
    """A secret reference as the daemon hands it over: the value only on reveal()."""

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Ref(<hidden>)"


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def fake_settings(fake: Any, **overrides: object) -> GmailSettings:
    table: dict[str, object] = {
        "client_id": fake.client_id,
        "client_secret": Ref(fake.client_secret),
        "api_url": fake.base_url,
        "token_url": fake.token_url,
        "certs_url": fake.certs_url,
    }
    table.update(overrides)
    return GmailSettings.from_settings(table)


def refresh_mailbox(fake: Any, address: str = ALICE, **settings: object) -> GmailMailbox:
    token = fake.issue_refresh_token(address)
    return GmailMailbox.from_settings({"refresh_token": Ref(token), **settings}, address=address)


def make_client(
    fake: Any,
    http: aiohttp.ClientSession,
    mailbox: GmailMailbox | None = None,
    *,
    pacer: QuotaPacer | None = None,
    **tuning: Any,
) -> GmailClient:
    settings = fake_settings(fake)
    mailbox = mailbox or refresh_mailbox(fake)
    tokens = AccessTokens(settings, mailbox, http, **FAST)
    return GmailClient(
        settings,
        mailbox,
        http,
        pacer or QuotaPacer(),
        tokens,
        **({**FAST, "rate_limit_hold_s": 0.05} | tuning),
    )
