"""Every key of the schema is tenant-first, so the schema can be distributed by tenant
(Citus: docs/architecture.md, "Beyond one PostgreSQL") without a change: every table
has `tenant_id`, and every primary key, unique constraint or index and foreign key
starts with it — except the few operational tables that stay on the coordinator,
each named here with its reason. A new table or key that breaks the rule fails here.
"""

from __future__ import annotations

import asyncpg

#: Tables without tenant_id, kept on the coordinator (never distributed).
COORDINATOR_TABLES = {
    "inboxd_schema_version": "which schema.sql was applied: one per database",
    "inboxd_daemons": "the running replicas: processes, not tenants",
    "queue_pollers": "an SQS door's pollers: the queue serves every tenant",
    "unrouted_items": "queue mail no tenant's mailbox claims: no tenant to put it under",
}

_TABLES = """
SELECT c.relname AS table_name,
       EXISTS (SELECT 1 FROM pg_attribute a
                WHERE a.attrelid = c.oid AND a.attname = 'tenant_id' AND NOT a.attisdropped)
         AS has_tenant
  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
 WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p')
"""

# Unique indexes (primary keys and unique constraints included) and foreign keys,
# with their columns in order.
_KEYS = """
SELECT t.relname AS table_name, i.relname AS key_name,
       array_agg(a.attname ORDER BY k.ord) AS columns
  FROM pg_index x
  JOIN pg_class t ON t.oid = x.indrelid
  JOIN pg_class i ON i.oid = x.indexrelid
  JOIN pg_namespace n ON n.oid = t.relnamespace
  CROSS JOIN LATERAL unnest(x.indkey) WITH ORDINALITY AS k(attnum, ord)
  JOIN pg_attribute a ON a.attrelid = t.oid AND a.attnum = k.attnum
 WHERE n.nspname = 'public' AND x.indisunique
 GROUP BY 1, 2
UNION ALL
SELECT t.relname, con.conname, array_agg(a.attname ORDER BY k.ord)
  FROM pg_constraint con
  JOIN pg_class t ON t.oid = con.conrelid
  JOIN pg_namespace n ON n.oid = t.relnamespace
  CROSS JOIN LATERAL unnest(con.conkey) WITH ORDINALITY AS k(attnum, ord)
  JOIN pg_attribute a ON a.attrelid = t.oid AND a.attnum = k.attnum
 WHERE n.nspname = 'public' AND con.contype = 'f'
 GROUP BY 1, 2
"""


async def test_every_table_and_key_is_tenant_first(pool: asyncpg.Pool) -> None:
    tables = {r["table_name"]: r["has_tenant"] for r in await pool.fetch(_TABLES)}
    assert set(COORDINATOR_TABLES) <= set(tables), "a coordinator table was renamed or dropped"
    without = {name for name, has in tables.items() if not has}
    assert without == set(COORDINATOR_TABLES), f"tables without tenant_id: {without}"
    keys = await pool.fetch(_KEYS)
    assert keys, "no keys read: the query is wrong"
    bad = [
        f"{k['table_name']}.{k['key_name']} ({', '.join(k['columns'])})"
        for k in keys
        if k["table_name"] not in COORDINATOR_TABLES and k["columns"][0] != "tenant_id"
    ]
    assert not bad, f"keys that do not start with tenant_id: {bad}"
