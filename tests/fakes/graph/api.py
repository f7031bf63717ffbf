"""The mail API the fake serves, as one dispatcher that $batch inner requests reuse.

Every request, direct or inside a batch, goes through `GraphApi.dispatch`:
route → bearer token (401 InvalidAuthenticationToken) → user (`/me` needs a
delegated token; app-only tokens reach any user of the tenant, delegated ones
only their own: 403 ErrorAccessDenied; unknown user 404 ErrorInvalidUser; a
user without an Exchange Online mailbox 404 MailboxNotEnabledForRESTAPI) →
count → the ImmutableId policy → throttling (throttle.py) → injected faults →
the method.

Prefer header ("Obtain immutable identifiers for Outlook resources", "Paging
Microsoft Graph data"): one header may carry several comma-separated
preferences, e.g. `Prefer: IdType="ImmutableId", odata.maxpagesize=50`, or the
preferences may come in several Prefer headers. With `IdType="ImmutableId"`
every id in the answer is an immutable id; without it, REST ids, which change
when a message moves. Either kind of id is accepted in a path. With
`fake.strict_immutable` (default on) a mail request without the preference is
refused with 400 and counted in `counters.missing_immutable`: a policy of the
fake, so a test can prove the client always asks for immutable ids.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import unquote

import anyio

from .delta import delta_page
from .errors import Answer, bad_request, graph_error, json_answer, not_found
from .resources import folder_resource, message_resource
from .state import Folder, Mailbox

if TYPE_CHECKING:
    from .server import FakeGraph

_WHO = r"^/(?:users/(?P<user>[^/]+)|(?P<me>me))"
_FOLDER = r"/mailFolders(?:\('(?P<fq>[^']+)'\)|/(?P<f>[^/(]+))"
ROUTES: list[tuple[str, re.Pattern[str], str]] = [
    (
        "GET",
        re.compile(_WHO + _FOLDER + r"/messages/(?:microsoft\.graph\.)?delta(?P<paren>\(\))?$"),
        "message.delta",
    ),
    (
        "GET",
        re.compile(_WHO + f"(?:{_FOLDER})?" + r"/messages/(?P<id>[^/]+)/\$value$"),
        "message.value",
    ),
    ("GET", re.compile(_WHO + f"(?:{_FOLDER})?" + r"/messages/(?P<id>[^/]+)$"), "message.get"),
    ("POST", re.compile(_WHO + r"/messages/(?P<id>[^/]+)/move$"), "message.move"),
    ("GET", re.compile(_WHO + r"/mailFolders$"), "mailFolder.list"),
    ("GET", re.compile(_WHO + _FOLDER + r"$"), "mailFolder.get"),
]


@dataclass
class Call:
    """One API request: an HTTP request, or one inner request of a $batch."""

    verb: str
    path: str  # below /v1.0, e.g. /users/a@b/messages/ID/$value
    query: Mapping[str, str]
    headers: Mapping[str, str]  # case-insensitive mapping
    body: bytes = b""


@dataclass
class Prefer:
    immutable: bool = False
    maxpagesize: int | None = None

    @classmethod
    def parse(cls, values: list[str]) -> Prefer:
        out = cls()
        for value in values:
            for item in value.split(","):
                key, _, raw = item.strip().partition("=")
                raw = raw.strip().strip('"')
                if key.strip().lower() == "idtype":
                    out.immutable = raw.lower() == "immutableid"
                elif key.strip().lower() == "odata.maxpagesize" and raw.isdigit():
                    out.maxpagesize = int(raw)
        return out


def prefer_values(headers: Mapping[str, str]) -> list[str]:
    getall = getattr(headers, "getall", None)
    if getall is not None:
        return list(getall("Prefer", []))
    return [v for k, v in headers.items() if k.lower() == "prefer"]


Handler = Callable[[Mailbox, Call, dict[str, str], Prefer], Answer]


class GraphApi:
    def __init__(self, fake: FakeGraph) -> None:
        self.fake = fake
        self._methods: dict[str, Handler] = {
            "message.delta": self._delta,
            "message.value": self._value,
            "message.get": self._get_message,
            "message.move": self._move,
            "mailFolder.list": self._list_folders,
            "mailFolder.get": self._get_folder,
        }

    async def dispatch(self, call: Call) -> Answer:
        route = next(
            ((m, r[2]) for r in ROUTES if r[0] == call.verb and (m := r[1].match(call.path))),
            None,
        )
        if route is None:
            return bad_request(f"Resource not found for the segment '{call.path}'.")
        match, kind = route
        params = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
        box, problem = self._authorise(call, params)
        if problem is not None or box is None:
            return problem or bad_request("no mailbox")
        answer = await self._admitted(box, kind, call, params)
        self.fake.counters.statuses[(box.address, kind, answer.status)] += 1
        return answer

    async def _admitted(
        self, box: Mailbox, kind: str, call: Call, params: dict[str, str]
    ) -> Answer:
        counters = self.fake.counters
        user = box.address
        counters.calls[(user, kind)] += 1
        prefer = Prefer.parse(prefer_values(call.headers))
        counters.maxpagesize[(user, kind, prefer.maxpagesize is not None)] += 1
        if self.fake.strict_immutable and not prefer.immutable:
            counters.missing_immutable[(user, kind)] += 1
            return bad_request(
                'fake Graph (strict_immutable): send Prefer: IdType="ImmutableId"',
                code="ErrorInvalidRequest",
            )
        async with self.fake.throttle.slot(user) as refusal:
            if refusal is not None:
                return refusal
            await self.fake.faults.wait_gate()
            if self.fake.service_latency_s > 0:
                await anyio.sleep(self.fake.service_latency_s)  # simulated service time
            ids = self._ids_named(box, params)
            injected = self.fake.faults.take_request(kind, ids)
            if injected is not None:
                if injected.status == 429:
                    counters.throttled[user] += 1
                return injected
            return self._methods[kind](box, call, params, prefer)

    def _authorise(
        self, call: Call, params: dict[str, str]
    ) -> tuple[Mailbox | None, Answer | None]:
        scheme, _, token = call.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None, graph_error(401, "InvalidAuthenticationToken", "Access token is empty.")
        grant = self.fake.identity.access_grant(token.strip())
        if grant is None:
            held = self.fake.identity.access_tokens.get(token.strip())
            return None, graph_error(
                401,
                "InvalidAuthenticationToken",
                "Continuous access evaluation resulted in challenge with result: "
                "InteractionRequired and code: TokenIssuedBeforeRevocationTimestamp"
                if held is not None and held.revoked
                else "Access token has expired or is not yet valid.",
            )
        if "me" in params:
            if grant.user is None:
                return None, bad_request(
                    "/me request is only valid with delegated authentication flow."
                )
            wanted = grant.user
        else:
            wanted = params["user"]
        box = self.fake.find_user(wanted)
        if box is None:
            return None, graph_error(
                404, "ErrorInvalidUser", f"The requested user '{wanted}' is invalid."
            )
        if grant.user is not None and grant.user.lower() != box.address.lower():
            return None, graph_error(
                403, "ErrorAccessDenied", "Access is denied. Check credentials and try again."
            )
        if not box.has_mailbox:
            return None, graph_error(
                404,
                "MailboxNotEnabledForRESTAPI",
                "The mailbox is either inactive, soft-deleted, or is hosted on-premise.",
            )
        return box, None

    @staticmethod
    def _ids_named(box: Mailbox, params: dict[str, str]) -> tuple[str, ...]:
        if "id" not in params:
            return ()
        message = box.find(params["id"])
        if message is None:
            return (params["id"],)
        return (params["id"], message.rest_id, message.immutable_id)

    @staticmethod
    def _folder(box: Mailbox, params: dict[str, str]) -> Folder | None:
        name = params.get("fq") or params.get("f")
        return None if name is None else box.folder(name)

    # -- methods ---------------------------------------------------------------
    def _delta(self, box: Mailbox, call: Call, params: dict[str, str], prefer: Prefer) -> Answer:
        folder = self._folder(box, params)
        if folder is None:
            return not_found("The specified folder could not be found in the store.")
        who = "/me" if "me" in params else f"/users/{params['user']}"
        spelling = "delta()" if "paren" in params else "delta"
        graph_url = self.fake.graph_url
        return delta_page(
            box,
            folder,
            dict(call.query),
            tokens=self.fake.delta,
            page_size=prefer.maxpagesize,
            immutable=prefer.immutable,
            link_base=f"{graph_url}{who}/mailFolders('{folder.id}')/messages/{spelling}",
            graph_url=graph_url,
            moved_out_reason=self.fake.faults.moved_out_reason,
            expire_style=self.fake.faults.expire_style,
        )

    def _value(self, box: Mailbox, call: Call, params: dict[str, str], prefer: Prefer) -> Answer:
        message = box.find(params["id"])
        folder = self._folder(box, params)
        if message is None or (folder is not None and folder.id != message.folder_id):
            return not_found()
        self.fake.counters.raw_downloads[(box.address, message.immutable_id)] += 1
        # "Get MIME content of a message": 200 with Content-type: text/plain.
        return Answer(200, message.raw, {"Content-Type": "text/plain"})

    def _get_message(
        self, box: Mailbox, call: Call, params: dict[str, str], prefer: Prefer
    ) -> Answer:
        message = box.find(params["id"])
        folder = self._folder(box, params)
        if message is None or (folder is not None and folder.id != message.folder_id):
            return not_found()
        select = call.query.get("$select")
        wanted = frozenset(s.strip() for s in select.split(",")) if select else None
        body = message_resource(message, immutable=prefer.immutable, select=wanted)
        body["@odata.context"] = (
            f"{self.fake.graph_url}/$metadata#users('{box.id}')/messages/$entity"
        )
        return json_answer(body)

    def _move(self, box: Mailbox, call: Call, params: dict[str, str], prefer: Prefer) -> Answer:
        try:
            destination = json.loads(call.body or b"{}").get("destinationId", "")
        except (ValueError, AttributeError):
            return bad_request("Invalid JSON body.")
        if box.find(params["id"]) is None:
            return not_found()
        if box.folder(str(destination)) is None:
            return not_found("The specified folder could not be found in the store.")
        message = box.move(params["id"], str(destination))
        return json_answer(message_resource(message, immutable=prefer.immutable), 201)

    def _list_folders(
        self, box: Mailbox, call: Call, params: dict[str, str], prefer: Prefer
    ) -> Answer:
        value = [folder_resource(box, f) for f in box.folders.values()]
        return json_answer(
            {
                "@odata.context": f"{self.fake.graph_url}/$metadata#users('{box.id}')/mailFolders",
                "value": value,
            }
        )

    def _get_folder(
        self, box: Mailbox, call: Call, params: dict[str, str], prefer: Prefer
    ) -> Answer:
        folder = self._folder(box, params)
        if folder is None:
            return not_found("The specified folder could not be found in the store.")
        return json_answer(folder_resource(box, folder))
