"""`inboxd check-config` on the SES door's settings (issue 12): the main file's `[ses]`
table and `provider = "ses"` mailboxes. Exit 2, each problem naming its file and key."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from helpers import CliResult, cli_env, run_cli

pytestmark = pytest.mark.slow  # `inboxd check-config` subprocesses

SES = '[ses]\nqueue_url = "https://sqs.eu-west-1.amazonaws.com/123456789012/inbound"\n'


def ses_mailbox(mailbox_id: str, extra: str) -> str:
    return f'\n[[mailboxes]]\nid = "{mailbox_id}"\nprovider = "ses"\n{extra}\n'


def write(tmp: Path, main: str, **tenants: str) -> Path:
    config = tmp / "inboxd.toml"
    config.write_text(main)
    (tmp / "tenants").mkdir(exist_ok=True)
    for tenant_id, mailboxes in tenants.items():
        (tmp / "tenants" / f"{tenant_id}.toml").write_text(f'id = "{tenant_id}"\n{mailboxes}')
    return config


def check(tmp: Path, config: Path, *args: str) -> CliResult:
    return run_cli("check-config", *args, config, env=cli_env(tmp / "data"))


def problems(tmp: Path, config: Path) -> list[tuple[str, str, str]]:
    """(file, key, message) of each problem, from --json; the run must exit 2."""
    result = check(tmp, config, "--json")
    assert result.code == 2, (result.stdout, result.stderr)
    answer = orjson.loads(result.stdout)
    assert answer["status"] == "invalid"
    return [(p["file"], p["key"], p["message"]) for p in answer["problems"]]


def test_a_valid_ses_setup_passes(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        SES + "wait_time_s = 20\nmax_messages = 10\nvisibility_timeout_s = 300\npollers = 4\n",
        acme=ses_mailbox(
            "support",
            'addresses = ["support@acme.example", "@billing.acme.example"]\n'
            'allowed_senders = ["*@vendor.example", "boss@gmail.com", "*@*.vendor.example"]\n'
            "keep_objects = false",
        ),
        beta=ses_mailbox("help", 'addresses = ["help@beta.example"]'),
    )
    result = check(tmp_path, config)
    assert result.code == 0, result.stderr
    assert result.stdout == "config OK: 2 tenants, 2 mailboxes\n"


def test_bad_ses_keys_are_named_with_the_main_file(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        SES + "max_mesages = 5\nvisibility_timeout_s = 5\n",
        acme=ses_mailbox("support", 'addresses = ["support@acme.example"]'),
    )
    assert problems(tmp_path, config) == [
        (str(config), "ses.max_mesages", 'unknown key; did you mean "max_messages"?'),
        (str(config), "ses.visibility_timeout_s", "expected an integer from 10 to 43200"),
    ]

    config.write_text('[ses]\nregion = "eu-west-1"\nwait_time_s = 20\n')
    ((file, key, message),) = problems(tmp_path, config)
    assert (file, key) == (str(config), "ses.queue_url")
    assert message.startswith("required")


def test_ses_mailboxes_without_addresses_or_with_a_public_wildcard_are_named(
    tmp_path: Path,
) -> None:
    config = write(
        tmp_path,
        SES,
        acme=ses_mailbox("support", 'allowed_senders = ["*@vendor.example"]')
        + ses_mailbox("sales", "addresses = []")
        + ses_mailbox(
            "billing",
            'addresses = ["billing@acme.example"]\n'
            'allowed_senders = ["*@vendor.example", "*@gmail.com"]',
        )
        + ses_mailbox(
            "press", 'addresses = ["press@acme.example"]\nallowed_senders = ["*@*.outlook.com"]'
        ),
    )
    acme = str(tmp_path / "tenants" / "acme.toml")
    found = problems(tmp_path, config)
    assert [(f, k) for f, k, _ in found] == [
        (acme, "mailboxes[0].addresses"),
        (acme, "mailboxes[1].addresses"),
        (acme, "mailboxes[2].allowed_senders"),
        (acme, "mailboxes[3].allowed_senders"),
    ]
    assert found[0][2].startswith("required")
    for _, _, message in found[2:]:
        assert "public mailbox domain" in message
        assert "gmail" not in message and "outlook" not in message  # values never quoted


def test_two_tenants_claiming_one_address_are_told_which(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        SES,
        acme=ses_mailbox(
            "support", 'addresses = ["Support@Acme.example", "@billing.acme.example"]'
        ),
        beta=ses_mailbox("help", 'addresses = ["help@beta.example", "support@acme.example"]')
        + ses_mailbox("bills", 'addresses = ["@BILLING.acme.example"]'),
    )
    acme, beta = (str(tmp_path / "tenants" / f"{t}.toml") for t in ("acme", "beta"))
    found = problems(tmp_path, config)
    claimed_by_acme = (
        f'already routed to another ses mailbox: tenant "acme" ({acme}: mailboxes[0].addresses)'
    )
    assert found == [
        (beta, "mailboxes[0].addresses", f'"support@acme.example" is {claimed_by_acme}'),
        (beta, "mailboxes[1].addresses", f'"@billing.acme.example" is {claimed_by_acme}'),
    ]

    human = check(tmp_path, config)
    assert human.code == 2
    assert f'{beta}: mailboxes[0].addresses: "support@acme.example" is {claimed_by_acme}' in (
        human.stderr
    )


def test_one_tenant_claiming_an_address_twice_is_told_where(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        SES,
        acme=ses_mailbox("support", 'addresses = ["support@acme.example"]')
        + ses_mailbox("helpdesk", 'addresses = ["support@acme.example"]'),
    )
    acme = str(tmp_path / "tenants" / "acme.toml")
    ((file, key, message),) = problems(tmp_path, config)
    assert (file, key) == (acme, "mailboxes[1].addresses")
    assert "mailboxes[0].addresses of this file" in message
