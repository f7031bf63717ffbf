"""SES door: mail forwarded to Amazon SES, stored in S3, announced on SQS (poller.py)."""

from inboxd.adapters.ses.aws import AwsClients
from inboxd.adapters.ses.config import SesMailbox, SesSettings
from inboxd.adapters.ses.poller import PollerEvents, SesPoller, Unrouted
from inboxd.adapters.ses.routing import Router

__all__ = [
    "AwsClients",
    "PollerEvents",
    "Router",
    "SesMailbox",
    "SesPoller",
    "SesSettings",
    "Unrouted",
]
