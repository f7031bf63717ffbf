"""Retry-After (RFC 9110 §10.2.3): how long a provider asks us to wait.

One parser for every adapter that talks HTTP (Gmail, Graph, extraction backends):
the header is delay-seconds or an HTTP-date, and each door used to read it its own
way. Callers apply their own cap; this returns what the server said.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

__all__ = ["retry_after_s"]

# delay-seconds is 1*DIGIT; a decimal point is tolerated (some servers send "1.5").
_SECONDS = re.compile(r"\d+(?:\.\d+)?")


def retry_after_s(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds to wait from `now`: None when absent or unreadable, 0.0 for a date
    already past. An HTTP-date without a zone is GMT (RFC 9110 §5.6.7)."""
    if value is None:
        return None
    value = value.strip()
    if _SECONDS.fullmatch(value):
        seconds = float(value)
    else:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - (now or datetime.now(UTC))).total_seconds()
    return max(seconds, 0.0) if math.isfinite(seconds) else None
