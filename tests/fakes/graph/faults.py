"""Fault switches: what a test turns on to see the client cope.

Injected failures answer Graph's error body (errors.graph_error). A direct
request gets the status as its HTTP answer; an inner request of a $batch gets
it as that response's `status` inside a 200 batch ("Processing the JSON batch
response": a 200 batch does not mean its requests succeeded). A 404 is the
item-level ErrorItemNotFound unless a `code` says otherwise: the mailbox-level
ones (MAILBOX_404_CODES) are what Graph answers when the mailbox itself went away
between the delta page and the body requests (user deleted or renamed, licence
removed, mailbox moved on-premises). `hold()` parks
requests in flight (after they took their concurrency slot) until `release()`,
so a test can make requests overlap without sleeping.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio

from .errors import Answer, graph_error

_CODES = {
    429: ("TooManyRequests", "Too many requests."),
    500: ("InternalServerError", "An internal server error occurred."),
    503: ("ServiceUnavailable", "The service is temporarily unavailable."),
    504: ("GatewayTimeout", "The request timed out."),
    404: ("ErrorItemNotFound", "The specified object was not found in the store."),
}


#: 404 codes Graph answers about the mailbox rather than the item (api.py answers
#: the first two for a user that does not exist or has no Exchange Online mailbox;
#: ResourceNotFound "Resource could not be discovered" is seen for the same cases,
#: microsoftgraph/microsoft-graph-docs#10481).
MAILBOX_404_CODES = {
    "ErrorInvalidUser": "The requested user is invalid.",
    "MailboxNotEnabledForRESTAPI": "The mailbox is either inactive, soft-deleted, or is "
    "hosted on-premise.",
    "ResourceNotFound": "Resource could not be discovered.",
    "ErrorNonExistentMailbox": "The SMTP address has no mailbox associated with it.",
}


@dataclass
class Fault:
    status: int
    remaining: int | None  # None: until cleared
    retry_after_s: int | None = None
    kinds: frozenset[str] | None = None
    code: str | None = None  # Graph's error code; default: the status's usual one
    message: str | None = None

    def answer(self) -> Answer:
        code, message = _CODES.get(self.status, ("UnknownError", "Injected failure."))
        if self.code is not None:
            code = self.code
            message = self.message or MAILBOX_404_CODES.get(code, "Injected failure.")
        return graph_error(self.status, code, message, retry_after_s=self.retry_after_s)

    def spend(self) -> bool:
        """Use one shot; True when it is spent."""
        if self.remaining is None:
            return False
        self.remaining -= 1
        return self.remaining <= 0


@dataclass
class Faults:
    """The injection switches of one FakeGraph (fake.faults)."""

    by_message: dict[str, Fault] = field(default_factory=dict)
    next_requests: list[Fault] = field(default_factory=list)
    next_batches: list[Fault] = field(default_factory=list)
    reverse_batch: bool = False  # batch responses in reverse order (any order is legal)
    expire_style: str = "410"  # "410": 410 resyncRequired; "400": 400 syncStateNotFound
    moved_out_reason: str = "deleted"  # @removed reason of a message moved out of a folder
    _gate: anyio.Event | None = None

    def fail_message(
        self,
        message_id: str,
        status: int = 429,
        *,
        times: int | None = 1,
        retry_after_s: int | None = 1,
        code: str | None = None,
    ) -> None:
        """Requests naming `message_id` (REST or immutable id) answer `status` (with
        Graph's `code`, default the status's usual one), `times` times."""
        self.by_message[message_id] = Fault(status, times, retry_after_s, code=code)

    def fail_next_requests(
        self,
        count: int | None,
        status: int = 503,
        *,
        kinds: set[str] | None = None,
        retry_after_s: int | None = None,
        code: str | None = None,
        message: str | None = None,
    ) -> None:
        """The next `count` (None: every, until cleared) mail API requests (of `kinds`,
        e.g. {"message.delta"}) fail with `status` and Graph's `code`/`message`."""
        scope = frozenset(kinds) if kinds else None
        self.next_requests.append(
            Fault(status, count, retry_after_s, scope, code=code, message=message)
        )

    def fail_next_batches(
        self, count: int, status: int = 503, *, retry_after_s: int | None = None
    ) -> None:
        """The next `count` $batch requests fail as a whole (no inner request runs)."""
        self.next_batches.append(Fault(status, count, retry_after_s))

    def hold(self) -> None:
        """Park every request, once it holds its concurrency slot, until release()."""
        self._gate = anyio.Event()

    def release(self) -> None:
        if self._gate is not None:
            self._gate.set()
            self._gate = None

    def clear(self) -> None:
        self.by_message.clear()
        self.next_requests.clear()
        self.next_batches.clear()
        self.reverse_batch = False
        self.release()

    # -- used by the server --------------------------------------------------
    async def wait_gate(self) -> None:
        gate = self._gate
        if gate is not None:
            await gate.wait()

    def take_request(self, kind: str, message_ids: tuple[str, ...]) -> Answer | None:
        for message_id in message_ids:
            fault = self.by_message.get(message_id)
            if fault is not None:
                if fault.spend():
                    del self.by_message[message_id]
                return fault.answer()
        for fault in self.next_requests:
            if fault.kinds is None or kind in fault.kinds:
                if fault.spend():
                    self.next_requests.remove(fault)
                return fault.answer()
        return None

    def take_batch(self) -> Answer | None:
        if not self.next_batches:
            return None
        fault = self.next_batches[0]
        if fault.spend():
            self.next_batches.pop(0)
        return fault.answer()
