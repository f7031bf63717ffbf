"""What the fake saw, so tests and benchmarks can assert on it.

`kind` names an API operation the way the reference pages do
(`message.delta`, `message.value`, `message.get`, `mailFolder.get`, …).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Counters:
    """fake.counters: every mail API request (batch inner requests included)."""

    calls: Counter[tuple[str, str]] = field(default_factory=Counter)  # (user, kind)
    statuses: Counter[tuple[str, str, int]] = field(default_factory=Counter)
    raw_downloads: Counter[tuple[str, str]] = field(default_factory=Counter)  # (user, immutable id)
    throttled: Counter[str] = field(default_factory=Counter)  # 429s per user, any cause
    missing_immutable: Counter[tuple[str, str]] = field(default_factory=Counter)
    # (user, kind, whether Prefer carried odata.maxpagesize): one count per request
    maxpagesize: Counter[tuple[str, str, bool]] = field(default_factory=Counter)
    max_concurrency: Counter[str] = field(default_factory=Counter)  # most in flight at once
    batch_sizes: list[int] = field(default_factory=list)
    token_requests: Counter[str] = field(default_factory=Counter)  # by grant_type
    validations: Counter[str] = field(default_factory=Counter)  # handshake URL -> times
    notifications_sent: int = 0

    def calls_of(self, kind: str | None = None, user: str | None = None) -> int:
        return sum(n for (u, k), n in self.calls.items() if kind in (None, k) and user in (None, u))

    def rejected(self, status: int, user: str | None = None) -> int:
        """How many requests answered `status` (e.g. 429)."""
        return sum(
            n for (u, _k, s), n in self.statuses.items() if s == status and user in (None, u)
        )

    def missing_immutable_total(self) -> int:
        return sum(self.missing_immutable.values())

    def without_maxpagesize(self, kind: str = "message.delta") -> int:
        """Requests of `kind` that did not ask for a page size."""
        return sum(n for (_u, k, had), n in self.maxpagesize.items() if k == kind and not had)

    def downloads(self, user: str) -> dict[str, int]:
        """immutable message id -> times its MIME ($value) was served."""
        return {m: n for (u, m), n in self.raw_downloads.items() if u == user}

    def max_downloads(self) -> int:
        """The most times any one body was downloaded (1 means never twice)."""
        return max(self.raw_downloads.values(), default=0)

    def reset(self) -> None:
        for value in list(self.__dict__.values()):
            if isinstance(value, Counter | list):
                value.clear()
        self.notifications_sent = 0
