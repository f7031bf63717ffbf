"""The door's own S3 GETs (adapters/ses/aws.py ObjectReader): signed as the SDK signs,
answering as the SDK path did, and handing a bucket to the SDK when S3 says
something only the SDK handles.

Against the in-memory stand-in (tests/fakes/ses_aws.py) with signature checking
on: it recomputes each request's SigV4 signature with botocore's own signer.
"""

from __future__ import annotations

import pytest
import structlog
from helpers.moto_server import isolate_aws_environment

from inboxd.adapters.ses import AwsClients, SesSettings
from inboxd.adapters.ses.errors import SesPermanent, SesTransient

pytestmark = pytest.mark.slow

# Keys S3 event notifications and SES object key prefixes produce: spaces, plus,
# at sign, tilde, unicode, deep paths.
KEYS = ["in/plain", "in/2026 12/a+b@c~d", "in/ünïcødé/ß.eml", "in/a/b/c/d/e.eml"]


def settings(fake_aws, **overrides: object) -> SesSettings:
    return SesSettings.from_settings(
        {
            "queue_url": fake_aws.queue_url,
            "endpoint_url": fake_aws.fake.url,
            "region": "us-east-1",
            **overrides,
        }
    )


@pytest.mark.parametrize("key", KEYS)
async def test_a_signed_get_reads_the_object_without_the_sdk(fake_aws, key: str) -> None:
    raw = f"Subject: {key}\r\n\r\nbody\r\n".encode()
    fake_aws.fake.put(fake_aws.bucket, key, raw)
    async with AwsClients(settings(fake_aws)) as aws:
        assert await aws.fetch(fake_aws.bucket, key, max_bytes=1024) == raw
        assert aws._objects is not None and not aws._objects.sdk_buckets
    assert fake_aws.fake.gets[key] == 1  # one GET, its signature checked and good
    assert fake_aws.fake.signed >= 1


async def test_a_missing_object_is_permanent(fake_aws) -> None:
    async with AwsClients(settings(fake_aws)) as aws:
        with pytest.raises(SesPermanent) as caught:
            await aws.fetch(fake_aws.bucket, "in/gone", max_bytes=1024)
        assert not aws._objects.sdk_buckets  # type: ignore[union-attr]
    assert caught.value.reason == "object_missing"
    assert "NoSuchKey" in caught.value.detail


async def test_throttling_is_transient_and_names_the_code(fake_aws) -> None:
    fake_aws.fake.put(fake_aws.bucket, "in/m", b"Subject: x\r\n\r\nx\r\n")
    fake_aws.fake.throttle["in/m"] = 1
    async with AwsClients(settings(fake_aws)) as aws:
        with pytest.raises(SesTransient, match="SlowDown") as caught:
            await aws.fetch(fake_aws.bucket, "in/m", max_bytes=1024)
        assert "s3://mail-bucket/in/m" in str(caught.value)
        # the next try reads it, still without the SDK
        assert await aws.fetch(fake_aws.bucket, "in/m", max_bytes=1024)
        assert not aws._objects.sdk_buckets  # type: ignore[union-attr]


async def test_an_object_over_the_limit_is_refused_from_its_length(fake_aws) -> None:
    fake_aws.fake.put(fake_aws.bucket, "in/big", b"x" * 5000)
    async with AwsClients(settings(fake_aws)) as aws:
        with pytest.raises(SesPermanent) as caught:
            await aws.fetch(fake_aws.bucket, "in/big", max_bytes=4096)
    assert caught.value.reason == "too_large"
    assert "5000 bytes" in caught.value.detail


async def test_a_refused_get_hands_the_bucket_to_the_sdk(fake_aws, monkeypatch) -> None:
    """A GET S3 refuses (here: a signature made with another secret) is asked again
    through the SDK, whose answer is the one that counts, and the bucket is read
    through the SDK from then on."""
    raw = b"Subject: x\r\n\r\nx\r\n"
    fake_aws.fake.put(fake_aws.bucket, "in/m", raw)
    async with AwsClients(settings(fake_aws)) as aws:
        reader = aws._objects
        assert reader is not None
        real_signed = reader._signed

        async def badly_signed(bucket: str, key: str):
            url, headers = await real_signed(bucket, key)
            headers["Authorization"] = headers["Authorization"][:-4] + "0000"
            return url, headers

        monkeypatch.setattr(reader, "_signed", badly_signed)
        with structlog.testing.capture_logs() as logged:
            assert await aws.fetch(fake_aws.bucket, "in/m", max_bytes=1024) == raw
        assert reader.sdk_buckets == {fake_aws.bucket}
        [event] = [e for e in logged if e["event"] == "ses_object_read_through_sdk"]
        assert (event["status"], event["code"]) == (403, "SignatureDoesNotMatch")
        assert await aws.fetch(fake_aws.bucket, "in/m", max_bytes=1024) == raw
    assert fake_aws.fake.gets["in/m"] == 2  # the SDK's two (ours was refused unread)


async def test_a_missing_bucket_is_confirmed_by_the_sdk(fake_aws) -> None:
    """NoSuchBucket might be a wrong endpoint's answer: the SDK is asked before the
    message is given up (its answer, the same here, is the one that counts)."""
    async with AwsClients(settings(fake_aws)) as aws:
        with pytest.raises(SesPermanent) as caught:
            await aws.fetch("no-such-bucket", "in/m", max_bytes=1024)
        assert aws._objects is not None and aws._objects.sdk_buckets == {"no-such-bucket"}
    assert caught.value.reason == "object_missing"
    assert "NoSuchBucket" in caught.value.detail


@pytest.mark.parametrize(
    ("bucket", "base"),
    [
        ("acme-inbound", "https://acme-inbound.s3.eu-west-1.amazonaws.com/"),
        ("acme.inbound", "https://s3.eu-west-1.amazonaws.com/acme.inbound/"),
    ],
)
async def test_the_endpoint_is_the_sdks_own(bucket: str, base: str, monkeypatch) -> None:
    """Against AWS itself (no endpoint_url): the regional endpoint, virtual-hosted
    unless the bucket's name has dots, as the SDK's GetObject resolves it — learnt
    from a GetObject the SDK builds and signs and that is stopped before it is sent
    (nothing reaches the network here)."""
    isolate_aws_environment(monkeypatch, "eu-west-1")
    config = SesSettings.from_settings(
        {"queue_url": "https://sqs.eu-west-1.amazonaws.com/123456789012/in", "region": "eu-west-1"}
    )
    async with AwsClients(config) as aws:
        assert aws._objects is not None
        assert await aws._objects._base(bucket) == (base, "eu-west-1")
        url, headers = await aws._objects._signed(bucket, "in/2026 12/a+b")
    assert url == base + "in/2026%2012/a%2Bb"
    assert "/eu-west-1/s3/aws4_request" in headers["Authorization"]
