"""The tenant files' `[[processors]]`, turned into runnable processors.

A processor is its checked config (adapters/extraction/config.py) plus the
backend object that does one attempt: `BuiltinBackend` (rules and schema) or
`HttpBackend` (the parse API, on the stage's one aiohttp session, with the
bearer token revealed here from its `env:`/`file:` reference, at start and at
every SIGHUP reload, so a rotated token file takes effect on reload). A token
that cannot be revealed leaves that one processor out with a logged problem;
the others run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from inboxd.adapters.extraction import BuiltinBackend, HttpBackend, ProcessorConfig
from inboxd.daemon.secrets import Secret, SecretError
from inboxd.daemon.tenant_config import TenantConfig
from inboxd.pipeline.extraction_messages import Reads
from inboxd.pipeline.message import MessageData


class Backend(Protocol):
    """One extraction attempt (adapters/extraction/__init__.py); `reads`: how much of
    a stored message it needs (pipeline/extraction_messages.py)."""

    reads: Reads

    async def extract(self, message: MessageData) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class Processor:
    """A tenant's processor, ready to run."""

    tenant_id: str
    config: ProcessorConfig
    backend: Backend

    @property
    def key(self) -> tuple[str, str]:
        return (self.tenant_id, self.config.id)

    @property
    def schema_version(self) -> str:
        """As the jobs table keeps it (text)."""
        return str(self.config.schema_version)


def build_processors(
    tenants: Mapping[str, TenantConfig], session: aiohttp.ClientSession
) -> tuple[dict[tuple[str, str], Processor], list[str]]:
    """Every configured processor by (tenant, processor id), and the problems of
    those left out (one line each, naming tenant, processor and reference)."""
    built: dict[tuple[str, str], Processor] = {}
    problems: list[str] = []
    for tenant_id, tenant in sorted(tenants.items()):
        for config in tenant.processors:
            try:
                backend = _backend(config, session)
            except SecretError as exc:
                problems.append(f"tenant {tenant_id} processor {config.id}: {exc}")
                continue
            built[(tenant_id, config.id)] = Processor(tenant_id, config, backend)
    return built, problems


def _backend(config: ProcessorConfig, session: aiohttp.ClientSession) -> Backend:
    if config.backend == "builtin":
        return BuiltinBackend(config.rules, config.schema)
    assert config.url is not None and config.token is not None  # checked by parse_processor
    return HttpBackend(
        url=config.url,
        token=Secret(config.token).reveal(),
        schema=config.schema,
        timeout_s=config.timeout_s,
        session=session,
        schema_id=config.schema_id,
    )
