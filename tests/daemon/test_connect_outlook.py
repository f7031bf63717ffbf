"""`inboxd connect outlook` as a subprocess against FakeGraph's /devicecode and /token.

The test plays the person at the verification page: it reads the user code in the
message the command prints and approves, declines or expires it at the fake.
INBOXD_TEST_POLL_SCALE shrinks every wait between polls (the fake's 5 s interval
becomes 0.1 s); the fake's token handler is wrapped to record when each poll
arrived and what it was answered.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
from anyio.abc import Process
from anyio.streams.text import TextReceiveStream
from cryptography.hazmat.primitives import serialization
from fakes.graph import DEVICE_CODE_GRANT, FakeGraph
from fakes.graph.errors import Answer
from helpers import cli_argv, cli_env, eventually, run_cli_async
from helpers.config_files import TENANTS_ONLY, write_config_tree
from helpers.keys import make_certificate, rsa_key

from inboxd.adapters.outlook.auth import GraphTokens
from inboxd.adapters.outlook.config import OutlookMailbox, OutlookSettings
from inboxd.daemon.commands.common import EXIT_USAGE, CommandError
from inboxd.daemon.commands.connect_outlook import device_flow
from inboxd.daemon.config.secrets import Secret

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

ALICE = "alice@contoso.com"
DEADLINE_S = 60
POLL_SCALE = 0.02  # the fake's interval of 5 s → 0.1 s between polls
FAKE_INTERVAL_S = 5.0  # what the fake answers in `interval`
SLOW_DOWN_STEP_S = 5.0  # RFC 8628 §3.5
TOKEN_FILE = "acme.alice.refresh-token"


@pytest.fixture
async def fake() -> AsyncIterator[FakeGraph]:
    async with FakeGraph([ALICE, "bob@contoso.com"]) as server:
        yield server


def write_outlook_config(
    tmp: Path,
    fake: FakeGraph,
    *,
    table: bool = True,
    line: str = "",
    credential: str = 'client_secret = "env:ACME_GRAPH_SECRET"',
) -> Path:
    """The main config; its tenant file is tmp/tenants/acme.toml."""
    outlook = f"""
[outlook]
directory_id = "{fake.directory_id}"
client_id = "{fake.client_id}"
{credential}
graph_url = "{fake.graph_url}"
authority_url = "{fake.authority_url}"
"""
    return write_config_tree(
        tmp,
        TENANTS_ONLY,
        acme=f"""
id = "acme"
{outlook if table else ""}
[[mailboxes]]
id = "alice"
provider = "outlook"
address = "{ALICE}"
{line}
""",
    )


def env_for(tmp: Path, fake: FakeGraph) -> dict[str, str]:
    return cli_env(
        tmp / "data", ACME_GRAPH_SECRET=fake.client_secret, INBOXD_TEST_POLL_SCALE=str(POLL_SCALE)
    )


@dataclass
class Seen:
    """What the fake's identity endpoints received."""

    device_code_forms: list[dict[str, str]] = field(default_factory=list)
    poll_forms: list[dict[str, str]] = field(default_factory=list)
    poll_at: list[float] = field(default_factory=list)  # time.monotonic() at arrival
    poll_errors: list[str] = field(default_factory=list)  # "" for a 200

    def gaps(self) -> Iterator[tuple[float, int]]:
        """(seconds since the previous poll, slow_downs answered before it)."""
        for i in range(1, len(self.poll_at)):
            yield self.poll_at[i] - self.poll_at[i - 1], self.poll_errors[:i].count("slow_down")


@pytest.fixture
def seen(fake: FakeGraph) -> Seen:
    record = Seen()
    token, devicecode = fake.identity.token, fake.identity.devicecode

    def on_token(tenant: str, form: dict[str, str]) -> Answer:
        answer = token(tenant, form)
        if form.get("grant_type") == DEVICE_CODE_GRANT:
            record.poll_at.append(time.monotonic())
            record.poll_forms.append(form)
            body: Any = answer.json
            record.poll_errors.append("" if answer.status == 200 else body["error"])
        return answer

    def on_devicecode(tenant: str, form: dict[str, str]) -> Answer:
        record.device_code_forms.append(form)
        return devicecode(tenant, form)

    fake.identity.token = on_token  # type: ignore[method-assign]
    fake.identity.devicecode = on_devicecode  # type: ignore[method-assign]
    return record


@dataclass
class Connect:
    """The running command: its stderr read line by line, its stdout at the end."""

    proc: Process
    stderr: list[str] = field(default_factory=list)
    stdout: str = ""

    async def user_code(self) -> str:
        """The code in the sign-in message the command prints on stderr."""
        assert self.proc.stderr is not None
        lines = TextReceiveStream(self.proc.stderr)
        with anyio.fail_after(DEADLINE_S):
            async for text in lines:
                self.stderr.extend(text.splitlines())
                if found := re.search(r"enter the code (\w+)", "\n".join(self.stderr)):
                    return found[1]
        raise AssertionError(f"no sign-in message in {self.stderr}")

    async def finish(self) -> int:
        assert self.proc.stdout is not None and self.proc.stderr is not None
        with anyio.fail_after(DEADLINE_S):
            self.stdout = "".join([text async for text in TextReceiveStream(self.proc.stdout)])
            rest = "".join([text async for text in TextReceiveStream(self.proc.stderr)])
            self.stderr.extend(rest.splitlines())
            return await self.proc.wait()

    @property
    def output(self) -> str:
        return self.stdout + "\n".join(self.stderr)


@asynccontextmanager
async def connect(tmp: Path, fake: FakeGraph, *extra: str) -> AsyncIterator[Connect]:
    argv = cli_argv(
        "connect", "outlook", "--config", tmp / "inboxd.toml", "--tenant", "acme",
        "--mailbox", "alice", *extra,
    )  # fmt: skip
    async with await anyio.open_process(argv, env=env_for(tmp, fake)) as proc:
        try:
            yield Connect(proc)
        finally:
            if proc.returncode is None:
                proc.kill()


async def polls_answered(seen: Seen, error: str, count: int) -> None:
    await eventually(
        lambda: seen.poll_errors.count(error),
        DEADLINE_S,
        what=f"{count} polls answered {error}",
        until=lambda n: n >= count,
    )


async def test_sign_in_writes_a_0600_refresh_token_the_daemon_can_use(
    tmp_path: Path, fake: FakeGraph, seen: Seen
) -> None:
    config = write_outlook_config(tmp_path, fake)
    async with connect(tmp_path, fake) as cmd:
        code = await cmd.user_code()
        await polls_answered(seen, "authorization_pending", 3)
        fake.approve_device_code(code, ALICE)
        assert await cmd.finish() == 0, cmd.stderr

    assert seen.device_code_forms == [
        {"client_id": fake.client_id, "scope": f"{fake.base_url}/.default offline_access"}
    ]
    assert seen.poll_errors[-1] == "" and len(seen.poll_errors) >= 4
    device_code = seen.poll_forms[0]["device_code"]
    assert all(
        form == {
            "grant_type": DEVICE_CODE_GRANT, "client_id": fake.client_id,
            "device_code": device_code, "client_secret": fake.client_secret,
        }
        for form in seen.poll_forms
    )  # fmt: skip
    # never faster than the (scaled) interval the fake answered
    assert all(gap >= FAKE_INTERVAL_S * POLL_SCALE * 0.98 for gap, _ in seen.gaps())

    out = tmp_path / "tenants" / TOKEN_FILE
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    token = out.read_text().strip()
    assert fake.identity.refresh_tokens[token].user == ALICE
    line = f'refresh_token = "file:{out}"'
    assert cmd.stdout.splitlines()[-1] == line
    assert token not in cmd.output
    assert not any(access in cmd.output for access in fake.identity.access_tokens)
    assert sorted(p.name for p in out.parent.iterdir()) == [TOKEN_FILE, "acme.toml"]

    # the printed line makes the tenant file valid, and the token opens the mailbox
    write_outlook_config(tmp_path, fake, line=line)
    env = env_for(tmp_path, fake)
    checked = await run_cli_async("check-config", config, env=env)
    assert checked.code == 0, checked.stderr
    settings = OutlookSettings.from_settings(
        {
            "directory_id": fake.directory_id, "client_id": fake.client_id,
            "graph_url": fake.graph_url, "authority_url": fake.authority_url,
        }
    )  # fmt: skip
    mailbox = OutlookMailbox(ALICE, refresh_token=Secret(f"file:{out}"))
    async with aiohttp.ClientSession() as http:
        assert fake.user_of_token(await GraphTokens(settings, mailbox, http).token()) == ALICE

    # never over an existing file without --force, and nobody is asked to sign in
    again = await run_cli_async(
        "connect", "outlook", "--config", config, "--tenant", "acme", "--mailbox", "alice",
        env=env,
    )  # fmt: skip
    assert again.code == 2 and "exists: pass --force" in again.stderr
    assert out.read_text().strip() == token and len(seen.device_code_forms) == 1


async def test_slow_down_makes_every_later_poll_wait_5_s_longer(
    tmp_path: Path, fake: FakeGraph, seen: Seen
) -> None:
    write_outlook_config(tmp_path, fake)
    async with connect(tmp_path, fake, "--json") as cmd:
        code = await cmd.user_code()
        fake.slow_down_device_code(code, times=2)
        await polls_answered(seen, "slow_down", 2)
        await polls_answered(seen, "authorization_pending", 1)
        fake.approve_device_code(code, ALICE)
        assert await cmd.finish() == 0, cmd.stderr

    assert '"status":"ok"' in cmd.stdout
    gaps = list(seen.gaps())
    # the fake's clock only gives lower bounds: each wait is at least the interval
    # in force, which grew by 5 s (scaled) with each slow_down and stayed grown
    for gap, slow_downs in gaps:
        wanted = (FAKE_INTERVAL_S + SLOW_DOWN_STEP_S * slow_downs) * POLL_SCALE
        assert gap >= wanted * 0.98, (gaps, seen.poll_errors)
    assert sum(1 for _, slow_downs in gaps if slow_downs == 2) >= 2  # pending, then 200
    assert (tmp_path / "tenants" / TOKEN_FILE).exists()


@pytest.mark.parametrize(
    ("act", "message"),
    [
        (FakeGraph.decline_device_code, "sign-in declined at the verification page"),
        (FakeGraph.expire_device_code, "the code expired before anyone signed in"),
    ],
    ids=["declined", "expired"],
)
async def test_a_failed_sign_in_writes_nothing(
    tmp_path: Path, fake: FakeGraph, seen: Seen, act: Any, message: str
) -> None:
    write_outlook_config(tmp_path, fake)
    async with connect(tmp_path, fake) as cmd:
        code = await cmd.user_code()
        await polls_answered(seen, "authorization_pending", 1)
        act(fake, code)
        assert await cmd.finish() == 1
    errors = [line for line in cmd.stderr if line.startswith("inboxd: error:")]
    assert len(errors) == 1 and message in errors[0], cmd.stderr
    assert "Traceback" not in cmd.output
    assert sorted(p.name for p in (tmp_path / "tenants").iterdir()) == ["acme.toml"]


async def test_ctrl_c_while_waiting_stops_cleanly(
    tmp_path: Path, fake: FakeGraph, seen: Seen
) -> None:
    write_outlook_config(tmp_path, fake)
    async with connect(tmp_path, fake) as cmd:
        await cmd.user_code()
        await polls_answered(seen, "authorization_pending", 1)
        cmd.proc.send_signal(signal.SIGINT)
        assert await cmd.finish() == 130
    assert "inboxd: interrupted" in cmd.stderr and "Traceback" not in cmd.output
    assert sorted(p.name for p in (tmp_path / "tenants").iterdir()) == ["acme.toml"]


async def test_an_unusable_outlook_table_is_a_config_error(
    tmp_path: Path, fake: FakeGraph, seen: Seen
) -> None:
    config = write_outlook_config(tmp_path, fake, table=False)
    argv = ("connect", "outlook", "--config", config, "--tenant", "acme", "--mailbox", "alice")
    tenant_file = tmp_path / "tenants" / "acme.toml"
    missing = await run_cli_async(*argv, env=env_for(tmp_path, fake))
    assert missing.code == 2, missing.stderr
    assert f"inboxd: error: {tenant_file}: outlook: tenant 'acme' has no [outlook] table" in (
        missing.stderr
    )

    write_outlook_config(tmp_path, fake)
    text = tenant_file.read_text().replace(f'client_id = "{fake.client_id}"', 'client_id = "x"')
    tenant_file.write_text(text)
    bad = await run_cli_async(*argv, env=env_for(tmp_path, fake))
    assert bad.code == 2 and f"{tenant_file}: outlook.client_id: expected" in bad.stderr
    assert seen.device_code_forms == []


def certificate_pem(tmp: Path, *, with_key: bool = True) -> tuple[Path, bytes]:
    """A PEM file as [outlook] certificate takes it (the unencrypted private key and
    a self-signed certificate), and the certificate alone (what the app registers)."""
    key = rsa_key()
    cert = make_certificate(key, common_name="inboxd")
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    pem = tmp / "graph.pem"
    pem.write_bytes((private if with_key else b"") + cert)
    return pem, cert


def certificate_settings(fake: FakeGraph, pem: Path) -> OutlookSettings:
    return OutlookSettings.from_settings(
        {
            "directory_id": fake.directory_id, "client_id": fake.client_id,
            "certificate": Secret(f"file:{pem}"), "graph_url": fake.graph_url,
            "authority_url": fake.authority_url,
        }
    )  # fmt: skip


async def test_a_certificate_tenant_signs_in_with_a_client_assertion(
    tmp_path: Path,
    fake: FakeGraph,
    seen: Seen,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """[outlook] certificate, and an app registration that does not allow public
    client flows (a confidential client): every poll authenticates the app with a
    client assertion signed by the certificate (Entra refuses a confidential
    client's device code grant without one, AADSTS7000218), and the refresh token
    it answers then refreshes with the certificate too."""
    pem, cert = certificate_pem(tmp_path)
    fake.identity.certificates = [cert]
    fake.identity.public_client_flows = False
    settings = certificate_settings(fake, pem)

    async def approve() -> None:
        await polls_answered(seen, "authorization_pending", 2)
        (code,) = fake.identity.device_codes.values()
        fake.approve_device_code(code.user_code, ALICE)

    async with aiohttp.ClientSession() as http, anyio.create_task_group() as tg:
        tg.start_soon(approve)
        token = await device_flow(settings, http, wait_scale=POLL_SCALE)

    assert seen.poll_errors[-1] == "" and "invalid_client" not in seen.poll_errors
    assert all("client_secret" not in form for form in seen.poll_forms)
    assert all(form.get("client_assertion") for form in seen.poll_forms)
    # a new assertion for each poll: one lives 10 minutes, the code 15
    assert len({form["client_assertion"] for form in seen.poll_forms}) == len(seen.poll_forms)
    assert fake.identity.refresh_tokens[token].user == ALICE
    printed = capsys.readouterr()
    assert token not in printed.out + printed.err

    mailbox = OutlookMailbox(ALICE, refresh_token=Secret("env:ACME_ALICE_TOKEN"))
    monkeypatch.setenv("ACME_ALICE_TOKEN", token)
    async with aiohttp.ClientSession() as http:
        assert fake.user_of_token(await GraphTokens(settings, mailbox, http).token()) == ALICE


async def test_a_certificate_that_cannot_sign_fails_before_anyone_is_asked_to_sign_in(
    tmp_path: Path, fake: FakeGraph, seen: Seen
) -> None:
    pem, _ = certificate_pem(tmp_path, with_key=False)
    async with aiohttp.ClientSession() as http:
        with pytest.raises(CommandError, match=r"certificate.*nothing written") as caught:
            await device_flow(certificate_settings(fake, pem), http, wait_scale=POLL_SCALE)
    assert caught.value.exit_code == EXIT_USAGE
    assert seen.device_code_forms == []
