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

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from inboxd.adapters.extraction import BuiltinBackend, HttpBackend, ProcessorConfig
from inboxd.daemon.config.secrets import Secret, SecretError
from inboxd.daemon.config.tenant import TenantConfig
from inboxd.pipeline.extraction.messages import Reads
from inboxd.pipeline.message import MessageData


class Backend(Protocol):
    """One extraction attempt (adapters/extraction/__init__.py); `reads`: how much of
    a stored message it needs (pipeline/extraction/messages.py)."""

    reads: Reads

    async def extract(self, message: MessageData) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class Processor:
    """A tenant's processor, ready to run. `token_sha256` tells a rotated token
    apart on reload without keeping a second copy of it."""

    tenant_id: str
    config: ProcessorConfig
    backend: Backend = field(compare=False, repr=False)
    token_sha256: str | None = field(default=None, repr=False)

    @property
    def key(self) -> tuple[str, str]:
        return (self.tenant_id, self.config.id)

    @property
    def schema_version(self) -> str:
        """As the jobs table keeps it (text)."""
        return str(self.config.schema_version)


def build_processors(
    tenants: Mapping[str, TenantConfig], session: aiohttp.ClientSession
) -> tuple[dict[tuple[str, str], Processor], dict[tuple[str, str], str]]:
    """Every configured processor by (tenant, processor id), and the problems of
    those left out by key (one line each, naming tenant, processor and reference)."""
    built: dict[tuple[str, str], Processor] = {}
    problems: dict[tuple[str, str], str] = {}
    for tenant_id, tenant in sorted(tenants.items()):
        for config in tenant.processors:
            try:
                built[(tenant_id, config.id)] = _build(tenant_id, config, session)
            except SecretError as exc:
                problems[(tenant_id, config.id)] = (
                    f"tenant {tenant_id} processor {config.id}: {exc}"
                )
    return built, problems


def _build(tenant_id: str, config: ProcessorConfig, session: aiohttp.ClientSession) -> Processor:
    if config.backend == "builtin":
        return Processor(tenant_id, config, BuiltinBackend(config.rules, config.schema))
    assert config.url is not None and config.token is not None  # checked by parse_processor
    token = Secret(config.token).reveal()
    backend = HttpBackend(
        url=config.url,
        token=token,
        schema=config.schema,
        timeout_s=config.timeout_s,
        session=session,
        schema_id=config.schema_id,
    )
    return Processor(tenant_id, config, backend, hashlib.sha256(token.encode()).hexdigest())
