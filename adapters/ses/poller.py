"""The SQS poller: forwarded mail from SES → S3 → SQS into rows, exactly once, as a
pipeline that runs at the database's pace (issue 25).

    receive loops × pollers        each message                 messages of any receives
    (long polls ≤ max_messages,    prepare, then S3 GETs        parse ─► gather per mailbox
     while fewer than max_in_      (fetch_concurrency at   ─►   ─► ingest (INGEST_BATCHES
     flight are in flight and      once for the door)            at once) ─► DeleteMessage-
     the ingest queue has room)                                  Batch ─► S3 objects
      └───── heartbeat: every message received and not yet deleted or left ─────┘

Each received message goes its own way (settle.py has the steps): its receive's
other messages do not wait for it, and it waits for no receive. A receive loop
hands what it received to the pipeline and receives again at once, as long as
fewer than `max_in_flight` messages are in flight (received, not yet deleted or
left) and the ingest queue has room (backpressure: nothing is received that
could not start within its visibility timeout). Every message's S3 objects are
fetched as soon as it arrives, `fetch_concurrency` GETs at once for the door: a
slow object holds one of them and its own message, nothing else. Fetched objects
of any messages are parsed together; their copies gather per mailbox and go to
ingest as one batch per mailbox whenever one of INGEST_BATCHES slots is free — so
while the database commits one batch the next gathers what arrived meanwhile, from
as many receives as it took, and a batch is as large as the database's pace makes
it (at most INGEST_BATCH_ITEMS). Nothing waits on a timer: a message ready while a
slot is free goes at once, so gathering never holds one near its visibility
timeout. A message whose every step settled (rows committed, or dead) is deleted
with whatever else settled meanwhile (DeleteMessageBatch groups messages of any
receives), then, keep_objects = false in every mailbox it reached, its S3 object.

One SQS message, from receipt to deletion:

    receive (long poll, ApproximateReceiveCount) → in flight (heartbeat)
      ├─ settle.py: poison / pointers / envelope / S3 fetch / parse / route /
      │   ingest; the message ends settled (rows committed or dead) or left for
      │   redelivery
      └─ settled → DeleteMessageBatch → (keep_objects = false in every mailbox it
         reached: delete the S3 object) → out of flight. Nothing is deleted before
         its rows committed; a pointer whose object is gone but whose message is
         stored is a redelivery (duplicate), not a loss.

"Dead": a dead_items row in each mailbox the message routes to, or, when it
routes nowhere (no recipient is ours, the pointer is unreadable), an unrouted
record with no tenant (the sink's record_unrouted; tables.py) that `inboxd status`
shows.

A message left alone is redelivered by SQS after its visibility timeout; while
one is in flight — fetched, parsed, waiting in a gathering batch, committing, being
deleted — the heartbeat extends its visibility, so a slow object or ingest is never
taken over by a competing consumer. Redelivery of a message already stored is
absorbed by the cascade (external id = SES message id, else the S3 key →
`duplicate`), which is also what makes several daemons on one queue safe.

Stopping (the daemon's stop event): the receive loops receive no more (a long
poll under way ends and what it brought is released at once); messages in flight
are finished; if the daemon's drain deadline cancels them, every message still in
flight is released (visibility 0) for another consumer, never deleted — what
committed meanwhile comes back as `duplicate`. A crash of a step (a bug) leaves
the messages it held for redelivery after their visibility timeout (not at once,
which would burn their receive counts in a tight loop). After a message was left
for redelivery, no loop receives again until the database answers, so an outage
does not spend the messages' receive counts.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import anyio
import structlog
from anyio.abc import TaskGroup

from inboxd.adapters.base import QueueSink
from inboxd.adapters.ses.aws import SQS_BATCH_ENTRIES, AwsClients, QueueMessage
from inboxd.adapters.ses.config import SesSettings
from inboxd.adapters.ses.errors import SesTransient
from inboxd.adapters.ses.pointers import Pointer
from inboxd.adapters.ses.routing import Router
from inboxd.adapters.ses.settle import CheckBody, Entry, Settler, Work

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
# Ingest batches of the door in the ingest queue or committing at once: while one
# commits, the next gathers. Two keep the database busy without hiding the
# backpressure of the ingest queue (each batch waits there for room).
INGEST_BATCHES = 2
# Copies in one ingest batch at most (one transaction; the daemon's default
# [workers] batch_size is 500).
INGEST_BATCH_ITEMS = 250
# Fetched objects parsed in one call (parse_in_workers splits it over the workers).
PARSE_BATCH = 64
# Parse calls at once: one parses while the next batch of objects arrives.
PARSES = 2
# DeleteMessageBatch calls at once (each ≤ 10 entries, SQS's limit).
DELETES = 4
# Object bytes fetched and not yet parsed, above which no further GET starts (a
# soft bound: GETs under way finish). Keeps memory flat when objects are large and
# parsing is behind; one object always passes. (Parsed copies waiting for ingest
# are bounded by max_in_flight.)
BUFFERED_BYTES = 256 * 1024 * 1024


class SesPoller:
    """`pollers` receive loops on one queue feeding the pipeline, plus the
    visibility heartbeat; the daemon's `sink` takes what they settle
    (adapters/base.py QueueSink)."""

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
        self._settler = Settler(settings, aws, router=router, sink=sink, check_body=check_body)
        self._receiving = anyio.Event()  # cleared while receiving is paused
        self._receiving.set()
        self._in_flight: dict[str, QueueMessage] = {}
        self._room = anyio.Event()  # set (and replaced) whenever a message leaves flight
        self._receiving_now = 0  # max_messages for every receive under way
        self._probing = False
        self._stop: anyio.Event | None = None
        self._pipeline_group: TaskGroup | None = None  # where the database probe runs

    @property
    def router(self) -> Router:
        return self._settler.router

    @router.setter
    def router(self, router: Router) -> None:
        """A SIGHUP's new routes (door.py): messages placed from now on route by them."""
        self._settler.router = router

    async def run(self, stop: anyio.Event) -> None:
        """Receive until `stop` is set; return once the messages in flight are done."""
        self._stop = stop
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._heartbeat)
            async with self._pipeline() as pipeline:
                async with anyio.create_task_group() as loops:
                    for number in range(self.settings.pollers):
                        loops.start_soon(self._loop, number, stop, pipeline)
            tg.cancel_scope.cancel()

    async def process(self, messages: Sequence[QueueMessage]) -> bool:
        """Take received messages through a pipeline of their own and return once each
        is deleted or left; True when some were left (tests, and tools that receive
        themselves). Cancelled part-way: every one not deleted is released."""
        async with self._pipeline() as pipeline:
            works = pipeline.submit(messages)
            for work in works:
                await work.done.wait()
        return any(w.failed for w in works)

    @asynccontextmanager
    async def _pipeline(self) -> AsyncIterator[_Pipeline]:
        """The pipeline's stages, running until the block ends and every message in
        flight is done; cancelled (the drain deadline), every message still in flight
        is released at once for another consumer."""
        pipeline = _Pipeline(self)
        try:
            async with anyio.create_task_group() as tg:
                pipeline.start(tg)
                yield pipeline
                await pipeline.idle()
                tg.cancel_scope.cancel()
        except BaseException:
            if self._in_flight:
                await self._release(list(self._in_flight.values()))
                self._in_flight.clear()
            raise

    # --- receiving ----------------------------------------------------------------------------

    async def _loop(self, number: int, stop: anyio.Event, pipeline: _Pipeline) -> None:
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
            pipeline.submit(messages)

    def _left(self) -> None:
        """A message was left for redelivery: no loop receives again until the
        database answers (every receive counts towards max_receive_count, and an
        outage must not turn good mail into poison). One probe at a time."""
        if self._probing or self._pipeline_group is None:
            return
        self._probing = True
        self._receiving = anyio.Event()
        self._pipeline_group.start_soon(self._probe)

    async def _probe(self) -> None:
        backoff = RECEIVE_BACKOFF_MIN_S
        stop = self._stop or anyio.Event()
        try:
            while not stop.is_set() and not await self._sink.database_ready():
                log.info("ses_receiving_paused", reason="database not ready", retry_s=backoff)
                with anyio.move_on_after(backoff):
                    await stop.wait()
                backoff = min(backoff * 2, RECEIVE_BACKOFF_MAX_S)
        finally:
            self._probing = False
            self._receiving.set()

    async def _receive_unless(self, stop: anyio.Event) -> list[QueueMessage]:
        """One long poll, after waiting for room (fewer than max_in_flight messages in
        flight, room in the ingest queue, the database answering after a message was
        left); that wait ends when `stop` is set. A long poll under way is not cut
        short at a stop: the messages it brings are released at once instead of
        hidden for a visibility timeout (at most wait_time_s more of shutdown)."""
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                await stop.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            while True:
                await self._receiving.wait()  # no loop receives while the database is down
                while not self._room_for_a_receive():
                    await self._room.wait()
                await self._sink.wait_for_room()
                if self._receiving.is_set() and self._room_for_a_receive():
                    break
            tg.cancel_scope.cancel()
        if stop.is_set():
            return []
        # the receive's share of max_in_flight is taken before it goes out, so the
        # loops together never pass it
        self._receiving_now += self.settings.max_messages
        try:
            received = await self._aws.receive()
        finally:
            self._receiving_now -= self.settings.max_messages
            self._wake()
        if received:
            self._sink.counted("received", len(received))
        return received

    def _room_for_a_receive(self) -> bool:
        """Whether another max_messages fit under max_in_flight (one receive always
        may when nothing is in flight, whatever max_in_flight says)."""
        taken = len(self._in_flight) + self._receiving_now
        return not taken or taken + self.settings.max_messages <= self.settings.max_in_flight

    async def _release(self, messages: Sequence[QueueMessage]) -> None:
        with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_TIMEOUT_S):
            await self._aws.set_visibility(list(messages), 0)
        self._sink.counted("released", len(messages))

    def _out_of_flight(self, message: QueueMessage) -> None:
        self._in_flight.pop(message.receipt_handle, None)
        self._wake()

    def _wake(self) -> None:
        """Room in flight may have been made: loops waiting for it look again."""
        self._room.set()
        self._room = anyio.Event()

    # --- visibility --------------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        period = self.settings.visibility_timeout_s * HEARTBEAT_SHARE
        while True:
            await anyio.sleep(period)
            await self._extend()

    async def _extend(self) -> None:
        """One beat: extend the visibility of every message in flight.

        The beat's request may reach SQS after a message it names has left flight:
        deleted (or released) by this poller meanwhile, its handle refused. That is
        no visibility lost; only the messages still in flight when the answer comes
        are (issue 22: every normal batch warned)."""
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


class _Pipeline:
    """The stages between the receive loops and the queue (module docstring). Each
    message is a `Work` (settle.py) whose `open` steps count down to done; the
    stages hand messages on through lists guarded by events, never by timers."""

    def __init__(self, poller: SesPoller) -> None:
        self._poller = poller
        self._settler = poller._settler
        self._sink = poller._sink
        self._aws = poller._aws
        self._tg: TaskGroup | None = None
        self._works = 0  # submitted and not done
        self._idle = anyio.Event()
        self._fetches = anyio.CapacityLimiter(poller.settings.fetch_concurrency)
        self._buffered = 0  # bytes fetched and not yet in an ingest batch
        self._drained = anyio.Event()  # set (and replaced) when buffered bytes go down
        self._fetched: list[tuple[Work, Pointer, bytes]] = []
        self._fetched_ready = anyio.Event()
        self._ready: dict[tuple[str, str], list[Entry]] = {}
        self._ready_set = anyio.Event()
        self._settled: list[Work] = []
        self._settled_set = anyio.Event()

    def start(self, tg: TaskGroup) -> None:
        self._tg = tg
        self._poller._pipeline_group = tg
        tg.start_soon(self._parse_stage)
        tg.start_soon(self._ingest_stage)
        tg.start_soon(self._delete_stage)

    async def idle(self) -> None:
        """Return once every message submitted is done (deleted or left)."""
        while self._works:
            self._idle = anyio.Event()
            await self._idle.wait()
        self._poller._pipeline_group = None

    def submit(self, messages: Sequence[QueueMessage]) -> list[Work]:
        assert self._tg is not None
        works = []
        for message in messages:
            self._poller._in_flight[message.receipt_handle] = message
            work = Work(message)
            works.append(work)
            self._works += 1
            self._tg.start_soon(self._prepare, work)
        return works

    # --- per message: prepare and fetch ---------------------------------------------------------

    async def _prepare(self, work: Work) -> None:
        try:
            pointers = await self._settler.prepare(work)
            if pointers:
                async with anyio.create_task_group() as tg:
                    for pointer in pointers:
                        tg.start_soon(self._fetch, work, pointer)
        except Exception as exc:  # a bug must not stop the queue: SQS redelivers it
            self._crashed([work], exc)
        self._step(work)

    async def _fetch(self, work: Work, pointer: Pointer) -> None:
        while self._buffered >= BUFFERED_BYTES:
            await self._drained.wait()
        async with self._fetches:
            raw = await self._settler.fetch(work, pointer)
        if raw is None:
            return
        work.open += 1  # until placed
        self._buffered += len(raw)
        self._fetched.append((work, pointer, raw))
        self._fetched_ready.set()

    # --- fetched objects of any messages: parse and place ----------------------------------------

    async def _parse_stage(self) -> None:
        assert self._tg is not None
        parses = anyio.Semaphore(PARSES)
        while True:
            await self._fetched_ready.wait()
            await parses.acquire()
            taken, self._fetched = self._fetched[:PARSE_BATCH], self._fetched[PARSE_BATCH:]
            if not self._fetched:
                self._fetched_ready = anyio.Event()
            if not taken:
                parses.release()
                continue
            self._tg.start_soon(self._parse, taken, parses)

    async def _parse(
        self, taken: list[tuple[Work, Pointer, bytes]], parses: anyio.Semaphore
    ) -> None:
        # Cancelled (the drain deadline), no step ends: the messages stay in flight
        # for the release (SesPoller._pipeline). Likewise in _ingest and _delete.
        try:
            try:
                parsed = await self._settler.parse([raw for _, _, raw in taken])
            finally:
                parses.release()
            for (work, pointer, raw), item in zip(taken, parsed, strict=True):
                placed = await self._settler.place(work, pointer, raw, item)
                work.open += len(placed)  # each copy until its ingest answers
                for route, copy in placed:
                    key = (route.tenant_id, route.mailbox_id)
                    self._ready.setdefault(key, []).append((work, copy))
                self._ready_set.set()
        except Exception as exc:
            self._crashed([w for w, _, _ in taken], exc)
        self._unbuffer(sum(len(raw) for _, _, raw in taken))
        for work, _, _ in taken:
            self._step(work)  # placed (or not): the object's own step ends

    def _unbuffer(self, n: int) -> None:
        self._buffered -= n
        self._drained.set()
        self._drained = anyio.Event()

    # --- copies of any messages, gathered per mailbox: ingest ------------------------------------

    async def _ingest_stage(self) -> None:
        assert self._tg is not None
        slots = anyio.Semaphore(INGEST_BATCHES)
        while True:
            await self._ready_set.wait()
            await slots.acquire()
            if not self._ready:
                self._ready_set = anyio.Event()
                slots.release()
                continue
            # the mailbox whose copies waited longest (dicts keep insertion order)
            key = next(iter(self._ready))
            entries = self._ready[key]
            batch, rest = entries[:INGEST_BATCH_ITEMS], entries[INGEST_BATCH_ITEMS:]
            if rest:
                self._ready[key] = rest
            else:
                del self._ready[key]
                if not self._ready:
                    self._ready_set = anyio.Event()
            self._tg.start_soon(self._ingest, key, batch, slots)

    async def _ingest(
        self, key: tuple[str, str], batch: list[Entry], slots: anyio.Semaphore
    ) -> None:
        try:
            await self._settler.ingest(*key, batch)
        except Exception as exc:
            self._crashed([w for w, _ in batch], exc)
        finally:
            slots.release()
        for work, _ in batch:
            self._step(work)

    # --- done: delete what settled, of any receives ---------------------------------------------

    def _step(self, work: Work) -> None:
        """One of the message's open steps ended; at the last, it is done."""
        work.open -= 1
        if work.open > 0:
            return
        if work.failed:  # left: SQS shows it again after its visibility timeout
            self._done(work)
            self._poller._left()
        else:
            self._settled.append(work)
            self._settled_set.set()

    def _done(self, work: Work) -> None:
        self._poller._out_of_flight(work.message)
        work.done.set()
        self._works -= 1
        if not self._works:
            self._idle.set()

    async def _delete_stage(self) -> None:
        assert self._tg is not None
        calls = anyio.Semaphore(DELETES)
        while True:
            await self._settled_set.wait()
            await calls.acquire()
            taken = self._settled[:SQS_BATCH_ENTRIES]
            self._settled = self._settled[SQS_BATCH_ENTRIES:]
            if not self._settled:
                self._settled_set = anyio.Event()
            if not taken:
                calls.release()
                continue
            self._tg.start_soon(self._delete, taken, calls)

    async def _delete(self, works: list[Work], calls: anyio.Semaphore) -> None:
        """Delete settled messages (then, keep_objects = false, their S3 objects)."""
        try:
            stale = await self._aws.delete([w.message for w in works])
            self._sink.counted("deleted", len(works) - len(stale))
            # objects last, and only of messages that left the queue: one that comes
            # back still finds its object (and a later redelivery is told apart from a
            # loss by _stored_already)
            left = {m.receipt_handle for m in stale}
            for work in works:
                if work.message.receipt_handle in left:
                    continue
                for pointer in work.objects:
                    try:
                        await self._aws.delete_object(pointer.bucket, pointer.key)
                    except SesTransient as exc:  # the rows are committed; the object lingers
                        log.warning("ses_object_not_deleted", error=str(exc))
        except Exception as exc:  # not deleted: back after the visibility timeout, duplicate
            self._sink.failed(f"{type(exc).__name__}: {exc}")
            log.exception("ses_batch_crashed", size=len(works), stage="delete")
        finally:
            calls.release()
        for work in works:
            self._done(work)

    def _crashed(self, works: Sequence[Work], exc: Exception) -> None:
        self._sink.failed(f"{type(exc).__name__}: {exc}")
        log.exception("ses_batch_crashed", size=len(works))
        for work in works:
            if not work.failed:
                work.failed = True
                self._sink.counted("left")
