"""The SQS long-poller: forwarded mail from SES → S3 → SQS into rows, exactly once.

One SQS message, from receipt to deletion:

    receive (long poll, ≤ max_messages, ApproximateReceiveCount)
      │   only while the ingest queue has room (backpressure: nothing is received
      │   that could not start within its visibility timeout)
      ├─ settle the batch (settle.py): poison / pointers / S3 fetch / parse /
      │   route / ingest; each message ends settled (rows committed or dead) or
      │   left for redelivery
      └─ every item settled → DeleteMessageBatch → (keep_objects = false in every
         mailbox it reached: delete the S3 object). Nothing is deleted before its
         rows committed; a pointer whose object is gone but whose message is
         stored is a redelivery (duplicate), not a loss.

"Dead": a dead_items row in each mailbox the message routes to, or, when it
routes nowhere (no recipient is ours, the pointer is unreadable), an unrouted
record with no tenant (the sink's record_unrouted; tables.py) that `inboxd status`
shows.

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

from collections.abc import Sequence

import anyio
import structlog

from inboxd.adapters.base import QueueSink
from inboxd.adapters.ses.aws import AwsClients, QueueMessage
from inboxd.adapters.ses.config import SesSettings
from inboxd.adapters.ses.errors import SesTransient
from inboxd.adapters.ses.routing import Router
from inboxd.adapters.ses.settle import BatchSettler, CheckBody, Work

__all__ = ["SesPoller"]

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


class SesPoller:
    """`pollers` receive loops on one queue, plus the visibility heartbeat; the
    daemon's `sink` takes what they settle (adapters/base.py QueueSink)."""

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
        self._aws = aws
        self._sink = sink
        self._settler = BatchSettler(settings, aws, router=router, sink=sink, check_body=check_body)
        self._receiving = anyio.Event()  # cleared while receiving is paused
        self._receiving.set()
        self._in_flight: dict[str, QueueMessage] = {}

    @property
    def router(self) -> Router:
        return self._settler.router

    @router.setter
    def router(self, router: Router) -> None:
        """A SIGHUP's new routes (door.py): the next batch settles by them."""
        self._settler.router = router

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
                self._sink.failed(str(exc))
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
                self._sink.failed(f"{type(exc).__name__}: {exc}")
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
            while not stop.is_set() and not await self._sink.database_ready():
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
            await self._sink.wait_for_room()
            tg.cancel_scope.cancel()
        if stop.is_set():
            return []
        received = await self._aws.receive()
        if received:
            self._sink.counted("received", len(received))
        return received

    async def _release(self, messages: Sequence[QueueMessage]) -> None:
        with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_TIMEOUT_S):
            await self._aws.set_visibility(list(messages), 0)
        self._sink.counted("released", len(messages))

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
        works = [Work(m) for m in messages]
        try:
            await self._settler.settle(works)
        except anyio.get_cancelled_exc_class():
            await self._release(messages)
            raise
        finally:
            for m in messages:
                self._in_flight.pop(m.receipt_handle, None)
        await self._finish(works)
        return any(w.failed or w.pending for w in works)

    # --- after commit ----------------------------------------------------------------------

    async def _finish(self, works: list[Work]) -> None:
        """Delete the messages whose every item settled (then, keep_objects = false,
        their S3 objects); the others wait for SQS to redeliver them."""
        done = [w for w in works if not w.failed and w.pending == 0]
        stale = await self._aws.delete([w.message for w in done])
        self._sink.counted("deleted", len(done) - len(stale))
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
            await self._extend()

    async def _extend(self) -> None:
        """One beat: extend the visibility of every message in flight.

        The beat's request may reach SQS after a batch it names has ended: its
        messages deleted (or released) by this poller meanwhile, their handles
        refused. Those are no visibility lost; only the messages still in flight
        when the answer comes are (issue 22: every normal batch warned)."""
        if not self._in_flight:
            return
        try:
            lost = await self._aws.set_visibility(
                list(self._in_flight.values()), self.settings.visibility_timeout_s
            )
        except Exception as exc:  # the next beat tries again; SQS redelivers at worst
            log.warning("ses_visibility_not_extended", error=f"{type(exc).__name__}: {exc}")
            return
        lost = [m for m in lost if m.receipt_handle in self._in_flight]
        if lost:  # another consumer may get them: the cascade makes that harmless
            log.warning("ses_visibility_lost", messages=len(lost))
