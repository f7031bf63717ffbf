"""SES door test helpers: a moto queue and bucket, the notification shapes, corpus bytes.

The bodies follow the published examples, field for field where it matters:
`ses_notification` the SES developer guide ("Amazon SNS notification contents for
receipts", an S3 action with a topic), `sns_envelope` what SNS puts on an SQS queue
without raw message delivery (SNS developer guide, "Amazon SNS message and JSON
formats"), `s3_event` / `s3_test_event` the S3 user guide ("Event message
structure"), `versioned_pointer` inboxd's own shape (issue 12).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote_plus

import boto3
import orjson

REGION = "us-east-1"
# The door name the in-process tests' unrouted records carry (the daemon's is
# ses:<queue name>).
TEST_DOOR = "ses:test"
# Arbitrary but realistic ARNs: SES publishes the S3 action's notification here.
TOPIC_ARN = "arn:aws:sns:us-east-1:123456789012:ses-inbound"


@dataclass
class Aws:
    endpoint: str
    queue_url: str
    bucket: str
    sqs: Any
    s3: Any

    def put(self, key: str, raw: bytes) -> None:
        self.s3.put_object(Bucket=self.bucket, Key=key, Body=raw)

    def send(self, body: object) -> None:
        text = body if isinstance(body, str) else orjson.dumps(body).decode()
        self.sqs.send_message(QueueUrl=self.queue_url, MessageBody=text)

    def queue_counts(self) -> tuple[int, int]:
        """(visible, in flight) messages of the queue."""
        attrs = self.sqs.get_queue_attributes(
            QueueUrl=self.queue_url,
            AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
        )["Attributes"]
        return (
            int(attrs["ApproximateNumberOfMessages"]),
            int(attrs["ApproximateNumberOfMessagesNotVisible"]),
        )

    def keys(self) -> list[str]:
        answer = self.s3.list_objects_v2(Bucket=self.bucket)
        return sorted(o["Key"] for o in answer.get("Contents", []))

    def receive_and_release(self) -> int:
        """Receive every visible message once and make it visible again at once, as a
        consumer that crashed would (ApproximateReceiveCount goes up by one)."""
        answer = self.sqs.receive_message(
            QueueUrl=self.queue_url, MaxNumberOfMessages=10, VisibilityTimeout=0
        )
        return len(answer.get("Messages", []))

    def release(self, receipt_handles: list[str]) -> None:
        """Make in-flight messages visible again (the visibility timeout, run out now)."""
        for handle in receipt_handles:
            self.sqs.change_message_visibility(
                QueueUrl=self.queue_url, ReceiptHandle=handle, VisibilityTimeout=0
            )


def make_queue(endpoint: str) -> Aws:
    """A fresh queue and bucket of one test's own on moto's server."""
    name = f"t-{uuid.uuid4().hex[:12]}"
    sqs = boto3.client("sqs", endpoint_url=endpoint, region_name=REGION)
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name=REGION)
    url = sqs.create_queue(QueueName=name)["QueueUrl"]
    s3.create_bucket(Bucket=name)
    return Aws(endpoint, url, name, sqs, s3)


def ses_notification(
    bucket: str,
    key: str,
    message_id: str,
    recipients: list[str],
    *,
    sns: bool = False,
    destination: list[str] | None = None,
) -> dict[str, Any]:
    """The SES receipt notification of an S3 action (SES developer guide's example):
    `receipt.recipients` are the envelope recipients this rule matched, `mail.destination`
    every envelope recipient of the message. `sns`: wrapped in SNS's envelope."""
    notification = {
        "notificationType": "Received",
        "mail": {
            "timestamp": "2026-12-01T10:00:00.000Z",
            "source": "0000014fbe1c09cf-7cb9f704@amazonses.com",
            "messageId": message_id,
            "destination": recipients if destination is None else destination,
            "headersTruncated": False,
            "headers": [
                {"name": "Return-Path", "value": "<sender@example.org>"},
                {"name": "From", "value": "Sender <sender@example.org>"},
                {"name": "To", "value": ", ".join(recipients)},
                {"name": "Subject", "value": "Example subject"},
            ],
            "commonHeaders": {
                "returnPath": "sender@example.org",
                "from": ["Sender <sender@example.org>"],
                "date": "Tue, 1 Dec 2026 10:00:00 +0000",
                "to": recipients,
                "messageId": "<example@example.org>",
                "subject": "Example subject",
            },
        },
        "receipt": {
            "timestamp": "2026-12-01T10:00:00.100Z",
            "processingTimeMillis": 222,
            "recipients": recipients,
            "spamVerdict": {"status": "PASS"},
            "virusVerdict": {"status": "PASS"},
            "spfVerdict": {"status": "PASS"},
            "dkimVerdict": {"status": "PASS"},
            "dmarcVerdict": {"status": "PASS"},
            "action": {
                "type": "S3",
                "topicArn": TOPIC_ARN,
                "bucketName": bucket,
                "objectKeyPrefix": key.rpartition("/")[0],
                "objectKey": key,
            },
        },
    }
    return (
        sns_envelope(notification, subject="Amazon SES Email Receipt Notification")
        if sns
        else notification
    )


def sns_envelope(message: object, *, subject: str | None = None) -> dict[str, Any]:
    """What SNS delivers to an SQS subscriber without raw message delivery: the
    payload as a JSON string in `Message` (SNS developer guide, notification JSON)."""
    envelope: dict[str, Any] = {
        "Type": "Notification",
        "MessageId": str(uuid.uuid4()),
        "TopicArn": TOPIC_ARN,
        "Message": message if isinstance(message, str) else orjson.dumps(message).decode(),
        "Timestamp": "2026-12-01T10:00:00.200Z",
        "SignatureVersion": "1",
        "Signature": "EXAMPLEpH+DcEwjAPg8O9mY8dReBSwksfg2S7WKQcikcNKWLQjwu6A4VbeS0QHVCkhRS7fUQvi",
        "SigningCertURL": "https://sns.us-east-1.amazonaws.com/SimpleNotificationService-0000.pem",
        "UnsubscribeURL": "https://sns.us-east-1.amazonaws.com/?Action=Unsubscribe",
    }
    if subject is not None:
        envelope["Subject"] = subject
    return envelope


def s3_record(
    bucket: str, key: str, *, event_name: str = "ObjectCreated:Put", encode: bool = True
) -> dict[str, Any]:
    """One record of an S3 event notification; the key URL-encoded as S3 sends it
    (spaces as '+'), unless `encode` is false (the key is given encoded already)."""
    return {
        "eventVersion": "2.1",
        "eventSource": "aws:s3",
        "awsRegion": REGION,
        "eventTime": "2026-12-01T10:00:00.300Z",
        "eventName": event_name,
        "userIdentity": {"principalId": "AWS:AIDAINPONIXQXHT3IKHL2"},
        "requestParameters": {"sourceIPAddress": "10.0.0.1"},
        "responseElements": {
            "x-amz-request-id": "C3D13FE58DE4C810",
            "x-amz-id-2": "FMyUVURIY8/IgAtTv8xRjskZQpcIZ9KG4V5Wp6S7S/JRWeUWerMUE5JgHvANOjpD",
        },
        "s3": {
            "s3SchemaVersion": "1.0",
            "configurationId": "inbound-mail",
            "bucket": {
                "name": bucket,
                "ownerIdentity": {"principalId": "A3NL1KOZZKExample"},
                "arn": f"arn:aws:s3:::{bucket}",
            },
            "object": {
                "key": quote_plus(key, safe="/") if encode else key,
                "size": 1024,
                "eTag": "d41d8cd98f00b204e9800998ecf8427e",
                "sequencer": "0055AED6DCD90281E5",
            },
        },
    }


def s3_event(bucket: str, *keys: str) -> dict[str, Any]:
    """An S3 event notification announcing these new objects (S3 user guide)."""
    return {"Records": [s3_record(bucket, key) for key in keys]}


def s3_test_event(bucket: str) -> dict[str, Any]:
    """What S3 sends to the queue once, when the notification is configured."""
    return {
        "Service": "Amazon S3",
        "Event": "s3:TestEvent",
        "Time": "2026-12-01T09:59:00.000Z",
        "Bucket": bucket,
        "RequestId": "5582815E1AEA5ADF",
        "HostId": "8cLeGAmw098X5cv4Zkwcmo8vvZa3eH3eKxsPzbB9wrR+YYz5NCZHaPoWJPEvB7l0",
    }


def versioned_pointer(
    bucket: str, key: str, ses_message_id: str | None, recipients: list[str]
) -> dict[str, Any]:
    """inboxd's own pointer, version 1 (issue 12)."""
    return {
        "version": 1,
        "provider": "ses",
        "sesMessageId": ses_message_id,
        "s3Bucket": bucket,
        "s3Key": key,
        "recipients": recipients,
        "receivedAt": "2026-12-01T10:00:00Z",
    }


async def drain(poller: Any) -> list[Any]:
    """Receive and process until the queue shows nothing more (in-flight messages
    are invisible); answers the QueueMessages received."""
    received: list[Any] = []
    while batch := await poller._aws.receive():
        received.extend(batch)
        await poller.process(batch)
    return received


async def copies(pool: Any) -> list[tuple[str, str, str]]:
    """(tenant, mailbox, external id) of every stored copy."""
    async with pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT tenant_id, mailbox_id, external_id FROM message_copies ORDER BY 1, 2, 3"
        )
    return [tuple(r) for r in rows]


async def dead(pool: Any) -> list[tuple[str, str, str, str]]:
    """(tenant, mailbox, external id, reason) of every dead item."""
    async with pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT tenant_id, mailbox_id, external_id, reason FROM dead_items ORDER BY 1, 2, 3"
        )
    return [tuple(r) for r in rows]


async def unrouted(pool: Any) -> list[dict[str, Any]]:
    """Every unrouted record, as a dict of its columns."""
    async with pool.acquire() as conn:
        rows = await conn.fetch("SELECT * FROM unrouted_items ORDER BY external_id")
    return [dict(r) for r in rows]


def corpus_file(corpus: Path, name: str) -> bytes:
    """One corpus message by its path under tests/corpus/mime."""
    return (corpus / "mime" / name).read_bytes()
