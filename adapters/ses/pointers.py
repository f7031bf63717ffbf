"""What an SQS message body says: where the raw message is, and for whom.

Three shapes reach the queue, each maybe wrapped in an SNS envelope (SNS → SQS
without raw message delivery puts the payload, as a string, in `Message`):

    SES receipt rule, S3 action + SNS topic      {"notificationType": "Received",
      (SES developer guide, "Amazon SNS            "mail": {"messageId", "destination",
      notification contents for receipts")         "source", ...}, "receipt": {
                                                   "recipients", "action": {"type": "S3",
                                                   "bucketName", "objectKey"}}}
    S3 event notification                        {"Records": [{"eventSource": "aws:s3",
      (S3 user guide, "Event message               "s3": {"bucket": {"name"}, "object":
      structure")                                  {"key": url-encoded, plus = space}}}]}
                                                 and {"Event": "s3:TestEvent"} when the
                                                 notification is configured: ignored
    inboxd's own versioned pointer               {"version": 1, "provider": "ses",
                                                  "sesMessageId", "s3Bucket", "s3Key",
                                                  "recipients": [...], "receivedAt"}

`parse_pointers` answers the pointers (one per S3 record; an empty list for a test
event) or raises SesPermanent("invalid_pointer"): a body we cannot read will not
become readable on redelivery. SNS signatures are not checked here but before the
pointers are followed (settle.py's CheckBody: envelope.py verifies them like
the SNS delivery webhooks); for a body without an envelope, the queue's access
policy and `[ses] buckets` are the trust boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import unquote_plus

import orjson

from inboxd.adapters.ses.config import normalise_address
from inboxd.adapters.ses.errors import SesPermanent

__all__ = ["Pointer", "parse_pointers"]

# S3 bucket names are 3-63 characters, object keys at most 1,024 bytes (S3 user guide).
_MAX_BUCKET = 63
_MAX_KEY_BYTES = 1024
# A notification lists at most 100 recipients per message (SES receiving quotas);
# more in a hand-written pointer is not something SES produced.
_MAX_RECIPIENTS = 100


@dataclass(frozen=True, slots=True)
class Pointer:
    """One stored message: its S3 object, SES id and envelope recipients (maybe none)."""

    bucket: str
    key: str
    ses_message_id: str | None = None
    recipients: tuple[str, ...] = ()
    received_at: datetime | None = None

    @property
    def external_id(self) -> str:
        """The stored copy's id: the SES message id, else the object key."""
        return self.ses_message_id or self.key


def parse_pointers(body: str | bytes) -> list[Pointer]:
    """The pointers in one SQS message body (module docstring)."""
    document = _json(body, "body")
    if isinstance(document, dict) and document.get("Type") == "Notification":
        message = document.get("Message")
        if not isinstance(message, str):
            raise _invalid("SNS envelope without a Message string")
        document = _json(message, "SNS Message")
    if not isinstance(document, dict):
        raise _invalid("not a JSON object")
    if "version" in document:
        return [_versioned(document)]
    if "notificationType" in document or "receipt" in document:
        return [_ses_notification(document)]
    if document.get("Event") == "s3:TestEvent":
        return []
    if "Records" in document:
        return _s3_records(document["Records"])
    raise _invalid("neither an SES notification, an S3 event nor an inboxd pointer")


def _ses_notification(document: dict[str, Any]) -> Pointer:
    kind = document.get("notificationType")
    if kind != "Received":
        raise _invalid(f"SES notificationType {_short(kind)} is not Received")
    receipt, mail = document.get("receipt"), document.get("mail")
    if not isinstance(receipt, dict) or not isinstance(mail, dict):
        raise _invalid("SES notification without receipt and mail objects")
    action = receipt.get("action")
    if not isinstance(action, dict) or action.get("type") != "S3":
        raise _invalid("SES notification of a receipt rule without an S3 action")
    recipients = receipt.get("recipients") or mail.get("destination") or []
    return Pointer(
        bucket=_bucket(action.get("bucketName")),
        key=_key(action.get("objectKey")),
        ses_message_id=_message_id(mail.get("messageId")),
        recipients=_recipients(recipients),
        received_at=_time(receipt.get("timestamp") or mail.get("timestamp")),
    )


def _s3_records(records: object) -> list[Pointer]:
    if not isinstance(records, list) or not records:
        raise _invalid("S3 event with no Records")
    pointers = []
    for record in records:
        if not isinstance(record, dict) or not isinstance(record.get("s3"), dict):
            raise _invalid("S3 event record without an s3 object")
        if not str(record.get("eventName", "ObjectCreated")).startswith("ObjectCreated"):
            continue  # a removal or restore event points at nothing to ingest
        s3 = record["s3"]
        bucket, obj = s3.get("bucket"), s3.get("object")
        if not isinstance(bucket, dict) or not isinstance(obj, dict):
            raise _invalid("S3 event record without bucket and object")
        raw_key = obj.get("key")
        if not isinstance(raw_key, str):
            raise _invalid("S3 event record without an object key")
        # keys are URL-encoded with '+' for spaces (S3 user guide, event message structure)
        pointers.append(
            Pointer(
                bucket=_bucket(bucket.get("name")),
                key=_key(unquote_plus(raw_key)),
                received_at=_time(record.get("eventTime")),
            )
        )
    return pointers


def _versioned(document: dict[str, Any]) -> Pointer:
    version = document.get("version")
    # bool is an int in Python: `true == 1` must not pass for version 1
    if isinstance(version, bool) or version != 1:
        raise _invalid(f"pointer version {_short(version)} is not 1")
    if document.get("provider") != "ses":
        raise _invalid("pointer provider is not ses")
    return Pointer(
        bucket=_bucket(document.get("s3Bucket")),
        key=_key(document.get("s3Key")),
        ses_message_id=_message_id(document.get("sesMessageId"), required=False),
        recipients=_recipients(document.get("recipients", [])),
        received_at=_time(document.get("receivedAt")),
    )


def _json(text: str | bytes, what: str) -> object:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise _invalid(f"{what} is not JSON ({exc.msg})") from None


def _bucket(value: object) -> str:
    if not isinstance(value, str) or not 3 <= len(value) <= _MAX_BUCKET:
        raise _invalid("missing or malformed bucket name")
    return value


def _key(value: object) -> str:
    if not isinstance(value, str) or not value or len(value.encode()) > _MAX_KEY_BYTES:
        raise _invalid("missing or malformed object key")
    return value


def _message_id(value: object, *, required: bool = True) -> str | None:
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value or len(value) > 256 or not value.isprintable():
        raise _invalid("missing or malformed SES messageId")
    return value


def _recipients(value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _invalid("recipients is not a list of addresses")
    if len(value) > _MAX_RECIPIENTS:
        raise _invalid(f"more than {_MAX_RECIPIENTS} recipients")
    return tuple(dict.fromkeys(normalise_address(v) for v in value if v.strip()))


def _time(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None  # informative only: a bad timestamp does not spoil a good pointer


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _invalid(detail: str) -> SesPermanent:
    return SesPermanent("invalid_pointer", f"SQS message is not a usable pointer: {detail}")
