"""The Gmail API methods the fake serves, as one dispatcher batch parts reuse.

Every call, direct or inside a batch, goes through `GmailApi.dispatch`:
route → count the call → bearer token (401) → userId (403/400) → injected
fault → quota (429 + Retry-After) → the method. Shapes follow the v1 REST
reference (https://developers.google.com/gmail/api/reference/rest/v1/users):
int64 fields (historyId, internalDate, expiration) are JSON strings, as Google
encodes every int64.
"""

from __future__ import annotations

import base64
import json
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import unquote

from multidict import MultiMapping

from .errors import Answer, google_error, json_answer
from .listing import BadRequest, HistoryTooOld, list_history, list_messages
from .quota import METHOD_UNITS
from .state import SYSTEM_LABELS, Mailbox, Message, Watch, header_list

if TYPE_CHECKING:
    from .server import FakeGmail

WATCH_TTL_MS = 7 * 24 * 3600 * 1000  # push guide: "re-call watch at least every 7 days"
_USER = r"^/gmail/v1/users/(?P<user>[^/]+)"
ROUTES: list[tuple[str, re.Pattern[str], str]] = [
    ("GET", re.compile(_USER + r"/profile$"), "users.getProfile"),
    ("GET", re.compile(_USER + r"/messages$"), "users.messages.list"),
    ("GET", re.compile(_USER + r"/messages/(?P<id>[^/]+)$"), "users.messages.get"),
    ("GET", re.compile(_USER + r"/history$"), "users.history.list"),
    ("GET", re.compile(_USER + r"/labels$"), "users.labels.list"),
    ("POST", re.compile(_USER + r"/watch$"), "users.watch"),
    ("POST", re.compile(_USER + r"/stop$"), "users.stop"),
]


@dataclass
class Call:
    """One API call: an HTTP request, or one part of a batch."""

    verb: str
    path: str
    query: MultiMapping[str]
    headers: Mapping[str, str]  # case-insensitive mapping
    body: bytes = b""


class GmailApi:
    def __init__(self, fake: FakeGmail) -> None:
        self.fake = fake
        self._methods: dict[str, Callable[[Mailbox, Call, dict[str, str]], Answer]] = {
            "users.getProfile": self._get_profile,
            "users.messages.list": self._list_messages,
            "users.messages.get": self._get_message,
            "users.history.list": self._list_history,
            "users.labels.list": self._list_labels,
            "users.watch": self._watch,
            "users.stop": self._stop,
        }

    def method_of(self, call: Call) -> str | None:
        """The API method `call` is (e.g. "users.watch"), None for an unknown route."""
        return next((r[2] for r in ROUTES if r[0] == call.verb and r[1].match(call.path)), None)

    def dispatch(self, call: Call) -> Answer:
        route = next(
            ((m, r[2]) for r in ROUTES if r[0] == call.verb and (m := r[1].match(call.path))),
            None,
        )
        if route is None:
            return google_error(404, f"fake Gmail has no {call.verb} {call.path}")
        match, method = route
        params = {k: unquote(v) for k, v in match.groupdict().items()}
        counters = self.fake.counters
        user, problem = self._authorise(call, params["user"])
        counters.calls[(user, method)] += 1
        answer = problem or self._run(user, method, call, params)
        counters.statuses[(user, method, answer.status)] += 1
        return answer

    def _authorise(self, call: Call, user_param: str) -> tuple[str, Answer | None]:
        auth = call.headers.get("Authorization", "")
        scheme, _, token = auth.partition(" ")
        grant = self.fake.oauth.access_grant(token) if scheme.lower() == "bearer" else None
        if grant is None:
            return user_param, google_error(401)
        if grant.user is None:
            # A service account token without `sub`: Gmail has no mailbox for it.
            return user_param, google_error(
                400, "Precondition check failed.", reason="failedPrecondition"
            )
        if user_param != "me" and user_param.lower() != grant.user.lower():
            return user_param, google_error(403, f"Delegation denied for {grant.user}")
        if grant.user not in self.fake.mailboxes:
            return grant.user, google_error(
                400, "Mail service not enabled", reason="failedPrecondition"
            )
        return grant.user, None

    def _run(self, user: str, method: str, call: Call, params: dict[str, str]) -> Answer:
        injected = self.fake.faults.take_call(method, params.get("id"))
        if injected is not None:
            return injected
        units = METHOD_UNITS[method]
        wait_s = self.fake.quota.try_spend(user, units)
        if wait_s is not None:
            return google_error(
                429,
                "User-rate limit exceeded.",
                reason="userRateLimitExceeded",
                retry_after_s=wait_s,
            )
        self.fake.counters.units[user] += units
        try:
            return self._methods[method](self.fake.mailboxes[user], call, params)
        except BadRequest as exc:
            return google_error(400, str(exc))

    # -- methods ---------------------------------------------------------------
    def _get_profile(self, box: Mailbox, call: Call, params: dict[str, str]) -> Answer:
        return json_answer(
            {
                "emailAddress": box.email,
                "messagesTotal": len(box.messages),
                "threadsTotal": len({m.thread_id for m in box.messages.values()}),
                "historyId": str(box.history_id),
            }
        )

    def _list_messages(self, box: Mailbox, call: Call, params: dict[str, str]) -> Answer:
        q = call.query
        return json_answer(
            list_messages(
                box,
                label_ids=q.getall("labelIds", []),
                q=q.get("q"),
                include_spam_trash=q.get("includeSpamTrash", "false").lower() == "true",
                max_results=q.get("maxResults"),
                page_token=q.get("pageToken"),
            )
        )

    def _get_message(self, box: Mailbox, call: Call, params: dict[str, str]) -> Answer:
        message = box.messages.get(params["id"])
        if message is None:
            return google_error(404)
        fmt = call.query.get("format", "full").lower()
        out = _message_resource(message)
        if fmt == "raw":
            self.fake.counters.raw_downloads[(box.email, message.id)] += 1
            # base64url of the exact stored bytes (users.messages resource, field raw).
            out["raw"] = base64.urlsafe_b64encode(message.raw).decode()
        elif fmt == "metadata":
            wanted = {h.lower() for h in call.query.getall("metadataHeaders", [])}
            headers = [
                {"name": name, "value": value}
                for name, value in header_list(message.raw)
                if not wanted or name.lower() in wanted
            ]
            out["payload"] = {"partId": "", "mimeType": _mime_type(message), "headers": headers}
        elif fmt != "minimal":
            raise BadRequest(f"fake Gmail serves format=raw|metadata|minimal, not {fmt!r}")
        return json_answer(out)

    def _list_history(self, box: Mailbox, call: Call, params: dict[str, str]) -> Answer:
        q = call.query
        try:
            body = list_history(
                box,
                start_history_id=q.get("startHistoryId"),
                history_types=q.getall("historyTypes", []),
                label_id=q.get("labelId"),
                max_results=q.get("maxResults"),
                page_token=q.get("pageToken"),
            )
        except HistoryTooOld:
            # Sync guide: an out-of-date startHistoryId answers 404; do a full sync.
            return google_error(404)
        return json_answer(body)

    def _list_labels(self, box: Mailbox, call: Call, params: dict[str, str]) -> Answer:
        labels = [{"id": x, "name": x, "type": "system"} for x in SYSTEM_LABELS]
        labels += [{"id": i, "name": n, "type": "user"} for i, n in box.user_labels.items()]
        return json_answer({"labels": labels})

    def _watch(self, box: Mailbox, call: Call, params: dict[str, str]) -> Answer:
        try:
            request = json.loads(call.body or b"{}")
        except ValueError as exc:
            raise BadRequest("Invalid JSON payload received.") from exc
        topic = request.get("topicName") if isinstance(request, dict) else None
        if not isinstance(topic, str) or not re.fullmatch(r"projects/[^/]+/topics/[^/]+", topic):
            raise BadRequest("Invalid topicName does not match projects/*/topics/*")
        allowed = self.fake.publishable_topics
        if allowed is not None and topic not in allowed:
            # push guide, "Grant publish rights on your topic": without them users.watch
            # is refused ("Error sending test message to Cloud PubSub ...: User not
            # authorized to perform this action.")
            return google_error(
                403,
                f"Error sending test message to Cloud PubSub {topic} : User not authorized "
                "to perform this action.",
                reason="forbidden",
            )
        behavior = str(request.get("labelFilterBehavior", "include")).lower()
        if behavior not in ("include", "exclude"):
            raise BadRequest(f"Invalid labelFilterBehavior: {behavior!r}")
        box.watch = Watch(
            topic_name=topic,
            label_ids=list(request.get("labelIds") or []),
            label_filter_behavior=behavior,
            expiration_ms=int(time.time() * 1000) + self.fake.watch_ttl_ms,
            history_id=box.history_id,
        )
        return json_answer(
            {"historyId": str(box.history_id), "expiration": str(box.watch.expiration_ms)}
        )

    def _stop(self, box: Mailbox, call: Call, params: dict[str, str]) -> Answer:
        box.watch = None
        # users.stop reference: "If successful, the response body is an empty JSON object."
        return json_answer({})


def _message_resource(message: Message) -> dict[str, object]:
    return {
        "id": message.id,
        "threadId": message.thread_id,
        "labelIds": list(message.label_ids),
        "snippet": "",
        "sizeEstimate": len(message.raw),
        "historyId": str(message.history_id),
        "internalDate": str(message.internal_date_ms),
    }


def _mime_type(message: Message) -> str:
    for name, value in header_list(message.raw):
        if name.lower() == "content-type":
            return value.split(";", 1)[0].strip().lower() or "text/plain"
    return "text/plain"
