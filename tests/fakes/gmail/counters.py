"""What the fake saw, so tests can assert on calls, quota spent and downloads."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Counters:
    """fake.counters: every API call (batch parts included), by user and method."""

    calls: Counter[tuple[str, str]] = field(default_factory=Counter)
    statuses: Counter[tuple[str, str, int]] = field(default_factory=Counter)
    units: Counter[str] = field(default_factory=Counter)  # quota units spent per user
    raw_downloads: Counter[tuple[str, str]] = field(default_factory=Counter)
    batch_sizes: list[int] = field(default_factory=list)
    token_requests: Counter[str] = field(default_factory=Counter)  # by grant_type
    cert_fetches: int = 0

    def calls_of(self, method: str | None = None, user: str | None = None) -> int:
        return sum(
            n
            for (u, m), n in self.calls.items()
            if (method is None or m == method) and (user is None or u == user)
        )

    def rejected(self, status: int, user: str | None = None) -> int:
        """How many calls answered `status` (e.g. 429)."""
        return sum(
            n for (u, _m, s), n in self.statuses.items() if s == status and user in (None, u)
        )

    def downloads(self, user: str) -> dict[str, int]:
        """message id -> times its body was served with format=raw."""
        return {m: n for (u, m), n in self.raw_downloads.items() if u == user}

    def max_downloads(self) -> int:
        """The most times any one body was downloaded (1 means never twice)."""
        return max(self.raw_downloads.values(), default=0)

    def reset(self) -> None:
        self.calls.clear()
        self.statuses.clear()
        self.units.clear()
        self.raw_downloads.clear()
        self.batch_sizes.clear()
        self.token_requests.clear()
        self.cert_fetches = 0
