"""`inboxd connect gmail` as a subprocess against FakeGmail's /authorize and /token.

The test plays the browser: it reads the consent URL the command prints, GETs it
(the fake consents at once and redirects to the command's loopback listener) and
follows the redirect there.
"""

from __future__ import annotations

import os
import pwd
import socket
import stat
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import aiohttp
import anyio
import pytest
from anyio.abc import Process
from fakes.gmail import GMAIL_SCOPE, FakeGmail, pkce_s256
from helpers import cli_argv, cli_env, run_cli
from helpers.config_files import TENANTS_ONLY, write_config_tree

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

ALICE = "alice@example.com"
DEADLINE_S = 60


def write_gmail_config(tmp: Path, fake: FakeGmail, *, refresh_line: str = "") -> Path:
    """Tenant acme with Gmail mailbox alice on `fake`; the main file's path."""
    return write_config_tree(
        tmp,
        TENANTS_ONLY,
        acme=f"""
id = "acme"
[gmail]
client_id = "{fake.client_id}"
client_secret = "env:ACME_GMAIL_SECRET"
api_url = "{fake.base_url}"
token_url = "{fake.token_url}"
[[mailboxes]]
id = "alice"
provider = "gmail"
address = "{ALICE}"
{refresh_line}
""",
    )


@dataclass
class Connect:
    proc: Process
    stderr: list[str] = field(default_factory=list)
    stdout: str = ""

    async def consent_url(self, prefix: str) -> str:
        """The URL line the command prints on stderr."""
        assert self.proc.stderr is not None
        buffer = ""
        with anyio.fail_after(DEADLINE_S):
            async for chunk in self.proc.stderr:
                buffer += chunk.decode()
                *lines, buffer = buffer.split("\n")
                self.stderr.extend(lines)
                for line in lines:
                    if line.startswith(prefix):
                        return line.strip()
        raise AssertionError(f"no consent URL in {self.stderr}")

    async def finish(self) -> int:
        assert self.proc.stdout is not None and self.proc.stderr is not None
        with anyio.fail_after(DEADLINE_S):
            self.stdout = (await _read_all(self.proc.stdout)).decode()
            self.stderr.extend((await _read_all(self.proc.stderr)).decode().splitlines())
            return await self.proc.wait()


async def _read_all(stream: anyio.abc.ByteReceiveStream) -> bytes:
    out = b""
    async for chunk in stream:
        out += chunk
    return out


@asynccontextmanager
async def connect(tmp: Path, fake: FakeGmail, *extra: str) -> AsyncIterator[Connect]:
    env = cli_env(tmp / "data", ACME_GMAIL_SECRET=fake.client_secret)
    argv = cli_argv(
        "connect",
        "gmail",
        "--config",
        tmp / "inboxd.toml",
        "--tenant",
        "acme",
        "--mailbox",
        "alice",
        "--auth-url",
        fake.authorize_url,
        *extra,
    )
    async with await anyio.open_process(argv, env=env) as proc:
        try:
            yield Connect(proc)
        finally:
            if proc.returncode is None:
                proc.kill()


async def browse(url: str) -> tuple[int, str]:
    """The browser: consent page → redirect → the command's loopback listener."""
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.text()


async def test_consent_writes_a_0600_refresh_token_the_daemon_can_use(tmp_path: Path) -> None:
    async with FakeGmail([ALICE, "bob@example.com"]) as fake:
        config = write_gmail_config(tmp_path, fake)
        async with connect(tmp_path, fake) as cmd:
            url = await cmd.consent_url(fake.authorize_url)
            query = parse_qs(urlsplit(url).query)
            redirect = query["redirect_uri"][0]
            # a request without our state is refused and the command keeps waiting
            status, _ = await browse(f"{redirect}?code=forged&state=wrong")
            assert status == 400
            assert await browse(url) == (200, "inboxd: done, you can close this window.\n")
            assert await cmd.finish() == 0, cmd.stderr

        assert urlsplit(redirect).hostname == "127.0.0.1"
        assert query["scope"] == [GMAIL_SCOPE]
        assert query["access_type"] == ["offline"] and query["prompt"] == ["consent"]
        assert query["code_challenge_method"] == ["S256"] and query["login_hint"] == [ALICE]
        assert len(query["code_challenge"][0]) == len(pkce_s256("x"))
        out = tmp_path / "tenants" / "acme.alice.refresh-token"
        assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
        token = out.read_text().strip()
        assert fake.oauth.refresh_tokens[token].user == ALICE
        line = f'refresh_token = "file:{out}"'
        assert cmd.stdout.splitlines()[-1] == line
        assert token not in cmd.stdout + "\n".join(cmd.stderr)

        # the printed line makes the tenant file valid for `inboxd run`
        write_gmail_config(tmp_path, fake, refresh_line=line)
        env = cli_env(tmp_path / "data", ACME_GMAIL_SECRET=fake.client_secret)
        checked = await anyio.to_thread.run_sync(lambda: run_cli("check-config", config, env=env))
        assert checked.code == 0, checked.stderr

        # never over an existing file without --force
        again = await anyio.to_thread.run_sync(
            lambda: run_cli(
                "connect", "gmail", "--config", config, "--tenant", "acme", "--mailbox", "alice",
                env=env,
            )
        )  # fmt: skip
        assert again.code == 2 and "exists: pass --force" in again.stderr
        assert out.read_text().strip() == token

        async with connect(tmp_path, fake, "--force", "--json") as cmd:
            await browse(await cmd.consent_url(fake.authorize_url))
            assert await cmd.finish() == 0, cmd.stderr
        assert out.read_text().strip() not in ("", token)
        assert stat.S_IMODE(os.stat(out).st_mode) == 0o600


async def test_consent_for_another_account_writes_nothing(tmp_path: Path) -> None:
    async with FakeGmail([ALICE, "bob@example.com"]) as fake:
        write_gmail_config(tmp_path, fake)
        async with connect(tmp_path, fake) as cmd:
            url = await cmd.consent_url(fake.authorize_url)
            # the browser was signed in as bob (the fake consents as login_hint)
            await browse(url.replace("alice%40example.com", "bob%40example.com"))
            assert await cmd.finish() == 1
        assert any(f"consent was given for bob@example.com, not {ALICE}" in x for x in cmd.stderr)
        assert not (tmp_path / "tenants" / "acme.alice.refresh-token").exists()


async def test_no_browser_answer_times_out(tmp_path: Path) -> None:
    async with FakeGmail([ALICE]) as fake:
        write_gmail_config(tmp_path, fake)
        async with connect(tmp_path, fake, "--timeout", "1") as cmd:
            await cmd.consent_url(fake.authorize_url)
            assert await cmd.finish() == 1
        assert any("no answer from the browser within 1 s" in line for line in cmd.stderr)
        assert not (tmp_path / "tenants" / "acme.alice.refresh-token").exists()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def _redirect_of(url: str) -> str:
    """The consent page's redirect, not followed: the address a browser would show."""
    async with aiohttp.ClientSession() as session:
        async with session.get(url, allow_redirects=False) as response:
            assert response.status in (302, 303), response.status
            return response.headers["Location"]


async def test_a_fixed_port_for_an_ssh_tunnel(tmp_path: Path) -> None:
    port = _free_port()
    async with FakeGmail([ALICE]) as fake:
        write_gmail_config(tmp_path, fake)
        async with connect(tmp_path, fake, "--port", str(port)) as cmd:
            url = await cmd.consent_url(fake.authorize_url)
            redirect = parse_qs(urlsplit(url).query)["redirect_uri"][0]
            assert redirect == f"http://127.0.0.1:{port}/"
            assert (await browse(url))[0] == 200
            assert await cmd.finish() == 0, cmd.stderr
        assert (tmp_path / "tenants" / "acme.alice.refresh-token").is_file()
        # the next step is spelled out
        assert any("inboxd check-config" in line for line in cmd.stderr), cmd.stderr

        # a port that is taken is said so at once, before anyone signs in
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            busy = str(taken.getsockname()[1])
            async with connect(tmp_path, fake, "--port", busy, "--force") as cmd:
                assert await cmd.finish() == 1
        assert any(f"cannot listen on 127.0.0.1:{busy}" in line for line in cmd.stderr)


async def test_manual_mode_takes_the_pasted_redirect(tmp_path: Path) -> None:
    async with FakeGmail([ALICE]) as fake:
        write_gmail_config(tmp_path, fake)
        async with connect(tmp_path, fake, "--manual") as cmd:
            url = await cmd.consent_url(fake.authorize_url)
            location = await _redirect_of(url)
            # a pasted address from another sign-in is refused
            assert cmd.proc.stdin is not None
            forged = location.replace("state=", "state=x")
            await cmd.proc.stdin.send(forged.encode() + b"\n")
            assert await cmd.finish() == 1
        assert any("belongs to another sign-in" in line for line in cmd.stderr), cmd.stderr
        out = tmp_path / "tenants" / "acme.alice.refresh-token"
        assert not out.exists()

        async with connect(tmp_path, fake, "--manual") as cmd:
            location = await _redirect_of(await cmd.consent_url(fake.authorize_url))
            assert location.startswith("http://127.0.0.1:")  # nothing listens there
            assert cmd.proc.stdin is not None
            await cmd.proc.stdin.send(f"  {location}  \n".encode())
            assert await cmd.finish() == 0, cmd.stderr
        token = out.read_text().strip()
        assert fake.oauth.refresh_tokens[token].user == ALICE


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
async def test_the_token_file_belongs_to_the_daemons_user(tmp_path: Path) -> None:
    nobody = pwd.getpwnam("nobody")
    async with FakeGmail([ALICE]) as fake:
        write_gmail_config(tmp_path, fake)
        async with connect(tmp_path, fake, "--owner", "nobody") as cmd:
            await browse(await cmd.consent_url(fake.authorize_url))
            assert await cmd.finish() == 0, cmd.stderr
        info = os.stat(tmp_path / "tenants" / "acme.alice.refresh-token")
        assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (nobody.pw_uid, 0o600)
