"""SesSettings (the main file's [ses]) and SesMailbox (a tenant's ses mailbox)."""

from __future__ import annotations

import pytest

from inboxd.adapters.ses.config import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_MAX_RECEIVE_COUNT,
    DEFAULT_POLLERS,
    DEFAULT_VISIBILITY_S,
    SesMailbox,
    SesSettings,
)
from inboxd.adapters.ses.errors import SesConfigError

QUEUE = "https://sqs.eu-west-1.amazonaws.com/123456789012/inbound"


def settings(**values: object) -> SesSettings:
    return SesSettings.from_settings({"queue_url": QUEUE, **values})


def refused(build, values: dict[str, object], key: str) -> str:
    """The error for `values`: it names `key` first, and never quotes a value."""
    with pytest.raises(SesConfigError) as caught:
        build(values)
    message = str(caught.value)
    assert message.startswith(f"{key}:"), message
    for value in values.values():
        if isinstance(value, str) and len(value) > 3:
            assert value not in message, message
    return message


# --- [ses] ----------------------------------------------------------------------------------


def test_defaults() -> None:
    s = settings()
    assert s == SesSettings(
        queue_url=QUEUE,
        region=None,
        endpoint_url=None,
        wait_time_s=20,
        max_messages=10,
        visibility_timeout_s=DEFAULT_VISIBILITY_S,
        max_receive_count=DEFAULT_MAX_RECEIVE_COUNT,
        max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES,
        pollers=DEFAULT_POLLERS,
    )
    assert s.queue_name == "inbound"
    # SES receives messages up to 40 MB: the default must not refuse one it sent
    assert s.max_message_bytes >= 40 * 1024 * 1024


def test_every_key_read() -> None:
    s = SesSettings.from_settings(
        {
            "queue_url": "https://sqs.eu-west-1.amazonaws.com/123/inbound/",
            "region": " eu-west-1 ",
            "endpoint_url": "https://vpce-0a1b.sqs.eu-west-1.vpce.amazonaws.com/",
            "wait_time_s": 0,
            "max_messages": 1,
            "visibility_timeout_s": 600,
            "max_receive_count": 3,
            "max_message_bytes": 10 * 1024 * 1024,
            "pollers": 4,
        }
    )
    assert s == SesSettings(
        queue_url="https://sqs.eu-west-1.amazonaws.com/123/inbound",
        region="eu-west-1",
        endpoint_url="https://vpce-0a1b.sqs.eu-west-1.vpce.amazonaws.com",
        wait_time_s=0,
        max_messages=1,
        visibility_timeout_s=600,
        max_receive_count=3,
        max_message_bytes=10 * 1024 * 1024,
        pollers=4,
    )
    assert s.queue_name == "inbound"


@pytest.mark.parametrize(
    ("key", "good", "bad"),
    [
        # SQS ReceiveMessage: WaitTimeSeconds 0-20, MaxNumberOfMessages 1-10
        ("wait_time_s", [0, 1, 20], [-1, 21, 60]),
        ("max_messages", [1, 10], [0, 11, -3]),
        ("visibility_timeout_s", [10, 43_200], [0, 9, 43_201]),
        ("max_receive_count", [1, 1000], [0, -1]),
        ("max_message_bytes", [1024, 40 * 1024 * 1024], [0, 1023]),
        ("pollers", [1, 64], [0, 65]),
        # the pipeline (issue 25): S3 GETs at once, messages in flight
        ("fetch_concurrency", [1, 256], [0, 257]),
        ("max_in_flight", [1, 10_000], [0, 10_001]),
    ],
)
def test_integer_bounds(key: str, good: list[int], bad: list[int]) -> None:
    for value in good:
        assert getattr(settings(**{key: value}), key) == value
    for value in bad:
        message = refused(SesSettings.from_settings, {"queue_url": QUEUE, key: value}, key)
        assert "integer from" in message


def test_pipeline_defaults() -> None:
    s = settings()
    # ~5 receives' worth per default poller; 32 GETs, so one slow object is one of many
    assert (s.fetch_concurrency, s.max_in_flight) == (32, 100)


@pytest.mark.parametrize("value", [True, False, 5.0, "5", [5]])
def test_integers_are_integers(value: object) -> None:
    # TOML true is not 1, 5.0 is not 5, and a quoted number is a typo worth reporting
    refused(SesSettings.from_settings, {"queue_url": QUEUE, "wait_time_s": value}, "wait_time_s")


def test_sns_signature_verified_by_default_and_allowlists_empty() -> None:
    s = settings()
    assert s.verify_sns_signature is True
    assert s.sns_topic_arns == frozenset() and s.buckets == frozenset()


def test_sns_and_bucket_allowlists_read() -> None:
    topics = [
        "arn:aws:sns:eu-west-1:123456789012:ses-inbound",
        "arn:aws-cn:sns:cn-north-1:123456789012:in.fifo",
    ]
    s = settings(verify_sns_signature=False, sns_topic_arns=topics, buckets=["acme-inbound.mail"])
    assert s.verify_sns_signature is False
    assert s.sns_topic_arns == frozenset(topics)
    assert s.buckets == frozenset({"acme-inbound.mail"})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("verify_sns_signature", "yes"),
        ("verify_sns_signature", 1),
        ("sns_topic_arns", "arn:aws:sns:eu-west-1:123456789012:ses-inbound"),
        ("sns_topic_arns", ["arn:aws:sqs:eu-west-1:123456789012:inbound"]),
        ("sns_topic_arns", ["ses-inbound"]),
        ("buckets", "acme-inbound"),
        ("buckets", ["Acme_Inbound"]),
        ("buckets", ["s3://acme-inbound"]),
        ("buckets", [3]),
    ],
)
def test_sns_and_bucket_settings_refused(key: str, value: object) -> None:
    refused(SesSettings.from_settings, {"queue_url": QUEUE, key: value}, key)


def test_queue_url_is_required() -> None:
    message = refused(SesSettings.from_settings, {"region": "eu-west-1"}, "queue_url")
    assert "required" in message
    refused(SesSettings.from_settings, {"queue_url": "  "}, "queue_url")
    refused(SesSettings.from_settings, {"queue_url": 42}, "queue_url")


@pytest.mark.parametrize(
    "url",
    [
        "sqs.eu-west-1.amazonaws.com/123/inbound",
        "ftp://sqs.eu-west-1.amazonaws.com/123/inbound",
        "http://sqs.eu-west-1.amazonaws.com/123/inbound",
        "http://10.0.0.5:4566/000000000000/inbound",
        "https:///no-host",
    ],
)
def test_queue_url_is_https_except_to_this_machine(url: str) -> None:
    refused(SesSettings.from_settings, {"queue_url": url}, "queue_url")


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:5000",
        "http://localhost:4566/",
        "http://[::1]:4566",
        "http://127.0.0.2:9000",
        "https://s3.eu-west-1.amazonaws.com",
    ],
)
def test_endpoint_url_http_only_for_loopback_accepted(url: str) -> None:
    assert settings(endpoint_url=url).endpoint_url == url.rstrip("/")


@pytest.mark.parametrize(
    "url",
    [
        "http://sqs.eu-west-1.amazonaws.com",
        "http://10.1.2.3:4566",
        "http://localhost.example.com:4566",
        "http://127.0.0.1.nip.io",
        "ftp://127.0.0.1",
        "127.0.0.1:5000",
        "",
        7,
    ],
)
def test_endpoint_url_plain_http_elsewhere_refused(url: object) -> None:
    refused(SesSettings.from_settings, {"queue_url": QUEUE, "endpoint_url": url}, "endpoint_url")


def test_unknown_key_is_named() -> None:
    message = refused(SesSettings.from_settings, {"queue_url": QUEUE, "wait_time": 20}, "wait_time")
    assert "unknown" in message and "wait_time_s" in message  # the known keys are listed


def test_aws_credentials_are_not_settings() -> None:
    # credentials come from the standard chain only (issue 12)
    for key in ("aws_access_key_id", "aws_secret_access_key", "profile"):
        refused(SesSettings.from_settings, {"queue_url": QUEUE, key: "AKIAEXAMPLE"}, key)


# --- ses mailboxes --------------------------------------------------------------------------


def mailbox(**values: object) -> SesMailbox:
    return SesMailbox.from_settings(values)


def test_mailbox_defaults_and_normalisation() -> None:
    m = mailbox(addresses=[" Support@Acme.TEST ", "@Billing.Acme.test", "support@acme.test"])
    assert m == SesMailbox(
        addresses=("support@acme.test", "@billing.acme.test"), allowed_senders=(), keep_objects=True
    )


def test_mailbox_keep_objects() -> None:
    assert mailbox(addresses=["a@acme.test"], keep_objects=False).keep_objects is False
    assert mailbox(addresses=["a@acme.test"], keep_objects=True).keep_objects is True
    for value in ("no", 0, 1, None):
        refused(
            SesMailbox.from_settings,
            {"addresses": ["a@acme.test"], "keep_objects": value},
            "keep_objects",
        )


@pytest.mark.parametrize(
    "addresses",
    [None, [], "support@acme.test", [42], ["support@acme.test", None]],
    ids=["missing", "empty", "a-string", "not-strings", "a-null"],
)
def test_mailbox_addresses_required_as_a_list(addresses: object) -> None:
    values = {} if addresses is None else {"addresses": addresses}
    refused(SesMailbox.from_settings, values, "addresses")


@pytest.mark.parametrize(
    "entry",
    [
        "support",  # no domain
        "support@",  # empty domain
        "@",  # nothing
        "support@localhost",  # no dot: not a routable domain
        "*@acme.test",  # routes are addresses, not patterns
        "support@*.acme.test",
        "sup port@acme.test",
        "a@acme.test,b@acme.test",  # two in one string
        "a@acme.test;b@acme.test",
        "[ab]@acme.test",
        "",
    ],
)
def test_mailbox_bad_address_entries_refused(entry: str) -> None:
    refused(SesMailbox.from_settings, {"addresses": ["ok@acme.test", entry]}, "addresses")


def test_mailbox_unknown_key_is_named() -> None:
    refused(
        SesMailbox.from_settings,
        {"addresses": ["a@acme.test"], "keep_object": False},
        "keep_object",
    )


@pytest.mark.parametrize(
    "pattern",
    [
        "*@vendor.example",
        "*@*.vendor.example",
        "alerts-?@vendor.example",
        "boss@gmail.com",  # one address at a public domain: fine
        "Boss@GMail.com",
        "noreply@*.vendor.example",
        "*@mail.gmail.com.vendor.example",
    ],
)
def test_allowed_senders_accepted(pattern: str) -> None:
    m = mailbox(addresses=["a@acme.test"], allowed_senders=[pattern])
    assert m.allowed_senders == (pattern.lower(),)


@pytest.mark.parametrize(
    "pattern",
    [
        "*@gmail.com",
        "*@GMAIL.COM",
        "*@googlemail.com",
        "*@outlook.com",
        "*@hotmail.com",
        "*@yahoo.com",
        "*@icloud.com",
        "*@proton.me",
        "*@gmx.de",
        "*@qq.com",
        "?*@gmail.com",
        "boss*@gmail.com",
        "[a-z]*@gmail.com",
        "*@*.gmail.com",
        # a wildcard over a top-level domain admits anyone who registers one
        "*@*.com",
        "*@*.*",
    ],
)
def test_allowed_senders_wildcards_over_public_domains_refused(pattern: str) -> None:
    message = refused(
        SesMailbox.from_settings,
        {"addresses": ["a@acme.test"], "allowed_senders": [pattern]},
        "allowed_senders",
    )
    assert "example.com" in message or "public" in message or "wildcard" in message


@pytest.mark.parametrize(
    "pattern",
    [
        "*@*.*.*",  # any address at a domain of three labels: the world
        "*@*.*.com",  # any address at any second-level .com subdomain
        "*@*.?.com",
        "boss@*.com",  # boss at whatever .com domain one registers
        "boss@*.*",
    ],
)
def test_allowed_senders_wildcards_that_admit_the_world_refused(pattern: str) -> None:
    refused(
        SesMailbox.from_settings,
        {"addresses": ["a@acme.test"], "allowed_senders": [pattern]},
        "allowed_senders",
    )


@pytest.mark.parametrize(
    "pattern",
    ["*", "vendor.example", "*@*", "*@vendor.*", "*@ven*dor.example", "*@", 42],
)
def test_allowed_senders_malformed_refused(pattern: object) -> None:
    refused(
        SesMailbox.from_settings,
        {"addresses": ["a@acme.test"], "allowed_senders": [pattern]},
        "allowed_senders",
    )


@pytest.mark.parametrize(
    ("sender", "allowed"),
    [
        ("billing@vendor.example", True),
        ("Billing@VENDOR.example", True),
        ("<billing@vendor.example>", True),
        ("x@eu.vendor.example", True),  # *@*.vendor.example
        ("boss@gmail.com", True),
        ("BOSS@gmail.com", True),
        ("someone@gmail.com", False),
        ("billing@vendor.example.evil", False),
        ("billing@notvendor.example", False),
        ("vendor.example@evil.test", False),
        ("", False),
        (None, False),
    ],
)
def test_allows_sender(sender: str | None, allowed: bool) -> None:
    m = mailbox(
        addresses=["a@acme.test"],
        allowed_senders=["*@vendor.example", "*@*.vendor.example", "boss@gmail.com"],
    )
    assert m.allows_sender(sender) is allowed


@pytest.mark.parametrize("sender", ["anyone@anywhere.test", "", None])
def test_no_allowlist_allows_everyone(sender: str | None) -> None:
    assert mailbox(addresses=["a@acme.test"]).allows_sender(sender) is True
