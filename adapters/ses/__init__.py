"""SES door: mail forwarded to Amazon SES, stored in S3, announced on SQS; a queue door
(door.py, adapters/base.py QueueDoor) around the SQS poller (poller.py).

The names below load on first use (PEP 562): `check-config` reads `inboxd.adapters.ses.config`
alone, and importing this package eagerly pulled aioboto3 (~0.2 s of the command's
start, measured with `python -X importtime`) into every configuration check.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inboxd.adapters.ses.aws import AwsClients
    from inboxd.adapters.ses.config import SesMailbox, SesSettings
    from inboxd.adapters.ses.door import SesDoor
    from inboxd.adapters.ses.poller import SesPoller
    from inboxd.adapters.ses.routing import Router

_HOMES = {
    "AwsClients": "aws",
    "Router": "routing",
    "SesMailbox": "config",
    "SesDoor": "door",
    "SesPoller": "poller",
    "SesSettings": "config",
}

__all__ = [
    "AwsClients",
    "Router",
    "SesDoor",
    "SesMailbox",
    "SesPoller",
    "SesSettings",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
