"""A Gmail mailbox added before it is connected (the documented onboarding order):
valid configuration, shown as needs_connect with the command that connects it, and
synced from the reload that adds its refresh token — under `inboxd run`."""

from __future__ import annotations

import signal

import pytest
from gmail_rig import SUPPORT, GatedGmail, daemon_life, tenant_file
from harness import generated_messages, write_config
from helpers import cli_env, run_cli
from helpers.google_jwt import GoogleSigner

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.slow,
    pytest.mark.own_database,  # daemon subprocesses (tests/conftest.py)
]


async def test_a_mailbox_waits_as_needs_connect_until_a_reload_brings_its_token(
    tmp_path, db_dsn
) -> None:
    async with GatedGmail() as fake:
        box = fake.add_user(SUPPORT)
        for raw in generated_messages(2, tag="waiting"):
            box.add_message(raw)
        signer = GoogleSigner()
        fake.set_certs(signer.certs())
        token = tmp_path / "support.refresh-token"
        connected = tenant_file(fake, {SUPPORT: token})
        waiting = "\n".join(line for line in connected.splitlines() if "refresh_token" not in line)
        config = write_config(tmp_path)
        (tmp_path / "tenants" / "acme.toml").write_text(waiting)

        env = cli_env(tmp_path / "data", ACME_GMAIL_SECRET=fake.client_secret)
        checked = run_cli("check-config", config, env={**env, "ACME_API_TOKEN": "x"})
        assert checked.code == 0, checked.stderr  # ExecStartPre passes

        async with daemon_life(tmp_path, db_dsn, fake, signer, "waiting") as run:

            async def state() -> tuple[str, str | None]:
                found = await run.fetchval(
                    "SELECT (sync_state, last_error) FROM mailboxes WHERE mailbox_id = 'support'"
                )
                return (found[0], found[1]) if found else ("", None)

            await run.eventually(
                lambda: _is(state, "needs_connect"), "the mailbox waiting for its token"
            )
            _, how = await state()
            assert how is not None
            assert "inboxd connect gmail --tenant acme --mailbox support" in how
            assert (await run.status())["support"]["sync_state"] == "needs_connect"

            # `inboxd connect gmail` wrote the token; the operator adds the line, reloads.
            token.write_text(fake.issue_refresh_token(SUPPORT) + "\n")
            (tmp_path / "tenants" / "acme.toml").write_text(connected)
            run.daemon.signal(signal.SIGHUP)
            await run.eventually(lambda: run.cursor("support"), "the first sync's cursor")
            assert await run.rows("support") == 2
            assert (await state())[0] == "idle"


async def _is(state, wanted: str) -> bool:
    return (await state())[0] == wanted


async def test_an_alias_in_address_is_named_in_the_status(tmp_path, db_dsn) -> None:
    """Gmail's pushes name the account's primary address; with an alias in `address`
    every push is ignored and mail waits for polling — the status says so, and which
    address to write."""
    async with GatedGmail() as fake:
        fake.add_user(SUPPORT)
        signer = GoogleSigner()
        fake.set_certs(signer.certs())
        token = tmp_path / "support.refresh-token"
        token.write_text(fake.issue_refresh_token(SUPPORT) + "\n")
        alias = "helpdesk@" + SUPPORT.split("@")[1]
        text = tenant_file(fake, {SUPPORT: token}).replace(
            f'address = "{SUPPORT}"', f'address = "{alias}"'
        )
        assert alias in text
        write_config(tmp_path)
        (tmp_path / "tenants" / "acme.toml").write_text(text)
        async with daemon_life(tmp_path, db_dsn, fake, signer, "alias") as run:
            error = await run.eventually(
                lambda: run.fetchval(
                    "SELECT last_error FROM mailboxes WHERE mailbox_id = 'support'"
                ),
                "the alias named in the last error",
            )
            assert f"address {alias} is an alias of {SUPPORT}" in error, error
            assert f'set address = "{SUPPORT}"' in error
