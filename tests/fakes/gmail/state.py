"""What the fake Gmail stores: mailboxes, messages, labels and the history log.

Facts from the Gmail API reference and sync guide
(https://developers.google.com/gmail/api/guides/sync,
https://developers.google.com/gmail/api/reference/rest/v1/users.history/list):

- every change to a mailbox appends a history record and moves the mailbox's
  historyId forward; "History IDs increase chronologically but are not contiguous
  with random gaps in between valid IDs", so the gaps here are random (seeded);
- a message's historyId is the id of the last record that touched it;
- history is retained for a limited window ("typically valid for at least a
  week, but in some rare circumstances may be valid for only a few hours"); a
  startHistoryId older than the window answers 404. `history_retention` (records
  kept) and `expire_history()` make that window small on purpose;
- a deleted message stays in history (messagesAdded of an id that
  messages.get then answers 404 for);
- while a users.watch lives, every change that touches a watched label is
  published to the topic as {emailAddress, historyId} (push guide,
  "Receiving notifications"); a watch lapses at its `expiration` ("You must
  re-call watch at least every 7 days or else you will stop receiving updates")
  and publishes nothing after it. `Mailbox.published` is what Pub/Sub would
  deliver; a test hands it to the daemon (the fake does not push by itself).
"""

from __future__ import annotations

import bisect
import email.utils
import random
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# System label ids (https://developers.google.com/gmail/api/guides/labels).
SYSTEM_LABELS = (
    "INBOX",
    "SPAM",
    "TRASH",
    "UNREAD",
    "STARRED",
    "IMPORTANT",
    "SENT",
    "DRAFT",
    "CHAT",
    "CATEGORY_PERSONAL",
    "CATEGORY_SOCIAL",
    "CATEGORY_PROMOTIONS",
    "CATEGORY_UPDATES",
    "CATEGORY_FORUMS",
)
DEFAULT_LABELS = ("INBOX", "UNREAD")
HISTORY_ID_START = 100_000  # arbitrary; real ids are large decimal strings
HISTORY_GAP_MAX = 7  # random gaps 1..7 between ids (sync guide: "not contiguous")
FALLBACK_DATE_MS = 1_700_000_000_000  # internalDate when the Date header is missing or bad


@dataclass
class Message:
    id: str
    thread_id: str
    raw: bytes
    internal_date_ms: int
    label_ids: list[str]
    history_id: int
    message_id_header: str | None = None

    def ref(self) -> dict[str, object]:
        """The {id, threadId, labelIds} message reference history records carry."""
        return {"id": self.id, "threadId": self.thread_id, "labelIds": list(self.label_ids)}


@dataclass
class HistoryRecord:
    """One users.history record: `types` maps messagesAdded/… to its entries."""

    id: int
    message: dict[str, object]
    types: dict[str, list[dict[str, object]]]
    labels_touched: frozenset[str]

    def as_json(self, wanted_types: set[str] | None) -> dict[str, object]:
        out: dict[str, object] = {
            "id": str(self.id),
            "messages": [{"id": self.message["id"], "threadId": self.message["threadId"]}],
        }
        for key, entries in self.types.items():
            if wanted_types is None or key in wanted_types:
                out[key] = entries
        return out


@dataclass
class Watch:
    topic_name: str
    label_ids: list[str]
    label_filter_behavior: str
    expiration_ms: int
    history_id: int

    def publishes(self, labels: Iterable[str], now_ms: int) -> bool:
        """Whether a change touching `labels` is published at `now_ms` (users.watch
        reference: labelIds with labelFilterBehavior include/exclude; none: all)."""
        if now_ms >= self.expiration_ms:
            return False
        if not self.label_ids:
            return True
        touched = set(labels) & set(self.label_ids)
        return bool(touched) if self.label_filter_behavior == "include" else not touched


@dataclass
class Mailbox:
    """One user's mailbox; every mutation appends history and bumps `history_id`."""

    email: str
    seed: int = 0
    history_retention: int | None = None
    messages: dict[str, Message] = field(default_factory=dict)
    history: list[HistoryRecord] = field(default_factory=list)
    user_labels: dict[str, str] = field(default_factory=dict)  # id -> name
    watch: Watch | None = None
    history_id: int = 0
    # startHistoryId values below this answer 404 (records at or below it are gone).
    history_floor: int = 0
    # Notifications Pub/Sub would deliver ({emailAddress, historyId}), oldest first.
    published: list[dict[str, str]] = field(default_factory=list)
    # listing.py's sorted messages.list results, keyed by (history_id, query).
    list_cache: dict[tuple[int, Any], tuple[list[Message], list[tuple[int, int]]]] = field(
        default_factory=dict, repr=False
    )

    def __post_init__(self) -> None:
        self._rng = random.Random(zlib.crc32(self.email.encode()) ^ self.seed)
        self.history_id = HISTORY_ID_START + self._rng.randint(0, 999)
        self.history_floor = self.history_id
        self._next_id = (zlib.crc32(self.email.encode()) << 28) | 0x1800_0000_0000_0000
        self._fallback_dates = 0

    # -- seeding ---------------------------------------------------------------
    def add_message(
        self,
        raw: bytes,
        *,
        label_ids: Iterable[str] = DEFAULT_LABELS,
        internal_date_ms: int | None = None,
        thread_id: str | None = None,
    ) -> Message:
        """Deliver `raw` (byte-exact) into the mailbox; appends a messagesAdded record."""
        headers = _headers(raw)
        self._next_id += self._rng.randint(1, 4096)
        message_id = f"{self._next_id:016x}"
        if internal_date_ms is None:
            internal_date_ms = self._date_of(headers.get("Date"))
        msgid_header = (headers.get("Message-ID") or "").strip() or None
        message = Message(
            id=message_id,
            thread_id=thread_id or self._thread_of(headers) or message_id,
            raw=raw,
            internal_date_ms=internal_date_ms,
            label_ids=list(dict.fromkeys(label_ids)),
            history_id=0,
            message_id_header=msgid_header,
        )
        self.messages[message_id] = message
        self._record(message, {"messagesAdded": [{"message": message.ref()}]}, message.label_ids)
        return message

    def add_files(
        self, paths: Iterable[Path | str], *, label_ids: Iterable[str] = DEFAULT_LABELS
    ) -> list[Message]:
        """Seed from raw MIME files (tests/corpus/mime is read, never written)."""
        labels = tuple(label_ids)
        return [self.add_message(Path(p).read_bytes(), label_ids=labels) for p in paths]

    def add_generated(self, count: int, *, size_bytes: int = 2_000) -> list[Message]:
        """`count` small deterministic RFC 5322 messages (for benchmarks, not MIME tests)."""
        tag = zlib.crc32(self.email.encode())
        added = []
        for n in range(count):
            date = email.utils.formatdate(FALLBACK_DATE_MS / 1000 + n * 60)
            body = f"line {n} of a generated body\r\n" * max(1, size_bytes // 32)
            raw = (
                f"From: sender{n % 17}@example.org\r\nTo: {self.email}\r\n"
                f"Subject: generated {n}\r\nDate: {date}\r\n"
                f"Message-ID: <gen-{n}.{tag}@fake.example>\r\nMIME-Version: 1.0\r\n"
                f"Content-Type: text/plain; charset=us-ascii\r\n\r\n{body}"
            )
            added.append(self.add_message(raw.encode("ascii")))
        return added

    # -- changes ---------------------------------------------------------------
    def delete_message(self, message_id: str) -> None:
        """Permanent delete (users.messages.delete): a messagesDeleted record."""
        message = self.messages.pop(message_id)
        self._record(message, {"messagesDeleted": [{"message": message.ref()}]}, message.label_ids)

    def modify_labels(
        self, message_id: str, add: Iterable[str] = (), remove: Iterable[str] = ()
    ) -> None:
        """users.messages.modify: one record with labelsAdded and/or labelsRemoved."""
        message = self.messages[message_id]
        added = [label for label in dict.fromkeys(add) if label not in message.label_ids]
        removed = [label for label in dict.fromkeys(remove) if label in message.label_ids]
        if not added and not removed:
            return  # Gmail records nothing for a no-op modify
        message.label_ids = [x for x in message.label_ids if x not in removed] + added
        types: dict[str, list[dict[str, object]]] = {}
        if added:
            types["labelsAdded"] = [{"message": message.ref(), "labelIds": added}]
        if removed:
            types["labelsRemoved"] = [{"message": message.ref(), "labelIds": removed}]
        self._record(message, types, [*message.label_ids, *removed])

    def trash(self, message_id: str) -> None:
        """users.messages.trash: TRASH added, INBOX removed (a label change, not a delete)."""
        self.modify_labels(message_id, add=["TRASH"], remove=["INBOX"])

    def create_label(self, name: str) -> str:
        label_id = f"Label_{len(self.user_labels) + 1}"
        self.user_labels[label_id] = name
        return label_id

    def expire_history(self, through: int | None = None) -> None:
        """Forget history up to `through` (default: all of it), so older starts answer 404."""
        through = self.history_id if through is None else through
        self.history = [r for r in self.history if r.id > through]
        self.history_floor = max(self.history_floor, through)

    # -- reading ---------------------------------------------------------------
    def history_after(self, start: int) -> list[HistoryRecord]:
        """Records with id > start, oldest first (the log is kept in id order)."""
        return self.history[bisect.bisect_right(self.history, start, key=lambda r: r.id) :]

    # -- internals -------------------------------------------------------------
    def _record(
        self,
        message: Message,
        types: dict[str, list[dict[str, object]]],
        labels: Iterable[str],
    ) -> None:
        self.history_id += self._rng.randint(1, HISTORY_GAP_MAX)
        message.history_id = self.history_id
        touched = frozenset(labels)
        self.history.append(HistoryRecord(self.history_id, message.ref(), types, touched))
        if self.watch is not None and self.watch.publishes(touched, int(time.time() * 1000)):
            self.published.append({"emailAddress": self.email, "historyId": str(self.history_id)})
        if self.history_retention is not None and len(self.history) > self.history_retention:
            dropped = self.history[: len(self.history) - self.history_retention]
            self.history = self.history[len(dropped) :]
            self.history_floor = max(self.history_floor, dropped[-1].id)

    def _date_of(self, value: str | None) -> int:
        try:
            parsed = email.utils.parsedate_to_datetime(value) if value else None
        except (TypeError, ValueError, IndexError):
            parsed = None
        if parsed is not None and parsed.tzinfo is not None:
            return int(parsed.timestamp() * 1000)
        self._fallback_dates += 1
        return FALLBACK_DATE_MS + self._fallback_dates * 1000

    def _thread_of(self, headers: dict[str, str]) -> str | None:
        # Gmail threads a reply with the message its In-Reply-To/References names.
        wanted = (headers.get("In-Reply-To") or "") + " " + (headers.get("References") or "")
        ids = {token for token in wanted.split() if token.startswith("<")}
        if not ids:
            return None
        for message in reversed(self.messages.values()):
            if message.message_id_header in ids:
                return message.thread_id
        return None


def header_list(raw: bytes) -> list[tuple[str, str]]:
    """The header fields of `raw`, in order, unfolded (RFC 5322 §2.2.3), decoded
    leniently; never raises. A plain scan: seeding a benchmark mailbox calls it per message."""
    end = len(raw)
    for sep in (b"\r\n\r\n", b"\n\n"):
        pos = raw.find(sep, 0, end)
        if pos != -1:
            end = pos
    fields: list[tuple[str, str]] = []
    for line in raw[:end].decode("utf-8", errors="replace").splitlines():
        if line[:1] in (" ", "\t") and fields:
            name, value = fields[-1]
            fields[-1] = (name, value + " " + line.strip())
            continue
        name, colon, value = line.partition(":")
        if colon and name and " " not in name:
            fields.append((name, value.strip()))
    return fields


def _headers(raw: bytes) -> dict[str, str]:
    headers: dict[str, str] = {}
    for name, value in header_list(raw):
        headers.setdefault(_canonical(name), value)
    return headers


def _canonical(name: str) -> str:
    lowered = name.lower()
    return {"message-id": "Message-ID", "in-reply-to": "In-Reply-To"}.get(
        lowered, "-".join(part.capitalize() for part in lowered.split("-"))
    )
