"""Router: which ses mailboxes a forwarded message's recipients reach."""

from __future__ import annotations

import pytest

from inboxd.adapters.ses.config import SesMailbox
from inboxd.adapters.ses.routing import Router


def mailbox(*addresses: str, **settings: object) -> SesMailbox:
    return SesMailbox.from_settings({"addresses": list(addresses), **settings})


@pytest.fixture
def router() -> Router:
    return Router(
        [
            ("acme", "support", mailbox("support@acme.test", "help@acme.test")),
            ("acme", "billing", mailbox("billing@acme.test", "@billing.acme.test")),
            ("acme", "catchall", mailbox("@acme.test")),
            ("globex", "sales", mailbox("Sales@Globex.test")),
            ("globex", "ops", mailbox("ops+alerts@globex.test")),
        ]
    )


def where(router: Router, *recipients: str) -> list[tuple[str, str]]:
    return [(r.tenant_id, r.mailbox_id) for r in router.route(recipients)]


@pytest.mark.parametrize(
    ("recipient", "expected"),
    [
        ("support@acme.test", ("acme", "support")),
        ("help@acme.test", ("acme", "support")),
        ("billing@acme.test", ("acme", "billing")),
        ("sales@globex.test", ("globex", "sales")),
        # case never matters: configured or received
        ("SUPPORT@ACME.TEST", ("acme", "support")),
        ("Sales@GLOBEX.test", ("globex", "sales")),
        # angle brackets and whitespace as an envelope address may carry them
        (" <support@acme.test> ", ("acme", "support")),
        # RFC 5233 sub-address: the base address's mailbox
        ("support+ticket-42@acme.test", ("acme", "support")),
        ("SUPPORT+Ticket-42@Acme.Test", ("acme", "support")),
        ("sales+eu+de@globex.test", ("globex", "sales")),
        # an exact entry with a sub-address wins over its base address
        ("ops+alerts@globex.test", ("globex", "ops")),
        # @domain catch-all: anyone else at that domain
        ("nobody@acme.test", ("acme", "catchall")),
        ("nobody+x@acme.test", ("acme", "catchall")),
        ("anyone@billing.acme.test", ("acme", "billing")),
        ("Anyone@BILLING.acme.test", ("acme", "billing")),
    ],
)
def test_a_recipient_reaches_its_mailbox(router: Router, recipient: str, expected) -> None:
    assert where(router, recipient) == [expected]


@pytest.mark.parametrize(
    "recipient",
    [
        "stranger@example.org",
        # a catch-all is for its domain only, not its subdomains nor lookalikes
        "x@sub.acme.test",
        "x@acme.test.evil",
        "x@notacme.test",
        "support@acme.testing",
        # the sub-address of an address not configured on its own
        "ops@globex.test",
        "ops+other@globex.test",
        # a plus that is not a sub-address separator: no empty base
        "+support@acme.tes",
        "",
        "   ",
        "no-at-sign",
        "support",
    ],
)
def test_a_recipient_for_no_mailbox_reaches_none(router: Router, recipient: str) -> None:
    assert where(router, recipient) == []


def test_several_recipients_reach_several_mailboxes_each_once_in_order(router: Router) -> None:
    assert where(
        router,
        "sales@globex.test",
        "support@acme.test",
        "help@acme.test",  # the same mailbox again
        "support+x@acme.test",  # and again
        "stranger@example.org",  # nobody's
        "who@acme.test",  # the catch-all
        "SALES@globex.test",
    ) == [("globex", "sales"), ("acme", "support"), ("acme", "catchall")]


def test_no_recipients_reach_nothing(router: Router) -> None:
    assert where(router) == []


def test_route_carries_the_mailbox_settings(router: Router) -> None:
    [route] = router.route(["support@acme.test"])
    assert route.mailbox.addresses == ("support@acme.test", "help@acme.test")


def test_two_claims_of_one_address_first_wins() -> None:
    # check-config refuses this; the router must still be deterministic
    router = Router(
        [
            ("acme", "first", mailbox("shared@acme.test")),
            ("globex", "second", mailbox("Shared@Acme.test")),
        ]
    )
    assert where(router, "shared@acme.test") == [("acme", "first")]


def test_len_counts_routing_entries(router: Router) -> None:
    assert len(router) == 7
    assert len(Router([])) == 0
