"""Helpers for tests that talk to FakeGraph over HTTP: a hand-moved clock, request
headers with the Prefer preferences, JSON GETs, a delta-round walker, and a
webhook receiver that answers Graph's validation handshake and records
notifications (so tests wait on an event, never sleep).
"""

from __future__ import annotations

from typing import Any

import aiohttp
import anyio
from aiohttp import web

from .server import FakeGraph

ALICE = "alice@contoso.com"
BOB = "bob@contoso.com"
EPOCH_2026 = 1_767_225_600.0  # 2026-01-01T00:00:00Z


class ManualClock:
    """Wall-clock seconds that tests move by hand (`clock.now += 60`), never sleeping."""

    def __init__(self, now: float = EPOCH_2026) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def headers(
    token: str, *, immutable: bool = True, maxpagesize: int | None = None
) -> dict[str, str]:
    """Authorization plus one Prefer header carrying every preference, comma-separated."""
    prefs = ['IdType="ImmutableId"'] if immutable else []
    if maxpagesize is not None:
        prefs.append(f"odata.maxpagesize={maxpagesize}")
    out = {"Authorization": f"Bearer {token}"}
    if prefs:
        out["Prefer"] = ", ".join(prefs)
    return out


async def get_json(
    http: aiohttp.ClientSession, url: str, hdrs: dict[str, str], params: Any = None
) -> tuple[int, dict[str, Any]]:
    async with http.get(url, headers=hdrs, params=params) as resp:
        return resp.status, await resp.json(content_type=None)


async def delta_round(
    http: aiohttp.ClientSession, url: str, hdrs: dict[str, str], params: Any = None
) -> tuple[list[dict[str, Any]], str, list[dict[str, Any]]]:
    """Follow nextLinks to the deltaLink: (every item, the deltaLink, every page)."""
    items: list[dict[str, Any]] = []
    pages: list[dict[str, Any]] = []
    while True:
        status, page = await get_json(http, url, hdrs, params)
        assert status == 200, page
        pages.append(page)
        items += page["value"]
        if "@odata.deltaLink" in page:
            return items, page["@odata.deltaLink"], pages
        url, params = page["@odata.nextLink"], None


async def app_token(http: aiohttp.ClientSession, fake: FakeGraph) -> str:
    form = {
        "grant_type": "client_credentials",
        "client_id": fake.client_id,
        "client_secret": fake.client_secret,
        "scope": "https://graph.microsoft.com/.default",
    }
    async with http.post(fake.token_url, data=form) as resp:
        assert resp.status == 200
        return str((await resp.json())["access_token"])


class Receiver:
    """A webhook endpoint on 127.0.0.1: echoes validationToken (unless `validate`
    is off), records every JSON POST, answers `status` (202 by default)."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self.validations: list[str] = []
        self.validate = True
        self.status = 202
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._arrived = anyio.Event()

    async def __aenter__(self) -> Receiver:
        app = web.Application()
        app.router.add_post("/{name}", self._post)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def wait_for(self, count: int, timeout_s: float = 5.0) -> list[dict[str, Any]]:
        """Every notification item received, once there are at least `count`."""
        with anyio.fail_after(timeout_s):
            while len(self.items()) < count:
                await self._arrived.wait()
        return self.items()

    def items(self) -> list[dict[str, Any]]:
        return [item for body in self.received for item in body["value"]]

    async def _post(self, request: web.Request) -> web.Response:
        token = request.query.get("validationToken")
        if token is not None:
            self.validations.append(token)
            if not self.validate:
                return web.Response(status=400)
            return web.Response(text=token, content_type="text/plain")
        self.received.append(await request.json())
        self._arrived.set()
        self._arrived = anyio.Event()
        return web.Response(status=self.status)
