"""The ingest stage's bookkeeping: one batch's working state and its results.

`IngestPlan` is what a batch learns inside its transaction, per message item
(index `k` into `items`): the cascade's decision, or for an in-batch follower
its leader and outcome; the message row it ended on; where its bytes went; and
why it failed, if it did. From the plan (and the batch's dead items) come the
per-item results, one per batch position, in batch order, and the one
mailbox.sync_completed event a backfill writes instead of per-message events.

``ingest.py`` fills the plan (with ``pipeline/ingest/objects.py`` and ``pipeline/ingest/write.py``);
nothing here touches the database.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inboxd.pipeline.cascade import Decision
from inboxd.pipeline.ingest.objects import AttachmentState, DeadRawKeys
from inboxd.pipeline.message import DeadItem, MessageData
from inboxd.pipeline.outbox import EventBuffer
from inboxd.pipeline.outcomes import ItemResult, Outcome


@dataclass(slots=True)
class IngestPlan:
    """Working state of one batch inside its transaction."""

    items: list[MessageData]
    positions: list[int]  # batch index of each message item
    decisions: dict[int, Decision] = field(default_factory=dict)
    followers: dict[int, tuple[int, Outcome]] = field(default_factory=dict)
    message_ids: dict[int, int] = field(default_factory=dict)
    raw_keys: dict[int, str] = field(default_factory=dict)
    html_keys: dict[int, str] = field(default_factory=dict)
    att_state: dict[int, AttachmentState] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)

    def outcome_of(self, k: int) -> Outcome:
        """Message item k's outcome: its own decision, or as its in-batch leader's follower."""
        if k in self.followers:
            _lead, outcome = self.followers[k]
            return outcome
        return self.decisions[k].outcome

    def all_duplicate(self) -> bool:
        """Every message item is a duplicate with nothing to retry: nothing to write."""
        return all(
            d.outcome is Outcome.DUPLICATE and not d.retry_attachments
            for d in self.decisions.values()
        ) and all(o is Outcome.DUPLICATE for _, o in self.followers.values())


def results_all_duplicate(plan: IngestPlan) -> list[ItemResult]:
    """Results of a batch whose every item is a duplicate (`IngestPlan.all_duplicate`)."""
    out: list[ItemResult] = []
    for k, pos in enumerate(plan.positions):
        lead = plan.followers[k][0] if k in plan.followers else k
        out.append(ItemResult(pos, Outcome.DUPLICATE, plan.decisions[lead].existing_id))
    return out


def assemble_results(
    size: int,
    plan: IngestPlan,
    deads: list[tuple[int, DeadItem]],
    dead_keys: DeadRawKeys,
) -> list[ItemResult]:
    """One ItemResult per position of a batch of `size` items, in batch order."""
    results: list[ItemResult | None] = [None] * size
    for k, pos in enumerate(plan.positions):
        if k in plan.failures:
            results[pos] = ItemResult(pos, Outcome.RETRIABLE_FAILURE, detail=plan.failures[k])
            continue
        outcome = plan.outcome_of(k)
        results[pos] = ItemResult(
            pos,
            outcome,
            plan.message_ids.get(k) or plan.decisions.get(k, Decision(outcome)).existing_id,
        )
    for i, dead in deads:
        if i in dead_keys.failed:
            results[i] = ItemResult(
                i, Outcome.RETRIABLE_FAILURE, detail="raw bytes of a dead item not stored"
            )
        else:
            results[i] = ItemResult(
                i, Outcome.PERMANENT_FAILURE, detail=f"{dead.reason}: {dead.detail}"
            )
    return [r for r in results if r is not None]


def add_backfill_event(results: list[ItemResult], events: EventBuffer) -> None:
    """A backfill's one event instead of one per message, when it stored anything."""
    counts: dict[str, int] = {}
    for r in results:
        counts[r.outcome.value] = counts.get(r.outcome.value, 0) + 1
    if counts.get("new") or counts.get("merged") or counts.get("conflict"):
        events.add("mailbox.sync_completed", payload={"outcomes": counts})
