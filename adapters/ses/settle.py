"""One SQS message, from its body to settled items: the steps the door's pipeline
(poller.py) runs for each message, whatever receive it came in.

Per message:

    received more than max_receive_count times → poison: dead (unless every pointer
    │   is stored already: its deletes were lost, a duplicate); an envelope still
    │   unverifiable then is poison recorded unrouted, saying why
    ├─ body → pointers (pointers.py); invalid → dead
    ├─ an SNS envelope carrying a signature is verified (`CheckBody`,
    │   envelope.py): forged or foreign → dead, its pointers never followed;
    │   not verifiable now (certificate unreachable) → leave the message
    ├─ a pointer to a bucket outside [ses] buckets (when set) → dead, nothing read
    │                                                         (`Settler.prepare`)
    ├─ fetch each object from S3, streamed and size-limited (aws.py)
    │     missing → a duplicate when its message is stored, else dead;
    │     too large → dead;  throttled / 5xx / network → leave the message
    │                                                         (`Settler.fetch`)
    ├─ parse the bytes (worker processes, many messages per call), route by the
    │   envelope recipients (else To/Cc/Delivered-To) to mailboxes (routing.py),
    │   apply each mailbox's sender allowlist (refused → a dead item in that
    │   mailbox)                                              (`Settler.place`)
    └─ ingest, one transaction per mailbox and gathered batch (poller.py); any
       item retriable → leave the message                    (`Settler.answered`)

A message is settled when none of its steps is open and it was not left; only
settled messages are deleted. "Dead" is a dead_items row in each mailbox the
message routes to, or, when it routes nowhere, an unrouted record with no tenant.
Everything outside the door (ingest, records, counters) goes through the daemon's
QueueSink (adapters/base.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from email.parser import BytesHeaderParser
from email.utils import getaddresses

import anyio
import structlog

from inboxd.adapters.base import QueueSink, Unrouted
from inboxd.adapters.ses.aws import AwsClients, QueueMessage
from inboxd.adapters.ses.config import SesSettings
from inboxd.adapters.ses.errors import SesPermanent, SesTransient
from inboxd.adapters.ses.pointers import Pointer, parse_pointers
from inboxd.adapters.ses.routing import Route, Router
from inboxd.pipeline.ingest.stage import IngestBatch
from inboxd.pipeline.message import DeadItem, MessageData
from inboxd.pipeline.mime.workers import parse_in_workers
from inboxd.pipeline.outcomes import Outcome

__all__ = ["CheckBody", "Entry", "Settler", "Unrouted", "Work"]

log = structlog.get_logger(__name__)

# Header block read to find Delivered-To when a pointer names no recipients.
_HEADER_SNIFF_BYTES = 256 * 1024

_PARSE_TENANT = "-"  # items are parsed once, then copied to each mailbox they route to


# Checks an SQS body before its pointers are followed: returns when they may be,
# raises SesPermanent (never: a forged envelope) or SesTransient (cannot tell now).
CheckBody = Callable[[str], Awaitable[None]]


@dataclass(slots=True, eq=False)
class Work:
    """One SQS message in the pipeline: its pointers, its open steps, whether it is left.

    `open` counts what is not settled yet: the preparation (1 from the start),
    each fetched object until it is placed, each copy handed to ingest until its
    result is in. The message is done when it reaches 0: settled (deleted) unless
    `failed` (left for redelivery)."""

    message: QueueMessage
    pointers: list[Pointer] = field(default_factory=list)
    open: int = 1
    failed: bool = False  # left for redelivery
    objects: list[Pointer] = field(default_factory=list)  # to delete after commit
    done: anyio.Event = field(default_factory=anyio.Event)  # deleted or left


# One copy of a parsed message for one mailbox, waiting for (or in) an ingest batch.
Entry = tuple[Work, MessageData | DeadItem]


class Settler:
    """The per-message steps (module docstring); the pipeline (poller.py) runs them."""

    def __init__(
        self,
        settings: SesSettings,
        aws: AwsClients,
        *,
        router: Router,
        sink: QueueSink,
        check_body: CheckBody | None = None,
    ) -> None:
        self.settings = settings
        self.router = router
        self._check_body = check_body
        self._aws = aws
        self._sink = sink

    async def prepare(self, work: Work) -> list[Pointer]:
        """Pointers, poison, envelope, buckets: the pointers whose objects are to be
        fetched (the others are dead or the message is left already)."""
        message = work.message
        try:
            work.pointers = parse_pointers(message.body)
        except SesPermanent as exc:
            await self._dead(work, None, exc.reason, exc.detail)
            return []
        if message.receive_count > self.settings.max_receive_count:
            await self._poisoned(work)  # reads no object
            return []
        if not await self._checked(work):
            return []
        fetches: list[Pointer] = []
        for pointer in work.pointers:
            if self.settings.buckets and pointer.bucket not in self.settings.buckets:
                detail = f"s3://{pointer.bucket}/{pointer.key}: bucket not in [ses] buckets"
                await self._dead(work, pointer, "bucket_not_allowed", detail)
            else:
                fetches.append(pointer)
        return fetches

    async def _checked(self, work: Work) -> bool:
        """Whether the message's pointers may be followed (`CheckBody`); when not, the
        message is dead (recorded with its body, deleted) or left for redelivery."""
        if self._check_body is None:
            return True
        try:
            await self._check_body(work.message.body)
        except SesPermanent as exc:
            await self._dead(work, None, exc.reason, exc.detail)
            return False
        except SesTransient as exc:
            self.leave(work, str(exc))
            return False
        return True

    async def fetch(self, work: Work, pointer: Pointer) -> bytes | None:
        """The object's bytes, or None when there is nothing to parse (dead, a
        redelivery of a stored message, or the message left)."""
        try:
            return await self._aws.fetch(
                pointer.bucket, pointer.key, max_bytes=self.settings.max_message_bytes
            )
        except SesPermanent as exc:
            if exc.reason == "object_missing" and await self._stored_already(work, pointer):
                return None  # keep_objects = false deleted it after a commit: a redelivery
            await self._dead(work, pointer, exc.reason, exc.detail)
        except SesTransient as exc:
            self.leave(work, str(exc))
        return None

    async def parse(self, raws: Sequence[bytes]) -> list[MessageData | DeadItem]:
        """Parse fetched objects of any messages at once, in the worker processes."""
        return await parse_in_workers(list(raws), _PARSE_TENANT, _PARSE_TENANT, "ses")

    async def place(
        self, work: Work, pointer: Pointer, raw: bytes, item: MessageData | DeadItem
    ) -> list[tuple[Route, MessageData | DeadItem]]:
        """The copies of one parsed message, one per mailbox it reaches (none: it is
        recorded unrouted). Notes the object for deletion after commit when no
        mailbox it reached keeps it as its raw copy."""
        placed = await self._place(work, pointer, raw, item)
        if placed and not any(route.mailbox.keep_objects for route, _ in placed):
            work.objects.append(pointer)
        return placed

    async def _place(
        self, work: Work, pointer: Pointer, raw: bytes, item: MessageData | DeadItem
    ) -> list[tuple[Route, MessageData | DeadItem]]:
        recipients = pointer.recipients or _header_recipients(raw, item)
        routes = self.router.route(recipients)
        if not routes:
            reason = "unparseable" if isinstance(item, DeadItem) else "no_mailbox"
            detail = (
                f"no ses mailbox for any recipient of {pointer.external_id}"
                if reason == "no_mailbox"
                else f"{pointer.external_id}: {item.detail}"  # type: ignore[union-attr]
            )
            await self._unrouted(work, pointer, reason, detail, recipients)
            return []
        copies: list[tuple[Route, MessageData | DeadItem]] = []
        for route in routes:
            tenant, mailbox = route.tenant_id, route.mailbox_id
            if isinstance(item, DeadItem):
                copy: MessageData | DeadItem = dataclasses.replace(
                    item, tenant_id=tenant, mailbox_id=mailbox, external_id=pointer.external_id
                )
            elif not route.mailbox.allows_sender(item.from_.email if item.from_ else None):
                copy = DeadItem(
                    tenant_id=tenant,
                    mailbox_id=mailbox,
                    external_id=pointer.external_id,
                    reason="sender_refused",
                    detail="the From address matches no allowed_senders pattern",
                    raw=raw,
                    raw_sha256=item.raw_sha256,
                )
            else:
                copy = dataclasses.replace(
                    item,
                    tenant_id=tenant,
                    mailbox_id=mailbox,
                    external_id=pointer.external_id,
                    received_at=item.received_at or pointer.received_at,
                )
            copies.append((route, copy))
        return copies

    async def ingest(self, tenant: str, mailbox: str, entries: Sequence[Entry]) -> None:
        """One ingest transaction for copies of any messages bound for one mailbox;
        each answer is noted on its message (`answered`)."""
        batch = IngestBatch(tenant, mailbox, [item for _, item in entries])
        results = await self._sink.ingest(batch)
        for (work, _), result in zip(entries, results, strict=True):
            self.answered(work, result.outcome, result.detail)

    def answered(self, work: Work, outcome: Outcome, detail: str | None = None) -> None:
        if outcome is Outcome.RETRIABLE_FAILURE:
            self.leave(work, detail or "ingest retriable")
        else:
            self._sink.counted(_COUNTER.get(outcome, "stored"))

    async def _stored_already(self, work: Work, pointer: Pointer) -> bool:
        """True when the message a pointer names is stored in a mailbox it reaches
        (every ses mailbox when the pointer names no recipients): its object is gone
        or it keeps coming back only because deletes were lost. Also True, with the
        message left for redelivery, when the database cannot say."""
        routes = self.router.route(pointer.recipients) if pointer.recipients else []
        candidates = [(r.tenant_id, r.mailbox_id) for r in routes] or self.router.mailboxes()
        try:
            stored = await self._sink.stored_in(candidates, pointer.external_id)
        except Exception as exc:  # the database: decide when SQS redelivers
            self.leave(work, f"stored copy not checked: {type(exc).__name__}")
            return True
        if stored:
            self._sink.counted("duplicate")
        return stored

    # --- permanent failures ----------------------------------------------------------------

    async def _poisoned(self, work: Work) -> None:
        """A message received more than max_receive_count times. Its envelope is
        checked first: a forged one is `sns_unverified` like any other; one that still
        cannot be verified (SNS's certificate host unreachable all along: an egress
        firewall, a VPC without a route to it) is poison whose record says so, kept
        unrouted — an unverified pointer does not choose the mailbox it lands in."""
        unverified: str | None = None
        if self._check_body is not None:
            try:
                await self._check_body(work.message.body)
            except SesPermanent as exc:
                await self._dead(work, None, exc.reason, exc.detail)
                return
            except SesTransient as exc:
                unverified = str(exc)
        await self._poison(work, unverified)

    async def _poison(self, work: Work, unverified: str | None = None) -> None:
        message = work.message
        detail = (
            f"received {message.receive_count} times (max_receive_count "
            f"{self.settings.max_receive_count}) without being stored"
        )
        if unverified is not None:
            detail += f"; this time: {unverified}"
        pointers = [p for p in work.pointers if not await self._stored_already(work, p)]
        if work.failed or not pointers:
            return  # stored already (its deletes were lost): a duplicate, not poison
        self._sink.counted("poison")
        for pointer in pointers:
            where = f"s3://{pointer.bucket}/{pointer.key} "
            if unverified is not None:
                await self._unrouted(work, pointer, "poison", where + detail, pointer.recipients)
            else:
                await self._dead(work, pointer, "poison", where + detail)

    async def _dead(self, work: Work, pointer: Pointer | None, reason: str, detail: str) -> None:
        """Record a permanent failure where an operator sees it, or leave the message
        if that record cannot be written (the database is down)."""
        routes = self.router.route(pointer.recipients) if pointer is not None else []
        if not routes:
            recipients = pointer.recipients if pointer is not None else ()
            await self._unrouted(work, pointer, reason, detail, recipients)
            return
        assert pointer is not None
        for route in routes:
            item = DeadItem(route.tenant_id, route.mailbox_id, pointer.external_id, reason, detail)
            batch = IngestBatch(route.tenant_id, route.mailbox_id, [item])
            [result] = await self._sink.ingest(batch)
            if result.outcome is Outcome.RETRIABLE_FAILURE:
                self.leave(work, result.detail or "dead item not recorded")
                return
            self._sink.counted("dead")

    async def _unrouted(
        self,
        work: Work,
        pointer: Pointer | None,
        reason: str,
        detail: str,
        recipients: Sequence[str],
    ) -> None:
        record = Unrouted(
            external_id=pointer.external_id if pointer is not None else work.message.message_id,
            reason=reason,
            detail=detail,
            body=work.message.body,
            recipients=tuple(recipients),
        )
        try:
            await self._sink.record_unrouted(record)
        except Exception as exc:  # the database: try again when SQS redelivers
            self.leave(work, f"unrouted record not written: {type(exc).__name__}")
            return
        log.warning(
            "ses_unrouted", reason=reason, detail=detail, sqs_message=work.message.message_id
        )
        self._sink.counted("unrouted")

    def leave(self, work: Work, error: str) -> None:
        """The message is left for SQS to redeliver (counted once), the error kept."""
        if not work.failed:
            work.failed = True
            self._sink.counted("left")
        self._sink.failed(error)


_COUNTER = {
    Outcome.NEW: "stored",
    Outcome.CONFLICT: "stored",
    Outcome.MERGED: "duplicate",
    Outcome.DUPLICATE: "duplicate",
    Outcome.PERMANENT_FAILURE: "dead",
}


def _header_recipients(raw: bytes, item: MessageData | DeadItem) -> list[str]:
    """To, Cc and Delivered-To of the message, when the pointer named no envelope."""
    head = BytesHeaderParser().parsebytes(raw[:_HEADER_SNIFF_BYTES], headersonly=True)
    found = [a for _, a in getaddresses([str(v) for v in head.get_all("Delivered-To", [])])]
    if isinstance(item, MessageData):
        found += [a.email for a in item.to + item.cc]
    else:
        values = head.get_all("To", []) + head.get_all("Cc", [])
        found += [a for _, a in getaddresses([str(v) for v in values])]
    return list(dict.fromkeys(a.lower() for a in found if a))
