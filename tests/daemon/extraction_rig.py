"""The extraction stage running in the test's process, and what its tests read back.

Shared by test_extraction_stage and test_extraction_faults (a test module never
imports another test module).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import orjson
from helpers.db import extraction_jobs

from inboxd.adapters.extraction import ProcessorConfig, parse_processor
from inboxd.daemon.config.tenant import TenantConfig
from inboxd.daemon.extraction.stage import ExtractionStage
from inboxd.daemon.metrics.registry import Metrics
from inboxd.pipeline.ingest.stage import IngestBatch, IngestStage
from inboxd.pipeline.message import MessageData
from inboxd.pipeline.mime.parse import parse_raw
from inboxd.pipeline.objectstore.store import ObjectStore
from inboxd.pipeline.outcomes import Outcome

T = "acme"
SCHEMA = {
    "type": "object",
    "properties": {"order": {"type": "string"}, "sender": {"type": "string"}},
    "required": ["order"],
}
ORDER_RULES = {
    "order": {"regex": r"Order (?P<value>[A-Z]+-\d+)", "in": "subject"},
    "sender": {"address": "from.email"},
}
DEADLINE_S = 30.0


def builtin(tmp: Path, **extra: Any) -> ProcessorConfig:
    table = {
        "id": "orders",
        "backend": "builtin",
        "schema": SCHEMA,
        "schema_version": 1,
        "rules": ORDER_RULES,
        **extra,
    }
    return parse_processor(table, tmp)


def http(tmp: Path, url: str, **extra: Any) -> ProcessorConfig:
    table = {
        "id": "parser",
        "backend": "http",
        "url": url,
        "token": "env:TEST_PARSE_TOKEN",
        "schema": SCHEMA,
        "schema_version": 1,
        "timeout_s": 5,
        **extra,
    }
    return parse_processor(table, tmp)


def tenant(tmp: Path, *processors: ProcessorConfig) -> dict[str, TenantConfig]:
    return {T: TenantConfig(T, "Acme", tmp / "acme.toml", processors=processors)}


def raw_mail(i: int, *, subject: str | None = None, tag: str = "A", body: str = "") -> bytes:
    subject = subject if subject is not None else f"Order {tag}-{i}"
    return (
        f"From: Shop <shop{i % 3}@vendor.example>\r\nTo: ap@acme.example\r\n"
        f"Subject: {subject}\r\nDate: Mon, 02 Nov 2026 09:30:00 +0000\r\n"
        f"Message-ID: <{tag}-{i}@vendor.example>\r\n\r\nHello {i}. {body}\r\n"
    ).encode()


def parsed(raw: bytes, mailbox: str = "inbox") -> MessageData:
    item = parse_raw(raw, tenant_id=T, mailbox_id=mailbox, source="import")
    assert isinstance(item, MessageData)
    return item


@asynccontextmanager
async def running(
    pool: asyncpg.Pool,
    store: ObjectStore,
    tenants: dict[str, TenantConfig],
    *,
    lease_s: float = 30.0,
    owner: str = "test-owner",
) -> AsyncIterator[tuple[ExtractionStage, IngestStage]]:
    stage = ExtractionStage(pool, store, tenants, owner=owner, lease_s=lease_s, metrics=Metrics())
    ingest = IngestStage(pool, store, extraction=stage.handoff)
    async with anyio.create_task_group() as tg:
        await tg.start(stage.run)
        yield stage, ingest
        tg.cancel_scope.cancel()


async def ingest_raws(
    ingest: IngestStage, raws: list[bytes], mailbox: str = "inbox"
) -> list[tuple[Outcome, int | None]]:
    results = await ingest.ingest(IngestBatch(T, mailbox, [parsed(r, mailbox) for r in raws]))
    return [(r.outcome, r.message_id) for r in results]


#: `await jobs(pool)`: tenant T's jobs, oldest first, as the stage tests read them.
jobs = partial(
    extraction_jobs,
    columns="job_id, processor_id, message_id, state, result, attempts, review_reason, lease_owner",
    order_by="job_id",
    tenant=T,
)


async def completed_events(pool: asyncpg.Pool) -> list[dict]:
    rows = await pool.fetch(
        "SELECT message_id, payload FROM events WHERE tenant_id = $1 "
        "AND kind = 'extraction.completed' ORDER BY event_id",
        T,
    )
    return [{"message_id": r["message_id"], **orjson.loads(r["payload"])} for r in rows]


async def states(pool: asyncpg.Pool) -> list[str]:
    return [r["state"] for r in await jobs(pool)]


def all_in(state: str, n: int) -> Callable[[list[str]], bool]:
    return lambda got: len(got) == n and all(s == state for s in got)
