"""The Outlook door's cursor: one delta position per synced folder, in one string.

    {"v": 1, "folders": {"inbox": {"link": "https://graph…/delta?$deltatoken=…"},
                         "sentitems": {"link": "https://graph…/delta?$skiptoken=…",
                                       "first": true}}}

A folder's position is the URL to call next (Graph's delta query overview: "the
state token is encoded in the nextLink or deltaLink URL"):

    absent            no round yet: the next run starts a fresh round (with the
                      backfill filter), its pages flagged `backfill`
    link, first=true  in the middle of the folder's first round (a nextLink)
    link              a deltaLink (the round ended), or a nextLink of a later round

Folders are independent: when one folder's state expires (410 Gone), only that
folder restarts (`without`), the others keep their links. The runner writes the
whole string after each settled page, so a crash resumes every folder exactly
where its last settled page ended. Folders no longer configured are dropped;
newly configured ones start fresh.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

import orjson

__all__ = ["DeltaCursor", "FolderPosition"]

CURSOR_VERSION = 1


@dataclass(frozen=True, slots=True)
class FolderPosition:
    """Where a folder's delta sync goes on: `link` to call next (None: start a fresh
    round), `first` while that link is inside the folder's first round."""

    link: str | None = None
    first: bool = True


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
        folders = {
            name: ({"link": pos.link, "first": True} if pos.first else {"link": pos.link})
            for name, pos in sorted(self.folders.items())
            if pos.link is not None
        }
        return orjson.dumps({"v": CURSOR_VERSION, "folders": folders}).decode()

    def at(self, folder: str, link: str, *, first: bool) -> DeltaCursor:
        """This cursor with `folder` moved to `link`."""
        return replace(self, folders={**self.folders, folder: FolderPosition(link, first)})

    def without(self, folder: str) -> DeltaCursor:
        """This cursor with `folder` starting a fresh round."""
        return replace(self, folders={**self.folders, folder: FolderPosition()})


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
        if isinstance(entry, dict) and isinstance(entry.get("link"), str):
            out[name] = FolderPosition(entry["link"], entry.get("first") is True)
    return out
