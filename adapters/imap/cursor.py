"""The cursor of an IMAP mailbox: one position per synced folder, as JSON.

    {"v": 1, "folders": {"INBOX": {"uidvalidity": 1733, "last_uid": 4521,
                                   "modseq": 90210}}}

`last_uid`: every UID up to it is settled (stored or recorded dead). A folder
absent from the cursor has not finished its first sync. `modseq` is the
folder's HIGHESTMODSEQ at that point, where the server offers CONDSTORE.

    "retired": {"Archive": 1701}

a folder whose UIDVALIDITY changed and is being read again: once that is done,
the copies stored under the old UIDVALIDITY are recorded as gone (their UIDs
address nothing any more) and the entry is dropped.

    "reread": ["Archive"]

a folder whose position was reset (a UIDVALIDITY change, a server that forgot
its modseq or UIDs): it is read in full (ALL), whatever `backfill` says, until
it has a position again.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

__all__ = ["FolderCursor", "dump_cursor", "load_cursor", "load_reread", "load_retired"]

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


def load_retired(cursor: str | None) -> dict[str, int]:
    """Folders being read again after a UIDVALIDITY change → their old UIDVALIDITY."""
    if not cursor:
        return {}
    try:
        document = orjson.loads(cursor)
        return {str(k): int(v) for k, v in document.get("retired", {}).items()}
    except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
        return {}


def load_reread(cursor: str | None) -> set[str]:
    """Folders whose position was reset: read in full until they have one again."""
    if not cursor:
        return set()
    try:
        return {str(name) for name in orjson.loads(cursor).get("reread", [])}
    except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
        return set()


def dump_cursor(
    folders: dict[str, FolderCursor],
    retired: dict[str, int] | None = None,
    reread: set[str] | None = None,
) -> str:
    document: dict[str, object] = {
        "v": _VERSION,
        "folders": {
            name: {"uidvalidity": f.uidvalidity, "last_uid": f.last_uid, "modseq": f.modseq}
            for name, f in sorted(folders.items())
        },
    }
    if retired:
        document["retired"] = dict(sorted(retired.items()))
    if reread:
        document["reread"] = sorted(reread - folders.keys())
    return orjson.dumps(document).decode()


def _optional_int(value: object) -> int | None:
    return None if value is None else int(value)  # type: ignore[call-overload]
