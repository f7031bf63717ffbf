"""The extraction metrics: backlog gauges re-read from the tables
(daemon/metrics/extraction.py) and the outcome counter the stage increments
(daemon/metrics/registry.py). Read through /metrics' own text format, as Prometheus does."""

from __future__ import annotations

import anyio
import asyncpg
import pytest
import structlog
from helpers import eventually
from helpers.mail import store_mail
from prometheus_client.parser import text_string_to_metric_families

from inboxd.daemon.metrics import extraction as extraction_metric
from inboxd.daemon.metrics.extraction import refresh_extraction_backlog
from inboxd.daemon.metrics.registry import Metrics
from inboxd.pipeline.extraction import claims
from inboxd.pipeline.extraction.enqueue import enqueue
from inboxd.pipeline.extraction.inbox import note_new
from inboxd.pipeline.ingest.stage import IngestStage

T = "acme"
VENDOR = "billing@vendor.example"
LEASE_S = 60.0
DEADLINE_S = 10.0

Labels = frozenset[tuple[str, str]]


def samples(metrics: Metrics, name: str) -> dict[Labels, float]:
    """Every sample of `name` in the rendered exposition, by label set."""
    out: dict[Labels, float] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if s.name == name:
                out[frozenset(s.labels.items())] = s.value
    return out


def labels(**kw: str) -> Labels:
    return frozenset(kw.items())


@pytest.fixture
async def backlog(pool: asyncpg.Pool, stage: IngestStage, make_mailbox) -> list[int]:
    """invoices: 2 pending and 1 needs_review; receipts: 1 pending; 2 inbox rows."""
    await make_mailbox(T, "inbox")
    ids = await store_mail(stage, T, "inbox", [VENDOR] * 5)
    await enqueue(pool, T, "invoices", "1", ids[:3])
    await enqueue(pool, T, "receipts", "1", ids[:1])
    [job] = await claims.claim_due(pool, [T], "w", LEASE_S, 1, processor_id="invoices")
    assert await claims.fail_terminal(pool, job, "result does not validate")
    async with pool.acquire() as conn:
        await note_new(conn, T, ids[3:])
    return ids


async def test_backlog_gauges_follow_the_tables_and_the_config(
    pool: asyncpg.Pool, backlog: list[int]
) -> None:
    metrics = Metrics()
    configured = [(T, "invoices"), (T, "receipts"), (T, "idle")]
    jobs = "inboxd_extraction_jobs"
    async with anyio.create_task_group() as tg:
        await tg.start(refresh_extraction_backlog, pool, metrics, lambda: [T], lambda: configured)
        got = await eventually(lambda: samples(metrics, jobs), DEADLINE_S, what="a reading")
        tg.cancel_scope.cancel()

    assert got[labels(tenant=T, processor="invoices", state="pending")] == 2
    assert got[labels(tenant=T, processor="invoices", state="needs_review")] == 1
    assert got[labels(tenant=T, processor="invoices", state="running")] == 0
    assert got[labels(tenant=T, processor="receipts", state="pending")] == 1
    assert got[labels(tenant=T, processor="idle", state="pending")] == 0  # configured, idle
    due = samples(metrics, "inboxd_extraction_due")
    assert due[labels(tenant=T, processor="invoices")] == 2  # needs_review is never due
    oldest = samples(metrics, "inboxd_extraction_oldest_due_seconds")
    assert oldest[labels(tenant=T, processor="invoices")] >= 0
    assert samples(metrics, "inboxd_extraction_inbox") == {labels(tenant=T): 2}

    # receipts leaves the config and its job is done: its series go; idle stays at 0.
    await pool.execute("DELETE FROM extraction_jobs WHERE processor_id = 'receipts'")
    await pool.execute("DELETE FROM extraction_inbox")
    configured.remove((T, "receipts"))
    async with anyio.create_task_group() as tg:
        # The refresher re-reads every 15 s; a restart reads at once.
        await tg.start(refresh_extraction_backlog, pool, metrics, lambda: [T], lambda: configured)
        await eventually(
            lambda: samples(metrics, "inboxd_extraction_inbox"),
            DEADLINE_S,
            what="the inbox read empty",
            until=lambda inbox: inbox == {labels(tenant=T): 0},
        )
        tg.cancel_scope.cancel()
    processors = {dict(k)["processor"] for k in samples(metrics, jobs)}
    assert processors == {"invoices", "idle"}


async def test_without_a_config_only_pairs_with_jobs_show(
    pool: asyncpg.Pool, backlog: list[int]
) -> None:
    metrics = Metrics()
    async with anyio.create_task_group() as tg:
        await tg.start(refresh_extraction_backlog, pool, metrics, lambda: [T, "globex"])
        await eventually(
            lambda: samples(metrics, "inboxd_extraction_inbox"), DEADLINE_S, what="a reading"
        )
        tg.cancel_scope.cancel()

    due = samples(metrics, "inboxd_extraction_due")
    assert set(due) == {
        labels(tenant=T, processor="invoices"),
        labels(tenant=T, processor="receipts"),
    }
    inbox = samples(metrics, "inboxd_extraction_inbox")
    assert inbox == {labels(tenant=T): 2, labels(tenant="globex"): 0}


async def test_a_database_failure_keeps_the_last_reading(
    db_dsn: str, backlog: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Re-read at once after each reading, so the failure is reached without waiting 15 s.
    monkeypatch.setattr(extraction_metric, "EXTRACTION_REFRESH_INTERVAL_S", 0.01)
    metrics = Metrics()
    own = await asyncpg.create_pool(db_dsn, min_size=0, max_size=1)
    with structlog.testing.capture_logs() as logs:
        async with anyio.create_task_group() as tg:
            await tg.start(refresh_extraction_backlog, own, metrics, lambda: [T])
            await eventually(
                lambda: samples(metrics, "inboxd_extraction_inbox"), DEADLINE_S, what="a reading"
            )
            await own.close()  # every later reading fails
            await eventually(
                lambda: [e for e in logs if e["event"] == "extraction_metric_unavailable"],
                DEADLINE_S,
                what="the failure logged",
            )
            tg.cancel_scope.cancel()  # the task was still running: it outlived the error

    assert [e["event"] for e in logs].count("extraction_metric_unavailable") == 1
    assert samples(metrics, "inboxd_extraction_inbox") == {labels(tenant=T): 2}


def test_extraction_outcomes_are_counted_by_tenant_processor_and_outcome() -> None:
    metrics = Metrics()

    metrics.extraction_finished(T, "invoices", "completed", 3)
    metrics.extraction_finished(T, "invoices", "completed")
    metrics.extraction_finished(T, "invoices", "lost")

    got = samples(metrics, "inboxd_extractions_total")
    assert got == {
        labels(tenant=T, processor="invoices", outcome="completed"): 4,
        labels(tenant=T, processor="invoices", outcome="lost"): 1,
    }
    with pytest.raises(ValueError, match="unknown extraction outcome"):
        metrics.extraction_finished(T, "invoices", "exploded")
