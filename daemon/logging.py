"""Log setup shared by every inboxd command: structlog, to stderr, one event per line.

stdout belongs to the command's result (a summary, `--json` output); logs and
progress go to stderr. On a terminal the lines are human-readable; anywhere
else (systemd journal, a pipe, a file) they are JSON objects, one per line.
Fields follow CONTRIBUTING.md rule 11: short snake_case event names, values as fields.
"""

from __future__ import annotations

import logging as std_logging
import sys
from typing import Any

import orjson
import structlog

__all__ = ["LOG_LEVELS", "configure_logging"]

LOG_LEVELS = ("debug", "info", "warning", "error")


class _Stderr:
    """Writes to whatever `sys.stderr` is at the time of the call.

    rich's progress display swaps `sys.stderr` for a proxy that prints above the
    bar; a logger holding the original stream would tear the bar apart.
    """

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _orjson_dumps(obj: Any, **_: Any) -> str:
    return orjson.dumps(obj, default=str).decode()


def configure_logging(
    json: bool | None = None, *, level: str = "warning", final: bool = False
) -> None:
    """Configure structlog (and the stdlib root logger) for a command.

    `json`: True for JSON lines, False for console lines, None to pick JSON exactly
    when stderr is not a terminal. `level`: one of `LOG_LEVELS`; raises `ValueError`
    for anything else. Safe to call more than once (the last call wins) — except
    after a call with `final=True` (what the daemon does once its config is read):
    then each module's logger is built once, on first use, instead of on every
    call (structlog's lazy proxy cost ~2 % of a webhook request, bench/webhooks.py).
    """
    if level not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, not {level!r}")
    if json is None:
        json = not sys.stderr.isatty()
    level_no = std_logging.getLevelNamesMapping()[level.upper()]
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: list[structlog.typing.Processor]
    if json:
        renderer = [
            # Tracebacks as data, without local variables: locals hold message bodies
            # and DSNs, which must never reach a log (CONTRIBUTING.md rule 11).
            structlog.processors.ExceptionRenderer(
                structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
            ),
            structlog.processors.JSONRenderer(serializer=_orjson_dumps),
        ]
    else:
        # plain tracebacks: rich's default formatter prints local variables
        renderer = [
            structlog.dev.ConsoleRenderer(
                colors=sys.stderr.isatty(), exception_formatter=structlog.dev.plain_traceback
            )
        ]
    structlog.configure(
        processors=[*shared, *renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=structlog.WriteLoggerFactory(file=_Stderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=final,
    )
    # Libraries that use the stdlib (asyncpg, botocore) log through the root logger;
    # their records get the same shape, so stderr stays one format.
    handler = std_logging.StreamHandler(_Stderr())
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderer],
        )
    )
    root = std_logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(level_no, std_logging.WARNING))
