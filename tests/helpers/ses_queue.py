"""SES door test helpers: a moto queue and bucket, SES notifications, corpus bytes."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

import boto3
import orjson

REGION = "us-east-1"


@dataclass
class Aws:
    endpoint: str
    queue_url: str
    bucket: str
    sqs: object
    s3: object

    def put(self, key: str, raw: bytes) -> None:
        self.s3.put_object(Bucket=self.bucket, Key=key, Body=raw)  # type: ignore[attr-defined]

    def send(self, body: object) -> None:
        text = body if isinstance(body, str) else orjson.dumps(body).decode()
        self.sqs.send_message(QueueUrl=self.queue_url, MessageBody=text)  # type: ignore[attr-defined]

    def queue_counts(self) -> tuple[int, int]:
        """(visible, in flight) messages of the queue."""
        attrs = self.sqs.get_queue_attributes(  # type: ignore[attr-defined]
            QueueUrl=self.queue_url,
            AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
        )["Attributes"]
        return (
            int(attrs["ApproximateNumberOfMessages"]),
            int(attrs["ApproximateNumberOfMessagesNotVisible"]),
        )

    def keys(self) -> list[str]:
        answer = self.s3.list_objects_v2(Bucket=self.bucket)  # type: ignore[attr-defined]
        return [o["Key"] for o in answer.get("Contents", [])]


def make_queue(endpoint: str) -> Aws:
    """A fresh queue and bucket of one test's own on moto's server."""
    name = f"t-{uuid.uuid4().hex[:12]}"
    sqs = boto3.client("sqs", endpoint_url=endpoint, region_name=REGION)
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name=REGION)
    url = sqs.create_queue(QueueName=name)["QueueUrl"]
    s3.create_bucket(Bucket=name)
    return Aws(endpoint, url, name, sqs, s3)


def ses_notification(
    bucket: str, key: str, message_id: str, recipients: list[str], *, sns: bool = False
) -> dict[str, object]:
    """The SES receipt-rule notification of an S3 action (SES developer guide)."""
    notification = {
        "notificationType": "Received",
        "mail": {
            "timestamp": "2026-12-01T10:00:00.000Z",
            "source": "sender@example.org",
            "messageId": message_id,
            "destination": recipients,
        },
        "receipt": {
            "timestamp": "2026-12-01T10:00:00.100Z",
            "recipients": recipients,
            "action": {"type": "S3", "bucketName": bucket, "objectKey": key},
        },
    }
    if not sns:
        return notification
    return {
        "Type": "Notification",
        "MessageId": str(uuid.uuid4()),
        "TopicArn": "arn:aws:sns:us-east-1:123456789012:ses-inbound",
        "Subject": "Amazon SES Email Receipt Notification",
        "Message": orjson.dumps(notification).decode(),
        "Timestamp": "2026-12-01T10:00:00.200Z",
    }


def corpus_files(corpus: Path, n: int) -> list[bytes]:
    files = sorted(p for p in (corpus / "mime").rglob("*.eml"))[:n]
    return [p.read_bytes() for p in files]
