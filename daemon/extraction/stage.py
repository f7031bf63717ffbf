"""The extraction stage of `inboxd run`: its own queue and workers beside ingest.

    ingest transaction ──note_new──▶ extraction_inbox ──feeder──▶ extraction_jobs
                                                                     │ claim_due
                                                    runner per (tenant, processor)

Ingest only writes one set-based INSERT of the new rows' ids and rings the
feeder (`handoff`); everything else runs here, so a slow parse API never slows
ingest, and the queue between them is a table: bounded memory, nothing lost to
a crash. Each processor has a runner under its own cancel scope — a
`LockedRunner` (locked_runner.py: the claim is a row lock of one transaction) for
builtin rules, a `ProcessorRunner` (runner.py: leases) for an http backend — so a
SIGHUP reload restarts only what changed (its config, or its token: a processor
whose token cannot be read at a reload keeps running with the one it has); every
http backend shares one aiohttp session, closed when the stage ends. Cancelling the stage
(SIGTERM) releases the claims it holds (runner.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import aiohttp
import anyio
import anyio.abc
import asyncpg
import structlog

from inboxd.adapters.extraction import ProcessorConfig
from inboxd.daemon.config.tenant import TenantConfig
from inboxd.daemon.extraction.feeder import Feeder
from inboxd.daemon.extraction.locked_runner import LOCKED_ROUNDS_AT_ONCE, LockedRunner
from inboxd.daemon.extraction.processors import Processor, build_processors
from inboxd.daemon.extraction.runner import ProcessorRunner
from inboxd.daemon.metrics.registry import Metrics
from inboxd.pipeline.errors import DATABASE_ERRORS
from inboxd.pipeline.extraction.inbox import HandOff
from inboxd.pipeline.extraction.versions import carry_over
from inboxd.pipeline.objectstore.store import ObjectStore

log = structlog.get_logger(__name__)

#: After a failed carry-over of old-version jobs (database down), wait this long.
CARRY_OVER_RETRY_S = 2.0


class ExtractionStage:
    """Feeder plus one runner per configured processor."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        store: ObjectStore,
        tenants: Mapping[str, TenantConfig],
        *,
        owner: str,
        lease_s: float,
        metrics: Metrics,
    ) -> None:
        self._pool = pool
        self._store = store
        self._owner = owner
        self._lease_s = lease_s
        self._metrics = metrics
        self._tenants = dict(tenants)
        self.feeder = Feeder(
            pool, self._configs_of, self._ring_tenant, tenants=self._tenants_with_processors
        )
        self.handoff = HandOff(wants=self._wants, noted=self.feeder.ring)
        self._runners: dict[
            tuple[str, str], tuple[ProcessorRunner | LockedRunner, anyio.CancelScope]
        ] = {}
        self._session: aiohttp.ClientSession | None = None
        self._locked_rounds = anyio.CapacityLimiter(LOCKED_ROUNDS_AT_ONCE)
        self._group: anyio.abc.TaskGroup | None = None

    @property
    def runners(self) -> dict[tuple[str, str], ProcessorRunner | LockedRunner]:
        return {key: runner for key, (runner, _) in self._runners.items()}

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        # No pool limit: each processor's callers are bounded by its `concurrency`.
        # A shared limit made one tenant's calls queue for a connection behind
        # another's, and the wait counted against their timeout_s (charged attempts).
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            self._session = session
            try:
                async with anyio.create_task_group() as group:
                    self._group = group
                    await group.start(self.feeder.run)
                    self._start(self._tenants)
                    task_status.started()
            finally:
                self._group = None
                self._session = None

    def reload(self, tenants: Mapping[str, TenantConfig]) -> None:
        """New tenant configs: start new processors, restart changed ones, stop gone
        ones (their claims are released). Before `run` started, only remembered."""
        self._tenants = dict(tenants)
        if self._group is not None:
            self._start(self._tenants)

    # --- internals ------------------------------------------------------------------------

    def _start(self, tenants: Mapping[str, TenantConfig]) -> None:
        assert self._group is not None and self._session is not None
        wanted, problems = build_processors(tenants, self._session)
        for key, problem in problems.items():
            if key in self._runners:  # e.g. a token file unreadable right now: keep running
                log.error("extraction_processor_not_reloaded", problem=problem)
                wanted[key] = self._runners[key][0].processor
            else:
                log.error("extraction_processor_not_started", problem=problem)
        for key, (runner, scope) in list(self._runners.items()):
            # compared by value (config and token digest): a reload of an unchanged file
            # must not cancel calls in flight, which would be paid for twice
            if wanted.get(key) != runner.processor:
                scope.cancel()
                del self._runners[key]
        for key, processor in wanted.items():
            if key not in self._runners:
                self._launch(processor)

    def _launch(self, processor: Processor) -> None:
        assert self._group is not None
        runner: ProcessorRunner | LockedRunner
        if processor.config.backend == "builtin":
            # rules answer in microseconds: a row lock for one transaction is their claim
            runner = LockedRunner(
                processor,
                self._pool,
                self._store,
                metrics=self._metrics,
                rounds=self._locked_rounds,
            )
        else:
            runner = ProcessorRunner(
                processor,
                self._pool,
                self._store,
                owner=self._owner,
                lease_s=self._lease_s,
                metrics=self._metrics,
            )
        scope = anyio.CancelScope()
        self._runners[processor.key] = (runner, scope)

        async def run_scoped() -> None:
            with scope:
                await self._carry_over(processor)
                await runner.run()

        self._group.start_soon(run_scoped)
        log.info(
            "extraction_processor_started",
            tenant=processor.tenant_id,
            processor=processor.config.id,
            backend=processor.config.backend,
            concurrency=processor.config.concurrency,
        )

    async def _carry_over(self, processor: Processor) -> None:
        """Jobs of the processor's other schema versions that never ran move to its
        current one (pipeline/extraction/versions.py) before its runner claims; tried
        until the database answers, since the runner could not claim before either."""
        version = str(processor.config.schema_version)
        while True:
            try:
                carried = await carry_over(
                    self._pool, processor.tenant_id, processor.config.id, version
                )
            except (*DATABASE_ERRORS, asyncpg.UniqueViolationError) as exc:
                # a unique violation: the feeder queued the key under this version
                # meanwhile; the next try finds that job and supersedes the old one
                log.warning(
                    "extraction_carry_over_failed",
                    tenant=processor.tenant_id,
                    processor=processor.config.id,
                    error=f"{type(exc).__name__}: {exc}",
                )
                await anyio.sleep(CARRY_OVER_RETRY_S)
                continue
            if carried.moved or carried.superseded:
                log.info(
                    "extraction_jobs_carried_over",
                    tenant=processor.tenant_id,
                    processor=processor.config.id,
                    schema_version=version,
                    moved=len(carried.moved),
                    superseded=len(carried.superseded),
                )
            return

    def _configs_of(self, tenant_id: str) -> Sequence[ProcessorConfig]:
        tenant = self._tenants.get(tenant_id)
        return tenant.processors if tenant is not None else ()

    def _tenants_with_processors(self) -> list[str]:
        return sorted(t for t, config in self._tenants.items() if config.processors)

    def _wants(self, tenant_id: str) -> bool:
        return bool(self._configs_of(tenant_id))

    def _ring_tenant(self, tenant_id: str) -> None:
        for (tenant, _), (runner, _) in self._runners.items():
            if tenant == tenant_id:
                runner.ring()
