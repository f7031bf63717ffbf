"""adapters/outlook/tables.py on a real server: the rows the Outlook source and the
Graph notification routes share."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from inboxd.adapters.outlook import tables as subs
from inboxd.pipeline.mailbox.status import mailbox_status

T = "acme"
EXPIRES = datetime(2026, 12, 3, 17, 0, tzinfo=UTC)


@pytest.fixture
async def mailboxes(make_mailbox) -> None:
    await make_mailbox(T, "support", provider="outlook")
    await make_mailbox(T, "sales", provider="outlook")
    await make_mailbox("globex", "support", provider="outlook")


async def save(pool: asyncpg.Pool, mailbox: str, folder: str, sub_id: str, **kw: object) -> None:
    await subs.save_subscription(
        pool,
        str(kw.get("tenant", T)),
        mailbox,
        folder,
        sub_id,
        str(kw.get("secret", f"secret-{sub_id}")),
        EXPIRES,
    )


async def test_save_then_read_back_by_mailbox_and_by_id(pool, mailboxes) -> None:
    await save(pool, "support", "sentitems", "sub-2")
    await save(pool, "support", "inbox", "sub-1")
    await save(pool, "sales", "inbox", "sub-3")
    await save(pool, "support", "inbox", "sub-g", tenant="globex")

    rows = await subs.subscriptions_of(pool, T, "support")
    assert [(r.folder, r.subscription_id) for r in rows] == [
        ("inbox", "sub-1"),
        ("sentitems", "sub-2"),
    ]
    assert rows[0].client_state == "secret-sub-1" and rows[0].expires_at == EXPIRES
    assert rows[0].renew_failures == 0 and rows[0].lifecycle_event is None
    assert "secret-sub-1" not in repr(rows[0])

    found = await subs.subscriptions_by_id(pool, T, ["sub-1", "sub-3", "sub-g", "nope", "sub-1"])
    assert {k: v.mailbox_id for k, v in found.items()} == {"sub-1": "support", "sub-3": "sales"}
    assert await subs.subscriptions_by_id(pool, T, []) == {}


async def test_a_recreated_subscription_replaces_the_folder_row_and_resets_its_health(
    pool, mailboxes
) -> None:
    await save(pool, "support", "inbox", "old")
    assert await subs.record_renew_failure(pool, T, "support", "inbox", "503\nunavailable") == 1
    assert await subs.record_renew_failure(pool, T, "support", "inbox", "timeout") == 2
    await subs.record_lifecycle(pool, T, {"old": "subscriptionRemoved"})
    (row,) = await subs.subscriptions_of(pool, T, "support")
    assert (row.renew_failures, row.last_error) == (2, "timeout")

    await save(pool, "support", "inbox", "new", secret="fresh")
    (row,) = await subs.subscriptions_of(pool, T, "support")
    assert (row.subscription_id, row.client_state) == ("new", "fresh")
    assert (row.renew_failures, row.last_error, row.renewed_at) == (0, None, None)
    # still owed: the delta resync after subscriptionRemoved
    assert row.lifecycle_event == "subscriptionRemoved"
    assert await subs.subscriptions_by_id(pool, T, ["old"]) == {}


async def test_renewal_moves_the_expiry_and_clears_failures(pool, mailboxes) -> None:
    await save(pool, "support", "inbox", "sub-1")
    await subs.record_renew_failure(pool, T, "support", "inbox", "x" * 1000)
    (row,) = await subs.subscriptions_of(pool, T, "support")
    assert row.last_error is not None and len(row.last_error) <= 300
    later = EXPIRES + timedelta(days=2)
    assert await subs.record_renewal(pool, T, "support", "inbox", later)
    (row,) = await subs.subscriptions_of(pool, T, "support")
    assert (row.expires_at, row.renew_failures, row.last_error) == (later, 0, None)
    assert row.renewed_at is not None
    assert not await subs.record_renewal(pool, T, "support", "archive", later)
    assert await subs.record_renew_failure(pool, T, "support", "archive", "x") is None


async def test_lifecycle_keeps_the_strongest_event_and_is_tenant_scoped(pool, mailboxes) -> None:
    await save(pool, "support", "inbox", "sub-1")
    await save(pool, "support", "inbox", "sub-g", tenant="globex")

    assert await subs.record_lifecycle(pool, T, {"sub-1": "missed"}) == [("support", "inbox")]
    assert await subs.record_lifecycle(pool, T, {"sub-1": "reauthorizationRequired"})
    (row,) = await subs.subscriptions_of(pool, T, "support")
    assert row.lifecycle_event == "missed" and row.lifecycle_at is not None

    await subs.record_lifecycle(pool, T, {"sub-1": "subscriptionRemoved"})
    await subs.record_lifecycle(pool, T, {"sub-1": "missed"})
    (row,) = await subs.subscriptions_of(pool, T, "support")
    assert row.lifecycle_event == "subscriptionRemoved"

    # another tenant's id through this tenant: nothing found, nothing written
    assert await subs.record_lifecycle(pool, T, {"sub-g": "missed"}) == []
    (other,) = await subs.subscriptions_of(pool, "globex", "support")
    assert other.lifecycle_event is None
    with pytest.raises(ValueError, match="unknown lifecycle"):
        await subs.record_lifecycle(pool, T, {"sub-1": "bogus"})


def test_stronger_event_orders_the_lifecycle_events() -> None:
    assert subs.stronger_event(None, "reauthorizationRequired") == "reauthorizationRequired"
    assert subs.stronger_event("missed", "reauthorizationRequired") == "missed"
    assert subs.stronger_event("missed", "subscriptionRemoved") == "subscriptionRemoved"


async def test_clear_lifecycle_leaves_an_event_that_arrived_since_it_was_read(
    pool, mailboxes
) -> None:
    await save(pool, "support", "inbox", "sub-1")
    await subs.record_lifecycle(pool, T, {"sub-1": "missed"})
    (read,) = await subs.subscriptions_of(pool, T, "support")
    await subs.record_lifecycle(pool, T, {"sub-1": "missed"})  # a second one meanwhile

    assert not await subs.clear_lifecycle(pool, T, "support", "inbox", seen_at=read.lifecycle_at)
    (again,) = await subs.subscriptions_of(pool, T, "support")
    assert again.lifecycle_event == "missed"
    assert await subs.clear_lifecycle(pool, T, "support", "inbox", seen_at=again.lifecycle_at)
    (row,) = await subs.subscriptions_of(pool, T, "support")
    assert (row.lifecycle_event, row.lifecycle_at) == (None, None)
    assert not await subs.clear_lifecycle(pool, T, "support", "inbox")  # nothing pending

    await subs.record_lifecycle(pool, T, {"sub-1": "reauthorizationRequired"})
    assert await subs.clear_lifecycle(pool, T, "support", "inbox")  # unconditionally


async def test_delete_subscriptions_of_a_mailbox_or_some_folders(pool, mailboxes) -> None:
    await save(pool, "support", "inbox", "sub-1")
    await save(pool, "support", "sentitems", "sub-2")
    await save(pool, "support", "archive", "sub-3")
    await save(pool, "sales", "inbox", "sub-4")
    await save(pool, "support", "inbox", "sub-g", tenant="globex")

    assert await subs.delete_subscriptions(pool, T, "support", []) == []
    assert await subs.delete_subscriptions(pool, T, "support", ["archive"]) == ["sub-3"]
    assert await subs.delete_subscriptions(pool, T, "support") == ["sub-1", "sub-2"]
    assert await subs.subscriptions_of(pool, T, "support") == []
    assert [r.subscription_id for r in await subs.subscriptions_of(pool, T, "sales")] == ["sub-4"]
    assert len(await subs.subscriptions_of(pool, "globex", "support")) == 1


async def test_a_failing_renewal_shows_on_the_mailbox_status_without_the_secret(
    pool, mailboxes
) -> None:
    await save(pool, "support", "inbox", "sub-1", secret="s3cret-state")
    [healthy] = await mailbox_status(pool, T, mailbox_id="support")
    assert healthy.push_error is None
    await subs.record_renew_failure(pool, T, "support", "inbox", "Graph answered 503")
    [failing] = await mailbox_status(pool, T, mailbox_id="support")
    assert failing.push_error == "inbox: Graph answered 503"
    assert "s3cret-state" not in repr(failing)
    await subs.record_renewal(pool, T, "support", "inbox", EXPIRES + timedelta(days=2))
    [renewed] = await mailbox_status(pool, T, mailbox_id="support")
    assert renewed.push_error is None
