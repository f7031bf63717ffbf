"""Fault injection switches: what a test turns on to see the client cope.

Every switch answers with Google's error body (errors.google_error). Direct calls
get the status as the HTTP answer; calls inside a batch get it as that part's
status line inside a 200 multipart answer, which is how Gmail reports per-call
failures (batch guide: "each part ... has its own status code"; 429
rateLimitExceeded per part is what oversized batches draw).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import Answer, google_error


@dataclass
class Fault:
    status: int
    remaining: int | None  # None: until cleared
    retry_after_s: int | None = None
    reason: str | None = None
    methods: frozenset[str] | None = None  # None: every method

    def answer(self) -> Answer:
        return google_error(self.status, reason=self.reason, retry_after_s=self.retry_after_s)

    def applies(self, method: str) -> bool:
        return self.methods is None or method in self.methods


@dataclass
class Faults:
    """The injection switches of one FakeGmail (fake.faults)."""

    by_message: dict[str, Fault] = field(default_factory=dict)
    next_calls: list[Fault] = field(default_factory=list)
    next_batches: list[Fault] = field(default_factory=list)
    # Gmail may answer batch parts in any order (batch guide); on: reversed order.
    shuffle_batch: bool = False

    def fail_message(
        self,
        message_id: str,
        status: int = 429,
        *,
        times: int | None = 1,
        retry_after_s: int | None = None,
        reason: str | None = None,
    ) -> None:
        """messages.get of `message_id` answers `status` for the next `times` calls."""
        self.by_message[message_id] = Fault(status, times, retry_after_s, reason)

    def fail_next_calls(
        self,
        count: int,
        status: int = 500,
        *,
        methods: set[str] | None = None,
        retry_after_s: int | None = None,
        reason: str | None = None,
    ) -> None:
        """The next `count` API calls (of `methods`, e.g. {"users.messages.get"}) fail."""
        scope = frozenset(methods) if methods else None
        self.next_calls.append(Fault(status, count, retry_after_s, reason, scope))

    def rate_limit(
        self,
        methods: set[str],
        *,
        times: int | None = None,
        retry_after_s: int = 1,
        reason: str = "rateLimitExceeded",
    ) -> None:
        """429 with Retry-After on `methods`, `times` times (None: until clear())."""
        self.next_calls.append(Fault(429, times, retry_after_s, reason, frozenset(methods)))

    def fail_next_batches(
        self, count: int, status: int = 503, *, retry_after_s: int | None = None
    ) -> None:
        """The next `count` batch requests fail as a whole (no parts are run)."""
        self.next_batches.append(Fault(status, count, retry_after_s))

    def clear(self) -> None:
        self.by_message.clear()
        self.next_calls.clear()
        self.next_batches.clear()
        self.shuffle_batch = False

    # -- used by the server --------------------------------------------------
    def take_call(self, method: str, message_id: str | None) -> Answer | None:
        if message_id is not None and message_id in self.by_message:
            fault = self.by_message[message_id]
            if _consume(fault):
                del self.by_message[message_id]
            return fault.answer()
        for fault in self.next_calls:
            if fault.applies(method):
                if _consume(fault):
                    self.next_calls.remove(fault)
                return fault.answer()
        return None

    def take_batch(self) -> Answer | None:
        if not self.next_batches:
            return None
        fault = self.next_batches[0]
        if _consume(fault):
            self.next_batches.pop(0)
        return fault.answer()


def _consume(fault: Fault) -> bool:
    """Use one shot of `fault`; True when it is spent."""
    if fault.remaining is None:
        return False
    fault.remaining -= 1
    return fault.remaining <= 0
