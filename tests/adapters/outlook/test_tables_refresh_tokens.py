"""graph_refresh_tokens (adapters/outlook/tables.py): a delegated mailbox's newest refresh token."""

from __future__ import annotations

import pytest

from inboxd.adapters.outlook import tables as tokens

T = "acme"


@pytest.fixture
async def mailboxes(make_mailbox) -> None:
    await make_mailbox(T, "support", provider="outlook")
    await make_mailbox("globex", "support", provider="outlook")


async def test_the_newest_token_is_read_back_only_for_the_configured_one_it_was_stored_for(
    pool, mailboxes
) -> None:
    assert await tokens.load_refresh_token(pool, T, "support", "cfg-1") is None
    await tokens.save_refresh_token(pool, T, "support", "cfg-1", "rt-2")
    await tokens.save_refresh_token(pool, T, "support", "cfg-1", "rt-3")
    assert await tokens.load_refresh_token(pool, T, "support", "cfg-1") == "rt-3"
    # the configuration names another sign-in now: the stored token is not its
    assert await tokens.load_refresh_token(pool, T, "support", "cfg-2") is None
    # another tenant's mailbox of the same id sees nothing
    assert await tokens.load_refresh_token(pool, "globex", "support", "cfg-1") is None
    await tokens.save_refresh_token(pool, T, "support", "cfg-2", "rt-9")
    assert await tokens.load_refresh_token(pool, T, "support", "cfg-2") == "rt-9"
    assert await pool.fetchval("SELECT count(*) FROM graph_refresh_tokens") == 1
