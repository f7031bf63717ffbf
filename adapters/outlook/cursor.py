"""The Outlook door's cursor: one delta position per synced folder, in one string.

    {"v": 1, "folders": {"inbox": {"link": "https://graph…/delta?$deltatoken=…",
                                   "since": "2026-11-02T09:30:00Z"},
                         "sentitems": {"link": "https://graph…/delta?$skiptoken=…",
                                       "first": true, "since": "all"}}}

A folder's position is the URL to call next (Graph's delta query overview: "the
state token is encoded in the nextLink or deltaLink URL"):

    absent            no round yet: the next run starts a fresh round (with the
                      backfill filter), its pages flagged `backfill`
    link, first=true  in the middle of the folder's first round (a nextLink)
    link              a deltaLink (the round ended), or a nextLink of a later round
    since only        the folder's state expired: the next run starts a fresh round
                      with the same bound as the expired one (flagged `backfill`
                      only if the expired one was still the first round)

`since` is the `receivedDateTime ge` bound the folder's first round was started
with ("all": none), fixed when that round starts and kept for good: a delta round
reports only what its query admits, so a fresh round after an expiry must ask with
the same bound to cover everything the expired state would have reported — the
mail that arrived while the cursor was stale included (issue 22 item 3: with
`backfill = "none"` a bound of "now" at the reset lost it). Messages already
stored are listed again but not downloaded (source.py). A position written
before `since` existed expires to "all", flagged `backfill`: listing the whole
folder never loses mail; it may store older mail once, without an event for each.

Folders are independent: when one folder's state expires (410 Gone), only that
folder restarts (`without`), the others keep their links. The runner writes the
whole string after each settled page, so a crash resumes every folder exactly
where its last settled page ended. Folders no longer configured are dropped;
newly configured ones start fresh.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

import orjson

__all__ = ["ALL", "DeltaCursor", "FolderPosition", "bound_of"]

CURSOR_VERSION = 1
#: `since` of a folder whose rounds have no receivedDateTime bound (backfill "all").
ALL = "all"


@dataclass(frozen=True, slots=True)
class FolderPosition:
    """Where a folder's delta sync goes on: `link` to call next (None: start a fresh
    round), `first` while that link is inside the folder's first round, `since` the
    bound its rounds were started with (module docstring; None: not known yet)."""

    link: str | None = None
    first: bool = True
    since: str | None = None

    @property
    def since_time(self) -> datetime | None:
        """`since` as the fresh round's `receivedDateTime ge` bound (None: no bound)."""
        if self.since is None or self.since == ALL:
            return None
        return datetime.fromisoformat(self.since.replace("Z", "+00:00"))


@dataclass(frozen=True, slots=True)
class DeltaCursor:
    """Every synced folder's position (module docstring)."""

    folders: Mapping[str, FolderPosition] = field(default_factory=dict)

    @classmethod
    def decode(cls, text: str | None, folders: Iterable[str]) -> DeltaCursor:
        """The positions of `folders` in `text` (None: none yet). A cursor this door
        cannot read is an expired one: every folder starts fresh."""
        stored: dict[str, FolderPosition] = {}
        if text:
            stored = _read(text)
        return cls({f: stored.get(f, FolderPosition()) for f in folders})

    def encode(self) -> str:
        folders: dict[str, dict[str, object]] = {}
        for name, pos in sorted(self.folders.items()):
            if pos.link is None and pos.since is None:
                continue
            entry: dict[str, object] = {} if pos.link is None else {"link": pos.link}
            if pos.first:
                entry["first"] = True
            if pos.since is not None:
                entry["since"] = pos.since
            folders[name] = entry
        return orjson.dumps({"v": CURSOR_VERSION, "folders": folders}).decode()

    def at(self, folder: str, link: str, *, first: bool) -> DeltaCursor:
        """This cursor with `folder` moved to `link` (its bound kept)."""
        since = self.folders[folder].since if folder in self.folders else None
        position = FolderPosition(link, first, since)
        return replace(self, folders={**self.folders, folder: position})

    def bounded(self, folder: str, since: str) -> DeltaCursor:
        """This cursor with `folder`'s rounds bound by `since` (a fresh round starts)."""
        position = replace(self.folders.get(folder, FolderPosition()), since=since)
        return replace(self, folders={**self.folders, folder: position})

    def without(self, folder: str, since: str | None = None) -> DeltaCursor:
        """This cursor with `folder`'s state expired: a fresh round with the bound the
        folder had (`since` when the caller knows a newer one; "all" when a link
        older than bounds expires). A folder that never started stays fresh."""
        old = self.folders.get(folder, FolderPosition())
        bound = since or old.since
        if bound is not None:
            position = FolderPosition(None, old.first, bound)
        elif old.link is not None:
            # a link older than bounds: the whole folder, as a backfill (it may hold
            # years of mail never stored: no event for each)
            position = FolderPosition(None, True, ALL)
        else:
            position = FolderPosition()  # never started: its first round, as configured
        return replace(self, folders={**self.folders, folder: position})


def bound_of(moment: datetime | None) -> str:
    """The `since` of a round bound by `moment` (None: "all"), to the second, as
    Graph's $filter takes it."""
    if moment is None:
        return ALL
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _read(text: str) -> dict[str, FolderPosition]:
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError:
        return {}
    if not isinstance(data, dict) or data.get("v") != CURSOR_VERSION:
        return {}
    folders = data.get("folders")
    if not isinstance(folders, dict):
        return {}
    out: dict[str, FolderPosition] = {}
    for name, entry in folders.items():
        if not isinstance(entry, dict):
            continue
        link = entry.get("link") if isinstance(entry.get("link"), str) else None
        since = _since(entry.get("since"))
        if link is not None or since is not None:
            out[name] = FolderPosition(link, entry.get("first") is True, since)
    return out


def _since(value: object) -> str | None:
    if value == ALL:
        return ALL
    if not isinstance(value, str):
        return None
    try:
        datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return value
