"""Local mail files (.eml, mbox, Maildir) as raw bytes, for `inboxd import`."""

from __future__ import annotations

from .source import (
    ImportPlan,
    RawMessage,
    SourceError,
    SourceFile,
    iter_messages,
    plan_import,
)

__all__ = ["ImportPlan", "RawMessage", "SourceError", "SourceFile", "iter_messages", "plan_import"]
