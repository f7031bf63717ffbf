"""The SES door's SNS envelope check: an SQS body that is an SNS envelope carrying
a signature is verified before its pointer is followed (issue 22).

SNS → SQS without raw message delivery puts the whole signed envelope on the
queue (SNS developer guide, "Amazon SNS message and JSON formats"). Verifying it
with the delivery webhooks' SNS verification (adapters/esp/sns.py: SNS signing
certificate host, signature over the canonical string, TopicArn allowlist) means
a pointer someone wrote onto the queue in SNS's shape cannot make the daemon read
a bucket of their choosing:

    not JSON, not an object       → nothing to verify (the pointer parser says
                                    what it is)
    no envelope (raw message delivery, an S3 event sent straight to the queue)
                                  → nothing to verify when `sns_topic_arns` is
                                    empty (the queue's access policy and
                                    `[ses] buckets` are the boundary); refused as
                                    `sns_unverified` when it is set: listing
                                    topics says every pointer comes through them
    an envelope (`Type` Notification, what the pointer parser unwraps) or any
    body with Signature / SigningCertURL / SignatureVersion
                                  → verified in full: an envelope without its
                                    signature fails (else a forger would simply
                                    leave the signature out)
    verified, TopicArn in `sns_topic_arns` (or any topic when none is set)
                                  → its pointers are followed
    EnvelopeRejected              → SesPermanent("sns_unverified"): recorded dead
                                    with its body (replayable), deleted, no object
                                    read
    EnvelopeUnverifiable          → SesTransient: the certificate could not be
                                    fetched (SNS briefly unreachable); SQS
                                    redelivers, and a message still unverifiable
                                    past max_receive_count is poison (a dead item)

The signature itself is checked by the SNS webhooks' verification, which is
another adapter's (adapters/esp/sns.py); an adapter imports no other
(tests/test_layering.py), so the daemon hands it in as a `VerifyEnvelope`
(daemon/ses_door.py) and this module decides which bodies it sees.
"""

from __future__ import annotations

from typing import Protocol

import orjson

from inboxd.adapters.ses.errors import SesPermanent, SesTransient

__all__ = [
    "NOTIFICATION",
    "SIGNATURE_KEYS",
    "EnvelopeRejected",
    "EnvelopeUnverifiable",
    "SnsEnvelopeCheck",
    "VerifyEnvelope",
]

# A body carrying any of these is verified in full (a missing one fails it).
SIGNATURE_KEYS = ("Signature", "SigningCertURL", "SignatureVersion")
# The `Type` of an SNS envelope that carries a message (SNS message formats).
NOTIFICATION = "Notification"


class EnvelopeRejected(Exception):
    """The envelope is not SNS's: a bad signature, a foreign certificate host or topic,
    a missing field. Its text names the check that failed, never a secret."""


class EnvelopeUnverifiable(Exception):
    """The envelope cannot be verified now (SNS's signing certificate unreachable)."""


class VerifyEnvelope(Protocol):
    """Verifies an SNS envelope's signature against `topic_arns`; returns when it is
    SNS's, raises EnvelopeRejected or EnvelopeUnverifiable otherwise."""

    async def __call__(self, body: bytes, topic_arns: frozenset[str]) -> None: ...


class SnsEnvelopeCheck:
    """settle.CheckBody for `[ses] verify_sns_signature = true` (module docstring).

    `topic_arns` is `[ses] sns_topic_arns` (empty: any topic SNS signed for);
    `verify` checks the signature (one certificate cache for every check of the
    door)."""

    def __init__(self, topic_arns: frozenset[str], verify: VerifyEnvelope) -> None:
        self._topic_arns = topic_arns
        self._verify = verify

    async def __call__(self, body: str) -> None:
        try:
            document = orjson.loads(body)
        except orjson.JSONDecodeError:
            return  # not an envelope: the pointer parser says what it is
        if not isinstance(document, dict):
            return
        enveloped = document.get("Type") == NOTIFICATION
        if not enveloped and not any(k in document for k in SIGNATURE_KEYS):
            if self._topic_arns:
                raise SesPermanent(
                    "sns_unverified",
                    "SNS envelope not verified: the body is not an SNS envelope and "
                    "[ses] sns_topic_arns is set (turn raw message delivery off)",
                )
            return
        topics = self._topic_arns
        if not topics:
            topic = document.get("TopicArn")
            topics = frozenset({topic}) if isinstance(topic, str) else frozenset()
        try:
            await self._verify(body.encode(), topics)
        except EnvelopeRejected as exc:
            raise SesPermanent("sns_unverified", f"SNS envelope not verified: {exc}") from exc
        except EnvelopeUnverifiable as exc:
            raise SesTransient(f"SNS envelope not verified yet: {exc}") from exc
