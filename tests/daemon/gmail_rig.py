"""The Gmail door under `inboxd run`: a real daemon process against FakeGmail, and
what its tests read back.

FakeGmail runs in the test's event loop on 127.0.0.1; the tenant file points the
door's api_url/token_url/certs_url at it, and the fake serves the GoogleSigner's
certificates, so a push the test signs is verified exactly as Google's would be.
Blocking waits (DaemonProcess.wait_ready, CLI runs) go to a thread: the fake must
keep answering the daemon meanwhile.

Shared by test_gmail_run, test_gmail_reset_run, test_gmail_watch_run and
test_gmail_connect_run (a test module never imports another test module).
"""

from __future__ import annotations

import base64
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import anyio
import orjson
from aiohttp import web
from fakes.gmail import FakeGmail
from harness import DaemonProcess, DaemonReads, generated_messages, write_config
from helpers.google_jwt import GoogleSigner

AUDIENCE = "https://inboxd.acme.example/push/gmail/acme"
PUSHER = "gmail-push@acme-mail.iam.gserviceaccount.com"
TOPIC = "projects/acme-mail/topics/gmail"
SUPPORT, SALES = "support@acme.example", "sales@acme.example"
API_TOKEN = "acme-api-token-for-tests"


class GatedGmail(FakeGmail):
    """FakeGmail whose history.list answers wait while `gate` is closed, so a test
    can hold one sync in flight while a storm of pushes arrives."""

    gate: anyio.Event | None = None

    async def _api(self, request: web.Request) -> web.Response:
        if self.gate is not None and request.path.endswith("/history"):
            await self.gate.wait()
        return await super()._api(request)


@dataclass
class Running(DaemonReads):
    tmp: Path
    dsn: str
    fake: GatedGmail
    signer: GoogleSigner
    daemon: DaemonProcess
    base: str
    session: aiohttp.ClientSession
    refresh_tokens: dict[str, str] = field(default_factory=dict)

    async def push(self, address: str, history_id: int | str | None = None) -> int:
        """POST a signed Pub/Sub push for `address` (its newest historyId unless given)."""
        box = self.fake.mailbox(address)
        history_id = box.history_id if history_id is None else history_id
        data = orjson.dumps({"emailAddress": address, "historyId": history_id})
        body = orjson.dumps(
            {
                "message": {
                    "data": base64.b64encode(data).decode(),
                    "messageId": str(history_id),
                    "publishTime": "2026-12-01T17:00:00.000Z",
                },
                "subscription": "projects/acme-mail/subscriptions/gmail-push",
            }
        )
        claims = self.signer.claims(audience=AUDIENCE, email=PUSHER, now=time.time())
        headers = {
            "Authorization": f"Bearer {self.signer.sign(claims)}",
            "Content-Type": "application/json",
        }
        async with self.session.post(
            f"{self.base}/push/gmail/acme", data=body, headers=headers
        ) as response:
            return response.status

    async def deliver_published(self, address: str) -> list[int]:
        """Pub/Sub's part: push what the fake published for `address` (only what a
        live watch published), oldest first; the answers' statuses."""
        box = self.fake.mailbox(address)
        published, box.published = box.published, []
        return [await self.push(address, note["historyId"]) for note in published]

    async def cursor_is(self, mailbox: str, expected: str) -> bool:
        return await self.cursor(mailbox) == expected

    async def backfilled(self, mailbox: str, count: int) -> bool:
        """The mailbox has a cursor and exactly `count` copies."""
        return await self.cursor(mailbox) is not None and await self.rows(mailbox) == count


def tenant_file(
    fake: FakeGmail,
    token_files: dict[str, Path],
    gmail_extra: str = "",
    *,
    backfill: str = '"all"',
) -> str:
    """The tenant "acme": push-mode Gmail mailboxes on `fake`; `backfill` as TOML."""
    boxes = "".join(
        f"""
[[mailboxes]]
id = "{address.split("@")[0]}"
provider = "gmail"
address = "{address}"
sync_mode = "push"
refresh_token = "file:{path}"
backfill = {backfill}
"""
        for address, path in token_files.items()
    )
    return f"""
id = "acme"
api_token = "env:ACME_API_TOKEN"
[gmail]
client_id = "{fake.client_id}"
client_secret = "env:ACME_GMAIL_SECRET"
topic = "{TOPIC}"
push_audience = "{AUDIENCE}"
push_service_account = "{PUSHER}"
api_url = "{fake.base_url}"
token_url = "{fake.token_url}"
certs_url = "{fake.certs_url}"
{gmail_extra}
{boxes}"""


@asynccontextmanager
async def daemon_life(
    tmp: Path, dsn: str, fake: GatedGmail, signer: GoogleSigner, life: str
) -> AsyncIterator[Running]:
    """One `inboxd run` process over the config already in `tmp` (its log
    tmp/daemon-`life`.log), until the block ends (then SIGKILL: the daemon is down,
    nothing of it finishes)."""
    config = tmp / "inboxd.toml"
    env = {"ACME_GMAIL_SECRET": fake.client_secret, "ACME_API_TOKEN": API_TOKEN}
    daemon = DaemonProcess(config, dsn, tmp / f"daemon-{life}.log", env=env)
    try:
        port = await anyio.to_thread.run_sync(daemon.wait_ready)
        async with aiohttp.ClientSession() as session:
            yield Running(tmp, dsn, fake, signer, daemon, f"http://127.0.0.1:{port}", session)
    finally:
        daemon.kill()


@asynccontextmanager
async def gmail_daemon(
    tmp: Path,
    dsn: str,
    seed: dict[str, int],
    *,
    gated: bool = False,
    unmetered: bool = False,
    watch_ttl_ms: int | None = None,
) -> AsyncIterator[Running]:
    """A daemon whose tenant "acme" has one push-mode Gmail mailbox per `seed`
    address, each seeded with that many messages and fully backfilled.
    `unmetered`: no quota in the fake and a pacer far above it (large volumes);
    `watch_ttl_ms`: how long the fake's users.watch answers say a watch lasts."""
    quota = {"quota_units_per_s": None} if unmetered else {}
    async with GatedGmail(seed, **quota) as fake:
        if watch_ttl_ms is not None:
            fake.watch_ttl_ms = watch_ttl_ms
        signer = GoogleSigner()
        fake.set_certs(signer.certs())
        tokens: dict[str, str] = {}
        files: dict[str, Path] = {}
        for address, count in seed.items():
            for raw in generated_messages(count, tag=address.split("@")[0]):
                fake.mailbox(address).add_message(raw)
            tokens[address] = fake.issue_refresh_token(address)
            files[address] = tmp / f"{address}.refresh-token"
            files[address].write_text(tokens[address] + "\n")
        write_config(tmp)
        extra = "quota_units_per_s = 100000" if unmetered else ""
        (tmp / "tenants" / "acme.toml").write_text(tenant_file(fake, files, extra))
        async with daemon_life(tmp, dsn, fake, signer, "only") as running:
            running.refresh_tokens = tokens
            try:
                for address, count in seed.items():
                    box = address.split("@")[0]
                    await running.eventually(
                        lambda box=box, count=count: running.backfilled(box, count),
                        f"{box}: {count} rows and a cursor",
                    )
                if gated:
                    fake.gate = anyio.Event()
                yield running
            finally:
                if fake.gate is not None:
                    fake.gate.set()
