"""Token buckets behind the 429s of webhook routes.

`RateLimiter` is one bucket: a source's budget of verified requests.
`PeerBudgets` is a bounded table of buckets by key — (tenant, source, peer) —
the budget of failed verifications of each peer at each source (the budget
design is in the docstring of daemon/webhooks/esp.py). `peer_key` names the peer.
Shared by every route set a provider calls: the ESP hooks and the doors' push
routes (adapters/gmail/push_route.py, adapters/outlook/notifications.py).
"""

from __future__ import annotations

import ipaddress
import time
from collections import OrderedDict
from collections.abc import Hashable, Mapping
from typing import Generic, TypeVar

__all__ = ["IPV6_PEER_PREFIX", "PeerBudgets", "RateLimiter", "peer_key"]

#: An IPv6 peer is its /64: one host (one customer line, one VM) is routinely
#: given a whole /64 (RFC 6177, RFC 7421), so an address per request would
#: otherwise be a fresh budget per request.
IPV6_PEER_PREFIX = 64


T = TypeVar("T")


class RateLimiter:
    """Token bucket: `rate` requests per second, bursts of up to `burst`."""

    __slots__ = ("_burst", "_rate", "_stamp", "_tokens")

    def __init__(self, rate: float, burst: float) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self._rate, self._burst = rate, burst
        self._tokens, self._stamp = burst, time.monotonic()

    @property
    def settings(self) -> tuple[float, float]:
        """(rate per second, burst)."""
        return self._rate, self._burst

    def ready(self) -> bool:
        """True when a token is there to take; spends nothing."""
        self._refill()
        return self._tokens >= 1

    def take(self) -> bool:
        """Spend one token; False when the bucket is empty."""
        self._refill()
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._stamp) * self._rate)
        self._stamp = now


class PeerBudgets:
    """A token bucket per key, for at most `max_keys` keys (least recently charged
    dropped first).

    A key without a bucket has a full one, so dropping the oldest bucket only
    ever hands its key a fresh burst: memory stays bounded whatever the number
    of peers, and the worst a peer with many addresses gains is one burst per
    address it can use (IPv6 peers are their /64, `peer_key`).
    """

    __slots__ = ("_buckets", "_burst", "_max_keys", "_rate")

    def __init__(self, rate: float, burst: float, max_keys: int) -> None:
        if max_keys < 1:
            raise ValueError("max_keys must be >= 1")
        RateLimiter(rate, burst)  # the same validation
        self._rate, self._burst, self._max_keys = rate, burst, max_keys
        self._buckets: OrderedDict[Hashable, RateLimiter] = OrderedDict()

    def allows(self, key: Hashable) -> bool:
        """True unless `key`'s bucket is empty; spends nothing."""
        bucket = self._buckets.get(key)
        return bucket is None or bucket.ready()

    def charge(self, key: Hashable) -> None:
        """Spend one of `key`'s tokens (nothing left to spend is fine: it stays empty)."""
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = RateLimiter(self._rate, self._burst)
            while len(self._buckets) > self._max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
        bucket.take()

    def __len__(self) -> int:
        return len(self._buckets)


def peer_key(remote: str | None) -> str:
    """The peer a request's budget is kept for: its address (`request.remote`),
    an IPv6 one as its /64 and an IPv4-mapped one as IPv4; "" for a peer without
    an address (a Unix socket)."""
    if not remote:
        return ""
    try:
        address = ipaddress.ip_address(remote)
    except ValueError:
        return remote  # not an address (a test transport): itself
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, IPV6_PEER_PREFIX), strict=False))
    return str(address)


# A push route's budget of failed requests per peer (Gmail's and Outlook's): a
# misconfigured subscription fails every request; 5/s keeps its 401s visible while
# a flood costs header parsing only (the ESP hooks' reasoning, daemon/webhooks/esp.py).
PUSH_FAILURES_PER_S = 5.0
PUSH_FAILURE_BURST = 20.0
MAX_TRACKED_PUSH_PEERS = 10_000


def push_failure_budgets() -> PeerBudgets:
    """Every push route's per-peer budget of failed requests."""
    return PeerBudgets(PUSH_FAILURES_PER_S, PUSH_FAILURE_BURST, MAX_TRACKED_PUSH_PEERS)


class PushTable(Generic[T]):
    """tenant → what a push route needs of it, with the route's per-peer failure
    budgets; `replace` swaps the tenants whole on SIGHUP (the budgets stay)."""

    def __init__(self, tenants: Mapping[str, T] | None = None) -> None:
        self._tenants: dict[str, T] = dict(tenants or {})
        self.failures = push_failure_budgets()

    def replace(self, tenants: Mapping[str, T]) -> None:
        self._tenants = dict(tenants)

    def get(self, tenant_id: str) -> T | None:
        return self._tenants.get(tenant_id)
