"""The one error of the embedded PostgreSQL, raised by every step of finding, preparing,
starting and stopping it (`embedded_pg` and the `pg_*` modules it drives)."""

from __future__ import annotations


class EmbeddedPostgresError(Exception):
    """The embedded server cannot be found, started or stopped. One-line message."""
