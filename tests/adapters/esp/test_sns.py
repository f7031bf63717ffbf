"""adapters.esp.sns: SNS envelope, certificate URL, certificate cache and signature checks.

Two kinds of vectors:
- published: real SNS messages with the real certificate that signed them, copied
  verbatim from other verifiers' test suites (sources next to each constant),
  served by a fake fetch — they pin the canonical string to what SNS signs;
- generated: a self-signed RSA certificate made here, signing canonical strings
  built independently of the module, for every message type and failure mode.
"""

from __future__ import annotations

import base64
import socket
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import anyio
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from helpers.keys import FakeFetch, make_certificate, rsa_key, sign_sns

from inboxd.adapters.esp import sns_certificates
from inboxd.adapters.esp.base import VerificationFailed, VerificationUnavailable
from inboxd.adapters.esp.sns import is_signing_cert_url, is_subscribe_url, verify_sns_message
from inboxd.adapters.esp.sns_certificates import CertificateCache, fetch_certificate

# --- published vectors --------------------------------------------------------------
# Kept byte-for-byte as published (a reflowed JSON body is still valid, but the
# point is to verify exactly what SNS sent), hence the long lines:
# ruff: noqa: E501

# aws/aws-sdk-ruby, gems/aws-sdk-sns/spec/message_verifier_spec.rb: two real
# messages (SignatureVersion 1 and 2) and the SNS certificate that signed them.
RUBY_CERT_URL = "https://sns.us-east-2.amazonaws.com/SimpleNotificationService-7ff5318490ec183fbaddaa2a969abfda.pem"
RUBY_CERT = b"""-----BEGIN CERTIFICATE-----
MIIF1zCCBL+gAwIBAgIQB9pYWG3Mi7xej22g9pobJTANBgkqhkiG9w0BAQsFADBG
MQswCQYDVQQGEwJVUzEPMA0GA1UEChMGQW1hem9uMRUwEwYDVQQLEwxTZXJ2ZXIg
Q0EgMUIxDzANBgNVBAMTBkFtYXpvbjAeFw0yMTA5MDcwMDAwMDBaFw0yMjA4MTcy
MzU5NTlaMBwxGjAYBgNVBAMTEXNucy5hbWF6b25hd3MuY29tMIIBIjANBgkqhkiG
9w0BAQEFAAOCAQ8AMIIBCgKCAQEAutFqueT3XgP13udzxE6UpbdjOtVO5DwoMpSM
iDNMnGzF1TYH5/R2LPUOBeTB0SkKnR4kpNcUZhicpGD4aKciz/GEZ6wu65xncfT9
H/KBOQwoXYTuClHwp6fYpGzcGFaFoEYMnijL/o4qmTSd+ukglQUgKpsDw4ofw6rU
m2CttJo+GQSNQ9NfGR1h/0J+zsApkeSYrXRx5wNlu87z8os1C/6PBrUHwt3xXeaf
Xzfwut8aRRYsS8BySOA9DAgLfNHlfdQCjKPXKrG/ussgReyWD6n/HH+j7Uha3xos
TzQqJifcxlTq6MxWdPR6fDaJNvqw6DOE7UjUNxHguXHlVfxhlQIDAQABo4IC6TCC
AuUwHwYDVR0jBBgwFoAUWaRmBlKge5WSPKOUByeWdFv5PdAwHQYDVR0OBBYEFAqz
C+vyouneE7mWWLbi9i0UsWUbMBwGA1UdEQQVMBOCEXNucy5hbWF6b25hd3MuY29t
MA4GA1UdDwEB/wQEAwIFoDAdBgNVHSUEFjAUBggrBgEFBQcDAQYIKwYBBQUHAwIw
OwYDVR0fBDQwMjAwoC6gLIYqaHR0cDovL2NybC5zY2ExYi5hbWF6b250cnVzdC5j
b20vc2NhMWIuY3JsMBMGA1UdIAQMMAowCAYGZ4EMAQIBMHUGCCsGAQUFBwEBBGkw
ZzAtBggrBgEFBQcwAYYhaHR0cDovL29jc3Auc2NhMWIuYW1hem9udHJ1c3QuY29t
MDYGCCsGAQUFBzAChipodHRwOi8vY3J0LnNjYTFiLmFtYXpvbnRydXN0LmNvbS9z
Y2ExYi5jcnQwDAYDVR0TAQH/BAIwADCCAX0GCisGAQQB1nkCBAIEggFtBIIBaQFn
AHYAKXm+8J45OSHwVnOfY6V35b5XfZxgCvj5TV0mXCVdx4QAAAF7vfDVkQAABAMA
RzBFAiEA2XfHuy36aqRFiaL8c3md2mH451go8707+fRE0pEdSRACIE/g5FXTUXUZ
PFcmOhm9TZ+uMY1i4CIQ/CKVWln6C3t+AHYAUaOw9f0BeZxWbbg3eI8MpHrMGyfL
956IQpoN/tSLBeUAAAF7vfDVjAAABAMARzBFAiBF1MhhFP0+FQt3daDFfMYoWwnr
muTInrjNpwfzlvQBugIhAPYadFzr+LaxSJoiZEbEHBvTts7bT0M3eCQONA2O7w6n
AHUAQcjKsd8iRkoQxqE6CUKHXk4xixsD6+tLx2jwkGKWBvYAAAF7vfDVdAAABAMA
RjBEAiAtPapmFAuA71ih4NoSd5hJelzAltNQpxDMcDfDyHyU8gIgWxmaa6+2KbBu
9xdv379zvnJACFR7jc+4asl08Dn4aagwDQYJKoZIhvcNAQELBQADggEBAA54QX0u
oFWXfMmv02CGZv4NWo5TapyeeixQ2kKpZHRdVZjxZrw+hoF6HD7P3kGjH8ztyJll
tDxB0qgMltbPhQdScwhA6iTgoaBYqEUC/VHKd4PmmPT6yIsM36NBZVmkGlzl5uNo
/dBgBaG0SsVJnhr5zro3c2quC7n6fVGEZhf/UgQwRnnvThnvbNKguglDMq4uEqv8
njKyleht+glkcmXO0m9qLKt6BOS0amy6U2GlAwRn0Wx02ndJtnRCSC6kPuRWK/SQ
FEjB7gCK4hdKaAOuWdZpI55vF6ifOeM8toC3g7ofO8qLTnJupAG+ZitY5J3cvHWr
HqOUdKigPDHYLRo=
-----END CERTIFICATE-----
"""
RUBY_TOPIC_V1 = (
    "arn:aws:sns:us-east-2:295079676684:publish-and-verify-892f85fe-4836-424d-8188-ab85bef0f362"
)
RUBY_TOPIC_V2 = (
    "arn:aws:sns:us-east-2:295079676684:publish-and-verify-62674b1d-4295-426b-88e7-5fb75652a04e"
)
RUBY_MESSAGE_V1 = b"""{
  "Type" : "Notification",
  "MessageId" : "792cda85-518f-5dd3-9163-81d851212f3a",
  "TopicArn" : "arn:aws:sns:us-east-2:295079676684:publish-and-verify-892f85fe-4836-424d-8188-ab85bef0f362",
  "Message" : "Hello world",
  "Timestamp" : "2022-07-28T21:23:58.317Z",
  "SignatureVersion" : "1",
  "Signature" : "ghtf+deOBAzHJJZ6s6CdRLfTQAlcGzq9naoFM1wi0CJiq//uVRuZnamrkWNF0fhouMFvuLVRwcz8PZLUMSfnmd5VpdTKpTyiKmy1qJAZXma0w+yi7G+I33hD1Jyk1Nbym2n0kqp3fVu2aoooiN2ZeLAT2bH0/BtjLSfN1yAOKNoprco4qV9gGUZinXJdj9a1YdNhDR2jKi33ldlsVtEXAtiaDklGEk7DgRKX38GerBPiLg3FdtgY6KC7cdeGpU/dGK+4hjc83Ive1HoFkAwqhpgInM2sMytBosoiXfCmOKmU4xeGD0gHDNZTlJUJQDlzw8Eag0H9f/5zXF9d3uy0YQ==",
  "SigningCertURL" : "https://sns.us-east-2.amazonaws.com/SimpleNotificationService-7ff5318490ec183fbaddaa2a969abfda.pem",
  "UnsubscribeURL" : "https://sns.us-east-2.amazonaws.com/?Action=Unsubscribe&SubscriptionArn=arn:aws:sns:us-east-2:295079676684:publish-and-verify-892f85fe-4836-424d-8188-ab85bef0f362:2296bc94-7992-4be1-b15f-b97229b5c1d8"
}"""
RUBY_MESSAGE_V2 = b"""{
  "Type" : "Notification",
  "MessageId" : "17dea24b-55c2-540b-8362-f916557af765",
  "TopicArn" : "arn:aws:sns:us-east-2:295079676684:publish-and-verify-62674b1d-4295-426b-88e7-5fb75652a04e",
  "Message" : "Hello world",
  "Timestamp" : "2022-07-28T21:24:08.324Z",
  "SignatureVersion" : "2",
  "Signature" : "CXVqp9PfZAL+4JHS3Zxo1PFbQsvnOjvmYhtIf17TWpwc+iIVas8kZ8GopuzVzVMdatE7rCl/O4P91Zp05Dwz8lk8dLhfp8gSu3Njlzxlyrmzo9x3va3Jb7zFnedgS2GKnZWHGBdwTXho+TosNUE+3e10OMSlwN5XGDwX7+R3WL+rn+AXmFAqp3alg27sYa55h1dLE9cGszGPjScPdtF3BmZsUDMx9wSdNKsCk+vSvE8yBjnCmUl7laSFj3LzPVrlSwgNYCF3kYnNAkah7NplK4SFhJYLwS0HCVCQJKa8rVbQLf9cBTu60U402mrgy0bN8xWoyimzbYbrOMJjalqkUg==",
  "SigningCertURL" : "https://sns.us-east-2.amazonaws.com/SimpleNotificationService-7ff5318490ec183fbaddaa2a969abfda.pem",
  "UnsubscribeURL" : "https://sns.us-east-2.amazonaws.com/?Action=Unsubscribe&SubscriptionArn=arn:aws:sns:us-east-2:295079676684:publish-and-verify-62674b1d-4295-426b-88e7-5fb75652a04e:ad7d16e3-0a7c-46aa-b23e-ffaf02250cbe"
}"""

# rizen/AWS-SNS-Verify (Perl), t/01_verify.t: a real SignatureVersion 1 message
# with a Subject (so the optional key is in the canonical string) and its certificate.
PERL_CERT_URL = "https://sns.us-east-1.amazonaws.com/SimpleNotificationService-d6d679a1d18e95c2f9ffcf11f4f9e198.pem"
PERL_CERT = b"""-----BEGIN CERTIFICATE-----
MIIFFzCCA/+gAwIBAgIQfXvtWTP5lfZLpmyNHLk1TDANBgkqhkiG9w0BAQUFADCB
tTELMAkGA1UEBhMCVVMxFzAVBgNVBAoTDlZlcmlTaWduLCBJbmMuMR8wHQYDVQQL
ExZWZXJpU2lnbiBUcnVzdCBOZXR3b3JrMTswOQYDVQQLEzJUZXJtcyBvZiB1c2Ug
YXQgaHR0cHM6Ly93d3cudmVyaXNpZ24uY29tL3JwYSAoYykxMDEvMC0GA1UEAxMm
VmVyaVNpZ24gQ2xhc3MgMyBTZWN1cmUgU2VydmVyIENBIC0gRzMwHhcNMTQwODIz
MDAwMDAwWhcNMTUwODIyMjM1OTU5WjBrMQswCQYDVQQGEwJVUzETMBEGA1UECBMK
V2FzaGluZ3RvbjEQMA4GA1UEBxQHU2VhdHRsZTEZMBcGA1UEChQQQW1hem9uLmNv
bSwgSW5jLjEaMBgGA1UEAxQRc25zLmFtYXpvbmF3cy5jb20wggEiMA0GCSqGSIb3
DQEBAQUAA4IBDwAwggEKAoIBAQDP/HD18qyBx4IgBvgVCkLTW18bULmoaaOQYtRY
yVpPxIFkNSHxT4uYH9knKUqddKQd1TEXHh0bF50lBiHZpuascNc3+FP2YKbF2t/z
a+zHfLipW01np85VDdIWedvB9TpnMdY9PQYTVx41+2fnei9WgjwXVM085WRSECh3
aRdkvOjwTN/Tlrgy3hoebVN3V5kB67b139m3xAlZjoB8MPdk/tlsk+wgVxuAY/gz
xGIZRJxlgEtsu2g8+rDkjS2tk3457Cz8aXRZSCGi+BB6yN2WhvWwPzSDJMDKxwXY
I8fGw0xutF4WHN414KBUp/s/+E6Ib7GxLUCwFon1swKRz9NxAgMBAAGjggFqMIIB
ZjAcBgNVHREEFTATghFzbnMuYW1hem9uYXdzLmNvbTAJBgNVHRMEAjAAMA4GA1Ud
DwEB/wQEAwIFoDAdBgNVHSUEFjAUBggrBgEFBQcDAQYIKwYBBQUHAwIwZQYDVR0g
BF4wXDBaBgpghkgBhvhFAQc2MEwwIwYIKwYBBQUHAgEWF2h0dHBzOi8vZC5zeW1j
Yi5jb20vY3BzMCUGCCsGAQUFBwICMBkaF2h0dHBzOi8vZC5zeW1jYi5jb20vcnBh
MB8GA1UdIwQYMBaAFA1EXBZTRMGCfh0gqyX0AWPYvnmlMCsGA1UdHwQkMCIwIKAe
oByGGmh0dHA6Ly9zZC5zeW1jYi5jb20vc2QuY3JsMFcGCCsGAQUFBwEBBEswSTAf
BggrBgEFBQcwAYYTaHR0cDovL3NkLnN5bWNkLmNvbTAmBggrBgEFBQcwAoYaaHR0
cDovL3NkLnN5bWNiLmNvbS9zZC5jcnQwDQYJKoZIhvcNAQEFBQADggEBABm5RaeH
sLtJftDeGghHAUkco8wkCshKQO1obhuMDJkJHAHbUrweP4Gw7WRhHNHo1jgA6Q61
NXik2w6H7SDVngCVIqOLFsr1DQ7fB5oSevMwjLvlaLxWBAvgKPSsjCt+QF1aNQiv
sfhOIgiJZTObBERsSs9FXWQ/vMkoisPKYJGn3KigzZj0GXSAB0do8Ejq8siBczgM
9o8NixqVvD7AOoE/QWXCtRDMRnQ5oIAc/Q9iUCJ8oAlbljDFkSqwgunpaG0iuHQZ
6Q4iHgmrgHM302H9fFxupyW46zwLH9gmbrUulmLRZT14bIzd0cZXqIl6nd8il4nq
kqQRCW8P2LDot4s=
-----END CERTIFICATE-----
"""
PERL_TOPIC = "arn:aws:sns:us-east-1:041977924901:foo"
PERL_MESSAGE = b"""{
    "Type" : "Notification",
    "MessageId" : "a890c547-5d98-55e2-971d-8826fff56413",
    "TopicArn" : "arn:aws:sns:us-east-1:041977924901:foo",
    "Subject" : "test subject",
    "Message" : "test message",
    "Timestamp" : "2015-02-20T20:59:25.401Z",
    "SignatureVersion" : "1",
    "Signature" : "kzi3JBQz64uFAXG9ZuAwPI2gYW5tT7OF83oeHb8v0/XRPsy0keq2NHTCpQVRxCgPOJ/QUB2Yl/L29/W4hiHMo9+Ns0hrqyasgUfjq+XkVR1WDuYLtNaEA1vLnA0H9usSh3eVVlLhpYzoT4GUoGgstRVvFceW2QVF9EYUQyromlcbOVtVpKCEINAvGEEKJNGTXQQUkPUka3YMhHitgQg1WlFBmf+oweSYUEj8+RoguWsn6vluxD0VtIOGOml5jlUecfhDqnetF5pUVYMqCHPfHn6RBguiW+XD6XWsdKKxkjqo90a65Nlb72gPSRw6+sIEIgf4J39WFZK+FCpeSm0qAg==",
    "SigningCertURL" : "https://sns.us-east-1.amazonaws.com/SimpleNotificationService-d6d679a1d18e95c2f9ffcf11f4f9e198.pem",
    "UnsubscribeURL" : "https://sns.us-east-1.amazonaws.com/?Action=Unsubscribe&SubscriptionArn=arn:aws:sns:us-east-1:041977924901:foo:20b2d060-2a32-4506-9cb0-24b8b9e605e1",
    "MessageAttributes" : {
        "AWS.SNS.MOBILE.MPNS.Type" : {"Type":"String","Value":"token"},
        "AWS.SNS.MOBILE.WNS.Type" : {"Type":"String","Value":"wns/badge"},
        "AWS.SNS.MOBILE.MPNS.NotificationClass" : {"Type":"String","Value":"realtime"}
    }
}
"""
PUBLISHED_TOPICS = frozenset({RUBY_TOPIC_V1, RUBY_TOPIC_V2, PERL_TOPIC})

# --- generated vectors --------------------------------------------------------------

TOPIC = "arn:aws:sns:eu-west-1:123456789012:ses-events"
OTHER_TOPIC = "arn:aws:sns:eu-west-1:123456789012:other-allowed"
TOPICS = frozenset({TOPIC, OTHER_TOPIC})
CERT_URL = "https://sns.eu-west-1.amazonaws.com/SimpleNotificationService-0123456789abcdef.pem"
SUBSCRIBE_URL = (
    "https://sns.eu-west-1.amazonaws.com/?Action=ConfirmSubscription"
    f"&TopicArn={TOPIC}&Token=2336412f37fb687f5d51e6e2425c464de12884"
)


def notification(**overrides: Any) -> dict[str, Any]:
    """Unsigned Notification fields (the SNS developer guide's example, our topic)."""
    return {
        "Type": "Notification",
        "MessageId": "22b80b92-fdea-4c2c-8f9d-bdfb0c7bf324",
        "TopicArn": TOPIC,
        "Subject": "My First Message",
        "Message": "Hello world!",
        "Timestamp": "2012-05-02T00:54:06.655Z",
        "SignatureVersion": "2",
        "SigningCertURL": CERT_URL,
        "UnsubscribeURL": "https://sns.eu-west-1.amazonaws.com/?Action=Unsubscribe",
        **overrides,
    }


def confirmation(message_type: str = "SubscriptionConfirmation", **overrides: Any) -> dict:
    return {
        "Type": message_type,
        "MessageId": "165545c9-2a5c-472c-8df2-7ff2be2b3b1b",
        "Token": "2336412f37fb687f5d51e6e2425c464de12884",
        "TopicArn": TOPIC,
        "Message": f"You have chosen to subscribe to the topic {TOPIC}.",
        "SubscribeURL": SUBSCRIBE_URL,
        "Timestamp": "2012-04-26T20:45:04.751Z",
        "SignatureVersion": "2",
        "SigningCertURL": CERT_URL,
        **overrides,
    }


def body(fields: dict[str, Any]) -> bytes:
    return orjson.dumps(fields)


@pytest.fixture
def fetch(certificate: bytes) -> FakeFetch:
    return FakeFetch({CERT_URL: certificate, RUBY_CERT_URL: RUBY_CERT, PERL_CERT_URL: PERL_CERT})


@pytest.fixture
def cache(fetch: FakeFetch) -> CertificateCache:
    return CertificateCache(fetch)


async def verify(raw: bytes, cache: CertificateCache, topics: frozenset[str] = TOPICS):
    return await verify_sns_message(raw, topic_arns=topics, certificates=cache)


# --- published vectors ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "message_id"),
    [
        (RUBY_MESSAGE_V1, "792cda85-518f-5dd3-9163-81d851212f3a"),
        (RUBY_MESSAGE_V2, "17dea24b-55c2-540b-8362-f916557af765"),
        (PERL_MESSAGE, "a890c547-5d98-55e2-971d-8826fff56413"),
    ],
    ids=["ruby-sha1", "ruby-sha256", "perl-sha1-subject"],
)
async def test_published_vectors_verify(
    raw: bytes, message_id: str, cache: CertificateCache, fetch: FakeFetch
) -> None:
    message = await verify(raw, cache, PUBLISHED_TOPICS)
    assert message.type == "Notification"
    assert message.message_id == message_id
    assert message.timestamp.tzinfo is not None
    assert len(fetch.calls) == 1


async def test_published_vector_keeps_subject(cache: CertificateCache) -> None:
    message = await verify(PERL_MESSAGE, cache, PUBLISHED_TOPICS)
    assert (message.subject, message.message) == ("test subject", "test message")


@pytest.mark.parametrize(
    "tamper",
    [
        lambda f: {**f, "Message": "Hello World"},
        lambda f: {**f, "Subject": "added"},
        lambda f: {**f, "Timestamp": "2022-07-28T21:23:58.318Z"},
        lambda f: {**f, "MessageId": "792cda85-518f-5dd3-9163-81d851212f3b"},
        lambda f: {**f, "TopicArn": RUBY_TOPIC_V2},
        lambda f: {**f, "SignatureVersion": "2"},
    ],
    ids=["message", "subject-added", "timestamp", "message-id", "topic", "version"],
)
async def test_published_vector_tampered_fails(
    tamper: Callable[[dict], dict], cache: CertificateCache
) -> None:
    fields = tamper(orjson.loads(RUBY_MESSAGE_V1))
    with pytest.raises(VerificationFailed):
        await verify(body(fields), cache, PUBLISHED_TOPICS)


async def test_published_vector_with_other_certificate_fails(
    fetch: FakeFetch, cache: CertificateCache
) -> None:
    fetch.pems[RUBY_CERT_URL] = PERL_CERT
    with pytest.raises(VerificationFailed, match="signature"):
        await verify(RUBY_MESSAGE_V1, cache, PUBLISHED_TOPICS)


# --- generated: the happy paths -------------------------------------------------------


@pytest.mark.parametrize("version", ["1", "2"])
async def test_notification_verifies_with_both_signature_versions(
    version: str, signing_key: rsa.RSAPrivateKey, cache: CertificateCache
) -> None:
    message = await verify(
        body(sign_sns(notification(SignatureVersion=version), signing_key)), cache
    )
    assert message.type == "Notification"
    assert message.topic_arn == TOPIC
    assert message.message == "Hello world!"
    assert message.subject == "My First Message"
    assert message.timestamp == datetime(2012, 5, 2, 0, 54, 6, 655000, tzinfo=UTC)
    assert message.subscribe_url is None


@pytest.mark.parametrize("subject", [None, "absent"])
async def test_notification_without_subject(
    subject: str | None, signing_key: rsa.RSAPrivateKey, cache: CertificateCache
) -> None:
    fields = notification(Subject=subject)
    if subject == "absent":
        del fields["Subject"]
    message = await verify(body(sign_sns(fields, signing_key)), cache)
    assert message.subject is None


async def test_message_with_newlines_and_unicode(
    signing_key: rsa.RSAPrivateKey, cache: CertificateCache
) -> None:
    text = '{"eventType":"Send",\n"note":"caf\u00e9 \u2014 \\"quoted\\""}'
    message = await verify(body(sign_sns(notification(Message=text), signing_key)), cache)
    assert message.message == text


@pytest.mark.parametrize("message_type", ["SubscriptionConfirmation", "UnsubscribeConfirmation"])
@pytest.mark.parametrize("version", ["1", "2"])
async def test_confirmations_verify(
    message_type: str, version: str, signing_key: rsa.RSAPrivateKey, cache: CertificateCache
) -> None:
    fields = sign_sns(confirmation(message_type, SignatureVersion=version), signing_key)
    message = await verify(body(fields), cache)
    assert message.type == message_type
    assert message.subscribe_url == SUBSCRIBE_URL
    assert message.token == fields["Token"]


async def test_confirmation_token_is_signed(
    signing_key: rsa.RSAPrivateKey, cache: CertificateCache
) -> None:
    fields = {**sign_sns(confirmation(), signing_key), "Token": "other"}
    with pytest.raises(VerificationFailed):
        await verify(body(fields), cache)


async def test_china_region_certificate_url(
    signing_key: rsa.RSAPrivateKey, fetch: FakeFetch, certificate: bytes
) -> None:
    url = "https://sns.cn-north-1.amazonaws.com.cn/SimpleNotificationService-abc.pem"
    fetch.pems[url] = certificate
    fields = sign_sns(notification(SigningCertURL=url), signing_key)
    await verify(body(fields), CertificateCache(fetch))
    assert fetch.calls == [url]


# --- generated: every failure ---------------------------------------------------------


@pytest.mark.parametrize("version", ["3", "0", "", "SHA256", 2, None])
async def test_unknown_signature_version_fails_without_fetch(
    version: Any, signing_key: rsa.RSAPrivateKey, fetch: FakeFetch, cache: CertificateCache
) -> None:
    fields = {**sign_sns(notification(), signing_key), "SignatureVersion": version}
    with pytest.raises(VerificationFailed):
        await verify(body(fields), cache)
    assert fetch.calls == []


async def test_signature_version_must_match_the_signature(
    signing_key: rsa.RSAPrivateKey, cache: CertificateCache
) -> None:
    fields = {**sign_sns(notification(SignatureVersion="2"), signing_key), "SignatureVersion": "1"}
    with pytest.raises(VerificationFailed, match="signature"):
        await verify(body(fields), cache)


@pytest.mark.parametrize(
    "tamper",
    [
        lambda f: {**f, "Message": f["Message"] + " "},
        lambda f: {**f, "Subject": "Other"},
        lambda f: {k: v for k, v in f.items() if k != "Subject"},
        lambda f: {**f, "Timestamp": "2012-05-02T00:54:07.655Z"},
        lambda f: {**f, "TopicArn": OTHER_TOPIC},
        lambda f: {**f, "MessageId": "other"},
    ],
    ids=["message", "subject", "subject-removed", "timestamp", "topic", "message-id"],
)
async def test_tampered_notification_fails(
    tamper: Callable[[dict], dict], signing_key: rsa.RSAPrivateKey, cache: CertificateCache
) -> None:
    with pytest.raises(VerificationFailed, match="signature"):
        await verify(body(tamper(sign_sns(notification(), signing_key))), cache)


@pytest.mark.parametrize(
    "signature",
    [
        lambda s: s[:-8],  # truncated, still base64
        lambda s: s[: len(s) // 2],  # half
        lambda s: "bad",  # not base64
        lambda s: "",  # empty
        lambda s: "!!" + s[2:],  # invalid characters
        lambda s: base64.b64encode(b"\x00" * 256).decode(),  # right length, garbage
        lambda s: s[:10] + ("A" if s[10] != "A" else "B") + s[11:],  # one character flipped
    ],
    ids=["truncated", "half", "not-base64", "empty", "bad-chars", "zeros", "flipped"],
)
async def test_garbage_signature_fails(
    signature: Callable[[str], str], signing_key: rsa.RSAPrivateKey, cache: CertificateCache
) -> None:
    fields = sign_sns(notification(), signing_key)
    fields["Signature"] = signature(fields["Signature"])
    with pytest.raises(VerificationFailed):
        await verify(body(fields), cache)


async def test_signature_by_another_key_fails(
    signing_key: rsa.RSAPrivateKey, cache: CertificateCache
) -> None:
    other = rsa_key()
    with pytest.raises(VerificationFailed, match="signature"):
        await verify(body(sign_sns(notification(), other)), cache)


HOSTILE_CERT_URLS = [
    "http://sns.us-east-1.amazonaws.com/SimpleNotificationService-abc.pem",
    "https://sns.us-east-1.amazonaws.com.evil.com/SimpleNotificationService-abc.pem",
    "https://evil.com/sns.us-east-1.amazonaws.com/SimpleNotificationService-abc.pem",
    "https://evil.com/?sns.us-east-1.amazonaws.com/x.pem",
    "https://sns.us-east-1.amazonaws.com@evil.com/SimpleNotificationService-abc.pem",
    "https://user:pass@sns.us-east-1.amazonaws.com/SimpleNotificationService-abc.pem",
    "https://evil.com#@sns.us-east-1.amazonaws.com/SimpleNotificationService-abc.pem",
    "https://sns.us-east-1.amazonaws.com\\@evil.com/SimpleNotificationService-abc.pem",
    "https://sns.us-east-1.amazonaws.com:8443/SimpleNotificationService-abc.pem",
    "https://sns.us-east-1.amazonaws.com:443@evil.com/SimpleNotificationService-abc.pem",
    "https://sns.us-east-1.amazonaws.com/SimpleNotificationService-abc.key",
    "https://sns.us-east-1.amazonaws.com/SimpleNotificationService-abc.pem?x=1",
    "https://sns.us-east-1.amazonaws.com/SimpleNotificationService-abc.pem#frag",
    "https://sns.us-east-1.amazonaws.com/../evil/x.pem",
    "https://sns.us-east-1.amazonaws.com/a/b.pem",
    "https://sns.us-east-1.amazonaws.com/",
    "https://sns.amazonaws.com/SimpleNotificationService-abc.pem",
    "https://sqs.us-east-1.amazonaws.com/SimpleNotificationService-abc.pem",
    "https://evilsns.us-east-1.amazonaws.com/SimpleNotificationService-abc.pem",
    "https://sns.us-east-1.evil.com/SimpleNotificationService-abc.pem",
    "https://sns.us-east-1.amazonaws.co/SimpleNotificationService-abc.pem",
    "https://sns.evil.amazonaws.com.cn.evil.com/x.pem",
    "https://54.239.28.85/SimpleNotificationService-abc.pem",
    "https://[::1]/SimpleNotificationService-abc.pem",
    "https://sns.us-east-1.amazonaws.com./SimpleNotificationService-abc.pem",
    "https://SNS.us-east-1.amazonaws.com/SimpleNotificationService-abc.pem",
    "https://sns.us-east-1.amazonaws.com/SimpleNotificationService-abc.pem\n",
    " https://sns.us-east-1.amazonaws.com/SimpleNotificationService-abc.pem",
    "file:///etc/ssl/cert.pem",
    "//sns.us-east-1.amazonaws.com/SimpleNotificationService-abc.pem",
    "",
]


@pytest.mark.parametrize("url", HOSTILE_CERT_URLS)
async def test_hostile_signing_cert_url_fails_without_fetch(
    url: str, signing_key: rsa.RSAPrivateKey, fetch: FakeFetch, cache: CertificateCache
) -> None:
    fetch.pems[url] = fetch.pems[CERT_URL]  # would verify if it were fetched
    assert not is_signing_cert_url(url)
    with pytest.raises(VerificationFailed):
        await verify(body(sign_sns(notification(SigningCertURL=url), signing_key)), cache)
    assert fetch.calls == []


@pytest.mark.parametrize(
    "url",
    [
        "https://sns.us-east-1.amazonaws.com/SimpleNotificationService-7ff5318490ec183fbaddaa2a969abfda.pem",
        "https://sns.us-east-1.amazonaws.com:443/SimpleNotificationService-abc.pem",
        "https://sns.us-gov-west-1.amazonaws.com/SimpleNotificationService-abc.pem",
        "https://sns.cn-northwest-1.amazonaws.com.cn/SimpleNotificationService-abc.pem",
        "https://sns.ap-southeast-5.amazonaws.com/SimpleNotificationService-abc.pem",
    ],
)
def test_signing_cert_urls_accepted(url: str) -> None:
    assert is_signing_cert_url(url)


HOSTILE_SUBSCRIBE_URLS = [
    "http://sns.eu-west-1.amazonaws.com/?Action=ConfirmSubscription&Token=x",
    "https://sns.eu-west-1.amazonaws.com.evil.com/?Action=ConfirmSubscription&Token=x",
    "https://evil.com/sns.eu-west-1.amazonaws.com/?Action=ConfirmSubscription",
    "https://evil.com/?https://sns.eu-west-1.amazonaws.com/",
    "https://sns.eu-west-1.amazonaws.com@evil.com/?Action=ConfirmSubscription",
    "https://sns.eu-west-1.amazonaws.com:8080/?Action=ConfirmSubscription",
    "https://sns.eu-west-1.amazonaws.com\\@evil.com/?Action=ConfirmSubscription",
    "https://169.254.169.254/latest/meta-data/",
    "https://localhost/?Action=ConfirmSubscription",
    "https://sns.eu-west-1.amazonaws.com",
]


@pytest.mark.parametrize("url", HOSTILE_SUBSCRIBE_URLS)
async def test_hostile_subscribe_url_fails_without_fetch(
    url: str, signing_key: rsa.RSAPrivateKey, fetch: FakeFetch, cache: CertificateCache
) -> None:
    assert not is_subscribe_url(url)
    with pytest.raises(VerificationFailed, match="SubscribeURL"):
        await verify(body(sign_sns(confirmation(SubscribeURL=url), signing_key)), cache)
    assert fetch.calls == []


async def test_topic_not_allowlisted_fails_without_fetch(
    signing_key: rsa.RSAPrivateKey, fetch: FakeFetch, cache: CertificateCache
) -> None:
    foreign = "arn:aws:sns:eu-west-1:999999999999:someone-else"
    with pytest.raises(VerificationFailed, match="TopicArn"):
        await verify(body(sign_sns(notification(TopicArn=foreign), signing_key)), cache)
    with pytest.raises(VerificationFailed, match="TopicArn"):
        await verify(body(sign_sns(confirmation(TopicArn=foreign), signing_key)), cache)
    assert fetch.calls == []


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"not json",
        b'{"Type": "Notification"',
        b"[]",
        b'"Notification"',
        b"\xff\xfe{}",
        b"{}",
        orjson.dumps({**notification(), "Type": "Other"}),
        orjson.dumps({**notification(), "Type": None}),
        orjson.dumps({k: v for k, v in notification().items() if k != "Message"}),
        orjson.dumps({**notification(), "Message": {"eventType": "Send"}}),
        orjson.dumps({**notification(), "Timestamp": 1336000446}),
        orjson.dumps({**notification(), "Signature": None}),
        orjson.dumps({k: v for k, v in notification().items() if k != "SigningCertURL"}),
        orjson.dumps({k: v for k, v in confirmation().items() if k != "SubscribeURL"}),
    ],
    ids=[
        "empty",
        "text",
        "truncated",
        "array",
        "string",
        "not-utf8",
        "empty-object",
        "unknown-type",
        "null-type",
        "no-message",
        "message-object",
        "numeric-timestamp",
        "null-signature",
        "no-cert-url",
        "no-subscribe-url",
    ],
)
async def test_malformed_envelope_is_verification_failure_without_fetch(
    raw: bytes, fetch: FakeFetch, cache: CertificateCache
) -> None:
    # Nothing in an envelope is trusted before its signature checks, so a bad one
    # is 401 (VerificationFailed), never 400 (MalformedPayload is for verified content).
    with pytest.raises(VerificationFailed):
        await verify(raw, cache)
    assert fetch.calls == []


async def test_unparsable_timestamp_fails_without_fetch(
    signing_key: rsa.RSAPrivateKey, fetch: FakeFetch, cache: CertificateCache
) -> None:
    with pytest.raises(VerificationFailed, match="Timestamp"):
        await verify(body(sign_sns(notification(Timestamp="yesterday"), signing_key)), cache)
    assert fetch.calls == []


async def test_old_timestamp_is_accepted(
    signing_key: rsa.RSAPrivateKey, cache: CertificateCache
) -> None:
    # No tolerance window: SNS retries with the original Timestamp (module docstring).
    fields = sign_sns(notification(Timestamp="2001-01-01T00:00:00.000Z"), signing_key)
    assert (await verify(body(fields), cache)).timestamp.year == 2001


# --- certificate fetch and cache ------------------------------------------------------


async def test_certificate_is_fetched_once_for_two_messages(
    signing_key: rsa.RSAPrivateKey, fetch: FakeFetch, cache: CertificateCache
) -> None:
    await verify(body(sign_sns(notification(), signing_key)), cache)
    await verify(body(sign_sns(notification(MessageId="second"), signing_key)), cache)
    assert fetch.calls == [CERT_URL]


async def test_certificate_expires_after_ttl(
    signing_key: rsa.RSAPrivateKey, fetch: FakeFetch
) -> None:
    now = [1000.0]
    cache = CertificateCache(fetch, ttl_s=60.0, clock=lambda: now[0])
    raw = body(sign_sns(notification(), signing_key))
    await verify(raw, cache)
    now[0] += 59.0
    await verify(raw, cache)
    assert len(fetch.calls) == 1
    now[0] += 1.0
    await verify(raw, cache)
    assert len(fetch.calls) == 2


async def test_cache_is_bounded_least_recently_used_first(certificate: bytes) -> None:
    urls = [
        f"https://sns.eu-west-1.amazonaws.com/SimpleNotificationService-{i}.pem" for i in range(3)
    ]
    fetch = FakeFetch(dict.fromkeys(urls, certificate))
    cache = CertificateCache(fetch, max_entries=2)
    for url in (urls[0], urls[1], urls[0], urls[2], urls[0], urls[1]):
        await cache.public_key(url)
    # urls[1] was least recently used when urls[2] arrived, so only it was refetched.
    assert fetch.calls == [urls[0], urls[1], urls[2], urls[1]]


async def test_concurrent_misses_fetch_once(certificate: bytes) -> None:
    gate = anyio.Event()
    calls: list[str] = []

    async def slow_fetch(url: str) -> bytes:
        calls.append(url)
        await gate.wait()
        return certificate

    cache = CertificateCache(slow_fetch)
    keys = []

    async def lookup() -> None:
        keys.append(await cache.public_key(CERT_URL))

    async with anyio.create_task_group() as tg:
        for _ in range(5):
            tg.start_soon(lookup)
        await anyio.wait_all_tasks_blocked()
        gate.set()
    assert calls == [CERT_URL]
    assert len(keys) == 5
    assert cache.flights == 0  # no lock left behind per URL


async def test_failed_fetch_is_not_repeated_until_its_pause_has_passed(
    signing_key: rsa.RSAPrivateKey,
    fetch: FakeFetch,
    certificate: bytes,
) -> None:
    from inboxd.adapters.esp.sns_certificates import CERT_FAILURE_TTL_S

    now = [1000.0]
    cache = CertificateCache(fetch, clock=lambda: now[0])
    raw = body(sign_sns(notification(), signing_key))
    del fetch.pems[CERT_URL]
    with pytest.raises(VerificationUnavailable):
        await verify(raw, cache)
    fetch.pems[CERT_URL] = certificate
    with pytest.raises(VerificationUnavailable, match="recently"):
        await verify(raw, cache)  # a retry (or a forger's repeat) makes no request
    assert fetch.calls == [CERT_URL]
    now[0] += CERT_FAILURE_TTL_S
    await verify(raw, cache)  # after the pause the next delivery fetches again
    assert fetch.calls == [CERT_URL, CERT_URL]


async def test_fetches_at_once_are_capped(
    signing_key: rsa.RSAPrivateKey, certificate: bytes
) -> None:
    import anyio

    from inboxd.adapters.esp.sns_certificates import MAX_CONCURRENT_CERT_FETCHES

    release = anyio.Event()
    started: list[str] = []

    async def slow_fetch(url: str) -> bytes:
        started.append(url)
        await release.wait()
        return certificate

    cache = CertificateCache(slow_fetch)
    outcomes: list[object] = []

    async def ask(i: int) -> None:
        url = f"https://sns.us-east-1.amazonaws.com/SimpleNotificationService-{i:032x}.pem"
        try:
            outcomes.append(await cache.public_key(url))
        except VerificationUnavailable as exc:
            outcomes.append(exc)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for i in range(MAX_CONCURRENT_CERT_FETCHES + 3):
                tg.start_soon(ask, i)
            await anyio.wait_all_tasks_blocked()
            release.set()
    assert len(started) == MAX_CONCURRENT_CERT_FETCHES
    assert sum(isinstance(o, VerificationUnavailable) for o in outcomes) == 3


@pytest.mark.parametrize(
    "served",
    [
        b"",
        b"<html>Not Found</html>",
        b"-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n",
        b"<xml><value>\n" + RUBY_CERT + b"\n</value></xml>",
        RUBY_CERT + PERL_CERT,
    ],
    ids=["empty", "html", "bad-pem", "wrapped", "two-certificates"],
)
async def test_response_that_is_not_one_certificate_is_unavailable(
    served: bytes, signing_key: rsa.RSAPrivateKey, fetch: FakeFetch, cache: CertificateCache
) -> None:
    """The SNS host's place was taken by something between us and AWS (a filtering
    proxy's page): the sender is not to blame, so SNS or SQS delivers again later
    (503 / left on the queue) instead of the mail being judged forged."""
    fetch.pems[CERT_URL] = served
    with pytest.raises(VerificationUnavailable, match="certificate"):
        await verify(body(sign_sns(notification(), signing_key)), cache)
    # remembered for CERT_FAILURE_TTL_S: the next message asks nobody
    calls = len(fetch.calls)
    with pytest.raises(VerificationUnavailable, match="failed recently"):
        await verify(body(sign_sns(notification(), signing_key)), cache)
    assert len(fetch.calls) == calls


async def test_certificate_with_non_rsa_key_is_unavailable(
    signing_key: rsa.RSAPrivateKey, fetch: FakeFetch, cache: CertificateCache
) -> None:
    fetch.pems[CERT_URL] = make_certificate(ec.generate_private_key(ec.SECP256R1()))
    with pytest.raises(VerificationUnavailable, match="RSA"):
        await verify(body(sign_sns(notification(), signing_key)), cache)


# --- the default fetch, against a local HTTP server -----------------------------------


@pytest.fixture
async def cert_server(certificate: bytes):
    async def pem(request: web.Request) -> web.Response:
        return web.Response(body=certificate, content_type="application/x-x509-ca-cert")

    async def missing(request: web.Request) -> web.Response:
        return web.Response(status=404, text="NoSuchKey")

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound("/cert.pem")

    async def huge(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()  # chunked: no Content-Length to check first
        await response.prepare(request)
        for _ in range(sns_certificates.CERT_MAX_BYTES // 1024 + 2):
            await response.write(b"A" * 1024)
        await response.write_eof()
        return response

    async def hang(request: web.Request) -> web.Response:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    app = web.Application()
    app.router.add_get("/cert.pem", pem)
    app.router.add_get("/missing.pem", missing)
    app.router.add_get("/redirect.pem", redirect)
    app.router.add_get("/huge.pem", huge)
    app.router.add_get("/hang.pem", hang)
    async with TestServer(app) as server:
        yield server


async def test_default_fetch_returns_the_body(cert_server: TestServer, certificate: bytes) -> None:
    assert await fetch_certificate(str(cert_server.make_url("/cert.pem"))) == certificate


@pytest.mark.parametrize("path", ["/missing.pem", "/redirect.pem", "/huge.pem"])
async def test_default_fetch_failures_are_source_unavailable(
    cert_server: TestServer, path: str
) -> None:
    with pytest.raises(VerificationUnavailable):
        await fetch_certificate(str(cert_server.make_url(path)))


async def test_default_fetch_has_a_deadline(
    cert_server: TestServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sns_certificates, "CERT_FETCH_TIMEOUT_S", 0.2)
    with pytest.raises(VerificationUnavailable, match="timed out"):
        await fetch_certificate(str(cert_server.make_url("/hang.pem")))


async def test_default_fetch_connection_refused_is_source_unavailable() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(VerificationUnavailable):
        await fetch_certificate(f"http://127.0.0.1:{port}/cert.pem")
