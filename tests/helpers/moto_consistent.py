"""moto's server with SQS calls made one at a time: `python moto_consistent.py -H … -p …`.

moto's SQS backend is not thread-safe, and its server answers each request on a
thread of its own. Two consumers receiving from one queue while a third deletes
(two daemons, each with two long-polling loops) made it fail in ways real SQS
never does (moto 5.2, seen in CI):

    moto/sqs/models.py receive_message
      currently_pending_groups = deepcopy(queue.pending_message_groups)
    RuntimeError: Set changed size during iteration          → HTTP 500

and a receive that fails after marking some messages received hides them for a
visibility timeout and spends their receive counts without anyone getting them —
a delivery nobody saw, which made the redelivery tests count wrong. Real SQS is
consistent under concurrent consumers, and our code is tested against that
contract, so this launcher serialises the SQS backend's queue operations under one
lock. A long poll waits *outside* the lock (one non-blocking pass at a time), so a
consumer waiting for mail never holds up a delete.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

from moto.server import main
from moto.sqs.models import SQSBackend

# Operations that read or change a queue's messages (moto 5.2's SQSBackend).
_SERIALISED = (
    "send_message",
    "send_message_batch",
    "delete_message",
    "delete_message_batch",
    "change_message_visibility",
    "change_message_visibility_batch",
    "get_queue_attributes",
    "purge_queue",
)
# A long poll looks again this often: a message whose visibility timeout ran out
# becomes receivable without any notification moto could wait for.
_POLL_S = 0.05

_lock = threading.RLock()


def _serialised(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        with _lock:
            return method(*args, **kwargs)

    return call


def _patch() -> None:
    for name in _SERIALISED:
        if hasattr(SQSBackend, name):
            setattr(SQSBackend, name, _serialised(getattr(SQSBackend, name)))
    receive_once = SQSBackend.receive_message

    @functools.wraps(receive_once)
    def receive_message(
        self: SQSBackend,
        queue_name: str,
        count: int,
        wait_seconds_timeout: int,
        visibility_timeout: int,
        message_attribute_names: list[str] | None = None,
    ) -> Any:
        deadline = time.monotonic() + (wait_seconds_timeout or 0)
        while True:
            with _lock:  # one pass, never waiting: wait_seconds_timeout 0
                got = receive_once(
                    self, queue_name, count, 0, visibility_timeout, message_attribute_names
                )
            left = deadline - time.monotonic()
            if got or left <= 0:
                return got
            self.get_queue(queue_name).wait_for_messages(min(left, _POLL_S))

    SQSBackend.receive_message = receive_message  # type: ignore[method-assign]


if __name__ == "__main__":
    _patch()
    main()
