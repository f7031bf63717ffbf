"""SES door settings: the main file's `[ses]` table and a tenant's ses mailboxes.

    [ses]                                   one poller set per daemon (absent: none)
    queue_url = "https://sqs.eu-west-1.amazonaws.com/123/inbound"
    region, endpoint_url                    S3 and SQS (tests point it at moto)
    wait_time_s, max_messages, visibility_timeout_s, max_receive_count,
    max_message_bytes, pollers, fetch_concurrency, max_in_flight
    verify_sns_signature = true             an SNS envelope's signature is checked
    sns_topic_arns = [...]                  optional: the topics its envelopes may name
    buckets = [...]                         optional: the buckets its pointers may name

    [[mailboxes]] provider = "ses"
    addresses = ["support@example.com", "@billing.example.com"]
    allowed_senders = ["*@vendor.example"]  optional; public-domain wildcards refused
    keep_objects = true                     false: the S3 object is deleted after commit

Readers raise SesConfigError("key: why") and never quote a value; the daemon turns
that into a problem at file.key. Credentials come from botocore's chain only.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass

from inboxd.adapters.ses.errors import SesConfigError
from inboxd.adapters.settings import optional_text, refuse_unknown, url

__all__ = [
    "MAILBOX_KEYS",
    "PUBLIC_MAILBOX_DOMAINS",
    "SES_KEYS",
    "SesMailbox",
    "SesSettings",
    "normalise_address",
]

# SQS ReceiveMessage limits (SQS API reference): WaitTimeSeconds 0-20,
# MaxNumberOfMessages 1-10, VisibilityTimeout 0-43,200 s (12 hours).
SQS_MAX_WAIT_S = 20
SQS_MAX_MESSAGES = 10
SQS_MAX_VISIBILITY_S = 43_200
# A message is being parsed and committed well within this; the poller extends it
# (ChangeMessageVisibility) while one is still in flight, so it only bounds how
# long a crashed daemon's messages stay hidden.
DEFAULT_VISIBILITY_S = 120
# Receives before a message is poison. SQS redrive policies commonly use 3-5; a
# message that failed five times for transient reasons over 5 × visibility is
# better in dead_items (with its pointer, replayable) than cycling forever.
DEFAULT_MAX_RECEIVE_COUNT = 5
# SES accepts incoming messages up to 40 MB including headers (SES developer
# guide, "Email receiving"); anything larger in the bucket did not come from SES.
DEFAULT_MAX_MESSAGE_BYTES = 40 * 1024 * 1024
# Concurrent receive loops. Each holds at most max_messages in flight; two keep
# one loop's S3 fetches overlapping the other's ingest on the 2-core target.
DEFAULT_POLLERS = 2
MAX_POLLERS = 64
# S3 GETs at once for the door (poller.py): one slow object holds one of them. Each
# is a connection of the S3 client's pool (aws.py sizes the pool from it).
DEFAULT_FETCH_CONCURRENCY = 32
MAX_FETCH_CONCURRENCY = 256
# Messages received and not yet deleted or left, at most: a receive waits while
# another max_messages would pass it. Bounds memory (objects waiting for ingest)
# and the heartbeat's work; ~5 receives' worth per default poller, enough to keep
# receives, GETs, ingest and deletes all busy at once (bench/README.md, ses.py).
DEFAULT_MAX_IN_FLIGHT = 100
MAX_IN_FLIGHT = 10_000

# Domains where anyone can open a mailbox: a wildcard over them admits the world.
PUBLIC_MAILBOX_DOMAINS = frozenset(
    {
        "gmail.com",
        "googlemail.com",
        "outlook.com",
        "hotmail.com",
        "live.com",
        "msn.com",
        "yahoo.com",
        "ymail.com",
        "aol.com",
        "icloud.com",
        "me.com",
        "mac.com",
        "proton.me",
        "protonmail.com",
        "pm.me",
        "gmx.com",
        "gmx.de",
        "gmx.net",
        "web.de",
        "mail.com",
        "mail.ru",
        "yandex.com",
        "yandex.ru",
        "zoho.com",
        "fastmail.com",
        "tutanota.com",
        "qq.com",
        "163.com",
    }
)

SES_KEYS = frozenset(
    {
        "queue_url",
        "region",
        "endpoint_url",
        "wait_time_s",
        "max_messages",
        "visibility_timeout_s",
        "max_receive_count",
        "max_message_bytes",
        "pollers",
        "fetch_concurrency",
        "max_in_flight",
        "verify_sns_signature",
        "sns_topic_arns",
        "buckets",
    }
)
# An SNS topic ARN (SNS API reference: names of 1-256 letters, digits, - and _;
# .fifo for FIFO topics), partitions aws, aws-cn, aws-us-gov.
_TOPIC_ARN = re.compile(
    r"arn:aws(?:-cn|-us-gov)?:sns:[a-z0-9-]+:[0-9]{12}:[A-Za-z0-9_-]{1,256}(?:\.fifo)?"
)
# S3 bucket names: 3-63 lower-case letters, digits, dots and hyphens (S3 user guide,
# "Bucket naming rules").
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
MAILBOX_KEYS = ("addresses", "allowed_senders", "keep_objects")
# fnmatch's wildcard characters (allowed_senders patterns are fnmatch patterns).
_WILDCARDS = "*?["


def normalise_address(text: str) -> str:
    """Lower-case and trim; routing and allowlists compare addresses this way."""
    return text.strip().strip("<>").lower()


@dataclass(frozen=True, slots=True)
class SesSettings:
    """The main file's `[ses]` table (module docstring)."""

    queue_url: str
    region: str | None = None
    endpoint_url: str | None = None
    wait_time_s: int = SQS_MAX_WAIT_S
    max_messages: int = SQS_MAX_MESSAGES
    visibility_timeout_s: int = DEFAULT_VISIBILITY_S
    max_receive_count: int = DEFAULT_MAX_RECEIVE_COUNT
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    pollers: int = DEFAULT_POLLERS
    fetch_concurrency: int = DEFAULT_FETCH_CONCURRENCY
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    # An SQS body that is an SNS envelope carrying a signature is verified like the
    # SNS delivery webhooks' (adapters/esp/sns.py) before its pointer is followed.
    verify_sns_signature: bool = True
    # Topics a verified envelope may come from; empty: any topic SNS signed for.
    sns_topic_arns: frozenset[str] = frozenset()
    # Buckets a pointer may name; empty: any (the queue's access policy decides).
    buckets: frozenset[str] = frozenset()

    @property
    def queue_name(self) -> str:
        """The queue's name (the URL's last segment), for logs, status and metrics."""
        return self.queue_url.rstrip("/").rsplit("/", 1)[-1]

    @classmethod
    def from_settings(cls, settings: Mapping[str, object]) -> SesSettings:
        refuse_unknown(settings, SES_KEYS, "[ses]", SesConfigError)
        queue_url = optional_text(settings, "queue_url", SesConfigError)
        if queue_url is None:
            raise SesConfigError("queue_url: required (the SQS queue SES notifications land in)")
        queue_url = url(settings, "queue_url", queue_url, SesConfigError)
        endpoint = settings.get("endpoint_url")
        return cls(
            queue_url=queue_url,
            region=optional_text(settings, "region", SesConfigError),
            endpoint_url=None
            if endpoint is None
            else url(settings, "endpoint_url", "", SesConfigError),
            wait_time_s=_integer(settings, "wait_time_s", SQS_MAX_WAIT_S, 0, SQS_MAX_WAIT_S),
            max_messages=_integer(settings, "max_messages", SQS_MAX_MESSAGES, 1, SQS_MAX_MESSAGES),
            visibility_timeout_s=_integer(
                settings, "visibility_timeout_s", DEFAULT_VISIBILITY_S, 10, SQS_MAX_VISIBILITY_S
            ),
            max_receive_count=_integer(
                settings, "max_receive_count", DEFAULT_MAX_RECEIVE_COUNT, 1, 1000
            ),
            max_message_bytes=_integer(
                settings, "max_message_bytes", DEFAULT_MAX_MESSAGE_BYTES, 1024, 2**40
            ),
            pollers=_integer(settings, "pollers", DEFAULT_POLLERS, 1, MAX_POLLERS),
            fetch_concurrency=_integer(
                settings,
                "fetch_concurrency",
                DEFAULT_FETCH_CONCURRENCY,
                1,
                MAX_FETCH_CONCURRENCY,
            ),
            max_in_flight=_integer(
                settings, "max_in_flight", DEFAULT_MAX_IN_FLIGHT, 1, MAX_IN_FLIGHT
            ),
            verify_sns_signature=_boolean(settings, "verify_sns_signature", default=True),
            sns_topic_arns=_matching(settings, "sns_topic_arns", _TOPIC_ARN, "an SNS topic ARN"),
            buckets=_matching(settings, "buckets", _BUCKET, "an S3 bucket name"),
        )


@dataclass(frozen=True, slots=True)
class SesMailbox:
    """A tenant's `[[mailboxes]] provider = "ses"` entry (module docstring).

    `addresses` are normalised: `user@domain` entries and `@domain` catch-alls.
    `allowed_senders` are fnmatch patterns over the From address (empty: anyone).
    """

    addresses: tuple[str, ...]
    allowed_senders: tuple[str, ...] = ()
    keep_objects: bool = True

    @classmethod
    def from_settings(cls, settings: Mapping[str, object]) -> SesMailbox:
        refuse_unknown(settings, frozenset(MAILBOX_KEYS), "an ses mailbox", SesConfigError)
        addresses = _strings(settings, "addresses", required=True)
        for entry in addresses:
            _check_route(entry)
        senders = _strings(settings, "allowed_senders", required=False)
        for pattern in senders:
            _check_sender_pattern(pattern)
        keep = settings.get("keep_objects", True)
        if not isinstance(keep, bool):
            raise SesConfigError("keep_objects: expected true or false")
        return cls(
            addresses=tuple(dict.fromkeys(addresses)),
            allowed_senders=tuple(dict.fromkeys(senders)),
            keep_objects=keep,
        )

    def allows_sender(self, sender: str | None) -> bool:
        """True when no allowlist is set, or the From address matches one pattern."""
        if not self.allowed_senders:
            return True
        if not sender:
            return False
        address = normalise_address(sender)
        return any(fnmatch.fnmatchcase(address, p) for p in self.allowed_senders)


def _integer(
    settings: Mapping[str, object], key: str, default: int, minimum: int, maximum: int
) -> int:
    value = settings.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise SesConfigError(f"{key}: expected an integer from {minimum} to {maximum}")
    return value


def _boolean(settings: Mapping[str, object], key: str, *, default: bool) -> bool:
    value = settings.get(key, default)
    if not isinstance(value, bool):
        raise SesConfigError(f"{key}: expected true or false")
    return value


def _matching(
    settings: Mapping[str, object], key: str, pattern: re.Pattern[str], what: str
) -> frozenset[str]:
    """An optional list of strings each matching `pattern` whole (never quoted back)."""
    value = settings.get(key, [])
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise SesConfigError(f"{key}: expected a list of strings")
    for entry in value:
        if not pattern.fullmatch(entry):
            raise SesConfigError(f"{key}: each entry is {what}")
    return frozenset(value)


def _strings(settings: Mapping[str, object], key: str, *, required: bool) -> list[str]:
    value = settings.get(key)
    if value is None:
        if required:
            raise SesConfigError(f"{key}: required (a list of addresses or @domain entries)")
        return []
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise SesConfigError(f"{key}: expected a list of strings")
    out = [normalise_address(v) for v in value]
    if required and not out:
        raise SesConfigError(f"{key}: expected at least one entry")
    return out


def _check_route(entry: str) -> None:
    local, at, domain = entry.rpartition("@")
    if not at or not domain or "." not in domain or any(c in entry for c in "*?[] ,;"):
        raise SesConfigError(
            "addresses: each entry is an address (user@example.com) or a domain (@example.com)"
        )
    del local


def _check_sender_pattern(pattern: str) -> None:
    local, at, domain = pattern.rpartition("@")
    if not at or not domain:
        raise SesConfigError("allowed_senders: each entry is an address pattern (*@example.com)")
    wild_local = any(c in local for c in _WILDCARDS)
    base = domain.removeprefix("*.")
    # A domain wildcard is only the leading "*." of a subdomain pattern: "*.*.com" or
    # "*.?.example" would admit any domain of that shape.
    if any(c in base for c in _WILDCARDS):
        raise SesConfigError(
            "allowed_senders: a wildcard domain must be a subdomain pattern (*@*.example.com)"
        )
    if base != domain and "." not in base:
        # *.com: anyone who registers a domain there, whatever the local part
        raise SesConfigError(
            "allowed_senders: a wildcard over a top-level domain admits anyone who "
            "registers a domain there; name the domain (*@*.example.com)"
        )
    if wild_local and base in PUBLIC_MAILBOX_DOMAINS:
        raise SesConfigError(
            "allowed_senders: a wildcard over a public mailbox domain admits anyone who "
            "opens an account there; list the addresses themselves"
        )
