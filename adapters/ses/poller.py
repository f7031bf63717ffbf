"""The SQS long-poller: forwarded mail from SES → S3 → SQS into rows, exactly once.

One SQS message, from receipt to deletion:

    receive (long poll, ≤ max_messages, ApproximateReceiveCount)
      │   only while the ingest queue has room (backpressure: nothing is received
      │   that could not start within its visibility timeout)
      ├─ received more than max_receive_count times → poison: dead, then delete
      ├─ body → pointers (pointers.py); invalid → dead; S3 test event → delete
      ├─ fetch each object from S3, streamed and size-limited (aws.py)
      │     missing / too large → dead;  throttled / 5xx / network → leave it
      ├─ parse the bytes (worker process), route by the envelope recipients (else
      │   To/Cc/Delivered-To) to mailboxes (routing.py), apply each mailbox's
      │   sender allowlist (refused → a dead item in that mailbox)
      ├─ ingest, one transaction per mailbox (the daemon's bounded queue)
      │     any item retriable (database down…) → leave the message
      └─ every item settled → DeleteMessageBatch → (keep_objects = false in every
         mailbox it reached: delete the S3 object). Nothing is deleted before its
         rows committed; a pointer whose object is gone but whose message is
         stored is a redelivery (duplicate), not a loss.

"Dead": a dead_items row in each mailbox the message routes to, or, when it
routes nowhere (no recipient is ours, the pointer is unreadable), an unrouted
record with no tenant (pipeline/unrouted.py) that `inboxd status` shows.

A message left alone is redelivered by SQS after its visibility timeout; while
one is being processed a heartbeat extends its visibility, so a slow ingest is
never taken over by a competing consumer. Redelivery of a message already
stored is absorbed by the cascade (external id = SES message id, else the S3
key → `duplicate`), which is also what makes several daemons on one queue safe.

Stopping (the daemon's stop event): the receive loops receive no more (a long
poll under way ends and what it brought is released at once); messages in flight
are finished; if the daemon's drain deadline cancels them, they are released
(visibility 0) for another consumer, never deleted. After a batch that left
messages for redelivery, a loop receives again only once the database answers,
so an outage does not spend the messages' receive counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from email.parser import BytesHeaderParser
from email.utils import getaddresses
from typing import Protocol

import anyio
import structlog

from inboxd.adapters.ses.aws import AwsClients, QueueMessage
from inboxd.adapters.ses.config import SesSettings
from inboxd.adapters.ses.errors import SesPermanent, SesTransient
from inboxd.adapters.ses.pointers import Pointer, parse_pointers
from inboxd.adapters.ses.routing import Route, Router
from inboxd.pipeline.ingest import IngestBatch
from inboxd.pipeline.message import DeadItem, MessageData
from inboxd.pipeline.outcomes import ItemResult, Outcome
from inboxd.pipeline.parsing import parse_in_workers

__all__ = ["PollerEvents", "SesPoller", "Unrouted"]

log = structlog.get_logger(__name__)

# Share of the visibility timeout after which in-flight messages are extended
# again: a third leaves two chances before a message would reappear.
HEARTBEAT_SHARE = 1 / 3
# Releasing in-flight messages at shutdown is bounded: the process must exit.
RELEASE_TIMEOUT_S = 5.0
# After a failed receive (queue unreachable, credentials), wait before the next:
# doubling from 1 s to 60 s, so an outage costs a request a minute per loop.
RECEIVE_BACKOFF_MIN_S = 1.0
RECEIVE_BACKOFF_MAX_S = 60.0
# Header block read to find Delivered-To when a pointer names no recipients.
_HEADER_SNIFF_BYTES = 256 * 1024

_PARSE_TENANT = "-"  # items are parsed once, then copied to each mailbox they route to


@dataclass(frozen=True, slots=True)
class Unrouted:
    """A message that belongs to no tenant (module docstring), for pipeline/unrouted.py."""

    external_id: str
    reason: str
    detail: str
    body: str
    recipients: tuple[str, ...] = ()


class PollerEvents(Protocol):
    """What the daemon hears of the poller: counters (received, stored, duplicate,
    dead, unrouted, poison, left, released, deleted) and the last error."""

    def counted(self, what: str, n: int = 1) -> None: ...

    def failed(self, error: str) -> None: ...


Ingest = Callable[[IngestBatch], Awaitable[list[ItemResult]]]
RecordUnrouted = Callable[[Unrouted], Awaitable[None]]
# Is this external id stored in any of these (tenant, mailbox)?
StoredIn = Callable[[list[tuple[str, str]], str], Awaitable[bool]]


@dataclass(slots=True)
class _Work:
    """One SQS message being processed: its items and whether each is settled."""

    message: QueueMessage
    pointers: list[Pointer] = field(default_factory=list)
    routes: list[Route] = field(default_factory=list)
    pending: int = 0  # items handed to ingest and not answered settled yet
    failed: bool = False  # left for redelivery
    objects: list[Pointer] = field(default_factory=list)  # to delete after commit


class SesPoller:
    """`pollers` receive loops on one queue, plus the visibility heartbeat."""

    def __init__(
        self,
        settings: SesSettings,
        aws: AwsClients,
        *,
        router: Router,
        ingest: Ingest,
        room: Callable[[], Awaitable[None]],
        record_unrouted: RecordUnrouted,
        events: PollerEvents,
        stored: StoredIn,
        ready: Callable[[], Awaitable[bool]],
    ) -> None:
        self.settings = settings
        self.router = router
        self._aws = aws
        self._ingest = ingest
        self._room = room
        self._record_unrouted = record_unrouted
        self._stored = stored
        self._ready = ready
        self._receiving = anyio.Event()  # cleared while receiving is paused
        self._receiving.set()
        self._events = events
        self._in_flight: dict[str, QueueMessage] = {}

    async def run(self, stop: anyio.Event) -> None:
        """Receive until `stop` is set; return once the messages in flight are done."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._heartbeat)
            async with anyio.create_task_group() as loops:
                for number in range(self.settings.pollers):
                    loops.start_soon(self._loop, number, stop)
            tg.cancel_scope.cancel()

    async def _loop(self, number: int, stop: anyio.Event) -> None:
        backoff = RECEIVE_BACKOFF_MIN_S
        while not stop.is_set():
            try:
                messages = await self._receive_unless(stop)
            except SesTransient as exc:
                self._events.failed(str(exc))
                log.warning("ses_receive_failed", poller=number, error=str(exc), retry_s=backoff)
                with anyio.move_on_after(backoff):
                    await stop.wait()
                backoff = min(backoff * 2, RECEIVE_BACKOFF_MAX_S)
                continue
            backoff = RECEIVE_BACKOFF_MIN_S
            if not messages:
                continue
            if stop.is_set():  # received while stopping: another consumer may have them
                await self._release(messages)
                return
            try:
                left = await self.process(messages)
            except Exception as exc:  # a bug must not stop the queue: SQS redelivers them
                self._events.failed(f"{type(exc).__name__}: {exc}")
                log.exception("ses_batch_crashed", poller=number, size=len(messages))
                left = True
            if left:
                await self._wait_until_ready(stop)

    async def _wait_until_ready(self, stop: anyio.Event) -> None:
        """After a batch left messages for redelivery, no loop receives again until
        the database answers: every receive counts towards max_receive_count, and an
        outage must not turn good mail into poison."""
        if not self._receiving.is_set():
            return  # another loop is probing already; this one waits at the gate
        self._receiving = anyio.Event()
        backoff = RECEIVE_BACKOFF_MIN_S
        try:
            while not stop.is_set() and not await self._ready():
                log.info("ses_receiving_paused", reason="database not ready", retry_s=backoff)
                with anyio.move_on_after(backoff):
                    await stop.wait()
                backoff = min(backoff * 2, RECEIVE_BACKOFF_MAX_S)
        finally:
            self._receiving.set()

    async def _receive_unless(self, stop: anyio.Event) -> list[QueueMessage]:
        """One long poll, after waiting for room in the ingest queue (that wait ends
        when `stop` is set). A long poll under way is not cut short at a stop: the
        messages it brings are released at once instead of hidden for a visibility
        timeout (at most wait_time_s more of shutdown)."""
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                await stop.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            await self._receiving.wait()  # no loop receives while the database is down
            await self._room()
            tg.cancel_scope.cancel()
        if stop.is_set():
            return []
        received = await self._aws.receive()
        if received:
            self._events.counted("received", len(received))
        return received

    async def _release(self, messages: Sequence[QueueMessage]) -> None:
        with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_TIMEOUT_S):
            await self._aws.set_visibility(list(messages), 0)
        self._events.counted("released", len(messages))

    # --- one received batch -----------------------------------------------------------------

    async def process(self, messages: Sequence[QueueMessage]) -> bool:
        """Take a received batch to rows and delete what settled (module docstring);
        True when some were left for redelivery.

        Cancelled part-way (the drain deadline): every message of the batch is
        released at once for another consumer, none deleted. Crashed part-way (a
        bug): none deleted, each back after its visibility timeout — not at once,
        which would burn its receive count in a tight loop. What committed
        meanwhile comes back as `duplicate`."""
        for m in messages:
            self._in_flight[m.receipt_handle] = m
        works = [_Work(m) for m in messages]
        try:
            await self._settle(works)
        except anyio.get_cancelled_exc_class():
            await self._release(messages)
            raise
        finally:
            for m in messages:
                self._in_flight.pop(m.receipt_handle, None)
        await self._finish(works)
        return any(w.failed or w.pending for w in works)

    async def _settle(self, works: list[_Work]) -> None:
        fetches: list[tuple[_Work, Pointer]] = []
        for work in works:
            message = work.message
            try:
                work.pointers = parse_pointers(message.body)
            except SesPermanent as exc:
                await self._dead(work, None, exc.reason, exc.detail)
                continue
            if message.receive_count > self.settings.max_receive_count:
                await self._poison(work)
                continue
            fetches.extend((work, p) for p in work.pointers)
        raws = await self._fetch_all(fetches)
        fetched = [
            (w, p, raw) for (w, p), raw in zip(fetches, raws, strict=True) if raw is not None
        ]
        if not fetched:
            return
        parsed = await parse_in_workers(
            [raw for _, _, raw in fetched], _PARSE_TENANT, _PARSE_TENANT, "ses"
        )
        groups: dict[tuple[str, str], list[tuple[_Work, MessageData | DeadItem]]] = {}
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

    async def _fetch_all(self, fetches: list[tuple[_Work, Pointer]]) -> list[bytes | None]:
        raws: list[bytes | None] = [None] * len(fetches)

        async def fetch(index: int, work: _Work, pointer: Pointer) -> None:
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
        self, work: _Work, pointer: Pointer, raw: bytes, item: MessageData | DeadItem
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
        self, tenant: str, mailbox: str, entries: list[tuple[_Work, MessageData | DeadItem]]
    ) -> None:
        batch = IngestBatch(tenant, mailbox, [item for _, item in entries])
        results = await self._ingest(batch)
        for (work, _), result in zip(entries, results, strict=True):
            outcome = result.outcome
            if outcome is Outcome.RETRIABLE_FAILURE:
                self._leave(work, result.detail or "ingest retriable")
                continue
            work.pending -= 1
            self._events.counted(_COUNTER.get(outcome, "stored"))

    async def _stored_already(self, work: _Work, pointer: Pointer) -> bool:
        """True when the message a pointer names is stored in a mailbox it reaches
        (every ses mailbox when the pointer names no recipients): its object is gone
        or it keeps coming back only because deletes were lost. Also True, with the
        message left for redelivery, when the database cannot say."""
        routes = self.router.route(pointer.recipients) if pointer.recipients else []
        candidates = [(r.tenant_id, r.mailbox_id) for r in routes] or self.router.mailboxes()
        try:
            stored = await self._stored(candidates, pointer.external_id)
        except Exception as exc:  # the database: decide when SQS redelivers
            self._leave(work, f"stored copy not checked: {type(exc).__name__}")
            return True
        if stored:
            self._events.counted("duplicate")
        return stored

    # --- permanent failures ----------------------------------------------------------------

    async def _poison(self, work: _Work) -> None:
        message = work.message
        detail = (
            f"received {message.receive_count} times (max_receive_count "
            f"{self.settings.max_receive_count}) without being stored"
        )
        pointers = [p for p in work.pointers if not await self._stored_already(work, p)]
        if work.failed or not pointers:
            return  # stored already (its deletes were lost): a duplicate, not poison
        self._events.counted("poison")
        for pointer in pointers:
            where = f"s3://{pointer.bucket}/{pointer.key} "
            await self._dead(work, pointer, "poison", where + detail)

    async def _dead(self, work: _Work, pointer: Pointer | None, reason: str, detail: str) -> None:
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
            [result] = await self._ingest(batch)
            if result.outcome is Outcome.RETRIABLE_FAILURE:
                self._leave(work, result.detail or "dead item not recorded")
                return
            self._events.counted("dead")

    async def _unrouted(
        self,
        work: _Work,
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
            await self._record_unrouted(record)
        except Exception as exc:  # the database: try again when SQS redelivers
            self._leave(work, f"unrouted record not written: {type(exc).__name__}")
            return
        log.warning(
            "ses_unrouted", reason=reason, detail=detail, sqs_message=work.message.message_id
        )
        self._events.counted("unrouted")

    def _leave(self, work: _Work, error: str) -> None:
        if not work.failed:
            work.failed = True
            self._events.counted("left")
        self._events.failed(error)

    # --- after commit ----------------------------------------------------------------------

    async def _finish(self, works: list[_Work]) -> None:
        """Delete the messages whose every item settled (then, keep_objects = false,
        their S3 objects); the others wait for SQS to redeliver them."""
        done = [w for w in works if not w.failed and w.pending == 0]
        stale = await self._aws.delete([w.message for w in done])
        self._events.counted("deleted", len(done) - len(stale))
        # objects last, and only of messages that left the queue: one that comes back
        # still finds its object (and a later redelivery is told apart from a loss by
        # _stored_already)
        left = {m.receipt_handle for m in stale}
        for work in done:
            if work.message.receipt_handle in left:
                continue
            for pointer in work.objects:
                try:
                    await self._aws.delete_object(pointer.bucket, pointer.key)
                except SesTransient as exc:  # the rows are committed; the object only lingers
                    log.warning("ses_object_not_deleted", error=str(exc))

    # --- visibility --------------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        period = self.settings.visibility_timeout_s * HEARTBEAT_SHARE
        while True:
            await anyio.sleep(period)
            if not self._in_flight:
                continue
            try:
                lost = await self._aws.set_visibility(
                    list(self._in_flight.values()), self.settings.visibility_timeout_s
                )
            except Exception as exc:  # the next beat tries again; SQS redelivers at worst
                log.warning("ses_visibility_not_extended", error=f"{type(exc).__name__}: {exc}")
                continue
            if lost:  # another consumer may get them: the cascade makes that harmless
                log.warning("ses_visibility_lost", messages=len(lost))


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
