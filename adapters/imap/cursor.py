"""The cursor of an IMAP mailbox: one position per synced folder, as JSON.

    {"v": 1, "folders": {"INBOX": {"uidvalidity": 1733, "last_uid": 4521,
                                   "modseq": 90210}}}

`last_uid`: every UID up to it is settled (stored or recorded dead). A folder
absent from the cursor has not finished its first sync. `modseq` is the
folder's HIGHESTMODSEQ at that point, where the server offers CONDSTORE.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

__all__ = ["FolderCursor", "dump_cursor", "load_cursor"]

_VERSION = 1


@dataclass(frozen=True, slots=True)
class FolderCursor:
    uidvalidity: int
    last_uid: int
    modseq: int | None = None


def load_cursor(cursor: str | None) -> dict[str, FolderCursor]:
    """The folders' positions; {} for None. A cursor we cannot read is {} too: the
    resync it causes is idempotent, and a corrupt cursor must not stop a mailbox."""
    if not cursor:
        return {}
    try:
        document = orjson.loads(cursor)
        folders = document["folders"] if document.get("v") == _VERSION else {}
        return {
            name: FolderCursor(
                int(f["uidvalidity"]), int(f["last_uid"]), _optional_int(f.get("modseq"))
            )
            for name, f in folders.items()
        }
    except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError):
        return {}


def dump_cursor(folders: dict[str, FolderCursor]) -> str:
    return orjson.dumps(
        {
            "v": _VERSION,
            "folders": {
                name: {"uidvalidity": f.uidvalidity, "last_uid": f.last_uid, "modseq": f.modseq}
                for name, f in sorted(folders.items())
            },
        }
    ).decode()


def _optional_int(value: object) -> int | None:
    return None if value is None else int(value)  # type: ignore[call-overload]
