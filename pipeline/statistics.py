"""Planner statistics for the ingest tables while a backfill fills them.

The ingest stage's statements (the participants insert's foreign-key check, the
thread statistics update, the cascade's lookups) are planned once per pooled
connection and kept. Planned while `messages` was empty, they scan it: cheap for
ten rows, quadratic over a backfill. PostgreSQL replans them when the tables are
ANALYZEd — autovacuum's job, which may be off (this project's CI server runs with
`autovacuum = off`) or a minute late (autovacuum_naptime) at the very moment a new
tenant's first backfill runs. bench/README.md (outlook.py): one ANALYZE after the
first 500 messages took PostgreSQL from 8.3 to 0.5 ms of CPU per stored message,
and the Outlook door from 0.49 to 0.91 of Graph's budget.

So the stage ANALYZEs the ingest tables itself when it has stored, since the last
time, at least ANALYZE_MIN_ROWS messages and ANALYZE_GROWTH of the table's size
then (autovacuum's own rule, with a much larger share). It is the first ANALYZE
that matters: the planner scales the row count of the last ANALYZE by the table's
current size in pages, so the index plans chosen on 1,000 messages stay the right
ones as the table grows; what goes stale is column statistics, which a backfill
changes little. A
backfill of N messages costs about log10(N / ANALYZE_MIN_ROWS) ANALYZEs, paid inside
`IngestStage.ingest` (the caller's next batch waits), most of each in `messages`'
text columns. At a growth of half the table (1.5×) a 20,000-message backfill ran
seven, 1.5-1.6 s of an 8 s bench/ingest.py (b); at 10× it runs two, 0.2 s
(bench/README.md, ingest.py). One at a time per process; a failure is logged and
retried at the next threshold, never an ingest failure.
"""

from __future__ import annotations

import anyio
import asyncpg
import structlog

from inboxd.pipeline.errors import DATABASE_ERRORS, describe

__all__ = [
    "ANALYZE_GROWTH",
    "ANALYZE_MIN_ROWS",
    "EXTRACTION_TABLES",
    "INGEST_TABLES",
    "IngestStatistics",
]

log = structlog.get_logger(__name__)

#: Tables whose plans matter to the ingest stage (schema.sql).
INGEST_TABLES = ("messages", "message_participants", "message_copies", "threads")
#: ... and to the extraction stage: its claims and the feeder's enqueue planned on an
#: empty extraction_jobs scanned it per id (a re-run of 20,000 linked messages took
#: 9 s instead of ~1, bench/extraction.py (c)).
EXTRACTION_TABLES = ("extraction_jobs", "extraction_inbox")
#: Messages stored before the first ANALYZE: a plan on 500 rows already uses the
#: indexes; before that a scan is as cheap.
ANALYZE_MIN_ROWS = 500
#: ... and at least this share of the table's size at the last ANALYZE: 9, so each
#: ANALYZE sees ten times the rows of the last (autovacuum's
#: autovacuum_analyze_scale_factor is 0.1, but autovacuum runs beside the writers;
#: these run in the ingest path, and plans only need the order of magnitude right).
#: 0.5 cost bench/ingest.py (b) 19 % at 20,000 messages (bench/README.md, ingest.py).
ANALYZE_GROWTH = 9.0


class IngestStatistics:
    """When to ANALYZE the ingest tables (module docstring); one per IngestStage.

    `tables`/`counted` serve another set of growing tables the same way: the
    extraction feeder's (EXTRACTION_TABLES, counted by extraction_jobs)."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        tables: tuple[str, ...] = INGEST_TABLES,
        counted: str = "messages",
    ) -> None:
        self._pool = pool
        self._tables = tables
        self._counted = counted
        self._stored_since = 0
        self._size_then: float | None = None  # messages' reltuples at the last look
        self._lock = anyio.Lock()

    async def note_stored(self, count: int) -> None:
        """`count` new messages were committed; ANALYZE when the rule says so."""
        if count <= 0:
            return
        self._stored_since += count
        if self._stored_since < ANALYZE_MIN_ROWS or self._lock.locked():
            return
        async with self._lock:
            try:
                if self._size_then is None:
                    self._size_then = await self._estimated_rows()
                if self._stored_since < max(ANALYZE_MIN_ROWS, ANALYZE_GROWTH * self._size_then):
                    return
                stored = self._stored_since
                async with self._pool.acquire() as conn:
                    await conn.execute(f"ANALYZE {', '.join(self._tables)}")
                self._size_then = await self._estimated_rows()
                self._stored_since = 0
                log.info(
                    "ingest_tables_analyzed",
                    tables=self._counted,
                    stored_since=stored,
                    rows=int(self._size_then),
                )
            except DATABASE_ERRORS as exc:
                log.warning("ingest_tables_not_analyzed", error=describe(exc))

    async def _estimated_rows(self) -> float:
        value = await self._pool.fetchval(
            "SELECT reltuples FROM pg_class WHERE oid = $1::regclass", self._counted
        )
        return max(0.0, float(value or 0.0))  # -1 before the first ANALYZE
