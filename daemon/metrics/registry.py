"""Prometheus metrics of one inboxd process, served at `GET /metrics`.

`Metrics` owns its own `CollectorRegistry` rather than prometheus_client's global
one, so a test (or two daemons in one interpreter) can create as many as it
likes without "Duplicated timeseries" errors, and `/metrics` shows exactly what
inboxd records.

Every name starts with `inboxd_`. Label values are ids inboxd chose or read from
its own config (outcome, provider, tenant id, mailbox id, source name, route
template, method, status code): never an address, a token, a URL or anything
from a message, so nothing secret or personal ends up in a time series, and
cardinality stays bounded by the configuration (unmatched paths are counted
under one `route="unmatched"`).

Callers use the helper methods (`observe_outcomes`, `sync_started`, …) rather
than the collectors, so the label sets stay consistent in one place.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from inboxd.pipeline.extraction.review import Backlog
from inboxd.pipeline.outcomes import ItemResult, Outcome

__all__ = ["EXTRACTION_OUTCOMES", "HTTP_UNMATCHED_ROUTE", "Metrics"]

#: Route label for requests that matched no route (404/405): one series, not one per path.
HTTP_UNMATCHED_ROUTE = "unmatched"

# Request durations: health probes take ~1 ms, an attachment download or a slow
# database a few seconds. SSE streams are long-lived and are not timed.
_HTTP_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Sync runs: an idle incremental Gmail/Graph sync is under a second; a backfill
# page loop can run for an hour.
_SYNC_BUCKETS_S = (0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0)
#: What became of one claimed extraction job (`Metrics.extraction_finished`): the
#: result committed, a retryable failure (retry_wait), a terminal one or attempts
#: exhausted (needs_review), handed back at shutdown, or the lease lost (a late
#: commit that changed no row). A closed set: the label's cardinality stays fixed.
EXTRACTION_OUTCOMES = ("completed", "retry", "needs_review", "released", "lost")


class _CursorLag(Collector):
    """`inboxd_cursor_lag_seconds`, computed at scrape time: a gauge set only when
    a sync completes would read 0 for ever while a mailbox silently stops
    syncing."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "inboxd_cursor_lag_seconds",
            "Seconds since the mailbox's cursor last reached the provider's head.",
            labels=["tenant", "mailbox"],
        )
        for (tenant, mailbox), lag_s in sorted(self._metrics.cursor_lags().items()):
            family.add_metric([tenant, mailbox], lag_s)
        yield family


#: Mailbox states an operator acts on, each a gauge inboxd_mailbox_<state>.
OPERATOR_STATES = ("needs_attention", "needs_connect")


class _NeedsOperator(Collector):
    """`inboxd_mailbox_needs_attention` (an auth or config problem only an operator can
    fix) and `inboxd_mailbox_needs_connect` (configured, no credential yet: `inboxd
    connect`): 1 for each watched or flagged mailbox in that sync_state, else 0, so an
    alert can name the mailbox and a fixed one returns to 0 instead of vanishing."""

    def __init__(self, metrics: Metrics, state: str) -> None:
        self._metrics = metrics
        self._state = state

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            f"inboxd_mailbox_{self._state}",
            f"1 when the mailbox's sync_state is {self._state} (an operator's step), else 0.",
            labels=["tenant", "mailbox"],
        )
        flagged = self._metrics.flagged.get(self._state, set())
        watched = set(self._metrics.cursor_lags()) | flagged
        for tenant, mailbox in sorted(watched):
            family.add_metric([tenant, mailbox], 1.0 if (tenant, mailbox) in flagged else 0.0)
        yield family


class _ExtractionBacklog(Collector):
    """The extraction backlog gauges, rendered from the last reading of the jobs table
    (daemon/metrics/extraction.py): a snapshot replaced whole at each refresh, so a
    (tenant, processor) missing from the newest reading has no series any more."""

    _STATES = ("pending", "running", "retry_wait", "needs_review")

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[GaugeMetricFamily]:
        jobs = GaugeMetricFamily(
            "inboxd_extraction_jobs",
            "Extraction jobs not completed, by tenant, processor and state.",
            labels=["tenant", "processor", "state"],
        )
        due = GaugeMetricFamily(
            "inboxd_extraction_due",
            "Extraction jobs claimable now (pending or retry_wait due, expired leases).",
            labels=["tenant", "processor"],
        )
        oldest = GaugeMetricFamily(
            "inboxd_extraction_oldest_due_seconds",
            "How long the oldest claimable extraction job has waited (0 when none).",
            labels=["tenant", "processor"],
        )
        for (tenant, processor), b in sorted(self._metrics.extraction_backlog.items()):
            for state in self._STATES:
                jobs.add_metric([tenant, processor, state], float(getattr(b, state)))
            due.add_metric([tenant, processor], float(b.due))
            oldest.add_metric([tenant, processor], b.oldest_due_s)
        inbox = GaugeMetricFamily(
            "inboxd_extraction_inbox",
            "New messages handed to the extraction stage and not yet matched to processors.",
            labels=["tenant"],
        )
        inbox_age = GaugeMetricFamily(
            "inboxd_extraction_inbox_oldest_seconds",
            "Age of the oldest of those messages (the feeder's lag; 0 when none).",
            labels=["tenant"],
        )
        for tenant, (rows, age_s) in sorted(self._metrics.extraction_inbox.items()):
            inbox.add_metric([tenant], float(rows))
            inbox_age.add_metric([tenant], age_s)
        yield from (jobs, due, oldest, inbox, inbox_age)


class Metrics:
    """The process's collectors, in a registry of their own.

    Attributes are the prometheus_client collectors (public so a component can
    read them in tests); record through the methods.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ingest_items = Counter(
            "inboxd_ingest_items",
            "Items answered by the ingest stage, by outcome.",
            ["outcome"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "inboxd_queue_depth", "Items waiting in the bounded ingest queue.", registry=r
        )
        self.queue_capacity = Gauge(
            "inboxd_queue_capacity", "Capacity of the bounded ingest queue.", registry=r
        )
        self.sync_runs = Counter(
            "inboxd_sync_runs", "Mailbox sync runs started, by provider.", ["provider"], registry=r
        )
        self.sync_failures = Counter(
            "inboxd_sync_failures",
            "Mailbox sync runs that ended in an error, by provider.",
            ["provider"],
            registry=r,
        )
        self.sync_duration = Histogram(
            "inboxd_sync_duration_seconds",
            "Duration of finished sync runs, by provider.",
            ["provider"],
            buckets=_SYNC_BUCKETS_S,
            registry=r,
        )
        #: Unix time source of the cursor-lag collector (replaceable in tests).
        self.clock: Callable[[], float] = time.time
        # (tenant, mailbox) → when its cursor last reached the provider's head,
        # or when it was first watched if it has not since this process started.
        self._caught_up: dict[tuple[str, str], float] = {}
        r.register(_CursorLag(self))
        #: sync_state → (tenant, mailbox) in it at the last refresh, for the states an
        #: operator acts on (OPERATOR_STATES).
        self.flagged: dict[str, set[tuple[str, str]]] = {}
        for state in OPERATOR_STATES:
            r.register(_NeedsOperator(self, state))
        self.webhook_verification_failures = Counter(
            "inboxd_webhook_verification_failures",
            "Webhook requests rejected because their signature or token did not verify.",
            ["source"],
            registry=r,
        )
        self.delivery_events = Counter(
            "inboxd_delivery_events",
            "Delivery events received by webhook, by provider and whether they were new.",
            ["provider", "result"],
            registry=r,
        )
        self.dead_items = Counter(
            "inboxd_dead_items", "Items recorded as dead (permanent failures).", registry=r
        )
        self.http_requests = Counter(
            "inboxd_http_requests",
            "HTTP requests answered, by route template and status.",
            ["route", "method", "status"],
            registry=r,
        )
        self.http_duration = Histogram(
            "inboxd_http_request_duration_seconds",
            "Time to answer an HTTP request (SSE streams excluded), by route template.",
            ["route"],
            buckets=_HTTP_BUCKETS_S,
            registry=r,
        )
        self.sse_clients = Gauge(
            "inboxd_sse_clients", "Connected Server-Sent Events clients.", registry=r
        )
        self.sse_events_sent = Counter(
            "inboxd_sse_events_sent", "Events written to SSE clients.", registry=r
        )
        self.queue_door_messages = Counter(
            "inboxd_queue_door_messages",
            "Queue door (SES SQS) messages, by door and what happened: received, stored, "
            "duplicate, dead, unrouted, poison, left (for redelivery), released, deleted.",
            ["door", "what"],
            registry=r,
        )
        self.queue_door_errors = Counter(
            "inboxd_queue_door_errors",
            "Queue door failures (receive, S3, ingest left for redelivery), by door.",
            ["door"],
            registry=r,
        )
        self.extractions = Counter(
            "inboxd_extractions",
            "Claimed extraction jobs finished by this process, by tenant, processor and "
            "outcome (completed, retry, needs_review, released, lost).",
            ["tenant", "processor", "outcome"],
            registry=r,
        )
        #: The last reading of the extraction backlog (daemon/metrics/extraction.py).
        self.extraction_backlog: dict[tuple[str, str], Backlog] = {}
        self.extraction_inbox: dict[str, tuple[int, float]] = {}
        r.register(_ExtractionBacklog(self))
        # Show every outcome from the start (a 0 is information; a missing series is not).
        for outcome in Outcome:
            self.ingest_items.labels(outcome=outcome.value)

    def __repr__(self) -> str:
        return f"Metrics(registry=0x{id(self.registry):x})"

    # ingest ------------------------------------------------------------------

    def observe_outcomes(self, results: Iterable[ItemResult]) -> None:
        """Count one batch's per-item outcomes; permanent failures also count as dead items."""
        counts: dict[Outcome, int] = {}
        for result in results:
            counts[result.outcome] = counts.get(result.outcome, 0) + 1
        for outcome, n in counts.items():
            self.ingest_items.labels(outcome=outcome.value).inc(n)
        if dead := counts.get(Outcome.PERMANENT_FAILURE, 0):
            self.dead_items.inc(dead)

    def dead_item_recorded(self, n: int = 1) -> None:
        """Count dead items recorded outside the ingest stage (e.g. an unfetchable page item)."""
        self.dead_items.inc(n)

    def set_queue(self, depth: int, capacity: int | None = None) -> None:
        """Publish the bounded queue's current depth (and, when given, its capacity)."""
        self.queue_depth.set(depth)
        if capacity is not None:
            self.queue_capacity.set(capacity)

    # sync --------------------------------------------------------------------

    def sync_started(self, provider: str) -> None:
        """A sync run began for a mailbox of `provider`."""
        self.sync_runs.labels(provider=provider).inc()

    def sync_finished(self, provider: str, *, duration_s: float, failed: bool) -> None:
        """A sync run ended after `duration_s`; `failed` when it ended in an error."""
        self.sync_duration.labels(provider=provider).observe(duration_s)
        if failed:
            self.sync_failures.labels(provider=provider).inc()

    def watch_mailbox(self, tenant: str, mailbox: str) -> None:
        """Publish the mailbox's cursor lag from now on; until its first complete
        sync the lag counts from this call (a lower bound: the database's
        last_success_at may be older, `inboxd status` shows it)."""
        self._caught_up.setdefault((tenant, mailbox), self.clock())

    def mark_caught_up(self, tenant: str, mailbox: str, at: float | None = None) -> None:
        """The mailbox's cursor reached the provider's head (a sync run completed)."""
        self._caught_up[(tenant, mailbox)] = self.clock() if at is None else at

    def forget_mailbox(self, tenant: str, mailbox: str) -> None:
        """Drop a removed mailbox's series (SIGHUP removed it from the config)."""
        self._caught_up.pop((tenant, mailbox), None)

    def cursor_lags(self) -> dict[tuple[str, str], float]:
        """Seconds since each watched mailbox last caught up, as of now."""
        now = self.clock()
        return {key: max(0.0, now - at) for key, at in self._caught_up.items()}

    def set_flagged(self, state: str, mailboxes: Iterable[tuple[str, str]]) -> None:
        """The (tenant, mailbox) pairs whose sync_state is `state`, as read now."""
        self.flagged[state] = set(mailboxes)

    @property
    def needing_attention(self) -> set[tuple[str, str]]:
        return self.flagged.get("needs_attention", set())

    # webhooks ----------------------------------------------------------------

    def webhook_verification_failed(self, source: str) -> None:
        """A webhook request from `source` (`tenant/source` config ids) failed to verify."""
        self.webhook_verification_failures.labels(source=source).inc()

    def delivery_events_stored(self, provider: str, new: int, duplicates: int) -> None:
        """One webhook request's events: `new` rows stored, `duplicates` already there."""
        if new:
            self.delivery_events.labels(provider=provider, result="new").inc(new)
        if duplicates:
            self.delivery_events.labels(provider=provider, result="duplicate").inc(duplicates)

    # HTTP --------------------------------------------------------------------

    def observe_http(
        self, route: str, method: str, status: int, duration_s: float | None = None
    ) -> None:
        """Count one answered request; `route` is the route template, never the raw path."""
        self.http_requests.labels(route=route, method=method, status=str(status)).inc()
        if duration_s is not None:
            self.http_duration.labels(route=route).observe(duration_s)

    def sse_client_connected(self) -> None:
        self.sse_clients.inc()

    def sse_client_disconnected(self) -> None:
        self.sse_clients.dec()

    def sse_event_sent(self, n: int = 1) -> None:
        self.sse_events_sent.inc(n)

    # extraction --------------------------------------------------------------

    def extraction_finished(self, tenant: str, processor: str, outcome: str, n: int = 1) -> None:
        """`n` claimed jobs of `processor` ended with `outcome` (EXTRACTION_OUTCOMES;
        anything else is a ValueError: an unbounded label would be a new series each)."""
        if outcome not in EXTRACTION_OUTCOMES:
            raise ValueError(f"unknown extraction outcome {outcome!r}")
        self.extractions.labels(tenant=tenant, processor=processor, outcome=outcome).inc(n)

    def set_extraction_backlog(
        self, backlog: Iterable[Backlog], inbox: Mapping[str, tuple[int, float]]
    ) -> None:
        """Replace the backlog gauges with this reading: one Backlog per (tenant,
        processor) to show, inbox (rows, oldest age in s) per tenant to show."""
        self.extraction_backlog = {(b.tenant_id, b.processor_id): b for b in backlog}
        self.extraction_inbox = dict(inbox)

    # queue doors ---------------------------------------------------------------

    def queue_door_counted(self, door: str, what: str, n: int = 1) -> None:
        self.queue_door_messages.labels(door=door, what=what).inc(n)

    def queue_door_failed(self, door: str) -> None:
        self.queue_door_errors.labels(door=door).inc()

    # exposition --------------------------------------------------------------

    def render(self) -> bytes:
        """The registry in Prometheus text format (serve with `CONTENT_TYPE_LATEST`)."""
        return generate_latest(self.registry)
