"""messages.list filtering and paging, history.list paging.

- messages.list (https://developers.google.com/gmail/api/reference/rest/v1/users.messages/list):
  newest first; `labelIds` must all match; `q` takes the search operators of
  https://support.google.com/mail/answer/7190 that a sync uses (after:/before:
  and their older:/newer: synonyms, older_than:/newer_than: with a d/m/y period
  counted back from now, in:, label:, is:, each optionally negated; every date
  term is compared with the message's internalDate, not its Date header);
  SPAM and TRASH are left out unless includeSpamTrash=true or asked for by name;
  maxResults defaults to 100 and is capped at 500; an empty result has no
  "messages" key, only resultSizeEstimate.
- history.list: records after startHistoryId, oldest first, maxResults default
  100 / max 500, filtered by historyTypes and labelId.
Page tokens are opaque; here they name the last item handed out, so a page
boundary survives messages arriving between pages (new mail sorts first).
"""

from __future__ import annotations

import base64
import bisect
import json
import re
import time
from datetime import datetime
from zoneinfo import ZoneInfo

from .state import HistoryRecord, Mailbox, Message

MAX_RESULTS_DEFAULT = 100  # users.messages.list / users.history.list reference
MAX_RESULTS_CAP = 500  # "The maximum allowed value for this field is 500."
HISTORY_TYPES = {"messageAdded", "messageDeleted", "labelAdded", "labelRemoved"}
_TYPE_KEYS = {
    "messageAdded": "messagesAdded",
    "messageDeleted": "messagesDeleted",
    "labelAdded": "labelsAdded",
    "labelRemoved": "labelsRemoved",
}
# Search operators: a date without a time is midnight Pacific time (search operator
# help page: "dates ... are interpreted as midnight PST"; epoch seconds are exact).
SEARCH_TZ = ZoneInfo("America/Los_Angeles")
# older_than:/newer_than: periods (search operator help page: "d (day), m (month),
# and y (year)"); Gmail does not say how long a month is, the fake counts 30 days.
_PERIOD = re.compile(r"([1-9][0-9]*)([dmy])")
_PERIOD_MS = {"d": 86_400_000, "m": 30 * 86_400_000, "y": 365 * 86_400_000}
_IN_LABELS = {
    "inbox": "INBOX",
    "spam": "SPAM",
    "trash": "TRASH",
    "sent": "SENT",
    "draft": "DRAFT",
    "drafts": "DRAFT",
    "chats": "CHAT",
    "unread": "UNREAD",
    "starred": "STARRED",
    "important": "IMPORTANT",
}


class BadRequest(Exception):
    """An argument Gmail would answer 400 for."""


def page_size(value: str | None) -> int:
    if value is None:
        return MAX_RESULTS_DEFAULT
    try:
        size = int(value)
    except ValueError as exc:
        raise BadRequest(f"Invalid value for maxResults: {value!r}") from exc
    if size < 1:
        raise BadRequest("maxResults must be positive")
    return min(size, MAX_RESULTS_CAP)


def encode_token(value: object) -> str:
    return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")


def decode_token(token: str) -> object:
    try:
        return json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
    except ValueError as exc:
        raise BadRequest("Invalid pageToken") from exc


# -- messages.list ---------------------------------------------------------------
def list_messages(
    mailbox: Mailbox,
    *,
    label_ids: list[str],
    q: str | None,
    include_spam_trash: bool,
    max_results: str | None,
    page_token: str | None,
    now_ms: int | None = None,
) -> dict[str, object]:
    size = page_size(max_results)
    # whole seconds: the list cache below keys on the bounds a relative term gives
    now_ms = int(time.time()) * 1000 if now_ms is None else now_ms
    required = set(label_ids)
    excluded: set[str] = set()
    after_ms, before_ms = None, None
    for term in (q or "").split():
        negated = term.startswith("-")
        key, _, value = term.lstrip("-").partition(":")
        key = key.lower()
        if key in ("after", "newer", "before", "older") and not negated:
            bound = _date_ms(value)
            if key in ("after", "newer"):
                after_ms = bound if after_ms is None else max(after_ms, bound)
            else:
                before_ms = bound if before_ms is None else min(before_ms, bound)
        elif key in ("newer_than", "older_than") and not negated:
            bound = now_ms - _period_ms(value)
            if key == "newer_than":
                after_ms = bound if after_ms is None else max(after_ms, bound)
            else:
                before_ms = bound if before_ms is None else min(before_ms, bound)
        elif key in ("in", "is", "label"):
            if key != "label" and value.lower() == "anywhere":
                include_spam_trash = True
                continue
            (excluded if negated else required).add(_label_of(mailbox, key, value))
        else:
            raise BadRequest(f"fake Gmail does not implement the search term {term!r}")
    if not include_spam_trash:
        excluded |= {"SPAM", "TRASH"} - required
    query = (frozenset(required), frozenset(excluded), after_ms, before_ms)
    matches, keys = _matching(mailbox, query)
    first = 0
    if page_token:
        last = decode_token(page_token)
        if not (isinstance(last, list) and len(last) == 2):
            raise BadRequest("Invalid pageToken")
        first = bisect.bisect_right(keys, (-int(last[0]), -int(str(last[1]), 16)))
    page = matches[first : first + size]
    out: dict[str, object] = {"resultSizeEstimate": len(matches)}
    if page:
        out["messages"] = [{"id": m.id, "threadId": m.thread_id} for m in page]
    if first + size < len(matches):
        out["nextPageToken"] = encode_token([page[-1].internal_date_ms, page[-1].id])
    return out


_Query = tuple[frozenset[str], frozenset[str], int | None, int | None]


def _matching(mailbox: Mailbox, query: _Query) -> tuple[list[Message], list[tuple[int, int]]]:
    # Sorted matches are kept per (history_id, query): a benchmark pages through a
    # large mailbox without re-filtering it per page, and every change moves history_id.
    cache = mailbox.list_cache
    cache_key = (mailbox.history_id, query)
    if cache_key not in cache:
        required, excluded, after_ms, before_ms = query
        matches = sorted(
            (
                m
                for m in mailbox.messages.values()
                if required.issubset(m.label_ids)
                and excluded.isdisjoint(m.label_ids)
                and (after_ms is None or m.internal_date_ms >= after_ms)
                and (before_ms is None or m.internal_date_ms < before_ms)
            ),
            key=_newest_first,
        )
        if len(cache) > 16:
            cache.clear()
        cache[cache_key] = (matches, [_newest_first(m) for m in matches])
    return cache[cache_key]


def _newest_first(message: Message) -> tuple[int, int]:
    return (-message.internal_date_ms, -int(message.id, 16))


def _date_ms(value: str) -> int:
    if value.isdigit():
        return int(value) * 1000
    for fmt in ("%Y/%m/%d", "%Y-%m-%d"):
        try:
            day = datetime.strptime(value, fmt).replace(tzinfo=SEARCH_TZ)
        except ValueError:
            continue
        return int(day.timestamp() * 1000)
    raise BadRequest(f"Invalid date in search query: {value!r}")


def _period_ms(value: str) -> int:
    match = _PERIOD.fullmatch(value.lower())
    if match is None:
        raise BadRequest(f"Invalid period in search query: {value!r}")
    return int(match[1]) * _PERIOD_MS[match[2]]


def _label_of(mailbox: Mailbox, key: str, value: str) -> str:
    if key in ("in", "is") and value.lower() in _IN_LABELS:
        return _IN_LABELS[value.lower()]
    if key == "label":
        for label_id, name in mailbox.user_labels.items():
            if value.lower() in (label_id.lower(), name.lower()):
                return label_id
        return value.upper()
    raise BadRequest(f"fake Gmail does not implement {key}:{value}")


# -- history.list ----------------------------------------------------------------
class HistoryTooOld(Exception):
    """startHistoryId lies before the retained window: Gmail answers 404."""


def list_history(
    mailbox: Mailbox,
    *,
    start_history_id: str | None,
    history_types: list[str],
    label_id: str | None,
    max_results: str | None,
    page_token: str | None,
) -> dict[str, object]:
    if not start_history_id:
        raise BadRequest("Required parameter: startHistoryId")
    try:
        start = int(start_history_id)
    except ValueError as exc:
        raise BadRequest(f"Invalid startHistoryId: {start_history_id!r}") from exc
    unknown = set(history_types) - HISTORY_TYPES
    if unknown:
        raise BadRequest(f"Invalid historyTypes: {sorted(unknown)}")
    size = page_size(max_results)
    if start < mailbox.history_floor:
        raise HistoryTooOld
    if page_token:
        resume = decode_token(page_token)
        if not isinstance(resume, int):
            raise BadRequest("Invalid pageToken")
        start = max(start, resume)
    wanted = {_TYPE_KEYS[t] for t in history_types} or None
    records = [r for r in mailbox.history_after(start) if _matches(r, wanted, label_id)]
    page = records[:size]
    out: dict[str, object] = {"historyId": str(mailbox.history_id)}
    if page:
        out["history"] = [r.as_json(wanted) for r in page]
    if len(records) > size:
        out["nextPageToken"] = encode_token(page[-1].id)
    return out


def _matches(record: HistoryRecord, wanted: set[str] | None, label_id: str | None) -> bool:
    if wanted is not None and wanted.isdisjoint(record.types):
        return False
    return label_id is None or label_id in record.labels_touched
