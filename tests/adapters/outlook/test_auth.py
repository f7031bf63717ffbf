"""GraphTokens against FakeGraph's token endpoint, with the refresh token store on a
real PostgreSQL (DatabaseRefreshTokens): what a delegated mailbox presents when
Entra rotates refresh tokens and refuses redeemed ones."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import asyncpg
import pytest
from fakes.graph import FakeGraph

from inboxd.adapters.outlook.auth import GraphTokens
from inboxd.adapters.outlook.config import OutlookMailbox, OutlookSettings
from inboxd.adapters.outlook.errors import OutlookAuthError
from inboxd.adapters.outlook.token_store import DatabaseRefreshTokens

USER = "ops@contoso.example"
T, M = "acme", "ops"


class Ref:
    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value


def settings_of(fake: FakeGraph) -> OutlookSettings:
    return OutlookSettings.from_settings(
        {
            "directory_id": fake.directory_id,
            "client_id": fake.client_id,
            "client_secret": Ref(fake.client_secret),
            "graph_url": fake.graph_url,
            "authority_url": fake.authority_url,
        }
    )


@pytest.fixture
async def fake() -> AsyncIterator[FakeGraph]:
    async with FakeGraph([USER]) as server:
        yield server


async def test_two_replicas_refreshing_one_mailbox_the_loser_presents_the_stored_winner(
    pool: asyncpg.Pool, make_mailbox, fake: FakeGraph
) -> None:
    """Entra single-use refresh tokens: replica B redeems the token replica A holds
    in memory and stores its successor; A's next refresh with the redeemed token is
    refused (invalid_grant AADSTS70000). A reads the store again and goes on with
    B's token instead of putting the mailbox in needs_attention."""
    await make_mailbox(T, M, provider="outlook")
    fake.identity.single_use_refresh_tokens = True
    configured = fake.issue_refresh_token(USER)
    settings = settings_of(fake)
    mailbox = OutlookMailbox(USER, refresh_token=Ref(configured))
    async with aiohttp.ClientSession() as http:
        a = GraphTokens(settings, mailbox, http, DatabaseRefreshTokens(pool, T, M))
        b = GraphTokens(settings, mailbox, http, DatabaseRefreshTokens(pool, T, M))
        assert fake.user_of_token(await a.token()) == USER
        assert fake.user_of_token(await b.token()) == USER  # redeems A's newest
        a.forget()  # A's access token is refused (or expires): A refreshes
        assert fake.user_of_token(await a.token()) == USER
        assert fake.identity.refused_redeemed == 1  # A's first try was refused
        # and the newest token is stored: B, restarted, refreshes with it
        b2 = GraphTokens(settings, mailbox, http, DatabaseRefreshTokens(pool, T, M))
        assert fake.user_of_token(await b2.token()) == USER
        assert fake.identity.refused_redeemed == 1


async def test_a_refused_refresh_token_with_nothing_newer_stored_needs_attention(
    pool: asyncpg.Pool, make_mailbox, fake: FakeGraph
) -> None:
    await make_mailbox(T, M, provider="outlook")
    configured = fake.issue_refresh_token(USER)
    fake.identity.revoke(configured)
    mailbox = OutlookMailbox(USER, refresh_token=Ref(configured))
    async with aiohttp.ClientSession() as http:
        tokens = GraphTokens(settings_of(fake), mailbox, http, DatabaseRefreshTokens(pool, T, M))
        with pytest.raises(OutlookAuthError, match="AADSTS50173") as caught:
            await tokens.token()
    assert configured not in str(caught.value)
