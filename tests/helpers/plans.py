"""Query plans as data: `plan_nodes`, every node of an EXPLAIN (FORMAT JSON) plan.

For tests that a statement can be served in index order (no sort of a whole
table per call). They assert the plan's shape, never its timing: speed is
measured in bench/ (CONTRIBUTING.md rule 13).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import asyncpg
import orjson


async def plan_nodes(conn: asyncpg.Connection, sql: str, *args: object) -> list[dict[str, Any]]:
    """Every node of the plan PostgreSQL makes for `sql` with `args` (not run), root first."""
    plan = await conn.fetchval("EXPLAIN (FORMAT JSON) " + sql, *args)
    return list(_walk(orjson.loads(plan)[0]["Plan"]))


def _walk(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", ()):
        yield from _walk(child)
