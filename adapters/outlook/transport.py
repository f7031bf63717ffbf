"""One mailbox's requests to Microsoft Graph: msgraph-sdk's request adapter, read raw.

    build       GraphServiceClient on our own httpx client (kiota's middleware off but
                ParametersNameDecodingHandler, so `$select` goes out as `$select`; no
                SDK retry handler: it would retry 429s behind our pacer's back, up to 3
                times, POSTs included — bench/README.md, Outlook), the base URL of
                `graph_url`, and GraphTokens as the token provider
    send(ri)    pace (1 request of the budget, at most `concurrent_requests` in flight),
                send, answer (status, headers, bytes) — the SDK's models never parse
                our answers: deserialising one message into them costs ~18 ms of CPU
                on the event loop against 0.011 ms with orjson (bench/README.md)
    retrying    429/503 honour Retry-After (the pacer holds every request of the
                mailbox meanwhile) and 5xx/connection errors back off with jitter, up to
                CALL_ATTEMPTS; then the error goes to the runner (the mailbox's throttle)
    401         the token is dropped and the request sent once more with a fresh one
                (the Authorization header of the first attempt removed first: kiota
                adds one only to a request without it, so the retry carried the
                refused token again — issue 22 item 5)

Errors map to adapters/outlook/errors.py: 410 and 400 syncStateNotFound/resyncRequired
→ DeltaExpired (for delta requests), 404 of the mailbox (ErrorInvalidUser,
MailboxNotEnabledForRESTAPI) and 401/403 after a fresh token → OutlookAuthError,
other 4xx → OutlookRequestRejected.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import httpx
import orjson
import structlog
from kiota_abstractions.authentication import BaseBearerTokenAuthenticationProvider
from kiota_abstractions.method import Method
from kiota_abstractions.request_information import RequestInformation
from kiota_abstractions.response_handler import ResponseHandler
from kiota_http.middleware import ParametersNameDecodingHandler
from kiota_http.middleware.options import ResponseHandlerOption
from msgraph.graph_request_adapter import GraphRequestAdapter
from msgraph.graph_service_client import GraphServiceClient
from msgraph_core import GraphClientFactory  # type: ignore[import-untyped]
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt

from inboxd.adapters.outlook.auth import GraphTokens
from inboxd.adapters.outlook.config import OutlookSettings
from inboxd.adapters.outlook.errors import (
    OutlookAuthError,
    OutlookRequestRejected,
    OutlookRetriable,
    OutlookThrottled,
    OutlookUnavailable,
)
from inboxd.adapters.pacing import TokenBucket
from inboxd.adapters.retry_after import retry_after_s

__all__ = ["Answer", "GraphTransport", "graph_error_code", "graph_error_text"]

log = structlog.get_logger(__name__)

T = TypeVar("T")

#: Attempts of one request before its retriable error goes to the runner.
CALL_ATTEMPTS = 4
BACKOFF_INITIAL_S = 1.0
BACKOFF_MAX_S = 30.0
#: Longest Retry-After honoured in place; a longer one is the runner's throttle.
MAX_RETRY_AFTER_S = 120.0
#: Share of Graph's 10,000 requests per 10 minutes the pacer spends. We also charge
#: a $batch envelope as a request (Graph documents only that the inner requests
#: count, each on its own), so against Graph's counting the door spends about
#: 0.97 × 101/106 ≈ 0.92 of the budget, and if Graph counted envelopes too, the
#: burst plus ten minutes at this rate stays under 10,000 (200 + 9,700).
BUDGET_SHARE = 0.97
#: Requests the bucket may send at once after an idle spell. Graph counts a sliding
#: 10-minute window, so burst + rate × 600 s must stay ≤ 10,000: 200 + 9,700 does.
BURST_REQUESTS = 200.0
REQUEST_TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 10.0
AUTHORIZATION = "Authorization"
#: 404 codes that mean the mailbox itself is gone or not reachable with REST.
MAILBOX_GONE_CODES = frozenset(
    {
        "errorinvaliduser",
        "mailboxnotenabledforrestapi",
        "resourcenotfound",
        "errornonexistentmailbox",
    }
)


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> dict[str, Any]:
        try:
            value = orjson.loads(self.body)
        except orjson.JSONDecodeError as exc:
            raise OutlookUnavailable(
                f"Graph answered {self.status} with a body that is not JSON"
            ) from exc
        if not isinstance(value, dict):
            raise OutlookUnavailable(
                f"Graph answered {self.status} with JSON that is not an object"
            )
        return value


class _Raw(ResponseHandler):
    """Hands the httpx response back untouched: status, headers and bytes are ours."""

    async def handle_response_async(
        self,
        response: Any,
        error_map: Any = None,  # noqa: ARG002 - kiota's ResponseHandler contract
    ) -> Any:
        await response.aread()
        return response


class GraphTransport:
    """The paced, retried, raw request path of one mailbox (module docstring)."""

    def __init__(
        self,
        settings: OutlookSettings,
        tokens: GraphTokens,
        *,
        pacer: TokenBucket | None = None,
        attempts: int = CALL_ATTEMPTS,
        backoff_initial_s: float = BACKOFF_INITIAL_S,
    ) -> None:
        self.settings = settings
        self.tokens = tokens
        rate = settings.requests_per_10_min * BUDGET_SHARE / 600.0
        self.pacer = pacer or TokenBucket(
            rate, min(BURST_REQUESTS, settings.requests_per_10_min / 50)
        )
        self.slots = anyio.CapacityLimiter(settings.concurrent_requests)
        self._wide = anyio.Lock()
        self._attempts = attempts
        self._backoff_s = backoff_initial_s
        # msgraph-core wraps this transport in one whose aclose() closes nothing
        # (AsyncGraphTransport has none): we close the connections ourselves.
        self._connections = httpx.AsyncHTTPTransport(
            limits=httpx.Limits(max_connections=settings.concurrent_requests + 1)
        )
        self._http = GraphClientFactory.create_with_custom_middleware(
            [ParametersNameDecodingHandler()],
            client=httpx.AsyncClient(
                transport=self._connections,
                timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
            ),
        )
        self.adapter = GraphRequestAdapter(
            BaseBearerTokenAuthenticationProvider(tokens), client=self._http
        )
        self.adapter.base_url = settings.graph_url
        self.client = GraphServiceClient(request_adapter=self.adapter)

    async def aclose(self) -> None:
        await self._http.aclose()
        await self._connections.aclose()

    def request(self, method: Method, url: str) -> RequestInformation:
        """A RequestInformation for an absolute URL (a nextLink, $batch, subscriptions)."""
        info = RequestInformation(method)
        info.url = url
        return info

    async def send(
        self, what: str, info: RequestInformation, *, cost: int = 1, slots: int = 1
    ) -> Answer:
        """One attempt: pace `cost` requests of the budget, hold `slots` of the
        mailbox's concurrent requests, send. 401 is retried once with a new token."""
        info.add_request_options([ResponseHandlerOption(_Raw())])
        for first in (True, False):
            await self.pacer.spend(cost)
            async with _slots(self.slots, slots, self._wide):
                # the token provider (GraphTokens, through kiota) sets the header of
                # each attempt: it alone decides which host may have a token
                info.headers.remove(AUTHORIZATION)
                try:
                    response = await self.adapter.send_primitive_async(info, "bytes", {})
                except (httpx.HTTPError, OSError) as exc:
                    raise OutlookUnavailable(f"{what}: {type(exc).__name__}") from exc
            answer = Answer(response.status_code, response.headers, response.content)
            if answer.status != 401:
                return answer
            self.tokens.invalidate(_bearer(info.headers.get(AUTHORIZATION)))
            if not first:
                break
        raise OutlookAuthError(f"{what}: Graph answered 401 to a freshly issued token")

    async def call(
        self,
        what: str,
        make: Callable[[], RequestInformation],
        *,
        expired: Callable[[Answer], Exception | None] | None = None,
    ) -> Answer:
        """`send` with retries; a 2xx answer, or the mapped error."""

        async def attempt() -> Answer:
            answer = await self.send(what, make())
            if 200 <= answer.status < 300:
                return answer
            if expired is not None and (gone := expired(answer)) is not None:
                raise gone
            raise self.error(what, answer)

        return await self.retrying(what, attempt)

    async def retrying(self, what: str, attempt: Callable[[], Awaitable[T]]) -> T:
        failed = 0

        def wait(state: RetryCallState) -> float:
            exc = state.outcome.exception() if state.outcome else None
            after = getattr(exc, "retry_after_s", None)
            backoff = min(BACKOFF_MAX_S, self._backoff_s * 2.0 ** (state.attempt_number - 1))
            return max(backoff, after or 0.0)

        def note(state: RetryCallState) -> None:
            nonlocal failed
            failed += 1
            if failed == 1:
                exc = state.outcome.exception() if state.outcome else None
                log.warning("graph_call_retrying", call=what, error=str(exc)[:200])

        retrying = AsyncRetrying(
            stop=stop_after_attempt(self._attempts),
            wait=wait,
            retry=retry_if_exception_type(OutlookRetriable),
            before_sleep=note,
            reraise=True,
        )
        result: T = await retrying(attempt)
        if failed:
            log.info("graph_call_recovered", call=what, retries=failed)
        return result

    def error(self, what: str, answer: Answer) -> Exception:
        """The exception for a non-2xx answer; a Retry-After holds the pacer."""
        code = graph_error_code(answer.body)
        text = f"{what}: Graph answered {answer.status}" + (f" {code}" if code else "")
        after = retry_after_of(answer.headers)
        if answer.status == 429 or (answer.status == 503 and after is not None):
            hold = after if after is not None else 1.0
            self.pacer.hold(min(hold, MAX_RETRY_AFTER_S))
            return OutlookThrottled(text, retry_after_s=hold)
        if answer.status >= 500:
            return OutlookUnavailable(text, retry_after_s=after)
        if answer.status == 403 or (
            answer.status == 404 and (code or "").lower() in MAILBOX_GONE_CODES
        ):
            words = graph_error_text(answer.body)  # the operator's lead: Graph's own text
            return OutlookAuthError(text + (f": {words}" if words else ""))
        return OutlookRequestRejected(text, status=answer.status, code=code)


def _bearer(values: set[str]) -> str:
    """The token of the request's `Authorization: Bearer …` header ("" without one)."""
    for value in values:
        scheme, _, token = value.partition(" ")
        if scheme.lower() == "bearer":
            return token.strip()
    return ""


class _slots:
    """Hold `n` tokens of a CapacityLimiter (a $batch holds all of the mailbox's).
    Several tokens are taken one by one under `wide`, so two wide holders never
    each hold part of the limiter waiting for the rest."""

    def __init__(self, limiter: anyio.CapacityLimiter, n: int, wide: anyio.Lock) -> None:
        self._limiter = limiter
        self._n = n
        self._wide = wide
        self._borrowers: list[object] = []

    async def __aenter__(self) -> None:
        if self._n > 1:
            async with self._wide:
                await self._take()
        else:
            await self._take()

    async def _take(self) -> None:
        try:
            for _ in range(self._n):
                borrower = object()
                await self._limiter.acquire_on_behalf_of(borrower)
                self._borrowers.append(borrower)
        except BaseException:
            self._release()
            raise

    async def __aexit__(self, *exc: object) -> None:
        self._release()

    def _release(self) -> None:
        while self._borrowers:
            self._limiter.release_on_behalf_of(self._borrowers.pop())


def graph_error_code(body: bytes) -> str | None:
    """`error.code` of a Graph error body, if it has one."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if isinstance(value, dict) and isinstance(value.get("error"), dict):
        code = value["error"].get("code")
        return code if isinstance(code, str) else None
    return None


#: Longest part of Graph's error text kept in an error message (one status line).
ERROR_TEXT_CHARS = 200


def graph_error_text(body: bytes) -> str | None:
    """`error.message` of a Graph error body, one line, at most ERROR_TEXT_CHARS: the
    provider's own words for an operator (it names the mailbox, never a token)."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if isinstance(value, dict) and isinstance(value.get("error"), dict):
        text = value["error"].get("message")
        if isinstance(text, str) and text.strip():
            return " ".join(text.split())[:ERROR_TEXT_CHARS]
    return None


def retry_after_of(headers: Mapping[str, str]) -> float | None:
    """Retry-After in seconds (adapters/retry_after.py), None when absent; the header
    name matched whatever its case (kiota hands a plain mapping)."""
    for name, item in headers.items():
        if name.lower() == "retry-after":
            return retry_after_s(item)
    return None
