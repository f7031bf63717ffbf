"""daemon/webhooks/gmail_config.py: which tenants `POST /push/gmail/<tenant>` serves."""

from __future__ import annotations

from pathlib import Path

from inboxd.daemon.config.main import load_main, load_tenants
from inboxd.daemon.webhooks.gmail_config import build_gmail_push

PUSH = """
push_audience = "https://inboxd.example/push/gmail/{id}"
push_service_account = "push@mail-project.iam.gserviceaccount.com"
"""


def tenant(tenant_id: str, gmail: str | None, *addresses: str) -> str:
    table = "" if gmail is None else f"[gmail]\n{gmail}\n"
    boxes = "".join(
        f'[[mailboxes]]\nid = "{tenant_id}-{i}"\nprovider = "gmail"\naddress = "{a}"\n'
        'service_account = "file:/run/secrets/sa.json"\n'
        for i, a in enumerate(addresses)
    )
    return f'id = "{tenant_id}"\n{table}{boxes}'


def test_only_tenants_with_both_push_keys_are_served(tmp_path: Path) -> None:
    (tmp_path / "tenants").mkdir()
    files = {
        "acme": tenant("acme", PUSH.format(id="acme"), "Support@Acme.example", "ops@acme.example"),
        "globex": tenant("globex", PUSH.format(id="globex"), "help@globex.example"),
        "initech": tenant("initech", 'topic = "projects/initech-mail/topics/gmail"', "a@i.example"),
        "hooli": tenant("hooli", None),
    }
    for name, text in files.items():
        (tmp_path / "tenants" / f"{name}.toml").write_text(text)
    (tmp_path / "main.toml").write_text("")
    tenants = load_tenants(load_main(tmp_path / "main.toml"))
    assert tenants.problems == []

    served, problems = build_gmail_push(tenants.tenants)

    assert problems == []
    assert sorted(served) == ["acme", "globex"]  # initech polls: nothing to verify against
    acme = served["acme"]
    assert acme.mailbox_of("support@acme.example") == "acme-0"
    assert acme.mailbox_of(" OPS@ACME.EXAMPLE ") == "acme-1"
    assert acme.mailbox_of("help@globex.example") is None  # another tenant's address
    assert "inboxd.example/push/gmail/acme" in repr(acme.verifier)
    # one certificate cache for every tenant that uses the same certs URL
    assert acme.verifier._certs is served["globex"].verifier._certs
