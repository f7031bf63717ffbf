"""One received batch of SQS messages, from bodies to settled items.

Per message (the poller, poller.py, receives and deletes):

    received more than max_receive_count times → poison: dead (unless every pointer
    │   is stored already: its deletes were lost, a duplicate); an envelope still
    │   unverifiable then is poison recorded unrouted, saying why
    ├─ body → pointers (pointers.py); invalid → dead
    ├─ an SNS envelope carrying a signature is verified (`CheckBody`,
    │   envelope.py): forged or foreign → dead, its pointers never followed;
    │   not verifiable now (certificate unreachable) → leave the message
    ├─ a pointer to a bucket outside [ses] buckets (when set) → dead, nothing read
    ├─ fetch each object from S3, streamed and size-limited (aws.py)
    │     missing → a duplicate when its message is stored, else dead;
    │     too large → dead;  throttled / 5xx / network → leave the message
    ├─ parse the bytes once (worker processes), route by the envelope recipients
    │   (else To/Cc/Delivered-To) to mailboxes (routing.py), apply each mailbox's
    │   sender allowlist (refused → a dead item in that mailbox)
    └─ ingest, one transaction per mailbox; any item retriable → leave the message

A message is settled when none of its items is pending and it was not left; only
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

__all__ = ["BatchSettler", "CheckBody", "Unrouted", "Work"]

log = structlog.get_logger(__name__)

# Header block read to find Delivered-To when a pointer names no recipients.
_HEADER_SNIFF_BYTES = 256 * 1024

_PARSE_TENANT = "-"  # items are parsed once, then copied to each mailbox they route to


# Checks an SQS body before its pointers are followed: returns when they may be,
# raises SesPermanent (never: a forged envelope) or SesTransient (cannot tell now).
CheckBody = Callable[[str], Awaitable[None]]


@dataclass(slots=True)
class Work:
    """One SQS message being processed: its items and whether each is settled."""

    message: QueueMessage
    pointers: list[Pointer] = field(default_factory=list)
    routes: list[Route] = field(default_factory=list)
    pending: int = 0  # items handed to ingest and not answered settled yet
    failed: bool = False  # left for redelivery
    objects: list[Pointer] = field(default_factory=list)  # to delete after commit


class BatchSettler:
    """Settles the messages of one received batch (module docstring)."""

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

    async def settle(self, works: list[Work]) -> None:
        """Take each message of a batch as far as it goes: items committed or dead,
        or the message marked `failed` (left for redelivery)."""
        fetches: list[tuple[Work, Pointer]] = []
        for work in works:
            message = work.message
            try:
                work.pointers = parse_pointers(message.body)
            except SesPermanent as exc:
                await self._dead(work, None, exc.reason, exc.detail)
                continue
            if message.receive_count > self.settings.max_receive_count:
                await self._poisoned(work)  # reads no object
                continue
            if not await self._checked(work):
                continue
            for pointer in work.pointers:
                if self.settings.buckets and pointer.bucket not in self.settings.buckets:
                    detail = f"s3://{pointer.bucket}/{pointer.key}: bucket not in [ses] buckets"
                    await self._dead(work, pointer, "bucket_not_allowed", detail)
                else:
                    fetches.append((work, pointer))
        raws = await self._fetch_all(fetches)
        fetched = [
            (w, p, raw) for (w, p), raw in zip(fetches, raws, strict=True) if raw is not None
        ]
        if not fetched:
            return
        parsed = await parse_in_workers(
            [raw for _, _, raw in fetched], _PARSE_TENANT, _PARSE_TENANT, "ses"
        )
        groups: dict[tuple[str, str], list[tuple[Work, MessageData | DeadItem]]] = {}
        for (work, pointer, raw), item in zip(fetched, parsed, strict=True):
            placed = await self._place(work, pointer, raw, item)
            for route, copy in placed:
                groups.setdefault((route.tenant_id, route.mailbox_id), []).append((work, copy))
                work.pending += 1
            # the object goes only when no mailbox it reached keeps it as its raw copy
            if placed and not any(route.mailbox.keep_objects for route, _ in placed):
                work.objects.append(pointer)
        async with anyio.create_task_group() as tg:
            for (tenant, mailbox), entries in groups.items():
                tg.start_soon(self._ingest_group, tenant, mailbox, entries)

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
            self._leave(work, str(exc))
            return False
        return True

    async def _fetch_all(self, fetches: list[tuple[Work, Pointer]]) -> list[bytes | None]:
        raws: list[bytes | None] = [None] * len(fetches)

        async def fetch(index: int, work: Work, pointer: Pointer) -> None:
            try:
                raws[index] = await self._aws.fetch(
                    pointer.bucket, pointer.key, max_bytes=self.settings.max_message_bytes
                )
            except SesPermanent as exc:
                if exc.reason == "object_missing" and await self._stored_already(work, pointer):
                    return  # keep_objects = false deleted it after a commit: a redelivery
                await self._dead(work, pointer, exc.reason, exc.detail)
            except SesTransient as exc:
                self._leave(work, str(exc))

        async with anyio.create_task_group() as tg:
            for index, (work, pointer) in enumerate(fetches):
                tg.start_soon(fetch, index, work, pointer)
        return raws

    async def _place(
        self, work: Work, pointer: Pointer, raw: bytes, item: MessageData | DeadItem
    ) -> list[tuple[Route, MessageData | DeadItem]]:
        """The copies of one parsed message, one per mailbox it reaches."""
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

    async def _ingest_group(
        self, tenant: str, mailbox: str, entries: list[tuple[Work, MessageData | DeadItem]]
    ) -> None:
        batch = IngestBatch(tenant, mailbox, [item for _, item in entries])
        results = await self._sink.ingest(batch)
        for (work, _), result in zip(entries, results, strict=True):
            outcome = result.outcome
            if outcome is Outcome.RETRIABLE_FAILURE:
                self._leave(work, result.detail or "ingest retriable")
                continue
            work.pending -= 1
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
            self._leave(work, f"stored copy not checked: {type(exc).__name__}")
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
                self._leave(work, result.detail or "dead item not recorded")
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
            self._leave(work, f"unrouted record not written: {type(exc).__name__}")
            return
        log.warning(
            "ses_unrouted", reason=reason, detail=detail, sqs_message=work.message.message_id
        )
        self._sink.counted("unrouted")

    def _leave(self, work: Work, error: str) -> None:
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
