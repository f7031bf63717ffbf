"""Extraction parse backends: turn a message into schema-validated JSON.

Two backends share one contract (`ExtractionBackend.extract(message) -> dict`):
`builtin` (deterministic per-field rules, builtin.py) and `http` (a parse API,
http.py). Each call is one attempt: it returns a result valid against the
processor's schema (schema.py), or raises ExtractionRetryable (the claim
protocol's fail_retryable, with the server's Retry-After) or ExtractionTerminal
(fail_terminal: needs_review with the reason); pipeline/extraction/claims.py.
config.py parses a tenant file's `[[processors]]` table and its mail filter.
"""

from __future__ import annotations

from inboxd.adapters.extraction.builtin import BuiltinBackend, Rule, extract_fields, parse_rules
from inboxd.adapters.extraction.config import (
    MailFilter,
    ProcessorConfig,
    matches,
    matches_fields,
    parse_processor,
)
from inboxd.adapters.extraction.errors import (
    ExtractionError,
    ExtractionMisconfigured,
    ExtractionRetryable,
    ExtractionTerminal,
    ExtractionUnauthorized,
    ProcessorConfigError,
)
from inboxd.adapters.extraction.http import HttpBackend
from inboxd.adapters.extraction.schema import ResultSchema, compile_schema, load_schema

__all__ = [
    "BuiltinBackend",
    "ExtractionError",
    "ExtractionMisconfigured",
    "ExtractionRetryable",
    "ExtractionTerminal",
    "ExtractionUnauthorized",
    "HttpBackend",
    "MailFilter",
    "ProcessorConfig",
    "ProcessorConfigError",
    "ResultSchema",
    "Rule",
    "compile_schema",
    "extract_fields",
    "load_schema",
    "matches",
    "matches_fields",
    "parse_processor",
    "parse_rules",
]
