"""What the ingest stage answers for each item of a batch (adapters/base.py relies on it)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Outcome(StrEnum):
    """Per-item result of the dedup cascade.

    new: stored as a new message.  merged: another sighting of a stored message
    (a copy row was added, provider fields may have been promoted).
    duplicate: already stored from this very copy; nothing written.
    conflict: same Message-ID as a stored message but different content; stored
    as its own row and recorded in ingest_conflicts.
    retriable_failure: nothing written for it; the producer must not move its
    cursor past it and should retry.  permanent_failure: recorded as a dead
    item; it does not pin the cursor.
    """

    NEW = "new"
    MERGED = "merged"
    DUPLICATE = "duplicate"
    CONFLICT = "conflict"
    RETRIABLE_FAILURE = "retriable_failure"
    PERMANENT_FAILURE = "permanent_failure"


#: Outcomes after which a producer may advance its cursor past the item.
SETTLED = frozenset(
    {Outcome.NEW, Outcome.MERGED, Outcome.DUPLICATE, Outcome.CONFLICT, Outcome.PERMANENT_FAILURE}
)


@dataclass(slots=True)
class ItemResult:
    """Outcome of one item; `message_id` is the row it became or matched."""

    index: int
    outcome: Outcome
    message_id: int | None = None
    detail: str | None = None


def page_is_clean(results: list[ItemResult]) -> bool:
    """True when a cursor may move past the page these results belong to."""
    return all(r.outcome in SETTLED for r in results)
