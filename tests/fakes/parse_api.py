"""FakeParseApi: a parse API on 127.0.0.1 (ephemeral port) for the http backend's tests.

POST /parse takes `{raw_mime, schema_id | schema}` with a bearer token, records
what it received, and answers the next of `script` (a list of answers given in
order), else whatever `answer` says (a status, headers and a body), after
`delay_s` (an endpoint's latency), or never answers while `hold` is set (a slow
endpoint: the client's deadline fires first; closing the server lets the
handler go). `answer` may also be a function of the received request (an
endpoint that extracts something from the mail).
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import anyio
import orjson
from aiohttp import web


@dataclass(slots=True)
class Answer:
    status: int = 200
    body: bytes = b"{}"
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, status: int, document: Any, **headers: str) -> Answer:
        return cls(status, orjson.dumps(document), {"Content-Type": "application/json", **headers})


@dataclass(slots=True)
class Received:
    authorization: str | None
    raw_mime: bytes
    document: dict[str, Any]
    at: float = field(default_factory=time.monotonic)  # when it arrived


class FakeParseApi:
    """`async with FakeParseApi() as api:` then point a backend at `api.url`."""

    def __init__(self) -> None:
        self.answer: Answer | Callable[[Received], Answer] = Answer.json(200, {})
        self.script: list[Answer] = []
        self.delay_s = 0.0
        self.hold = False
        self.received: list[Received] = []
        self._release = anyio.Event()
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> FakeParseApi:
        app = web.Application()
        app.router.add_post("/parse", self._parse)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}/parse"
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._release.set()
        if self._runner is not None:
            await self._runner.cleanup()

    def release_held(self) -> None:
        """Let every request held so far be answered (with the answer current then)."""
        self._release.set()
        self._release = anyio.Event()

    async def _parse(self, request: web.Request) -> web.Response:
        document = orjson.loads(await request.read())
        received = Received(
            request.headers.get("Authorization"),
            base64.b64decode(document["raw_mime"], validate=True),
            document,
        )
        self.received.append(received)
        if self.hold:
            await self._release.wait()
        if self.delay_s:
            await anyio.sleep(self.delay_s)
        if self.script:
            answer = self.script.pop(0)
        elif callable(self.answer):
            answer = self.answer(received)
        else:
            answer = self.answer
        return web.Response(status=answer.status, body=answer.body, headers=answer.headers)
