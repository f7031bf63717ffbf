"""The Graph calls of the Outlook door, on transport.py's paced raw path.

    delta_page(folder, link, since)   one page of a folder's message delta: the first
                                      page of a round through the SDK's request
                                      builder (`…/messages/delta()` with $select and
                                      the backfill $filter), later pages by their
                                      nextLink; EVERY request carries
                                      Prefer: IdType="ImmutableId", odata.maxpagesize
                                      (the SDK does not re-send headers on follow-up
                                      URLs: tests/adapters/outlook)
    get_raw_batch(ids)                raw MIME of messages (`/messages/{id}/$value`)
                                      through JSON $batch, ≤ 20 a batch; bodies come
                                      back base64 (JSON batching: non-JSON bodies are
                                      base64-encoded); inner 429/503 are retried, only
                                      those ids, after their Retry-After; 404
                                      ErrorItemNotFound → gone; a 404 about the
                                      mailbox (ErrorInvalidUser, …) or a 403 →
                                      OutlookAuthError for the whole page (nothing
                                      dead); 401 → a fresh token, those ids again
    create/renew/delete_subscription  change-notification subscriptions (raw JSON:
                                      the SDK's Subscription model costs a 2.6 s
                                      import wall on first use, bench/README.md)

Immutable ids: with the preference, a message keeps its id when it moves between
folders (Graph "Obtain immutable identifiers for Outlook resources"), so a move
between two synced folders is one stored row, not a delete and a new message.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import orjson
from kiota_abstractions.base_request_configuration import RequestConfiguration
from kiota_abstractions.method import Method
from kiota_abstractions.request_information import RequestInformation
from msgraph.generated.users.item.mail_folders.item.messages.delta.delta_request_builder import (
    DeltaRequestBuilder,
)

from inboxd.adapters.outlook.errors import (
    DeltaExpired,
    OutlookAuthError,
    OutlookRequestRejected,
    OutlookRetriable,
    OutlookThrottled,
    OutlookUnavailable,
)
from inboxd.adapters.outlook.transport import (
    Answer,
    GraphTransport,
    graph_error_code,
    graph_error_text,
)

__all__ = ["GRAPH_BATCH_SIZE", "DeltaItem", "DeltaPage", "GraphClient", "RawBatch", "Subscription"]

#: Requests per JSON batch: Graph's limit ("JSON batching": up to 20 requests).
GRAPH_BATCH_SIZE = 20
#: Messages per delta page we ask for (Prefer: odata.maxpagesize). One request per
#: page against one per body: 100 keeps listing at ~1 % of the budget.
DELTA_PAGE_SIZE = 100
#: Fields a delta page needs: ids, thread, folder. Bodies come raw from $value.
DELTA_SELECT = ["id", "conversationId", "parentFolderId", "receivedDateTime", "internetMessageId"]
#: Delta state that no longer exists: "resyncRequired" (410 Gone), "syncStateNotFound"
#: / "syncStateInvalid" (400) — the delta query overview's "synchronization reset".
EXPIRED_CODES = frozenset({"resyncrequired", "syncstatenotfound", "syncstateinvalid"})
#: Rounds of retrying the throttled ids of one batch before the error goes up.
BATCH_ROUNDS = 4
#: The only 404 codes that mean "this message is gone" (Graph error codes: "The
#: specified object was not found in the store."). Any other inner 404 is about the
#: mailbox — ErrorInvalidUser, MailboxNotEnabledForRESTAPI, ResourceNotFound,
#: ErrorNonExistentMailbox — and dead-lettering its messages would lose real mail.
ITEM_GONE_CODES = frozenset({"erroritemnotfound"})
IMMUTABLE = 'IdType="ImmutableId"'


@dataclass(frozen=True, slots=True)
class DeltaItem:
    id: str
    conversation_id: str | None


@dataclass(frozen=True, slots=True)
class DeltaPage:
    """One delta page: items present in the folder, ids that left it (id → reason:
    "deleted", or "changed" for moved out), and exactly one of the two links."""

    items: list[DeltaItem]
    removed: dict[str, str]
    next_link: str | None
    delta_link: str | None


@dataclass(slots=True)
class RawBatch:
    raw: dict[str, bytes] = field(default_factory=dict)
    gone: set[str] = field(default_factory=set)
    rejected: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Subscription:
    id: str
    expires_at: datetime


class GraphClient:
    """The Graph calls of one mailbox (module docstring)."""

    def __init__(self, transport: GraphTransport, user: str) -> None:
        self.transport = transport
        self.user = user
        self._prefer = [IMMUTABLE, f"odata.maxpagesize={DELTA_PAGE_SIZE}"]

    # --- delta ------------------------------------------------------------------------------

    async def delta_page(self, folder: str, link: str | None, since: datetime | None) -> DeltaPage:
        """The page at `link`, or the first page of a fresh round (link None)."""

        def make() -> RequestInformation:
            if link is not None:
                info = self.transport.request(Method.GET, link)
                info.headers.add("Prefer", self._prefer)
                return info
            query = DeltaRequestBuilder.DeltaRequestBuilderGetQueryParameters(
                select=DELTA_SELECT,
                filter=None if since is None else f"receivedDateTime ge {_iso(since)}",
            )
            config = RequestConfiguration(query_parameters=query)
            config.headers.add("Prefer", self._prefer)
            builder = (
                self.transport.client.users.by_user_id(self.user)
                .mail_folders.by_mail_folder_id(folder)
                .messages.delta
            )
            return builder.to_get_request_information(config)

        def expired(answer: Answer) -> Exception | None:
            code = (graph_error_code(answer.body) or "").lower()
            if answer.status == 410 or (answer.status == 400 and code in EXPIRED_CODES):
                return DeltaExpired(
                    f"{folder}: Graph answered {answer.status} {code or ''}".rstrip(),
                    folder=folder,
                )
            return None

        answer = await self.transport.call(f"{folder} delta", make, expired=expired)
        return _delta_page(answer.json())

    # --- bodies -----------------------------------------------------------------------------

    async def get_raw_batch(self, ids: Iterable[str]) -> RawBatch:
        out = RawBatch()

        def keep(mid: str, status: int, body: object) -> bool:
            if status == 200:
                raw = _body_bytes(body)
                if raw is None:
                    return False  # not base64: ask again
                out.raw[mid] = raw
            elif status == 404:
                out.gone.add(mid)
            else:
                out.rejected[mid] = f"$value answered {status}"
            return True

        await self._batched("$value", ids, "/$value", keep)
        return out

    async def locate(self, ids: Iterable[str]) -> dict[str, str | None]:
        """Each message's folder id now (parentFolderId), None when Graph no longer
        has it (404). Ids Graph refuses otherwise are left out."""
        found: dict[str, str | None] = {}

        def keep(mid: str, status: int, body: object) -> bool:
            if status == 200 and isinstance(body, dict):
                parent = body.get("parentFolderId")
                found[mid] = parent if isinstance(parent, str) else None
            elif status == 404:
                found[mid] = None
            return True

        await self._batched("locate", ids, "?$select=parentFolderId", keep)
        return found

    async def folder_ids(self, folders: Iterable[str]) -> dict[str, str]:
        """folder id → the configured name (a well-known name or an id) of each folder."""
        out: dict[str, str] = {}
        user = quote(self.user, safe="")
        for folder in folders:
            answer = await self._json_call(
                f"{folder} folder",
                Method.GET,
                f"/users/{user}/mailFolders/{quote(folder, safe='')}?$select=id",
                None,
            )
            folder_id = answer.json().get("id")
            if isinstance(folder_id, str):
                out[folder_id] = folder
        return out

    async def _batched(
        self,
        what: str,
        ids: Iterable[str],
        suffix: str,
        keep: Callable[[str, int, object], bool],
    ) -> None:
        """GET `/users/{u}/messages/{id}{suffix}` for every id through $batch (≤ 20 a
        batch). `keep(id, status, body)` takes each final answer (False: ask again);
        inner 429/5xx are asked again after their Retry-After, the rounds bounded by
        the transport's retry ladder."""
        wanted = list(dict.fromkeys(ids))
        for start in range(0, len(wanted), GRAPH_BATCH_SIZE):
            pending = wanted[start : start + GRAPH_BATCH_SIZE]

            async def attempt() -> None:
                nonlocal pending
                pending, error = await self._batch_once(what, pending, suffix, keep)
                if error is not None:
                    raise error

            await self.transport.retrying(f"$batch {what}", attempt)

    async def _batch_once(
        self,
        what: str,
        ids: list[str],
        suffix: str,
        keep: Callable[[str, int, object], bool],
    ) -> tuple[list[str], OutlookRetriable | None]:
        """One $batch; answers the ids to ask again and the error that says why."""
        user = quote(self.user, safe="")
        requests = [
            {
                "id": str(n),
                "method": "GET",
                "url": f"/users/{user}/messages/{quote(mid, safe='')}{suffix}",
                "headers": {"Prefer": IMMUTABLE},
            }
            for n, mid in enumerate(ids)
        ]
        info = self.transport.request(Method.POST, f"{self.transport.settings.graph_url}/$batch")
        info.headers.add("Content-Type", "application/json")
        info.headers.add("Prefer", IMMUTABLE)
        info.content = orjson.dumps({"requests": requests})
        # Graph runs a batch's requests against the mailbox's concurrency limit: the
        # batch holds every slot, and each inner request costs one of the budget.
        answer = await self.transport.send(
            f"$batch {what}",
            info,
            cost=len(ids) + 1,
            slots=self.transport.settings.concurrent_requests,
        )
        if answer.status != 200:
            raise self.transport.error(f"$batch {what}", answer)
        settled: set[str] = set()
        again: list[str] = []
        worst: OutlookRetriable | None = None
        for part in answer.json().get("responses") or []:
            if not isinstance(part, dict):
                continue
            try:
                mid = ids[int(part.get("id", -1))]
            except (ValueError, IndexError):
                continue
            status = part.get("status")
            if not isinstance(status, int):
                continue
            if status == 401:  # the token, not the message: a new one, these ids again
                self.transport.tokens.forget()
                if worst is None:
                    worst = OutlookUnavailable(f"$batch {what}: Graph answered 401 inside")
                continue
            refused = self._refused(f"$batch {what}", status, part)
            if refused is not None:
                raise refused
            if status == 429 or status >= 500:
                inner = Answer(status, _headers(part), orjson.dumps(part.get("body")))
                error = self.transport.error(f"$batch {what} {mid}", inner)
                if isinstance(error, OutlookRetriable) and (
                    worst is None or isinstance(error, OutlookThrottled)
                ):
                    worst = error
                continue
            if keep(mid, status, part.get("body")):
                settled.add(mid)
        again = [mid for mid in ids if mid not in settled]
        if again and worst is None:  # an answer without some of our ids, or unreadable
            worst = OutlookUnavailable(f"$batch {what}: answers missing or unreadable")
        return again, worst

    def _refused(self, what: str, status: int, part: dict[str, Any]) -> Exception | None:
        """The error for an inner answer that is about the mailbox, not the message,
        so no message of the batch may be settled by it: 404 with a code other than
        ErrorItemNotFound, or 403 → OutlookAuthError with Graph's code and text (the
        mailbox needs attention). (An inner 401 is about the token: the caller drops
        it and asks for those ids again, revoked early or by continuous access
        evaluation.)"""
        body = orjson.dumps(part.get("body"))
        code = graph_error_code(body) or ""
        if status == 403 or (status == 404 and code.lower() not in ITEM_GONE_CODES):
            text = graph_error_text(body)
            return OutlookAuthError(
                f"{what}: Graph answered {status} {code or '(no code)'}"
                + (f": {text}" if text else "")
            )
        return None

    # --- subscriptions ----------------------------------------------------------------------

    async def create_subscription(
        self,
        folder: str,
        notification_url: str,
        lifecycle_url: str,
        client_state: str,
        expires_at: datetime,
    ) -> Subscription:
        body = {
            "changeType": "created",
            "notificationUrl": notification_url,
            "lifecycleNotificationUrl": lifecycle_url,
            "resource": f"users/{self.user}/mailFolders('{folder}')/messages",
            "expirationDateTime": _iso(expires_at),
            "clientState": client_state,
        }
        answer = await self._json_call("create subscription", Method.POST, "/subscriptions", body)
        return _subscription(answer.json())

    async def renew_subscription(self, subscription_id: str, expires_at: datetime) -> Subscription:
        answer = await self._json_call(
            "renew subscription",
            Method.PATCH,
            f"/subscriptions/{quote(subscription_id, safe='')}",
            {"expirationDateTime": _iso(expires_at)},
        )
        return _subscription(answer.json())

    async def delete_subscription(self, subscription_id: str) -> None:
        """Delete it; one Graph no longer knows is deleted already."""
        try:
            await self._json_call(
                "delete subscription",
                Method.DELETE,
                f"/subscriptions/{quote(subscription_id, safe='')}",
                None,
            )
        except OutlookRequestRejected as exc:
            if exc.status != 404:
                raise

    async def _json_call(
        self, what: str, method: Method, path: str, body: dict[str, Any] | None
    ) -> Answer:
        def make() -> RequestInformation:
            info = self.transport.request(method, f"{self.transport.settings.graph_url}{path}")
            # a subscription made with it names immutable ids in its notifications
            info.headers.add("Prefer", IMMUTABLE)
            if body is not None:
                info.headers.add("Content-Type", "application/json")
                info.content = orjson.dumps(body)
            return info

        return await self.transport.call(what, make)


def _delta_page(doc: dict[str, Any]) -> DeltaPage:
    items: list[DeltaItem] = []
    removed: dict[str, str] = {}
    for entry in doc.get("value") or []:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            continue
        gone = entry.get("@removed")
        if isinstance(gone, dict):
            reason = gone.get("reason")
            removed[entry["id"]] = "deleted" if reason == "deleted" else "moved"
            continue
        conversation = entry.get("conversationId")
        items.append(
            DeltaItem(entry["id"], conversation if isinstance(conversation, str) else None)
        )
    next_link = doc.get("@odata.nextLink")
    delta_link = doc.get("@odata.deltaLink")
    if not isinstance(next_link, str) and not isinstance(delta_link, str):
        raise OutlookUnavailable("delta page without @odata.nextLink or @odata.deltaLink")
    return DeltaPage(
        items,
        removed,
        next_link if isinstance(next_link, str) else None,
        delta_link if isinstance(delta_link, str) and not isinstance(next_link, str) else None,
    )


def _subscription(doc: dict[str, Any]) -> Subscription:
    sid, expiry = doc.get("id"), doc.get("expirationDateTime")
    if not isinstance(sid, str) or not isinstance(expiry, str):
        raise OutlookUnavailable("subscription answer without id or expirationDateTime")
    try:
        expires_at = datetime.fromisoformat(expiry.replace("Z", "+00:00"))
    except ValueError as exc:
        raise OutlookUnavailable("subscription answer with an unreadable expiry") from exc
    if expires_at.tzinfo is None:
        expires_at = expires_at.replace(tzinfo=UTC)
    return Subscription(sid, expires_at)


def _body_bytes(body: object) -> bytes | None:
    if not isinstance(body, str):
        return None
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        return None


def _headers(part: dict[str, Any]) -> dict[str, str]:
    headers = part.get("headers")
    if not isinstance(headers, dict):
        return {}
    return {str(k): str(v) for k, v in headers.items()}


def _iso(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
