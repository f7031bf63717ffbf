"""The retry ladder of GmailClient.get_raw_batch: raw messages for any number of ids.

messages.get format=raw goes through the batch endpoint (batch.py, "Batching
requests" guide) in groups of at most GMAIL_BATCH_SIZE calls. The HTTP of one
batch request is the client's (client.py speaks Gmail's HTTP); this module
decides what to send and what each answer means:

    every id, once (duplicates fetched once), in groups of GMAIL_BATCH_SIZE
      one batch request per group; its units paid to the pacer first
        whole answer 401                the group again, once, with a fresh token
        whole answer 429 / 5xx / none   every id of the group failed retriably
        whole answer other 4xx          raised (the client's error for it)
        200: parts by Content-ID
          200 with raw bytes            stored in RawBatch.raw
          404 / 410                     RawBatch.gone (deleted between list and
                                        get: permanent, never retried)
          401                           those ids again, once, with a fresh token
          other 4xx                     RawBatch.rejected (permanent for that id)
          429 / 5xx / missing / no raw  failed retriably
      failed ids retried, only those, in groups half as large each round, with
      backoff and jitter (tenacity, through the client's `retrying`), for
      BATCH_ATTEMPTS rounds; then the group's retriable error is raised, so the
      page is read again next run

A second 401 to a fresh token is GmailAuthError. Nothing is silently capped.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping

import anyio

from inboxd.adapters.gmail.answers import HttpAnswer, RawBatch, raw_of
from inboxd.adapters.gmail.auth import TokenSource
from inboxd.adapters.gmail.batch import BatchFormatError, BatchPart, decode_batch
from inboxd.adapters.gmail.errors import (
    GmailAuthError,
    GmailRateLimited,
    GmailRequestRejected,
    GmailRetriable,
    GmailUnavailable,
)
from inboxd.adapters.gmail.pacer import BATCH_UNITS_PER_CALL, QuotaPacer

__all__ = [
    "BATCH_ATTEMPTS",
    "GMAIL_BATCH_SIZE",
    "THREAD_DECODE_MIN_BYTES",
    "RawBatchFetcher",
    "content_id",
]

#: Calls per batch: larger batches draw per-part 429s (the Gmail door's issue, measured
#: against Gmail); the batch guide allows 100 and advises at most 50.
GMAIL_BATCH_SIZE = 20
#: Rounds of a batch group (each round retries only the failed ids, in halved groups).
BATCH_ATTEMPTS = 6
#: Batch answers at least this large are decoded in a worker thread, off the event loop.
THREAD_DECODE_MIN_BYTES = 4 * 1024 * 1024

#: One batch request for these ids with this token: the HTTP answer, or GmailUnavailable
#: when none came (client.py's `_send_batch`; call i has Content-ID `content_id(i)`).
SendBatch = Callable[[list[str], str], Awaitable[HttpAnswer]]
#: The exception for a non-2xx answer: (what, status, headers, body) → error (the
#: client's table; a rate limit also holds the pacer).
ErrorOf = Callable[[str, int, Mapping[str, str], bytes], Exception]
#: Run an attempt with the client's tenacity policy: (what, attempts, attempt).
Retrying = Callable[[str, int, Callable[[], Awaitable[None]]], Awaitable[None]]


def content_id(index: int) -> str:
    """The Content-ID of the index-th call of a batch request."""
    return f"m{index}"


class RawBatchFetcher:
    """get_raw_batch of one mailbox's client (module docstring)."""

    def __init__(
        self,
        send: SendBatch,
        pacer: QuotaPacer,
        tokens: TokenSource,
        error_of: ErrorOf,
        retrying: Retrying,
        *,
        attempts: int = BATCH_ATTEMPTS,
    ) -> None:
        self._send = send
        self._pacer = pacer
        self._tokens = tokens
        self._error_of = error_of
        self._retrying = retrying
        self._attempts = attempts

    async def fetch(self, ids: Iterable[str]) -> RawBatch:
        """The raw bytes of every message in `ids`, batched by GMAIL_BATCH_SIZE."""
        wanted = list(dict.fromkeys(ids))
        out = RawBatch()
        for start in range(0, len(wanted), GMAIL_BATCH_SIZE):
            await self._fetch_group(wanted[start : start + GMAIL_BATCH_SIZE], out)
        return out

    async def _fetch_group(self, ids: list[str], out: RawBatch) -> None:
        """Fetch `ids` (≤ GMAIL_BATCH_SIZE) into `out`; retriable failures are retried
        in halved groups for BATCH_ATTEMPTS rounds, then raised."""
        pending = list(ids)
        group_size = len(pending)

        async def attempt() -> None:
            nonlocal pending, group_size
            failures: dict[str, GmailRetriable] = {}
            for start in range(0, len(pending), group_size):
                failures |= await self._batch_once(pending[start : start + group_size], out)
            if not failures:
                return
            pending = [i for i in pending if i in failures]
            group_size = max(1, group_size // 2)
            raise _worst(failures, len(ids))

        await self._retrying("messages.get batch", self._attempts, attempt)

    async def _batch_once(self, ids: list[str], out: RawBatch) -> dict[str, GmailRetriable]:
        """One batch request for `ids`; fills `out`, answers the retriable failures by id.
        A per-part or whole 401 re-sends those ids once with a fresh token."""
        todo, refreshed = list(ids), False
        failures: dict[str, GmailRetriable] = {}
        while True:
            await self._pacer.spend(BATCH_UNITS_PER_CALL * len(todo))
            token = await self._tokens.token()
            try:
                answer = await self._send(todo, token)
            except GmailUnavailable as exc:
                return failures | dict.fromkeys(todo, exc)
            if answer.status == 401:
                unauthorized = todo
            elif answer.status != 200:
                error = self._error_of("batch", answer.status, answer.headers, answer.body)
                if isinstance(error, GmailRetriable):
                    return failures | dict.fromkeys(todo, error)
                raise error
            else:
                try:
                    parts = await _decode_answer(answer)
                except BatchFormatError as exc:
                    return failures | dict.fromkeys(todo, exc)
                unauthorized = []
                for index, message_id in enumerate(todo):
                    part = parts.get(content_id(index))
                    if part is not None and part.status == 401:
                        unauthorized.append(message_id)
                    else:
                        self._settle_part(message_id, part, out, failures)
            if not unauthorized:
                return failures
            self._tokens.invalidate(token)
            if refreshed:
                raise GmailAuthError("Gmail answered 401 to a freshly issued access token")
            todo, refreshed = unauthorized, True

    def _settle_part(
        self,
        message_id: str,
        part: BatchPart | None,
        out: RawBatch,
        failures: dict[str, GmailRetriable],
    ) -> None:
        what = f"messages.get {message_id}"
        if part is None:
            failures[message_id] = GmailUnavailable(f"{what}: no part in the batch answer")
        elif part.status == 200:
            raw = raw_of(part.body, message_id)
            if raw is None:
                failures[message_id] = GmailUnavailable(f"{what}: answer without raw bytes")
            else:
                out.raw[message_id] = raw
        elif part.status in (404, 410):
            out.gone.add(message_id)  # deleted between list and get (sync guide)
        else:
            error = self._error_of(what, part.status, part.headers, part.body)
            if isinstance(error, GmailRetriable):
                failures[message_id] = error
            elif isinstance(error, GmailRequestRejected):
                out.rejected[message_id] = error
            else:
                raise error


def _worst(failures: Mapping[str, GmailRetriable], total: int) -> GmailRetriable:
    """One error for a round's failures: rate limited wins (it needs the longest
    wait), with the largest Retry-After seen."""
    errors = list(failures.values())
    retry_after = max((e.retry_after_s for e in errors if e.retry_after_s), default=None)
    kind = GmailRateLimited if any(isinstance(e, GmailRateLimited) for e in errors) else None
    sample = next((e for e in errors if isinstance(e, GmailRateLimited)), errors[0])
    text = f"messages.get: {len(failures)} of {total} calls failed, e.g. {sample}"
    if kind is not None:
        return GmailRateLimited(text, retry_after_s=retry_after)
    return GmailUnavailable(text, retry_after_s=retry_after)


async def _decode_answer(answer: HttpAnswer) -> dict[str, BatchPart]:
    content_type = answer.headers.get("content-type", "")
    if len(answer.body) >= THREAD_DECODE_MIN_BYTES:
        return await anyio.to_thread.run_sync(decode_batch, content_type, answer.body)
    return decode_batch(content_type, answer.body)
