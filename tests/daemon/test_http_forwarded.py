"""The client's address behind trusted proxies (daemon/http/forwarded.py), hop by hop."""

from __future__ import annotations

import ipaddress

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict

from inboxd.daemon.http.forwarded import client_address, client_middleware

TRUSTED = (ipaddress.ip_network("127.0.0.1/32"), ipaddress.ip_network("10.0.0.0/8"))


@pytest.mark.parametrize(
    ("peer", "hops", "client"),
    [
        # Not a trusted proxy: its headers are the sender's own words.
        ("192.0.2.9", ["198.51.100.7"], "192.0.2.9"),
        # The proxy's header names the client; the sender's own entries to its left never.
        ("127.0.0.1", ["198.51.100.7"], "198.51.100.7"),
        ("127.0.0.1", ["203.0.113.66", "198.51.100.7"], "198.51.100.7"),
        # Trusted hops are walked from the right.
        ("127.0.0.1", ["198.51.100.7", "10.1.2.3"], "198.51.100.7"),
        ("127.0.0.1", ["10.9.9.9", "10.1.2.3"], "10.9.9.9"),
        # Ports and brackets as proxies write them (RFC 7239 §6), IPv4-mapped as IPv4.
        ("127.0.0.1", ["198.51.100.7:4711"], "198.51.100.7"),
        ("127.0.0.1", ['"[2001:db8:cafe::17]:4711"'], "2001:db8:cafe::17"),
        ("127.0.0.1", ["2001:db8::1"], "2001:db8::1"),
        ("127.0.0.1", ["::ffff:198.51.100.7"], "198.51.100.7"),
        ("::ffff:127.0.0.1", ["198.51.100.7"], "198.51.100.7"),
        # A hop that is not an address ends the chain of trust at the proxy.
        ("127.0.0.1", ["198.51.100.7", "unknown"], "127.0.0.1"),
        ("127.0.0.1", ["_hidden"], "127.0.0.1"),
        ("127.0.0.1", [], "127.0.0.1"),
        (None, ["198.51.100.7"], None),
    ],
)
def test_client_address(peer: str | None, hops: list[str], client: str | None) -> None:
    assert client_address(peer, hops, TRUSTED) == client


def test_nothing_is_trusted_without_trusted_proxies() -> None:
    assert client_address("127.0.0.1", ["198.51.100.7"], ()) == "127.0.0.1"


@pytest.mark.parametrize(
    ("header", "headers", "client"),
    [
        ("x-forwarded-for", [("X-Forwarded-For", "203.0.113.66, 198.51.100.7")], "198.51.100.7"),
        # several header lines are one list, in order
        (
            "x-forwarded-for",
            [("X-Forwarded-For", "198.51.100.7"), ("X-Forwarded-For", "10.1.2.3")],
            "198.51.100.7",
        ),
        ("forwarded", [("Forwarded", 'for=203.0.113.66, for="[2001:db8::17]:80"')], "2001:db8::17"),
        # the header the proxy does not write is the sender's, and ignored
        ("forwarded", [("X-Forwarded-For", "198.51.100.7")], "127.0.0.1"),
        ("x-forwarded-for", [("Forwarded", "for=198.51.100.7")], "127.0.0.1"),
    ],
)
async def test_the_middleware_reads_only_the_configured_header(
    header: str, headers: list[tuple[str, str]], client: str
) -> None:
    seen: list[str | None] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(request.remote)
        return web.Response()

    request = make_mocked_request("POST", "/hooks/x", headers=CIMultiDict(headers))
    request = request.clone(remote="127.0.0.1")  # the TCP peer: the proxy
    await client_middleware(TRUSTED, header)(request, handler)
    assert seen == [client]
