"""The SES door as a queue door (adapters/base.py QueueDoor): the SQS poller on one
queue, the routing table of the tenants' ses mailboxes, the SNS envelope check.

    run(sink, stop) ── AwsClients (SQS, S3) ── SesPoller.run ─┬─ receive loops × pollers
                                                               ├─ the pipeline: fetch, parse,
                                                               │  gather, ingest, delete
                                                               └─ visibility heartbeat

It receives until `stop` is set and returns once the messages in flight are
stored and deleted (or released, if the daemon's drain deadline cancels them);
everything it settles goes through the daemon's QueueSink. `reload` (SIGHUP)
swaps the routing table whole: messages placed from then on route by it.
"""

from __future__ import annotations

from collections.abc import Iterable

import anyio
import structlog
from anyio.abc import TaskStatus

from inboxd.adapters.base import QueueMailbox, QueueSink
from inboxd.adapters.ses.aws import AwsClients
from inboxd.adapters.ses.config import SesMailbox, SesSettings
from inboxd.adapters.ses.envelope import SnsEnvelopeCheck, VerifyEnvelope
from inboxd.adapters.ses.poller import SesPoller
from inboxd.adapters.ses.routing import Router

__all__ = ["PROVIDER", "SesDoor", "build_router"]

log = structlog.get_logger(__name__)

PROVIDER = "ses"


def build_router(mailboxes: Iterable[QueueMailbox]) -> Router:
    """The routing table of these ses mailboxes (their `addresses`)."""
    return Router(
        (m.tenant_id, m.mailbox_id, SesMailbox.from_settings(m.settings)) for m in mailboxes
    )


class SesDoor:
    """One daemon's SES poller set (a QueueDoor).

    `verify_envelope` checks SNS signatures (the daemon's, from adapters/esp/sns.py);
    it is required when `[ses] verify_sns_signature` is on, which is the default."""

    provider = PROVIDER

    def __init__(
        self,
        settings: SesSettings,
        mailboxes: Iterable[QueueMailbox],
        *,
        verify_envelope: VerifyEnvelope | None,
    ) -> None:
        if settings.verify_sns_signature and verify_envelope is None:
            raise ValueError("[ses] verify_sns_signature is on: an envelope verifier is needed")
        self.settings = settings
        self.name = f"ses:{settings.queue_name}"
        self.router = build_router(mailboxes)
        self._check_body = (
            SnsEnvelopeCheck(settings.sns_topic_arns, verify_envelope)
            if settings.verify_sns_signature and verify_envelope is not None
            else None
        )
        self._poller: SesPoller | None = None

    def reload(self, mailboxes: Iterable[QueueMailbox]) -> None:
        self.router = build_router(mailboxes)
        if self._poller is not None:
            self._poller.router = self.router

    async def run(
        self,
        sink: QueueSink,
        stop: anyio.Event,
        *,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        if not len(self.router):
            log.warning("ses_no_mailboxes", door=self.name)
        async with AwsClients(self.settings) as aws:
            self._poller = SesPoller(
                self.settings, aws, router=self.router, sink=sink, check_body=self._check_body
            )
            log.info("ses_poller_started", door=self.name, pollers=self.settings.pollers)
            task_status.started()
            try:
                await self._poller.run(stop)
            finally:
                self._poller = None
