"""Reading a provider's `[[delivery_sources]]` table: the checks every `from_config` shares.

Each provider module's `from_config(source_id, table, reveal)` refuses keys it
does not know (besides base.COMMON_KEYS, which the daemon reads) and, for
schemes with a signed timestamp, reads `tolerance_s`. Both raise
DeliveryConfigError with a message that starts with the key and never quotes
a value, since a value may be a secret.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .base import COMMON_KEYS, DEFAULT_TOLERANCE_S, MAX_TOLERANCE_S, DeliveryConfigError

__all__ = ["read_tolerance", "refuse_unknown_keys"]


def refuse_unknown_keys(table: Mapping[str, Any], known: frozenset[str], provider: str) -> None:
    """DeliveryConfigError naming every key of `table` that is neither in `known`
    nor in COMMON_KEYS (a typo such as `topic_arn` must not be silently ignored)."""
    unknown = sorted(set(table) - COMMON_KEYS - known)
    if unknown:
        raise DeliveryConfigError(
            f"{', '.join(unknown)}: unknown key(s) for provider {provider} "
            f"(known: {', '.join(sorted(known))})"
        )


def read_tolerance(table: Mapping[str, Any]) -> float:
    """`tolerance_s` of `table` in seconds, DEFAULT_TOLERANCE_S when absent.

    DeliveryConfigError unless a positive, finite int or float of at most
    MAX_TOLERANCE_S (a bool is not a number here; NaN would make every skew
    comparison false and pass everything).
    """
    value = table.get("tolerance_s", DEFAULT_TOLERANCE_S)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0 < value <= MAX_TOLERANCE_S
    ):
        raise DeliveryConfigError(
            f"tolerance_s: must be a number of seconds above 0 and at most {MAX_TOLERANCE_S:g}"
        )
    return float(value)
