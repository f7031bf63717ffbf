"""parse_pointers: every body shape that reaches the queue, and every way one is unusable."""

from __future__ import annotations

from datetime import UTC, datetime

import orjson
import pytest
from helpers.ses_queue import (
    s3_event,
    s3_record,
    s3_test_event,
    ses_notification,
    sns_envelope,
    versioned_pointer,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from inboxd.adapters.ses.errors import SesPermanent
from inboxd.adapters.ses.pointers import Pointer, parse_pointers

BUCKET = "inbound-mail-acme"
# SES names the object <prefix>/<SES message id> (SES developer guide, S3 action).
SES_ID = "o3vrnil0e2ic28trm7dfhrc2v0cnbeccl4nbp0g1"
KEY = f"mail/{SES_ID}"


def body(document: object) -> bytes:
    return orjson.dumps(document)


def invalid(document: object) -> SesPermanent:
    with pytest.raises(SesPermanent) as caught:
        parse_pointers(document if isinstance(document, str | bytes) else body(document))
    assert caught.value.reason == "invalid_pointer"
    return caught.value


# --- SES receipt notification --------------------------------------------------------------


@pytest.mark.parametrize("sns", [False, True], ids=["raw-delivery", "sns-envelope"])
def test_ses_notification_points_at_its_object(sns: bool) -> None:
    document = ses_notification(BUCKET, KEY, SES_ID, ["Support@Acme.test", "billing@acme.test"])
    assert parse_pointers(body(sns_envelope(document) if sns else document)) == [
        Pointer(
            bucket=BUCKET,
            key=KEY,
            ses_message_id=SES_ID,
            recipients=("support@acme.test", "billing@acme.test"),
            received_at=datetime(2026, 12, 1, 10, 0, 0, 100_000, tzinfo=UTC),
        )
    ]


def test_ses_notification_from_the_helper_with_sns_flag_is_the_same_pointer() -> None:
    plain = ses_notification(BUCKET, KEY, SES_ID, ["a@acme.test"])
    wrapped = ses_notification(BUCKET, KEY, SES_ID, ["a@acme.test"], sns=True)
    assert wrapped["Type"] == "Notification"
    assert parse_pointers(body(wrapped)) == parse_pointers(body(plain))


def test_ses_notification_external_id_is_the_ses_message_id() -> None:
    [pointer] = parse_pointers(body(ses_notification(BUCKET, KEY, SES_ID, ["a@acme.test"])))
    assert pointer.external_id == SES_ID


def test_ses_recipients_are_the_rules_not_every_destination() -> None:
    # receipt.recipients: the addresses this receipt rule matched; mail.destination
    # also lists other domains' recipients of the same message
    document = ses_notification(
        BUCKET, KEY, SES_ID, ["support@acme.test"], destination=["support@acme.test", "x@else.test"]
    )
    [pointer] = parse_pointers(body(document))
    assert pointer.recipients == ("support@acme.test",)


def test_ses_recipients_fall_back_to_the_destination() -> None:
    document = ses_notification(BUCKET, KEY, SES_ID, ["support@acme.test"])
    del document["receipt"]["recipients"]
    [pointer] = parse_pointers(body(document))
    assert pointer.recipients == ("support@acme.test",)


def test_ses_duplicate_and_blank_recipients_are_dropped() -> None:
    document = ses_notification(BUCKET, KEY, SES_ID, ["a@acme.test", "A@ACME.TEST", "  "])
    [pointer] = parse_pointers(body(document))
    assert pointer.recipients == ("a@acme.test",)


def test_ses_key_is_taken_as_written_not_url_decoded() -> None:
    # the SES notification carries the key itself (only S3 events encode it)
    [pointer] = parse_pointers(body(ses_notification(BUCKET, "in/a+b%40c", SES_ID, [])))
    assert pointer.key == "in/a+b%40c"


def test_ses_unreadable_timestamp_does_not_spoil_the_pointer() -> None:
    document = ses_notification(BUCKET, KEY, SES_ID, ["a@acme.test"])
    document["receipt"]["timestamp"] = "yesterday"
    document["mail"]["timestamp"] = 12
    [pointer] = parse_pointers(body(document))
    assert (pointer.key, pointer.received_at) == (KEY, None)


@pytest.mark.parametrize(
    "kind", ["Bounce", "Complaint", "Delivery", "AmazonSnsSubscriptionSucceeded", None, 7]
)
def test_ses_notification_other_than_received_is_invalid(kind: object) -> None:
    document = ses_notification(BUCKET, KEY, SES_ID, ["a@acme.test"])
    document["notificationType"] = kind
    invalid(document)
    invalid(sns_envelope(document))


@pytest.mark.parametrize("action_type", ["SNS", "Lambda", "WorkMail", "Bounce", None])
def test_ses_notification_of_a_rule_without_an_s3_action_is_invalid(action_type: object) -> None:
    document = ses_notification(BUCKET, KEY, SES_ID, ["a@acme.test"])
    document["receipt"]["action"] = {"type": action_type, "topicArn": "arn:aws:sns:x"}
    invalid(document)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("receipt"),
        lambda d: d.pop("mail"),
        lambda d: d["receipt"].pop("action"),
        lambda d: d["receipt"].__setitem__("action", "S3"),
        lambda d: d["receipt"]["action"].pop("bucketName"),
        lambda d: d["receipt"]["action"].pop("objectKey"),
        lambda d: d["receipt"]["action"].__setitem__("objectKey", ""),
        lambda d: d["receipt"]["action"].__setitem__("objectKey", "k" * 1025),
        lambda d: d["receipt"]["action"].__setitem__("bucketName", "ab"),
        lambda d: d["receipt"]["action"].__setitem__("bucketName", "b" * 64),
        lambda d: d["receipt"]["action"].__setitem__("bucketName", ["bucket"]),
        lambda d: d["mail"].pop("messageId"),
        lambda d: d["mail"].__setitem__("messageId", ""),
        lambda d: d["mail"].__setitem__("messageId", "id\nwith a newline"),
        lambda d: d["receipt"].__setitem__("recipients", "a@acme.test"),
        lambda d: d["receipt"].__setitem__("recipients", [1, 2]),
        lambda d: d["receipt"].__setitem__("recipients", [f"u{i}@acme.test" for i in range(101)]),
    ],
    ids=[
        "no-receipt",
        "no-mail",
        "no-action",
        "action-not-object",
        "no-bucket",
        "no-key",
        "empty-key",
        "key-over-1024-bytes",
        "bucket-too-short",
        "bucket-too-long",
        "bucket-not-string",
        "no-message-id",
        "empty-message-id",
        "message-id-unprintable",
        "recipients-a-string",
        "recipients-not-strings",
        "recipients-over-100",
    ],
)
def test_ses_notification_missing_or_malformed_parts_are_invalid(mutate) -> None:
    document = ses_notification(BUCKET, KEY, SES_ID, ["a@acme.test"])
    mutate(document)
    invalid(document)


# --- S3 event notification -----------------------------------------------------------------


def test_s3_event_key_is_url_decoded_with_plus_as_space() -> None:
    record = s3_record(BUCKET, "in/a+b%2Bc%40d", encode=False)
    [pointer] = parse_pointers(body({"Records": [record]}))
    assert (pointer.bucket, pointer.key) == (BUCKET, "in/a b+c@d")
    # no SES id in an S3 event: the object key is the external id
    assert (pointer.ses_message_id, pointer.external_id, pointer.recipients) == (
        None,
        "in/a b+c@d",
        (),
    )
    assert pointer.received_at == datetime(2026, 12, 1, 10, 0, 0, 300_000, tzinfo=UTC)


def test_s3_event_round_trips_keys_as_s3_encodes_them() -> None:
    keys = ["mail/plain", "mail/with space", "mail/ünïcødé+plus", "mail/a%b&c=d?e"]
    pointers = parse_pointers(body(s3_event(BUCKET, *keys)))
    assert [p.key for p in pointers] == keys


def test_s3_event_with_several_records_gives_one_pointer_each_in_order() -> None:
    pointers = parse_pointers(body(s3_event(BUCKET, "in/1", "in/2", "in/3")))
    assert [(p.bucket, p.key) for p in pointers] == [(BUCKET, f"in/{i}") for i in (1, 2, 3)]


@pytest.mark.parametrize("sns", [False, True], ids=["raw-delivery", "sns-envelope"])
def test_s3_event_skips_records_that_did_not_create_an_object(sns: bool) -> None:
    document = {
        "Records": [
            s3_record(BUCKET, "in/removed", event_name="ObjectRemoved:Delete"),
            s3_record(BUCKET, "in/put", event_name="ObjectCreated:Put"),
            s3_record(BUCKET, "in/restored", event_name="ObjectRestore:Completed"),
            s3_record(BUCKET, "in/multipart", event_name="ObjectCreated:CompleteMultipartUpload"),
            s3_record(BUCKET, "in/copied", event_name="ObjectCreated:Copy"),
        ]
    }
    pointers = parse_pointers(body(sns_envelope(document) if sns else document))
    assert [p.key for p in pointers] == ["in/put", "in/multipart", "in/copied"]


def test_s3_event_of_removals_only_points_at_nothing() -> None:
    document = {"Records": [s3_record(BUCKET, "in/x", event_name="ObjectRemoved:Delete")]}
    assert parse_pointers(body(document)) == []


@pytest.mark.parametrize("sns", [False, True], ids=["raw-delivery", "sns-envelope"])
def test_s3_test_event_is_acknowledged_with_no_pointer(sns: bool) -> None:
    document = s3_test_event(BUCKET)
    assert parse_pointers(body(sns_envelope(document) if sns else document)) == []


@pytest.mark.parametrize(
    "records",
    [
        [],
        "not a list",
        None,
        [None],
        ["record"],
        [{"eventName": "ObjectCreated:Put"}],
        [{"eventName": "ObjectCreated:Put", "s3": "bucket"}],
        [{"eventName": "ObjectCreated:Put", "s3": {"object": {"key": "k"}}}],
        [{"eventName": "ObjectCreated:Put", "s3": {"bucket": {"name": BUCKET}}}],
        [{"eventName": "ObjectCreated:Put", "s3": {"bucket": {"name": BUCKET}, "object": {}}}],
        [
            {
                "eventName": "ObjectCreated:Put",
                "s3": {"bucket": {"name": BUCKET}, "object": {"key": 42}},
            }
        ],
        [{"eventName": "ObjectCreated:Put", "s3": {"bucket": {}, "object": {"key": "k"}}}],
    ],
    ids=[
        "empty",
        "string",
        "null",
        "null-record",
        "string-record",
        "no-s3",
        "s3-not-object",
        "no-bucket",
        "no-object",
        "no-key",
        "key-not-string",
        "no-bucket-name",
    ],
)
def test_s3_event_malformed_records_are_invalid(records: object) -> None:
    invalid({"Records": records})


def test_s3_event_one_bad_record_spoils_the_message() -> None:
    # one SQS message, one fate: the good records are not half-ingested
    document = s3_event(BUCKET, "in/good")
    document["Records"].append({"eventName": "ObjectCreated:Put", "s3": {}})
    invalid(document)


# --- the versioned pointer ------------------------------------------------------------------


def test_versioned_pointer() -> None:
    document = versioned_pointer(BUCKET, KEY, SES_ID, ["Support+T1@Acme.test"])
    assert parse_pointers(body(document)) == [
        Pointer(
            bucket=BUCKET,
            key=KEY,
            ses_message_id=SES_ID,
            recipients=("support+t1@acme.test",),
            received_at=datetime(2026, 12, 1, 10, 0, tzinfo=UTC),
        )
    ]
    assert parse_pointers(body(sns_envelope(document))) == parse_pointers(body(document))


def test_versioned_pointer_without_ses_id_or_recipients() -> None:
    document = versioned_pointer(BUCKET, KEY, None, [])
    del document["recipients"], document["sesMessageId"], document["receivedAt"]
    [pointer] = parse_pointers(body(document))
    assert (pointer.external_id, pointer.recipients, pointer.received_at) == (KEY, (), None)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("version", 2),
        ("version", 0),
        ("version", "1"),
        ("version", None),
        ("version", True),
        ("provider", "mailgun"),
        ("provider", None),
        ("s3Bucket", None),
        ("s3Bucket", ""),
        ("s3Key", None),
        ("s3Key", ""),
        ("s3Key", 17),
        ("recipients", "support@acme.test"),
        ("recipients", None),
        ("recipients", {"to": "support@acme.test"}),
        ("recipients", ["support@acme.test", None]),
        ("sesMessageId", ""),
        ("sesMessageId", 5),
    ],
)
def test_versioned_pointer_malformed_is_invalid(field: str, value: object) -> None:
    document = versioned_pointer(BUCKET, KEY, SES_ID, ["support@acme.test"])
    document[field] = value
    invalid(document)


@pytest.mark.parametrize("field", ["s3Bucket", "s3Key", "provider"])
def test_versioned_pointer_missing_field_is_invalid(field: str) -> None:
    document = versioned_pointer(BUCKET, KEY, SES_ID, ["support@acme.test"])
    del document[field]
    invalid(document)


# --- bodies that are no pointer at all ------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        b"",
        b"   ",
        b"not json",
        b"{",
        b"\xff\xfe{}",
        "Subject: hello\r\n\r\nan email pasted into the queue",
        b"[]",
        b"[{}]",
        b"null",
        b"42",
        b'"a string"',
        b"{}",
        b'{"Message": "{}"}',
        b'{"Type": "Notification"}',
        b'{"Type": "Notification", "Message": {"version": 1}}',
        b'{"Type": "Notification", "Message": "not json"}',
        b'{"Type": "Notification", "Message": "[1, 2]"}',
        b'{"Type": "SubscriptionConfirmation", "Message": "You have chosen to subscribe"}',
        b'{"Event": "s3:ObjectCreated:Put"}',
        b"[" * 2000,
    ],
)
def test_bodies_that_are_no_pointer_are_invalid(text: str | bytes) -> None:
    error = invalid(text)
    # the detail names what is wrong, never more than a short excerpt of the body
    assert len(error.detail) < 200


def test_invalid_detail_does_not_carry_the_body() -> None:
    secret = "x" * 500
    error = invalid({"version": secret, "provider": "ses"})
    assert secret not in error.detail


# --- nothing but SesPermanent, whatever arrives ---------------------------------------------

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),  # what JSON numbers orjson writes
    st.floats(allow_nan=False),
    st.text(max_size=30),
    st.sampled_from(
        [
            "Received",
            "S3",
            "Notification",
            "s3:TestEvent",
            "ObjectCreated:Put",
            "ses",
            BUCKET,
            KEY,
            "a@acme.test",
            "%ZZ+%41",
            "2026-12-01T10:00:00Z",
        ]
    ),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(
            st.one_of(
                st.text(max_size=10),
                st.sampled_from(
                    [
                        "version",
                        "provider",
                        "s3Bucket",
                        "s3Key",
                        "recipients",
                        "sesMessageId",
                        "receivedAt",
                        "notificationType",
                        "receipt",
                        "mail",
                        "action",
                        "type",
                        "bucketName",
                        "objectKey",
                        "messageId",
                        "destination",
                        "timestamp",
                        "Records",
                        "s3",
                        "bucket",
                        "object",
                        "name",
                        "key",
                        "eventName",
                        "eventTime",
                        "Event",
                        "Type",
                        "Message",
                    ]
                ),
            ),
            inner,
            max_size=6,
        ),
    ),
    max_leaves=25,
)


def _parses_or_is_permanent(text: str | bytes) -> None:
    try:
        pointers = parse_pointers(text)
    except SesPermanent as exc:
        assert exc.reason == "invalid_pointer"
        return
    for p in pointers:
        assert isinstance(p, Pointer)
        assert 3 <= len(p.bucket) <= 63 and p.key
        assert all(isinstance(r, str) and r for r in p.recipients)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_parse_or_raise_only_sespermanent(raw: bytes) -> None:
    _parses_or_is_permanent(raw)


@settings(max_examples=200, deadline=None)
@given(document=json_value, wrap=st.booleans())
def test_any_json_parses_or_raises_only_sespermanent(document: object, wrap: bool) -> None:
    text = orjson.dumps(document)
    _parses_or_is_permanent(orjson.dumps(sns_envelope(text.decode())) if wrap else text)


shapes = st.sampled_from(
    [
        ses_notification(BUCKET, KEY, SES_ID, ["a@acme.test"]),
        s3_event(BUCKET, "in/a b", "in/c"),
        versioned_pointer(BUCKET, KEY, SES_ID, ["a@acme.test"]),
    ]
)


def _paths(document: object, prefix: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    out = [prefix] if prefix else []
    if isinstance(document, dict):
        for k, v in document.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(document, list):
        for i, v in enumerate(document):
            out += _paths(v, (*prefix, i))
    return out


@settings(max_examples=200, deadline=None)
@given(data=st.data(), shape=shapes)
def test_a_real_shape_with_any_one_field_replaced_parses_or_is_permanent(data, shape) -> None:
    document = orjson.loads(orjson.dumps(shape))  # a deep copy
    path = data.draw(st.sampled_from(_paths(document)))
    value = data.draw(json_value)
    target = document
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    _parses_or_is_permanent(orjson.dumps(document))
