"""message: delta — rounds of pages over one folder, then changes since the last round.

Behaviour from "Get incremental changes to messages in a folder"
(delta-query-messages), "message: delta" and "Use delta query to track changes
in Microsoft Graph data" (delta-query-overview):

- state machine of a client: GET …/messages/delta (or `delta()`, the SDK's
  spelling) → pages with `@odata.nextLink` (a `$skiptoken`) → a last page with
  `@odata.deltaLink` (a `$deltatoken`) → later, GET the deltaLink → changes
  since that round, again paged, again ending in a deltaLink;
- state tokens are opaque and encode the round's query options (`$select`,
  `$filter`, `changeType`), so links are followed without repeating them;
- the first round holds the messages in the folder now; a later round holds
  messages that entered the folder (new or moved in) or changed (isRead), as
  full items, and `{"id", "@removed": {"reason": …}}` for messages that left it.
  The docs' only message example shows reason `deleted` for a deleted message;
  the overview defines `changed` (restorable) and `deleted` (gone). The fake
  answers `deleted` for both hard deletes and moves out by default, and
  `fake.faults.moved_out_reason = "changed"` flips moves, so a client must
  treat both reasons as "gone from this folder";
- a round is a snapshot taken when it starts: a message arriving mid-round is in
  the next round, never lost; a message changed mid-round may appear in both
  (the overview's "Replays" are allowed);
- `$filter` supports only `receivedDateTime ge|gt {value}`; `$top` and `Prefer:
  odata.maxpagesize={x}` bound a page (answered with `Preference-Applied`);
  without either the fake pages by 10, Outlook's default page size for message
  collections ("List messages": "the default page size is 10 messages");
- an expired token ("Token duration": Outlook tokens live only as long as the
  internal cache keeps them) answers `410 Gone` with code `resyncRequired` and
  a Location header holding the initial request ("Synchronization reset"), or,
  with `fake.faults.expire_style = "400"`, `400 syncStateNotFound` ("In case of
  an expired token, the service should respond with a 40X-series error with
  error codes such as syncStateNotFound").
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field
from datetime import datetime
from urllib.parse import quote

from .errors import Answer, graph_error, json_answer
from .resources import message_resource, removed_resource
from .state import Folder, Mailbox, Removal

DEFAULT_PAGE_SIZE = 10  # "List messages": default page size of Outlook message collections
MAX_PAGE_SIZE = 1000  # Outlook's largest $top for messages ("Paging Microsoft Graph data")
_FILTER = re.compile(r"^\s*receivedDateTime\s+(ge|gt)\s+(\S+)\s*$", re.IGNORECASE)
CHANGE_TYPES = ("created", "updated", "deleted")


class DeltaError(Exception):
    """A query the delta function refuses: 400 with a Graph error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Query:
    """The options a round was started with (encoded into its tokens)."""

    select: frozenset[str] | None = None
    received_op: str | None = None  # "ge" | "gt"
    received_at: datetime | None = None
    change_type: str | None = None
    top: int | None = None

    @classmethod
    def parse(cls, params: dict[str, str]) -> Query:
        select = params.get("$select")
        op = at = None
        if "$filter" in params:
            match = _FILTER.match(params["$filter"])
            if match is None:
                raise DeltaError(
                    "ErrorInvalidUrlQueryFilter",
                    "Delta of messages supports only $filter=receivedDateTime ge|gt {value}.",
                )
            op = match.group(1).lower()
            try:
                at = datetime.fromisoformat(match.group(2).replace("Z", "+00:00"))
            except ValueError as exc:
                raise DeltaError("ErrorInvalidUrlQueryFilter", str(exc)) from exc
        change_type = params.get("changeType")
        if change_type is not None and change_type not in CHANGE_TYPES:
            raise DeltaError("ErrorInvalidParameter", f"changeType {change_type!r} is invalid.")
        top = params.get("$top")
        if top is not None and (not top.isdigit() or int(top) < 1):
            raise DeltaError("ErrorInvalidParameter", "$top must be a positive integer.")
        return cls(
            select=frozenset(s.strip() for s in select.split(",") if s.strip()) if select else None,
            received_op=op,
            received_at=at,
            change_type=change_type,
            top=int(top) if top else None,
        )

    def admits(self, received: datetime) -> bool:
        if self.received_at is None:
            return True
        if self.received_op == "gt":
            return received > self.received_at
        return received >= self.received_at


@dataclass
class Token:
    """What a $skiptoken / $deltatoken stands for (kept server-side: tokens are opaque)."""

    user: str
    folder_id: str
    query: Query
    issued_seq: int
    watermark: int  # changes after this seq belong to the next round
    entries: list[tuple[str, str | Removal]] = field(default_factory=list)
    offset: int = 0
    is_delta: bool = False
    expired: bool = False


@dataclass
class DeltaTokens:
    """Every token the fake issued (fake.delta), by token string."""

    tokens: dict[str, Token] = field(default_factory=dict)
    expire_next_skiptoken: bool = False

    def issue(self, token: Token) -> str:
        value = secrets.token_urlsafe(18)
        if not token.is_delta and self.expire_next_skiptoken:
            self.expire_next_skiptoken = False
            token.expired = True
        self.tokens[value] = token
        return value


def delta_page(
    box: Mailbox,
    folder: Folder,
    params: dict[str, str],
    *,
    tokens: DeltaTokens,
    page_size: int | None,
    immutable: bool,
    link_base: str,
    graph_url: str,
    moved_out_reason: str,
    expire_style: str,
) -> Answer:
    """One page of a delta round; `link_base` is the absolute URL up to `?`."""
    # An empty $deltatoken is the initial request (the 410's Location header).
    skip, delta = params.get("$skiptoken") or None, params.get("$deltatoken") or None
    if skip is None and delta is None:
        try:
            query = Query.parse(params)
        except DeltaError as exc:
            return graph_error(400, exc.code, str(exc))
        token = _start_round(box, folder, query, since=None)
    else:
        held = tokens.tokens.get(skip or delta or "")
        if (
            held is None
            or held.expired
            or held.folder_id != folder.id
            or held.user != box.address
            or held.issued_seq < box.token_floor.get(folder.id, 0)
            or held.is_delta != (delta is not None)
        ):
            return _expired(link_base, expire_style)
        token = _start_round(box, folder, held.query, since=held.watermark) if delta else held
    size = min(page_size or token.query.top or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
    chunk = token.entries[token.offset : token.offset + size]
    value: list[dict[str, object]] = []
    for _kind, ref in chunk:
        if isinstance(ref, Removal):
            reason = "deleted" if ref.hard else moved_out_reason
            value.append(removed_resource(ref.immutable_id if immutable else ref.rest_id, reason))
            continue
        message = box.messages.get(ref)
        if message is None or message.folder_id != folder.id:
            continue  # gone since the round began: the next round says so
        value.append(message_resource(message, immutable=immutable, select=token.query.select))
    body: dict[str, object] = {
        "@odata.context": f"{graph_url}/$metadata#Collection(message)",
        "value": value,
    }
    following = token.offset + size
    if following < len(token.entries):
        nxt = Token(**{**token.__dict__, "offset": following, "issued_seq": box.seq})
        body["@odata.nextLink"] = f"{link_base}?$skiptoken={quote(tokens.issue(nxt))}"
    else:
        done = Token(box.address, folder.id, token.query, box.seq, token.watermark, is_delta=True)
        body["@odata.deltaLink"] = f"{link_base}?$deltatoken={quote(tokens.issue(done))}"
    headers = {"Preference-Applied": f"odata.maxpagesize={page_size}"} if page_size else None
    return json_answer(body, headers=headers)


def _start_round(box: Mailbox, folder: Folder, query: Query, since: int | None) -> Token:
    """Snapshot the round's entries at the mailbox's current seq."""
    now = box.seq
    entries: list[tuple[str, str | Removal]] = []
    if since is None:
        inside = [m for m in box.in_folder(folder.id) if query.admits(m.received)]
        inside.sort(key=lambda m: m.received, reverse=True)
        entries = [("item", m.immutable_id) for m in inside]
    else:
        events: dict[str, tuple[int, str | Removal]] = {}
        want = query.change_type
        for removal in box.removals:
            if removal.folder_id == folder.id and since < removal.seq <= now:
                if want in (None, "deleted"):
                    events[removal.immutable_id] = (removal.seq, removal)
        for message in box.in_folder(folder.id):
            if since < message.changed_seq <= now and query.admits(message.received):
                created = message.entered_seq > since
                if want is None or want == ("created" if created else "updated"):
                    events[message.immutable_id] = (message.changed_seq, message.immutable_id)
                elif message.immutable_id in events and created:
                    del events[message.immutable_id]  # left and came back: not "deleted"
        entries = [("item", ref) for _seq, ref in sorted(events.values(), key=lambda e: e[0])]
    return Token(box.address, folder.id, query, now, now, entries)


def _expired(link_base: str, style: str) -> Answer:
    if style == "400":
        return graph_error(
            400,
            "syncStateNotFound",
            "The sync state generation is not found. The delta token is expired and data "
            "must be synchronized again.",
        )
    return graph_error(
        410,
        "resyncRequired",
        "The delta token is no longer valid, and the app must reset the sync state.",
        headers={"Location": f"{link_base}?$deltatoken="},
    )
