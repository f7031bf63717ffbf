"""The SES door's SNS envelope check (issue 22): an SQS body in SNS's envelope with a
signature is verified like the SNS delivery webhooks before its pointer is followed.

The poller runs in process against moto's SQS and S3 with the daemon's check
(adapters/ses/envelope.py, with the daemon's SnsVerifier of daemon/ses_door.py), its
certificate fetch serving a test certificate
(helpers.keys): a forged envelope must never make it read a bucket.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from helpers.keys import FakeFetch, make_certificate, rsa_key, sign_sns
from helpers.ses_queue import (
    TOPIC_ARN,
    copies,
    corpus_file,
    dead,
    drain,
    make_queue,
    ses_notification,
    sns_envelope,
    unrouted,
    versioned_pointer,
)

from inboxd.adapters.esp.sns_certificates import CERT_FAILURE_TTL_S, CertificateCache
from inboxd.adapters.ses import SesMailbox
from inboxd.adapters.ses.envelope import SnsEnvelopeCheck
from inboxd.daemon.ses_door import SnsVerifier

pytestmark = pytest.mark.slow

SUPPORT = "support@acme.test"
ISSUE_82 = "django-mailbox/email_issue_82.eml"
CERT_URL = "https://sns.us-east-1.amazonaws.com/SimpleNotificationService-0123abcd.pem"
SNS_KEY = rsa_key()
FORGER_KEY = rsa_key()


def routes() -> list[tuple[str, str, SesMailbox]]:
    return [("acme", "support", SesMailbox.from_settings({"addresses": [SUPPORT]}))]


def signed(document: dict[str, Any], key: Any = SNS_KEY, **fields: str) -> dict[str, Any]:
    """`document` in SNS's envelope, signed by `key` (SNS's test key unless forged)."""
    envelope = sns_envelope(document, subject="Amazon SES Email Receipt Notification")
    envelope.pop("Signature")
    return sign_sns({**envelope, "SigningCertURL": CERT_URL, **fields}, key)


def check(fetch: FakeFetch, topics: frozenset[str] = frozenset(), **cache: Any) -> SnsEnvelopeCheck:
    return SnsEnvelopeCheck(topics, SnsVerifier(CertificateCache(fetch, **cache)))


@pytest.fixture
def fetch() -> FakeFetch:
    return FakeFetch({CERT_URL: make_certificate(SNS_KEY)})


async def test_a_signed_envelope_is_followed(aws, make_poller, make_mailbox, pool, corpus, fetch):
    await make_mailbox("acme", "support", provider="ses")
    aws.put("in/m", corpus_file(corpus, ISSUE_82))
    aws.send(signed(ses_notification(aws.bucket, "in/m", "ses-1", [SUPPORT])))
    topics = frozenset({TOPIC_ARN})
    async with make_poller(routes(), check_body=check(fetch, topics)) as (poller, _):
        await drain(poller)
    assert await copies(pool) == [("acme", "support", "ses-1")]
    assert aws.queue_counts() == (0, 0)
    assert fetch.calls == [CERT_URL]


@pytest.mark.parametrize(
    "forgery",
    ["signed by another key", "message changed after signing", "certificate not on SNS"],
)
async def test_a_forged_envelope_reads_no_bucket_and_is_recorded_with_its_reason(
    forgery, moto_endpoint, aws, make_poller, make_mailbox, pool, corpus, fetch
):
    """A pointer in SNS's shape, to a bucket of the forger's choosing, never read."""
    await make_mailbox("acme", "support", provider="ses")
    elsewhere = make_queue(moto_endpoint)  # a bucket the daemon can read, not the door's
    elsewhere.put("secret", corpus_file(corpus, ISSUE_82))
    notification = ses_notification(elsewhere.bucket, "secret", "ses-forged", [SUPPORT])
    if forgery == "signed by another key":
        body = signed(notification, FORGER_KEY)
    elif forgery == "message changed after signing":
        genuine = signed(ses_notification(aws.bucket, "in/m", "ses-forged", [SUPPORT]))
        body = {**genuine, "Message": signed(notification)["Message"]}
    else:
        forger_url = "https://sns.us-east-1.amazonaws.com.evil.example/cert.pem"
        body = signed(notification, FORGER_KEY, SigningCertURL=forger_url)
    aws.send(body)
    async with make_poller(routes(), check_body=check(fetch)) as (poller, _):
        await drain(poller)
    assert await copies(pool) == [] and await dead(pool) == []
    [record] = await unrouted(pool)
    assert record["reason"] == "sns_unverified"
    assert "SNS envelope not verified" in record["detail"]
    assert aws.queue_counts() == (0, 0)  # recorded with its body, then deleted
    assert fetch.calls in ([], [CERT_URL])  # never the forger's URL


async def test_an_envelope_from_a_topic_not_listed_is_refused_before_any_fetch(
    aws, make_poller, make_mailbox, pool, corpus, fetch
):
    await make_mailbox("acme", "support", provider="ses")
    aws.put("in/m", corpus_file(corpus, ISSUE_82))
    aws.send(signed(ses_notification(aws.bucket, "in/m", "ses-1", [SUPPORT])))
    other_topic = frozenset({"arn:aws:sns:us-east-1:123456789012:other"})
    async with make_poller(routes(), check_body=check(fetch, other_topic)) as (poller, _):
        await drain(poller)
    assert await copies(pool) == []
    assert [r["reason"] for r in await unrouted(pool)] == ["sns_unverified"]
    assert fetch.calls == []


async def test_an_unreachable_certificate_leaves_the_message_then_it_is_stored(
    aws, make_poller, make_mailbox, pool, corpus, fetch
):
    """Genuine mail while SNS's certificate host is briefly unreachable: not lost, not
    dead, stored once the certificate can be fetched."""
    await make_mailbox("acme", "support", provider="ses")
    aws.put("in/m", corpus_file(corpus, ISSUE_82))
    aws.send(signed(ses_notification(aws.bucket, "in/m", "ses-1", [SUPPORT])))
    now = [0.0]
    body_check = check(fetch, clock=lambda: now[0])
    fetch.fail = True
    async with make_poller(routes(), check_body=body_check) as (poller, events):
        received = await drain(poller)
        assert aws.queue_counts() == (0, 1)  # left for SQS to redeliver
        assert events.counts.get("left") == 1
        assert await copies(pool) == [] and await dead(pool) == []
        assert await unrouted(pool) == []

        fetch.fail = False
        now[0] += CERT_FAILURE_TTL_S + 1
        aws.release([m.receipt_handle for m in received])  # its visibility timeout, run out
        await drain(poller)
    assert await copies(pool) == [("acme", "support", "ses-1")]
    assert aws.queue_counts() == (0, 0)


async def test_a_pointer_to_a_bucket_not_listed_is_dead_and_not_read(
    moto_endpoint, aws, make_poller, make_mailbox, pool, corpus, fetch
):
    await make_mailbox("acme", "support", provider="ses")
    elsewhere = make_queue(moto_endpoint)
    elsewhere.put("secret", corpus_file(corpus, ISSUE_82))
    # no envelope, so no signature to check: the bucket allowlist is what refuses it
    aws.send(versioned_pointer(elsewhere.bucket, "secret", f"ses-{uuid.uuid4().hex}", [SUPPORT]))
    aws.put("in/m", corpus_file(corpus, ISSUE_82))
    aws.send(signed(ses_notification(aws.bucket, "in/m", "ses-1", [SUPPORT])))
    async with make_poller(routes(), check_body=check(fetch), buckets=[aws.bucket]) as (
        poller,
        _,
    ):
        await drain(poller)
    assert await copies(pool) == [("acme", "support", "ses-1")]
    assert [reason for *_, reason in await dead(pool)] == ["bucket_not_allowed"]
    assert aws.queue_counts() == (0, 0)


async def test_an_envelope_without_its_signature_reads_no_bucket(
    moto_endpoint, aws, make_poller, make_mailbox, pool, corpus, fetch
):
    """A forger who leaves the signature out of SNS's envelope (issue 22: before,
    "no Signature" meant "nothing to verify" and the pointer was followed)."""
    await make_mailbox("acme", "support", provider="ses")
    elsewhere = make_queue(moto_endpoint)
    elsewhere.put("secret", corpus_file(corpus, ISSUE_82))
    envelope = sns_envelope(ses_notification(elsewhere.bucket, "secret", "ses-forged", [SUPPORT]))
    for key in ("Signature", "SigningCertURL", "SignatureVersion"):
        envelope.pop(key)
    aws.send(envelope)
    async with make_poller(routes(), check_body=check(fetch)) as (poller, _):
        await drain(poller)
    assert await copies(pool) == [] and await dead(pool) == []
    assert [r["reason"] for r in await unrouted(pool)] == ["sns_unverified"]
    assert aws.queue_counts() == (0, 0)
    assert fetch.calls == []


async def test_raw_delivery_is_followed_unless_topics_are_listed(
    moto_endpoint, aws, make_poller, make_mailbox, pool, corpus, fetch
):
    """Raw message delivery carries no signature: followed when no topic is listed
    (the documented default), refused unread when `sns_topic_arns` says every pointer
    comes through SNS, or a forger would write the bare notification instead."""
    await make_mailbox("acme", "support", provider="ses")
    aws.put("in/m", corpus_file(corpus, ISSUE_82))
    aws.send(ses_notification(aws.bucket, "in/m", "ses-1", [SUPPORT]))
    async with make_poller(routes(), check_body=check(fetch)) as (poller, _):
        await drain(poller)
    assert await copies(pool) == [("acme", "support", "ses-1")]

    elsewhere = make_queue(moto_endpoint)
    elsewhere.put("secret", corpus_file(corpus, ISSUE_82))
    aws.send(ses_notification(elsewhere.bucket, "secret", "ses-forged", [SUPPORT]))
    topics = frozenset({TOPIC_ARN})
    async with make_poller(routes(), check_body=check(fetch, topics)) as (poller, _):
        await drain(poller)
    assert await copies(pool) == [("acme", "support", "ses-1")]
    [record] = await unrouted(pool)
    assert record["reason"] == "sns_unverified" and "sns_topic_arns" in record["detail"]
    assert aws.queue_counts() == (0, 0)


async def test_an_envelope_unverifiable_past_the_receive_budget_is_poison_saying_why(
    aws, make_poller, make_mailbox, pool, corpus, fetch
):
    """SNS's certificate host unreachable for longer than max_receive_count deliveries
    (an egress firewall, a VPC without a route to it): the poison record said only
    "received N times without being stored", and landed in the mailbox the unverified
    pointer named. It says why, and is kept unrouted with its body."""
    await make_mailbox("acme", "support", provider="ses")
    aws.put("in/m", corpus_file(corpus, ISSUE_82))
    aws.send(signed(ses_notification(aws.bucket, "in/m", "ses-1", [SUPPORT])))
    fetch.fail = True
    assert aws.receive_and_release() == 1
    async with make_poller(routes(), check_body=check(fetch), max_receive_count=1) as (
        poller,
        events,
    ):
        await drain(poller)
    assert await copies(pool) == [] and await dead(pool) == []
    [record] = await unrouted(pool)
    assert record["reason"] == "poison"
    assert "received 2 times" in record["detail"]
    assert "SNS envelope not verified yet" in record["detail"]
    assert record["body"]  # kept, to send again once the certificate can be fetched
    assert events.counts.get("poison") == 1
    assert aws.queue_counts() == (0, 0)
