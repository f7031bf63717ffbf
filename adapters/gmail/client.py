"""The Gmail REST client of the Gmail door: the only module that speaks Gmail's HTTP.

One `GmailClient` per mailbox (CONTRIBUTING.md rule 1), over the daemon's
aiohttp session, the mailbox's `QuotaPacer` (pacer.py) and `AccessTokens`
(auth.py). Calls are made as `users/me`: the token names the user (refresh
token of that user, or a service account's delegation with `sub` = address).

    get_profile()                               users.getProfile        1 unit
    list_messages(label_ids, query, page_token) users.messages.list     5 units
    list_history(start, types, page_token)      users.history.list      2 units
    get_raw_batch(ids)                          messages.get format=raw 5 units per id,
                                                in batches of GMAIL_BATCH_SIZE
    watch(topic, label_ids)                     users.watch           100 units
    stop()                                      users.stop             50 units

Every call pays its units to the pacer before it leaves, runs under a
deadline (rule 7), and is translated at this boundary (rule 4, errors.py):

    2xx                                   the answer
    401                                   the token is dropped and the call sent once
                                          more with a fresh one; a second 401 is
                                          GmailAuthError
    429, 403 with a usage-limit reason    pacer.hold(Retry-After), retried (tenacity:
      (RATE_LIMIT_REASONS)                bounded, exponential backoff with jitter),
                                          then GmailRateLimited(retry_after_s)
    5xx, connection error, deadline,      retried likewise, then GmailUnavailable
      an answer that is not Gmail's JSON
    403 (any other reason)                GmailAuthError (scope, delegation, policy)
    400 failedPrecondition                GmailConfigError (no Gmail for this user)
    404 of history.list                   HistoryExpired: the source resets the cursor
    other 4xx                             GmailRequestRejected (permanent)

Batches (batch.py, "Batching requests" guide): at most GMAIL_BATCH_SIZE calls
each; what each part's answer means, and the retries of only the failed ids in
halved groups, are raw_batches.py's (its docstring has the ladder); the HTTP of
one batch request is `_send_batch` here. `get_raw_batch` takes any number of
ids: nothing is silently capped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import quote

import aiohttp
import anyio
import structlog
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
    wait_random,
)

from inboxd.adapters.gmail.answers import (
    HistoryPage,
    HttpAnswer,
    MessagePage,
    MessageRef,
    Profile,
    RawBatch,
    WatchResult,
    google_error,
    int_field,
    json_object,
    list_of_objects,
    optional_text_field,
    retry_after_of,
    text_field,
)
from inboxd.adapters.gmail.auth import TokenSource
from inboxd.adapters.gmail.batch import BATCH_PATH, BatchCall, encode_batch
from inboxd.adapters.gmail.config import GmailMailbox, GmailSettings
from inboxd.adapters.gmail.errors import (
    GmailAuthError,
    GmailConfigError,
    GmailRateLimited,
    GmailRequestRejected,
    GmailRetriable,
    GmailUnavailable,
    HistoryExpired,
)
from inboxd.adapters.gmail.pacer import (
    GET_PROFILE_UNITS,
    HISTORY_LIST_UNITS,
    MESSAGES_LIST_UNITS,
    STOP_UNITS,
    WATCH_UNITS,
    QuotaPacer,
)
from inboxd.adapters.gmail.raw_batches import (
    BATCH_ATTEMPTS,
    GMAIL_BATCH_SIZE,
    RawBatchFetcher,
    content_id,
)
from inboxd.adapters.http_fetch import read_capped

__all__ = [
    "GMAIL_BATCH_SIZE",
    "GmailClient",
    "HistoryPage",
    "MessagePage",
    "MessageRef",
    "Profile",
    "RawBatch",
    "WatchResult",
]

log = structlog.get_logger(__name__)
T = TypeVar("T")

#: messages.list / history.list page size: "The maximum allowed value for this field is
#: 500" (reference pages). A list costs the same units whatever its size.
LIST_PAGE_SIZE = 500
#: Deadline of one JSON call (profile, lists, watch, stop), seconds.
CALL_TIMEOUT_S = 30.0
#: Deadline of one batch of raw messages, seconds: 20 messages of up to ~35 MB base64 each.
BATCH_TIMEOUT_S = 180.0
#: Attempts of one JSON call before its retriable error goes to the runner.
CALL_ATTEMPTS = 4
#: Exponential backoff between attempts, with full jitter (tenacity), seconds.
BACKOFF_INITIAL_S = 1.0
BACKOFF_MAX_S = 32.0
#: Pacer hold after a rate-limit answer without Retry-After: the per-second window
#: of the per-user limit (Usage limits page).
RATE_LIMIT_HOLD_S = 1.0
#: Largest JSON answer read from a non-batch call (a 500-record history page is far less).
MAX_JSON_ANSWER_BYTES = 32 * 1024 * 1024
#: 403 reasons that mean "too much", not "forbidden" (handle-errors guide, "Resolve a 403
#: error: Usage limit exceeded"; the Usage limits page names the per-user/project ones).
RATE_LIMIT_REASONS = frozenset(
    {"rateLimitExceeded", "userRateLimitExceeded", "dailyLimitExceeded", "quotaExceeded"}
)


class GmailClient:
    """Gmail calls for one mailbox (module docstring). `session` is shared and
    owned by the caller; `pacer` and `tokens` belong to this mailbox."""

    def __init__(
        self,
        settings: GmailSettings,
        mailbox: GmailMailbox,
        session: aiohttp.ClientSession,
        pacer: QuotaPacer,
        tokens: TokenSource,
        *,
        call_attempts: int = CALL_ATTEMPTS,
        batch_attempts: int = BATCH_ATTEMPTS,
        backoff_initial_s: float = BACKOFF_INITIAL_S,
        backoff_max_s: float = BACKOFF_MAX_S,
        rate_limit_hold_s: float = RATE_LIMIT_HOLD_S,
        connections: anyio.CapacityLimiter | None = None,
    ) -> None:
        self.settings = settings
        self.mailbox = mailbox
        self._session = session
        # The door's bound on requests in flight to Gmail (one connection each), shared
        # by the mailboxes of a shared session; taken before a call's deadline starts,
        # so waiting for a turn is never "no answer within 30 s" (None: unbounded).
        self._connections = connections or contextlib.nullcontext()
        self._pacer = pacer
        self._tokens = tokens
        self._call_attempts = call_attempts
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._rate_limit_hold_s = rate_limit_hold_s
        self._users_url = f"{settings.api_url}/gmail/v1/users/me"
        self._batch_url = f"{settings.api_url}{BATCH_PATH}"
        self._log = log.bind(mailbox=mailbox.address)
        self._raw = RawBatchFetcher(
            self._send_batch, pacer, tokens, self._error, self._retrying, attempts=batch_attempts
        )

    # --- the methods ----------------------------------------------------------------------

    async def get_profile(self) -> Profile:
        """users.getProfile: address, current historyId, totals."""
        answer = await self._json_call("getProfile", GET_PROFILE_UNITS, "GET", "/profile")
        return Profile(
            email_address=text_field(answer, "emailAddress"),
            history_id=text_field(answer, "historyId"),
            messages_total=int_field(answer.get("messagesTotal")),
            threads_total=int_field(answer.get("threadsTotal")),
        )

    async def list_messages(
        self,
        label_ids: Sequence[str] = (),
        query: str | None = None,
        page_token: str | None = None,
    ) -> MessagePage:
        """One messages.list page, newest first. Every label of `label_ids` must be
        on a message (Gmail ANDs them: list one label per call to get their union);
        `query` is Gmail search syntax (e.g. `newer_than:30d`)."""
        params: list[tuple[str, str]] = [("maxResults", str(LIST_PAGE_SIZE))]
        params += [("labelIds", label) for label in label_ids]
        if query:
            params.append(("q", query))
        if page_token:
            params.append(("pageToken", page_token))
        answer = await self._json_call(
            "messages.list", MESSAGES_LIST_UNITS, "GET", "/messages", params=params
        )
        refs = [
            MessageRef(text_field(m, "id"), text_field(m, "threadId"))
            for m in list_of_objects(answer, "messages")
        ]
        return MessagePage(
            refs,
            optional_text_field(answer, "nextPageToken"),
            int_field(answer.get("resultSizeEstimate")),
        )

    async def list_history(
        self,
        start_history_id: str,
        history_types: Iterable[str] = ("messageAdded",),
        page_token: str | None = None,
        *,
        label_id: str | None = None,
    ) -> HistoryPage:
        """One history.list page of records after `start_history_id`, oldest first.
        HistoryExpired when Gmail no longer has that history (404)."""
        params: list[tuple[str, str]] = [
            ("startHistoryId", start_history_id),
            ("maxResults", str(LIST_PAGE_SIZE)),
        ]
        params += [("historyTypes", kind) for kind in history_types]
        if label_id:
            params.append(("labelId", label_id))
        if page_token:
            params.append(("pageToken", page_token))
        answer = await self._json_call(
            "history.list",
            HISTORY_LIST_UNITS,
            "GET",
            "/history",
            params=params,
            on_404=lambda: HistoryExpired(
                f"history.list: startHistoryId {start_history_id} is no longer available"
            ),
        )
        return HistoryPage(
            records=list_of_objects(answer, "history"),
            history_id=text_field(answer, "historyId"),
            next_page_token=optional_text_field(answer, "nextPageToken"),
        )

    async def watch(self, topic: str, label_ids: Sequence[str] = ()) -> WatchResult:
        """users.watch: publish this mailbox's changes (restricted to `label_ids`
        when given) to the Pub/Sub `topic`. Renew before `expiration` (Gmail push
        guide: at least every 7 days); renewing never moves the cursor."""
        body: dict[str, Any] = {"topicName": topic}
        if label_ids:
            body["labelIds"] = list(label_ids)
            body["labelFilterBehavior"] = "include"  # LabelFilterAction enum, users.watch
        answer = await self._json_call("watch", WATCH_UNITS, "POST", "/watch", json_body=body)
        return WatchResult(text_field(answer, "historyId"), int_field(answer.get("expiration")))

    async def stop(self) -> None:
        """users.stop: no more push notifications for this mailbox."""
        await self._json_call("stop", STOP_UNITS, "POST", "/stop", expect_json=False)

    async def get_raw_batch(self, ids: Iterable[str]) -> RawBatch:
        """The raw RFC 822 bytes of every message in `ids` (messages.get format=raw,
        batched by GMAIL_BATCH_SIZE; duplicates fetched once). Ids Gmail answers
        404 for are in `gone`, other 4xx in `rejected`; a retriable failure that
        outlasts BATCH_ATTEMPTS raises GmailRateLimited / GmailUnavailable
        (raw_batches.py)."""
        return await self._raw.fetch(ids)

    # --- JSON calls -----------------------------------------------------------------------

    async def _json_call(
        self,
        what: str,
        units: int,
        verb: str,
        path: str,
        *,
        params: list[tuple[str, str]] | None = None,
        json_body: Mapping[str, Any] | None = None,
        on_404: Callable[[], Exception] | None = None,
        expect_json: bool = True,
    ) -> dict[str, Any]:
        url = self._users_url + path

        async def attempt() -> dict[str, Any]:
            answer = await self._authorised(
                units, lambda token: self._send(verb, url, token, params, json_body)
            )
            if 200 <= answer.status < 300:
                if not expect_json:
                    return {}
                return json_object(answer.body, what)
            if answer.status == 404 and on_404 is not None:
                raise on_404()
            raise self._error(what, answer.status, answer.headers, answer.body)

        return await self._retrying(what, self._call_attempts, attempt)

    async def _authorised(
        self, units: int, send: Callable[[str], Awaitable[HttpAnswer]]
    ) -> HttpAnswer:
        """Pay `units`, send with the current token; on 401 drop the token and send
        once more with a fresh one (paying again); a second 401 is GmailAuthError."""
        for first in (True, False):
            await self._pacer.spend(units)
            token = await self._tokens.token()
            answer = await send(token)
            if answer.status != 401:
                return answer
            self._tokens.invalidate(token)
            if not first:
                break
        raise GmailAuthError("Gmail answered 401 to a freshly issued access token")

    async def _send(
        self,
        verb: str,
        url: str,
        token: str,
        params: list[tuple[str, str]] | None,
        json_body: Mapping[str, Any] | None,
    ) -> HttpAnswer:
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        try:
            async with self._connections:
                with anyio.fail_after(CALL_TIMEOUT_S):
                    async with self._session.request(
                        verb,
                        url,
                        params=params,
                        json=json_body,
                        headers=headers,
                        allow_redirects=False,
                    ) as response:
                        body = await read_capped(response, MAX_JSON_ANSWER_BYTES)
                        status, answer_headers = response.status, _lowercased(response.headers)
        except TimeoutError as exc:
            raise GmailUnavailable(f"{verb} {url}: no answer within {CALL_TIMEOUT_S:g} s") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise GmailUnavailable(f"{verb} {url}: {type(exc).__name__}") from exc
        if body is None:
            raise GmailUnavailable(
                f"{verb} {url}: answer larger than {MAX_JSON_ANSWER_BYTES} bytes"
            )
        return HttpAnswer(status, answer_headers, body)

    # --- batches --------------------------------------------------------------------------

    async def _send_batch(self, ids: list[str], token: str) -> HttpAnswer:
        """One batch request of messages.get format=raw for `ids` (call i has Content-ID
        `content_id(i)`); GmailUnavailable when no answer came."""
        calls = [
            BatchCall(
                content_id(index),
                f"/gmail/v1/users/me/messages/{quote(message_id, safe='')}?format=raw",
            )
            for index, message_id in enumerate(ids)
        ]
        content_type, body = encode_batch(calls)
        headers = {"Authorization": f"Bearer {token}", "Content-Type": content_type}
        try:
            async with self._connections:
                with anyio.fail_after(BATCH_TIMEOUT_S):
                    async with self._session.post(
                        self._batch_url, data=body, headers=headers, allow_redirects=False
                    ) as response:
                        payload = await response.read()
                        return HttpAnswer(response.status, _lowercased(response.headers), payload)
        except TimeoutError as exc:
            raise GmailUnavailable(f"batch: no answer within {BATCH_TIMEOUT_S:g} s") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise GmailUnavailable(f"batch: {type(exc).__name__}") from exc

    # --- errors and retries ---------------------------------------------------------------

    def _error(self, what: str, status: int, headers: Mapping[str, str], body: bytes) -> Exception:
        """The exception for a non-2xx answer (module docstring's table). A rate
        limit also holds the pacer, so no call of this mailbox leaves before
        Gmail's Retry-After."""
        reason, message = google_error(body)
        text = f"{what}: HTTP {status}" + (f" {reason}" if reason else "")
        if message:
            text += f" ({message})"
        retry_after_s = retry_after_of(headers)
        if status == 429 or (status == 403 and reason in RATE_LIMIT_REASONS):
            self._pacer.hold(
                retry_after_s if retry_after_s is not None else self._rate_limit_hold_s
            )
            return GmailRateLimited(text, retry_after_s=retry_after_s)
        if status >= 500:
            return GmailUnavailable(text, retry_after_s=retry_after_s)
        if status in (401, 403):
            return GmailAuthError(text)
        if status == 400 and reason == "failedPrecondition":
            return GmailConfigError(f"address: {text}: is Gmail enabled for this user?")
        return GmailRequestRejected(text, status=status, reason=reason)

    async def _retrying(self, what: str, attempts: int, attempt: Callable[[], Awaitable[T]]) -> T:
        """Run `attempt` with tenacity: GmailRetriable is retried `attempts` times with
        exponential backoff and jitter, then re-raised; "unavailable" and "recovered"
        are logged once each (rule 8)."""
        failed = 0

        def note(state: RetryCallState) -> None:
            nonlocal failed
            failed += 1
            if failed == 1:
                exc = state.outcome.exception() if state.outcome else None
                self._log.warning("gmail_call_retrying", call=what, error=str(exc))

        retrying = AsyncRetrying(
            stop=stop_after_attempt(attempts),
            wait=wait_exponential(multiplier=self._backoff_initial_s, max=self._backoff_max_s)
            + wait_random(0, self._backoff_initial_s),
            retry=retry_if_exception_type(GmailRetriable),
            before_sleep=note,
            reraise=True,
        )
        result: T = await retrying(attempt)
        if failed:
            self._log.info("gmail_call_recovered", call=what, retries=failed)
        return result


# --- helpers -----------------------------------------------------------------------------


def _lowercased(headers: Mapping[str, str]) -> dict[str, str]:
    """Header fields by lowercased name, like BatchPart.headers."""
    return {name.lower(): value for name, value in headers.items()}
