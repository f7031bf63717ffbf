"""The client's address behind a reverse proxy: `[listener] trusted_proxies`.

Behind a proxy every request's TCP peer is the proxy, so every sender would share one
failure budget per webhook source (adapters/webhook_budgets.py), one line in the logs
and one label in the metrics: a flood of unsigned requests from one sender would have
every signed event of every other sender answered 429 (measured: 30 of 30 at ~4,000
req/s). With trusted proxies configured, `client_middleware` replaces
`request.remote` with the client's address before any handler, budget or log sees it.

The rule (the one nginx's `real_ip_recursive on` and Caddy's `trusted_proxies` use):

    TCP peer not a trusted proxy     → the peer is the client; headers are ignored
                                       (anyone can write them)
    TCP peer a trusted proxy         → walk the configured header's addresses from
                                       the right (the hop nearest to us) leftwards,
                                       skipping trusted proxies; the first address
                                       that is not one is the client
    every address a trusted proxy    → the leftmost one
    header missing, or a hop that is → the TCP peer (a hop that cannot be read ends the
    not an address ("unknown", an      chain of trust: its token would let a sender pick
    obfuscated node, garbage)          a fresh budget per request)

Entries to the left of the client were written by the client itself and are never
used. Only ONE header is read, the one the proxy is configured to write
(`forwarded_header`, X-Forwarded-For by default): a proxy that appends to
X-Forwarded-For usually passes a `Forwarded` header through untouched, so reading
both would let a sender choose its own address.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, Sequence

from aiohttp import hdrs, web
from aiohttp.typedefs import Middleware

from inboxd.daemon.config.main import FORWARDED_HEADERS, TrustedProxies

__all__ = [
    "FORWARDED_HEADERS",
    "TrustedProxies",
    "client_address",
    "client_middleware",
]

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _address(token: str) -> Address | None:
    """An address as proxies write it: bare, IPv4 with a port, `[IPv6]` with or without
    a port (RFC 7239 §6); an IPv4-mapped IPv6 address as IPv4. None when it is not one."""
    token = token.strip().strip('"')
    if token.startswith("["):
        token = token[1 : token.find("]")] if "]" in token else ""
    elif token.count(":") == 1:
        token = token.split(":", 1)[0]  # IPv4:port
    try:
        address = ipaddress.ip_address(token)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _trusted(address: Address, trusted: TrustedProxies) -> bool:
    return any(address in network for network in trusted)


def client_address(peer: str | None, hops: Sequence[str], trusted: TrustedProxies) -> str | None:
    """The client's address for a request from `peer` whose proxy header lists `hops`
    (left to right, as written); the rule is in the module docstring."""
    peer_address = _address(peer) if peer else None
    if peer_address is None or not _trusted(peer_address, trusted) or not hops:
        return peer
    client = peer
    for token in reversed(hops):
        address = _address(token)
        if address is None:
            return peer
        client = str(address)
        if not _trusted(address, trusted):
            return client
    return client


def _hops(request: web.Request, header: str) -> list[str]:
    if header == "forwarded":
        # aiohttp parses RFC 7239 elements (quoted strings, several header lines) for us;
        # an element without `for=` is a hop we cannot read.
        return [element.get("for", "") for element in request.forwarded]
    return [
        token
        for line in request.headers.getall(hdrs.X_FORWARDED_FOR, ())
        for token in line.split(",")
        if token.strip()
    ]


def client_middleware(trusted: TrustedProxies, header: str = FORWARDED_HEADERS[0]) -> Middleware:
    """An aiohttp middleware that sets `request.remote` to the client's address when the
    TCP peer is one of `trusted` (outermost, so budgets, logs and metrics see it)."""
    if header not in FORWARDED_HEADERS:
        raise ValueError(f"forwarded_header must be one of {', '.join(FORWARDED_HEADERS)}")

    @web.middleware
    async def middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
        client = client_address(request.remote, _hops(request, header), trusted)
        if client is not None and client != request.remote:
            request = request.clone(remote=client)
        return await handler(request)

    return middleware
