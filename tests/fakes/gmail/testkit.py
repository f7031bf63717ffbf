"""Helpers for tests that talk to FakeGmail over HTTP: a hand-moved clock, bearer
headers, JSON GETs, the refresh grant, and batch bodies built and read with only
the shape the batch guide documents (independently of the client's batch codec).
"""

from __future__ import annotations

from typing import Any

import aiohttp

from .batch import boundary_of, split_parts
from .server import DEFAULT_CLIENT_ID, DEFAULT_CLIENT_SECRET, FakeGmail

ALICE = "alice@example.com"
BOB = "bob@example.com"


class ManualClock:
    """Quota and token time that tests move by hand (`clock.now += 0.5`), never sleeping."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def get_json(
    http: aiohttp.ClientSession, url: str, token: str, params: object = None
) -> tuple[int, dict[str, Any]]:
    async with http.get(url, headers=bearer(token), params=params) as resp:  # type: ignore[arg-type]
        return resp.status, await resp.json()


async def refresh(
    http: aiohttp.ClientSession, fake: FakeGmail, refresh_token: str
) -> tuple[int, dict[str, Any]]:
    form = {
        "grant_type": "refresh_token",
        "refresh_token": refresh_token,
        "client_id": DEFAULT_CLIENT_ID,
        "client_secret": DEFAULT_CLIENT_SECRET,
    }
    async with http.post(fake.token_url, data=form) as resp:
        return resp.status, await resp.json()


def batch_body(paths: list[str], boundary: str = "xyz-boundary") -> bytes:
    parts = [
        f"--{boundary}\r\nContent-Type: application/http\r\nContent-ID: <item{n}>\r\n\r\n"
        f"GET {path}\r\n\r\n"
        for n, path in enumerate(paths)
    ]
    return ("".join(parts) + f"--{boundary}--\r\n").encode()


def parse_answer(body: bytes, content_type: str) -> dict[str, tuple[int, dict[str, str], bytes]]:
    """Content-ID -> (status, headers, body), read with the batch guide's shape only."""
    out = {}
    for part in split_parts(body, boundary_of(content_type)):
        head, _, http_message = part.partition(b"\r\n\r\n")
        content_id = next(
            line.split(b":", 1)[1].strip().decode()
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-id:")
        )
        status_head, _, payload = http_message.partition(b"\r\n\r\n")
        lines = status_head.decode().split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:])
        assert len(payload) == int(headers["Content-Length"])
        out[content_id] = (int(lines[0].split()[1]), headers, payload)
    return out
