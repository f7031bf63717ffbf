"""What the fake Graph stores: users, their mail folders, messages and the change log.

Facts imitated (Microsoft Graph v1.0 mail API):
- well-known folder names (`inbox`, `sentitems`, `deleteditems`, `archive`,
  `drafts`) work in place of a folder id in paths ("mailFolder resource type",
  well-known folder names); every folder also has an opaque id (parentFolderId);
- every message has a REST id and an immutable id ("Obtain immutable
  identifiers for Outlook resources"): the REST id CHANGES when the message is
  moved to another folder, the immutable id does not. Which one the API shows
  depends on the request's `Prefer: IdType="ImmutableId"` (api.py);
- `$value` serves the message's MIME bytes exactly as stored;
- conversationId groups a thread: here one stable id per References /
  In-Reply-To root Message-ID (Outlook derives it from the thread's root too);
- the change log (a sequence number per mutation, removals kept per folder) is
  what delta.py answers rounds from.
"""

from __future__ import annotations

import base64
import email.utils
import hashlib
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.header import decode_header, make_header
from pathlib import Path

# Well-known folder name -> displayName ("mailFolder resource type").
WELL_KNOWN_FOLDERS = {
    "inbox": "Inbox",
    "sentitems": "Sent Items",
    "deleteditems": "Deleted Items",
    "archive": "Archive",
    "drafts": "Drafts",
}
FALLBACK_RECEIVED = datetime(2026, 1, 1, tzinfo=UTC)  # when Date is missing or bad


def opaque_id(prefix: str, *parts: object) -> str:
    """A deterministic id that looks like Exchange's base64 ids (ends in '=')."""
    digest = hashlib.sha256("|".join(str(p) for p in parts).encode()).digest()
    return prefix + base64.urlsafe_b64encode(digest[:31] + b"\0").decode()[:-1] + "="


@dataclass
class Folder:
    id: str
    well_known: str
    display_name: str


@dataclass
class Message:
    immutable_id: str
    rest_id: str
    folder_id: str
    raw: bytes
    subject: str
    from_name: str
    from_address: str
    internet_message_id: str | None
    conversation_id: str
    received: datetime
    is_read: bool = False
    version: int = 1  # bumped by every change (changeKey / @odata.etag)
    entered_seq: int = 0  # the change that put it in its current folder
    changed_seq: int = 0  # the last change that touched it
    moves: int = 0

    @property
    def change_key(self) -> str:
        return base64.b64encode(f"{self.immutable_id[-12:]}:{self.version}".encode()).decode()


@dataclass
class Removal:
    """A message left `folder_id` at `seq` (moved out, or deleted when `hard`)."""

    seq: int
    folder_id: str
    rest_id: str
    immutable_id: str
    hard: bool


ChangeListener = Callable[["Mailbox", Message, str], None]


@dataclass
class Mailbox:
    """One user (UPN/address and a GUID id) and their mailbox."""

    address: str
    id: str = field(default_factory=lambda: str(uuid.uuid4()))
    has_mailbox: bool = True
    folders: dict[str, Folder] = field(default_factory=dict)  # by folder id
    messages: dict[str, Message] = field(default_factory=dict)  # by immutable id
    rest_index: dict[str, str] = field(default_factory=dict)  # rest id -> immutable id
    removals: list[Removal] = field(default_factory=list)
    seq: int = 0
    # delta tokens issued before this seq (per folder id) answer "expired"
    token_floor: dict[str, int] = field(default_factory=dict)
    listeners: list[ChangeListener] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        for name, display in WELL_KNOWN_FOLDERS.items():
            folder = Folder(opaque_id("AQMkAD", self.address, name), name, display)
            self.folders[folder.id] = folder
        self._serial = 0

    # -- lookups ---------------------------------------------------------------
    def folder(self, name_or_id: str) -> Folder | None:
        """A folder by well-known name (case-insensitive) or by id."""
        if name_or_id in self.folders:
            return self.folders[name_or_id]
        wanted = name_or_id.lower()
        return next((f for f in self.folders.values() if f.well_known == wanted), None)

    def find(self, message_id: str) -> Message | None:
        """A current message by REST id or immutable id (None once deleted or moved
        away from that REST id)."""
        immutable = self.rest_index.get(message_id, message_id)
        return self.messages.get(immutable)

    def in_folder(self, folder_id: str) -> list[Message]:
        return [m for m in self.messages.values() if m.folder_id == folder_id]

    # -- seeding ---------------------------------------------------------------
    def add_message(
        self,
        raw: bytes,
        *,
        folder: str = "inbox",
        received: datetime | str | None = None,
        is_read: bool = False,
    ) -> Message:
        """Deliver `raw` (kept byte-exact) into `folder`; a `created` change."""
        target = self._folder_or_raise(folder)
        headers = header_map(raw)
        self._serial += 1
        immutable = opaque_id("AAkALg", self.address, "imm", self._serial)
        message = Message(
            immutable_id=immutable,
            rest_id=opaque_id("AAMkAD", self.address, "rest", immutable, 0),
            folder_id=target.id,
            raw=raw,
            subject=_decoded(headers.get("subject", "")),
            from_name="",
            from_address="",
            internet_message_id=headers.get("message-id") or None,
            conversation_id=self._conversation_of(headers),
            received=_received(received, headers.get("date")),
            is_read=is_read,
        )
        message.from_name, message.from_address = email.utils.parseaddr(
            _decoded(headers.get("from", ""))
        )
        self.messages[immutable] = message
        self.rest_index[message.rest_id] = immutable
        self.seq += 1
        message.entered_seq = message.changed_seq = self.seq
        self._tell(message, "created")
        return message

    def add_files(self, paths: Iterable[Path | str], *, folder: str = "inbox") -> list[Message]:
        """Seed from raw MIME files (tests/corpus/mime is read, never written)."""
        return [self.add_message(Path(p).read_bytes(), folder=folder) for p in paths]

    def add_generated(
        self, count: int, *, size_bytes: int = 2_000, folder: str = "inbox"
    ) -> list[Message]:
        """`count` small deterministic RFC 5322 messages (benchmarks, not MIME tests)."""
        tag = hashlib.sha1(self.address.encode()).hexdigest()[:8]  # noqa: S324 - a label
        added = []
        for n in range(count):
            date = email.utils.format_datetime(FALLBACK_RECEIVED + timedelta(minutes=n))
            body = f"line {n} of a generated body\r\n" * max(1, size_bytes // 32)
            raw = (
                f"From: sender{n % 17}@example.org\r\nTo: {self.address}\r\n"
                f"Subject: generated {n}\r\nDate: {date}\r\n"
                f"Message-ID: <gen-{n}.{tag}@fake.example>\r\nMIME-Version: 1.0\r\n"
                f"Content-Type: text/plain; charset=us-ascii\r\n\r\n{body}"
            )
            added.append(self.add_message(raw.encode("ascii"), folder=folder))
        return added

    # -- changes ---------------------------------------------------------------
    def move(self, message_id: str, to_folder: str) -> Message:
        """Move (POST /messages/{id}/move): a new REST id, the same immutable id."""
        message = self._message_or_raise(message_id)
        target = self._folder_or_raise(to_folder)
        if target.id == message.folder_id:
            return message
        self.seq += 1
        self.removals.append(
            Removal(self.seq, message.folder_id, message.rest_id, message.immutable_id, False)
        )
        del self.rest_index[message.rest_id]
        message.moves += 1
        message.rest_id = opaque_id(
            "AAMkAD", self.address, "rest", message.immutable_id, message.moves
        )
        self.rest_index[message.rest_id] = message.immutable_id
        message.folder_id = target.id
        message.version += 1
        message.entered_seq = message.changed_seq = self.seq
        self._tell(message, "created")
        return message

    def delete(self, message_id: str) -> None:
        """Permanent delete (DELETE /messages/{id} then purge): gone from every id."""
        message = self._message_or_raise(message_id)
        self.seq += 1
        self.removals.append(
            Removal(self.seq, message.folder_id, message.rest_id, message.immutable_id, True)
        )
        del self.messages[message.immutable_id]
        del self.rest_index[message.rest_id]
        self._tell(message, "deleted")

    def mark_read(self, message_id: str, is_read: bool = True) -> Message:
        """PATCH {"isRead": …}: an `updated` change (delta shows the item again)."""
        message = self._message_or_raise(message_id)
        if message.is_read != is_read:
            self.seq += 1
            message.is_read = is_read
            message.version += 1
            message.changed_seq = self.seq
            self._tell(message, "updated")
        return message

    def expire_delta_tokens(self, folder: str | None = None) -> None:
        """Every nextLink/deltaLink issued so far (for `folder`, default all) is gone."""
        folders = self.folders.values() if folder is None else [self._folder_or_raise(folder)]
        self.seq += 1
        for f in folders:
            self.token_floor[f.id] = self.seq

    # -- internals -------------------------------------------------------------
    def _tell(self, message: Message, change: str) -> None:
        for listener in list(self.listeners):
            listener(self, message, change)

    def _folder_or_raise(self, name_or_id: str) -> Folder:
        folder = self.folder(name_or_id)
        if folder is None:
            raise KeyError(f"{self.address} has no folder {name_or_id!r}")
        return folder

    def _message_or_raise(self, message_id: str) -> Message:
        message = self.find(message_id)
        if message is None:
            raise KeyError(f"{self.address} has no message {message_id!r}")
        return message

    def _conversation_of(self, headers: dict[str, str]) -> str:
        references = headers.get("references", "").split()
        reply_to = headers.get("in-reply-to", "").split()
        own = headers.get("message-id", "").split()
        chain = references or reply_to or own
        if chain:
            root = chain[0]
        else:
            self._serial += 1
            root = f"no-message-id-{self._serial}"
        return opaque_id("AAQkAD", self.address, "conversation", root)


def header_map(raw: bytes) -> dict[str, str]:
    """The first value of each header field of `raw` (lowercase names), unfolded
    (RFC 5322 §2.2.3), decoded leniently; never raises."""
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
            fields.append((name.lower(), value.strip()))
    out: dict[str, str] = {}
    for name, value in fields:
        out.setdefault(name, value)
    return out


def _decoded(value: str) -> str:
    """RFC 2047 encoded-words decoded; the raw text when they are malformed."""
    try:
        return str(make_header(decode_header(value)))
    except (ValueError, LookupError, UnicodeError):
        return value


def _received(given: datetime | str | None, date_header: str | None) -> datetime:
    if isinstance(given, datetime):
        return given.astimezone(UTC) if given.tzinfo else given.replace(tzinfo=UTC)
    if isinstance(given, str):
        return datetime.fromisoformat(given.replace("Z", "+00:00")).astimezone(UTC)
    try:
        parsed = email.utils.parsedate_to_datetime(date_header) if date_header else None
    except (TypeError, ValueError, IndexError):
        parsed = None
    if parsed is None or parsed.tzinfo is None:
        return FALLBACK_RECEIVED
    return parsed.astimezone(UTC)


def graph_datetime(value: datetime) -> str:
    """Graph's DateTimeOffset as mail resources show it: 2026-01-01T00:00:00Z."""
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
