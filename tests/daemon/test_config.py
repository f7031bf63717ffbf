"""Configuration of `inboxd run`: daemon/config/main.py and secrets.py, `inboxd check-config`.

Config files are small TOML literals written to tmp_path by each test: a main
file (empty by default: every key has a default, and the tenants directory
defaults to `tenants/` next to it) plus tenant files. No database is needed.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import orjson
import pytest
from helpers import cli_env, run_cli
from helpers.config_files import write_config_tree

from inboxd.daemon.config.main import (
    ConfigError,
    ConfigProblem,
    MainConfig,
    TenantSet,
    check_config,
    inspect_config,
    load_main,
    load_tenants,
)
from inboxd.daemon.config.secrets import Secret, SecretError, is_secret_key, parse_secret_ref
from inboxd.daemon.database import resolve_dsn

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "config.example.toml"
DEMO_TOKEN = "demo-loopback-token"  # the Makefile's DEMO_TOKEN

# Values that must never show up in any output, repr or message.
LITERAL = "LITERAL-s3cr3t-hunter2"
ENV_VALUE = "ENV-s3cr3t-correct-horse"
FILE_VALUE = "FILE-s3cr3t-battery-staple"

MAILDIR_MAILBOX = """
[[mailboxes]]
id = "{id}"
provider = "maildir"
path = "maildir/{id}"
"""


def tenant(tenant_id: str, *mailbox_ids: str, extra: str = "") -> str:
    return f'id = "{tenant_id}"\n{extra}\n' + "".join(
        MAILDIR_MAILBOX.format(id=m) for m in mailbox_ids
    )


def rendered(problems: list[ConfigProblem]) -> list[str]:
    return [str(p) for p in problems]


def find(problems: list[ConfigProblem], file: Path, key: str) -> ConfigProblem:
    matches = [p for p in problems if p.file == file and p.key == key]
    assert matches, f"no problem for {file}: {key} in {rendered(problems)}"
    return matches[0]


# --- the shipped example -----------------------------------------------------------------


def test_example_config_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INBOXD_DEMO_TOKEN", DEMO_TOKEN)  # what `make run` exports
    main = load_main(EXAMPLE, check_secrets=True)
    tenants = load_tenants(main, check_secrets=True)

    assert tenants.problems == []
    assert main.tenants_dir == REPO / "config.example.tenants"
    assert main.object_store == {"kind": "local", "path": str(REPO / "var" / "objects")}
    assert (main.listen_host, main.listen_port, main.log_level) == ("127.0.0.1", 8025, "info")
    assert main.database_dsn is None  # the embedded PostgreSQL
    demo = tenants.tenants["demo"]
    assert demo.api_token is not None and demo.api_token.reveal() == DEMO_TOKEN
    (mailbox,) = demo.mailboxes
    assert (mailbox.tenant_id, mailbox.mailbox_id, mailbox.provider) == ("demo", "local", "maildir")
    assert (mailbox.address, mailbox.sync_mode, mailbox.poll_interval_s) == (
        "support@demo.example",
        "auto",
        2.0,
    )
    assert mailbox.settings == {"path": REPO / "var" / "maildir" / "demo"}
    assert demo.source_file == REPO / "config.example.tenants" / "demo.toml"


@pytest.mark.slow
def test_example_passes_check_config_on_a_fresh_machine(tmp_path: Path) -> None:
    env = cli_env(tmp_path / "data", INBOXD_DEMO_TOKEN=DEMO_TOKEN)  # as `make run` exports
    result = run_cli("check-config", "config.example.toml", env=env, cwd=REPO)

    assert result.code == 0, result.stderr
    assert result.stdout == "config OK: 1 tenant, 1 mailbox\n"
    assert result.stderr == ""
    # without it, one line says what is missing
    bare = run_cli("check-config", "config.example.toml", env=cli_env(tmp_path), cwd=REPO)
    assert bare.code == 2 and "api_token" in bare.stderr and "INBOXD_DEMO_TOKEN" in bare.stderr


@pytest.mark.slow
def test_check_config_json(tmp_path: Path) -> None:
    env = cli_env(tmp_path / "data", INBOXD_DEMO_TOKEN=DEMO_TOKEN)
    result = run_cli("check-config", "--json", EXAMPLE, env=env, cwd=REPO)

    assert result.code == 0, result.stderr
    assert orjson.loads(result.stdout) == {
        "command": "check-config",
        "status": "ok",
        "config": str(EXAMPLE),
        "tenants": 1,
        "mailboxes": 1,
        "problems": [],
    }


def test_defaults_and_relative_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INBOXD_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.chdir("/")  # relative paths follow the config file, not the working directory
    config = write_config_tree(tmp_path, "", acme=tenant("acme", "inbox"))

    main = load_main(config)
    tenants = load_tenants(main)

    assert main == MainConfig(
        config_path=config,
        tenants_dir=tmp_path / "tenants",
        object_store={"kind": "local", "path": str(tmp_path / "data" / "objects")},
    )
    (mailbox,) = tenants.tenants["acme"].mailboxes
    assert mailbox.settings["path"] == tmp_path / "tenants" / "maildir" / "inbox"
    assert (mailbox.sync_mode, mailbox.poll_interval_s) == ("auto", 2.0)
    assert tenants.tenants["acme"].name == "acme"


def test_every_main_key(tmp_path: Path) -> None:
    config = write_config_tree(
        tmp_path,
        """
        [database]
        dsn = "postgresql://inboxd@db.internal/inboxd"
        [listener]
        host = "::1"
        port = 0
        max_body_bytes = 1024
        trusted_proxies = ["127.0.0.1", "10.0.0.0/8", "fd00::/8"]
        forwarded_header = "forwarded"
        [object_store]
        kind = "s3"
        bucket = "mail"
        prefix = "inboxd/"
        region = "eu-west-1"
        endpoint_url = "http://127.0.0.1:9000"
        database_max_bytes = 32768
        [queue]
        capacity = 10
        [workers]
        ingest = 4
        batch_size = 5
        [shutdown]
        deadline_s = 2
        [sync]
        lease_ttl_s = 7.5
        poll_scan_interval_s = 1
        push_quiet_after_s = 60
        [tenants]
        dir = "elsewhere"
        [log]
        level = "debug"
        """,
    )
    (tmp_path / "elsewhere").mkdir()

    main = load_main(config)

    assert main == MainConfig(
        config_path=config,
        tenants_dir=tmp_path / "elsewhere",
        database_dsn="postgresql://inboxd@db.internal/inboxd",
        listen_host="::1",
        listen_port=0,
        max_body_bytes=1024,
        trusted_proxies=(
            ipaddress.ip_network("127.0.0.1/32"),
            ipaddress.ip_network("10.0.0.0/8"),
            ipaddress.ip_network("fd00::/8"),
        ),
        forwarded_header="forwarded",
        object_store={
            "kind": "s3",
            "bucket": "mail",
            "prefix": "inboxd/",
            "region": "eu-west-1",
            "endpoint_url": "http://127.0.0.1:9000",
            "database_max_bytes": 32768,
        },
        queue_capacity=10,
        ingest_workers=4,
        batch_size=5,
        shutdown_deadline_s=2.0,
        lease_ttl_s=7.5,
        poll_scan_interval_s=1.0,
        push_quiet_after_s=60.0,
        log_level="debug",
    )
    assert load_tenants(main).tenants == {}
    # The raw TOML is what database.resolve_dsn reads.
    assert resolve_dsn(None, main.raw, environ={}).dsn == main.database_dsn


def test_other_providers_keep_their_settings_with_secrets_wrapped(tmp_path: Path) -> None:
    config = write_config_tree(
        tmp_path,
        acme="""
        id = "acme"
        api_token = "env:ACME_TOKEN"
        [[mailboxes]]
        id = "support-imap"
        provider = "imap"
        address = "support@acme.example"
        sync_mode = "push"
        host = "imap.acme.example"
        username = "support@acme.example"
        password = "file:/run/secrets/imap-password"
        folders = ["INBOX", {name = "Sent", direction = "outbound"}]
        [[delivery_sources]]
        id = "postmark"
        provider = "postmark"
        webhook_secret = "env:POSTMARK_SECRET"
        [[processors]]
        id = "invoices"
        mailboxes = ["support-imap"]
        backend = "http"
        url = "https://parse.example/v1/parse"
        token = "env:PARSE_TOKEN"
        schema_id = "invoice"
        schema_version = 1
        schema = {type = "object", properties = {number = {type = "string"}}}
        """,
    )

    tenants = load_tenants(load_main(config))

    assert tenants.problems == []
    acme = tenants.tenants["acme"]
    assert acme.api_token == Secret("env:ACME_TOKEN")
    (imap,) = acme.mailboxes
    assert imap.runnable
    assert (imap.sync_mode, imap.poll_interval_s) == ("push", 60.0)
    assert imap.settings["host"] == "imap.acme.example"
    assert imap.settings["password"] == Secret("file:/run/secrets/imap-password")
    assert imap.settings["folders"][1]["direction"] == "outbound"
    assert acme.delivery_sources[0]["webhook_secret"] == Secret("env:POSTMARK_SECRET")
    assert acme.processors[0].backend == "http"
    assert acme.processors[0].token == "env:PARSE_TOKEN"
    with pytest.raises(TypeError):
        imap.settings["host"] = "x"  # type: ignore[index]


def test_gmail_table_and_mailboxes_are_runnable_with_secrets_wrapped(tmp_path: Path) -> None:
    config = write_config_tree(
        tmp_path,
        acme="""
        id = "acme"
        [gmail]
        client_id = "abc.apps.googleusercontent.com"
        client_secret = "env:GMAIL_CLIENT_SECRET"
        topic = "projects/acme-mail/topics/gmail"
        push_audience = "https://inboxd.acme.example/push/gmail/acme"
        push_service_account = "push@acme-mail.iam.gserviceaccount.com"
        [[mailboxes]]
        id = "support"
        provider = "gmail"
        address = "support@acme.example"
        refresh_token = "file:/run/secrets/support"
        labels = ["INBOX"]
        [[mailboxes]]
        id = "ops"
        provider = "gmail"
        address = "ops@acme.example"
        service_account = "file:/run/secrets/sa.json"
        backfill = "all"
        """,
    )

    tenants = load_tenants(load_main(config))

    assert tenants.problems == []
    acme = tenants.tenants["acme"]
    assert acme.gmail is not None
    assert acme.gmail["client_secret"] == Secret("env:GMAIL_CLIENT_SECRET")
    # an email address, not a credential
    assert acme.gmail["push_service_account"] == "push@acme-mail.iam.gserviceaccount.com"
    support, ops = acme.mailboxes
    assert support.runnable and ops.runnable
    assert support.settings["refresh_token"] == Secret("file:/run/secrets/support")
    assert support.settings["labels"] == ("INBOX",)
    assert ops.settings["service_account"] == Secret("file:/run/secrets/sa.json")
    # the tenant's table travels with each mailbox: changing it restarts their runners
    assert support.tenant_settings == acme.gmail


# --- every problem names its file and key ------------------------------------------------

PROBLEM_CASES = [
    # (id, main text, tenant text, file ("main" | "tenant"), key, message fragment)
    (
        "toml-syntax",
        "",
        'id = "acme"\n[[mailboxes]\n',
        "tenant",
        "line 2, column 12",
        "invalid TOML",
    ),
    ("main-toml-syntax", "[listener\n", None, "main", "line 1, column 10", "invalid TOML"),
    (
        "trusted-proxy-not-an-address",
        '[listener]\ntrusted_proxies = ["10.0.0.0/8", "proxy.internal"]\n',
        None,
        "main",
        "listener.trusted_proxies",
        "'proxy.internal' is not an IP address or CIDR",
    ),
    (
        "trusted-proxies-not-a-list",
        '[listener]\ntrusted_proxies = "10.0.0.1"\n',
        None,
        "main",
        "listener.trusted_proxies",
        "must be a list of addresses or CIDRs",
    ),
    (
        "forwarded-header-unknown",
        '[listener]\nforwarded_header = "x-real-ip"\n',
        None,
        "main",
        "listener.forwarded_header",
        'expected one of "x-forwarded-for", "forwarded"',
    ),
    (
        "unknown-main-key",
        "[listener]\nprot = 1\n",
        None,
        "main",
        "listener.prot",
        'unknown key; did you mean "port"?',
    ),
    (
        "unknown-section",
        "[listner]\nport = 1\n",
        None,
        "main",
        "listner",
        'unknown section; did you mean "listener"?',
    ),
    (
        "key-outside-its-section",
        'dsn = "env:X"\n',
        None,
        "main",
        "dsn",
        "did you mean [database] dsn?",
    ),
    (
        "unknown-object-store-key",
        '[object_store]\nkind = "local"\npath = "o"\nbucket = "b"\n',
        None,
        "main",
        "object_store.bucket",
        'unknown key for kind "local"',
    ),
    (
        "object-store-database-max-bytes",
        '[object_store]\nkind = "local"\npath = "o"\ndatabase_max_bytes = -1\n',
        None,
        "main",
        "object_store.database_max_bytes",
        "must be between 0 and 16777216, got -1",
    ),
    (
        "processor-schema-against-its-metaschema",
        "",
        'id = "acme"\n[[processors]]\nid = "inv"\nbackend = "builtin"\nschema_version = 1\n'
        'schema = {type = "no-such-type"}\n',
        "tenant",
        "processors[0]",
        "processor 'inv': `schema` is not a valid JSON Schema at $.type",
    ),
    (
        "processor-http-token-literal",
        "",
        'id = "acme"\n[[processors]]\nid = "inv"\nbackend = "http"\nschema_version = 1\n'
        'url = "https://p.example"\ntoken = "sk-live-123"\nschema = {type = "object"}\n',
        "tenant",
        "processors[0]",
        "`token` must be a secret reference",
    ),
    (
        "processor-unknown-mailbox",
        "",
        'id = "acme"\n[[processors]]\nid = "inv"\nbackend = "http"\nschema_version = 1\n'
        'url = "https://p.example"\ntoken = "env:T"\nmailboxes = ["nope"]\n'
        'schema = {type = "object"}\n',
        "tenant",
        "processors[0].mailboxes",
        "no mailbox nope in this tenant",
    ),
    (
        "unknown-tenant-key",
        "",
        'id = "acme"\nmailbox = []\n',
        "tenant",
        "mailbox",
        'did you mean "mailboxes"?',
    ),
    (
        "unknown-maildir-key",
        "",
        'id = "acme"\n[[mailboxes]]\nid = "m"\nprovider = "maildir"\npath = "p"\npaht = "q"\n',
        "tenant",
        "mailboxes[0].paht",
        'did you mean "path"?',
    ),
    (
        "generic-key-typo",
        "",
        'id = "acme"\n[[mailboxes]]\nid = "m"\nprovider = "imap"\nsync_mdoe = "poll"\n',
        "tenant",
        "mailboxes[0].sync_mdoe",
        'did you mean "sync_mode"?',
    ),
    (
        "wrong-type-number",
        "",
        'id = "acme"\n[[mailboxes]]\nid = "m"\nprovider = "maildir"\npath = "p"\n'
        'poll_interval_s = "abc"\n',
        "tenant",
        "mailboxes[0].poll_interval_s",
        'expected a number, got "abc"',
    ),
    (
        "wrong-type-integer",
        "[listener]\nport = 80.5\n",
        None,
        "main",
        "listener.port",
        "expected an integer, got 80.5",
    ),
    (
        "out-of-range",
        "[listener]\nport = 70000\n",
        None,
        "main",
        "listener.port",
        "must be between 0 and 65535, got 70000",
    ),
    (
        "not-positive",
        "[shutdown]\ndeadline_s = 0\n",
        None,
        "main",
        "shutdown.deadline_s",
        "greater than 0",
    ),
    ("wrong-type-table", 'listener = "x"\n', None, "main", "listener", "expected a table"),
    (
        "wrong-choice",
        '[log]\nlevel = "verbose"\n',
        None,
        "main",
        "log.level",
        'expected one of "debug", "info", "warning", "error", got "verbose"',
    ),
    (
        "mailboxes-not-array",
        "",
        'id = "acme"\n[mailboxes]\nid = "m"\n',
        "tenant",
        "mailboxes",
        "expected an array of tables ([[mailboxes]])",
    ),
    ("missing-tenant-id", "", 'name = "Acme"\n', "tenant", "id", "missing required key"),
    (
        "missing-provider",
        "",
        'id = "acme"\n[[mailboxes]]\nid = "m"\n',
        "tenant",
        "mailboxes[0].provider",
        "missing required key",
    ),
    (
        "missing-maildir-path",
        "",
        'id = "acme"\n[[mailboxes]]\nid = "m"\nprovider = "maildir"\n',
        "tenant",
        "mailboxes[0].path",
        "missing required key",
    ),
    (
        "missing-object-store-bucket",
        '[object_store]\nkind = "s3"\n',
        None,
        "main",
        "object_store.bucket",
        "missing required key",
    ),
    (
        "missing-delivery-source-provider",
        "",
        'id = "acme"\n[[delivery_sources]]\nid = "pm"\n',
        "tenant",
        "delivery_sources[0].provider",
        "missing required key",
    ),
    ("invalid-tenant-id", "", 'id = "Acme Corp"\n', "tenant", "id", "invalid tenant id"),
    (
        "invalid-mailbox-id",
        "",
        'id = "acme"\n[[mailboxes]]\nid = "-x"\nprovider = "maildir"\npath = "p"\n',
        "tenant",
        "mailboxes[0].id",
        "invalid mailbox id",
    ),
    (
        "unknown-provider",
        "",
        'id = "acme"\n[[mailboxes]]\nid = "m"\nprovider = "gmial"\n',
        "tenant",
        "mailboxes[0].provider",
        'did you mean "gmail"?',
    ),
    (
        "maildir-push",
        "",
        'id = "acme"\n[[mailboxes]]\nid = "m"\nprovider = "maildir"\npath = "p"\n'
        'sync_mode = "push"\n',
        "tenant",
        "mailboxes[0].sync_mode",
        'expected one of "poll", "auto" for provider "maildir"',
    ),
    (
        "bad-address",
        "",
        'id = "acme"\n[[mailboxes]]\nid = "m"\nprovider = "imap"\naddress = "support"\n',
        "tenant",
        "mailboxes[0].address",
        "expected an email address",
    ),
    (
        "imap-clear-text-to-a-remote-host",
        "",
        'id = "acme"\n[[mailboxes]]\nid = "m"\nprovider = "imap"\nhost = "imap.example.com"\n'
        'security = "none"\nusername = "u"\npassword = "env:HOME"\n',
        "tenant",
        "mailboxes[0].security",
        "only for a loopback host",
    ),
    (
        "imap-without-host",
        "",
        'id = "acme"\n[[mailboxes]]\nid = "m"\nprovider = "imap"\nusername = "u"\n'
        'password = "env:HOME"\n',
        "tenant",
        "mailboxes[0].host",
        "required",
    ),
    (
        "imap-folder-direction",
        "",
        'id = "acme"\n[[mailboxes]]\nid = "m"\nprovider = "imap"\nhost = "h.example"\n'
        'username = "u"\npassword = "env:HOME"\nfolders = [{name = "Sent", direction = "up"}]\n',
        "tenant",
        "mailboxes[0].folders",
        'direction` ("inbound" or "outbound")',
    ),
    (
        "duplicate-mailbox-in-file",
        "",
        'id = "acme"\n' + MAILDIR_MAILBOX.format(id="m") + MAILDIR_MAILBOX.format(id="m"),
        "tenant",
        "mailboxes[1].id",
        'duplicate mailbox id "m": already used by mailboxes[0].id',
    ),
    (
        "gmail-without-table",
        "",
        'id = "acme"\n[[mailboxes]]\nid = "m"\nprovider = "gmail"\naddress = "a@acme.example"\n'
        'service_account = "file:/run/secrets/sa.json"\n',
        "tenant",
        "mailboxes[0].provider",
        "a gmail mailbox needs a [gmail] table",
    ),
    (
        "gmail-unknown-mailbox-key",
        "",
        'id = "acme"\n[gmail]\n[[mailboxes]]\nid = "m"\nprovider = "gmail"\n'
        'address = "a@acme.example"\nservice_account = "file:/sa.json"\nlabel_ids = ["INBOX"]\n',
        "tenant",
        "mailboxes[0].label_ids",
        'did you mean "labels"?',
    ),
    (
        "gmail-bad-backfill",
        "",
        'id = "acme"\n[gmail]\n[[mailboxes]]\nid = "m"\nprovider = "gmail"\n'
        'address = "a@acme.example"\nservice_account = "file:/sa.json"\nbackfill = 0\n',
        "tenant",
        "mailboxes[0].backfill",
        'expected "all", "none" or a number of days',
    ),
    (
        "gmail-two-credentials",
        "",
        'id = "acme"\n[gmail]\nclient_id = "c"\nclient_secret = "env:HOME"\n[[mailboxes]]\n'
        'id = "m"\nprovider = "gmail"\naddress = "a@acme.example"\n'
        'refresh_token = "env:HOME"\nservice_account = "env:HOME"\n',
        "tenant",
        "mailboxes[0].refresh_token",
        "set only one of refresh_token and service_account",
    ),
    (
        "gmail-refresh-token-without-client",
        "",
        'id = "acme"\n[gmail]\n[[mailboxes]]\nid = "m"\nprovider = "gmail"\n'
        'address = "a@acme.example"\nrefresh_token = "env:HOME"\n',
        "tenant",
        "mailboxes[0].refresh_token",
        "a refresh_token mailbox needs [gmail] client_id and client_secret",
    ),
    (
        "outlook-no-table",
        "",
        'id = "acme"\n[[mailboxes]]\nid = "m"\nprovider = "outlook"\naddress = "a@acme.example"\n',
        "tenant",
        "mailboxes[0].provider",
        "an outlook mailbox needs a [outlook] table",
    ),
    (
        "outlook-table-bad-directory",
        "",
        'id = "acme"\n[outlook]\ndirectory_id = "acme"\n'
        'client_id = "5f1a2b3c-4d5e-6f70-8192-a3b4c5d6e7f8"\n',
        "tenant",
        "outlook.directory_id",
        "expected the Entra tenant id",
    ),
    (
        "outlook-table-literal-secret",
        "",
        'id = "acme"\n[outlook]\ndirectory_id = "acme.onmicrosoft.com"\n'
        f'client_id = "5f1a2b3c-4d5e-6f70-8192-a3b4c5d6e7f8"\nclient_secret = "{LITERAL}"\n',
        "tenant",
        "outlook.client_secret",
        "literal secrets are not allowed",
    ),
    (
        "outlook-unknown-mailbox-key",
        "",
        'id = "acme"\n[outlook]\ndirectory_id = "acme.onmicrosoft.com"\n'
        'client_id = "5f1a2b3c-4d5e-6f70-8192-a3b4c5d6e7f8"\nclient_secret = "env:HOME"\n'
        '[[mailboxes]]\nid = "m"\nprovider = "outlook"\naddress = "a@acme.example"\n'
        'folder = ["inbox"]\n',
        "tenant",
        "mailboxes[0].folder",
        'did you mean "folders"?',
    ),
    (
        "gmail-table-bad-topic",
        "",
        'id = "acme"\n[gmail]\ntopic = "acme-topic"\n',
        "tenant",
        "gmail.topic",
        "expected projects/PROJECT/topics/TOPIC",
    ),
    (
        "gmail-table-literal-secret",
        "",
        f'id = "acme"\n[gmail]\nclient_id = "c"\nclient_secret = "{LITERAL}"\n',
        "tenant",
        "gmail.client_secret",
        "literal secrets are not allowed",
    ),
    (
        "gmail-table-plain-http",
        "",
        'id = "acme"\n[gmail]\ntoken_url = "http://oauth.example/token"\n',
        "tenant",
        "gmail.token_url",
        "expected an https:// URL",
    ),
    (
        "literal-api-token",
        "",
        f'id = "acme"\napi_token = "{LITERAL}"\n',
        "tenant",
        "api_token",
        'literal secrets are not allowed in config files: use a secret reference, "env:NAME"',
    ),
    (
        "literal-nested-secret",
        "",
        f'id = "acme"\n[[mailboxes]]\nid = "m"\nprovider = "imap"\n[mailboxes.oauth]\n'
        f'client_secret = "{LITERAL}"\n',
        "tenant",
        "mailboxes[0].oauth.client_secret",
        "literal secrets are not allowed",
    ),
    (
        "secret-wrong-type",
        "",
        'id = "acme"\n[[delivery_sources]]\nid = "pm"\nprovider = "postmark"\ntoken = 1234\n',
        "tenant",
        "delivery_sources[0].token",
        "expected a secret reference",
    ),
    (
        "empty-env-reference",
        "",
        'id = "acme"\napi_token = "env:"\n',
        "tenant",
        "api_token",
        "env: needs a variable name",
    ),
    (
        "missing-env-secret",
        "",
        'id = "acme"\napi_token = "env:INBOXD_TEST_UNSET_TOKEN"\n',
        "tenant",
        "api_token",
        "environment variable INBOXD_TEST_UNSET_TOKEN is not set or empty",
    ),
    (
        "missing-file-secret",
        "",
        'id = "acme"\n[[mailboxes]]\nid = "m"\nprovider = "imap"\n'
        'password = "file:/nonexistent/inboxd/pw"\n',
        "tenant",
        "mailboxes[0].password",
        "cannot read /nonexistent/inboxd/pw",
    ),
    (
        "missing-dsn-secret",
        '[database]\ndsn = "env:INBOXD_TEST_UNSET_DSN"\n',
        None,
        "main",
        "database.dsn",
        "environment variable INBOXD_TEST_UNSET_DSN is not set",
    ),
    (
        "literal-dsn-password",
        f'[database]\ndsn = "postgresql://u:{LITERAL}@db/x"\n',
        None,
        "main",
        "database.dsn",
        "contains a literal password (postgresql://u:***@db/x)",
    ),
]


@pytest.mark.parametrize(
    ("main", "tenant_text", "where", "key", "fragment"),
    [case[1:] for case in PROBLEM_CASES],
    ids=[case[0] for case in PROBLEM_CASES],
)
def test_problem_names_file_and_key(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    main: str,
    tenant_text: str | None,
    where: str,
    key: str,
    fragment: str,
) -> None:
    monkeypatch.delenv("INBOXD_TEST_UNSET_TOKEN", raising=False)
    monkeypatch.delenv("INBOXD_TEST_UNSET_DSN", raising=False)
    config = write_config_tree(tmp_path, main, **({"acme": tenant_text} if tenant_text else {}))
    file = config if where == "main" else tmp_path / "tenants" / "acme.toml"

    problems = check_config(config)

    problem = find(problems, file, key)
    assert fragment in problem.message, str(problem)
    assert str(problem) == f"{file}: {key}: {problem.message}"
    assert all(LITERAL not in line for line in rendered(problems))


def test_problem_rendering_matches_the_documented_form(tmp_path: Path) -> None:
    problem = ConfigProblem(
        Path("path/to/file.toml"), "mailboxes[0].poll_interval_s", 'expected a number, got "abc"'
    )
    assert str(problem) == (
        'path/to/file.toml: mailboxes[0].poll_interval_s: expected a number, got "abc"'
    )
    assert str(ConfigProblem(Path("a.toml"), "", "no such file")) == "a.toml: no such file"


def test_all_problems_are_reported_at_once(tmp_path: Path) -> None:
    config = write_config_tree(
        tmp_path,
        '[listener]\nport = "x"\nhots = "h"\n[queue]\ncapacity = 0\n',
        acme='id = "acme"\nnmae = "x"\n',
    )

    keys = [(p.file.name, p.key) for p in check_config(config)]

    assert keys == [
        ("inboxd.toml", "listener.hots"),
        ("inboxd.toml", "listener.port"),
        ("inboxd.toml", "queue.capacity"),
        ("acme.toml", "nmae"),
    ]


def test_load_main_raises_with_every_problem(tmp_path: Path) -> None:
    config = write_config_tree(tmp_path, '[listener]\nport = "x"\n[workers]\ningest = 0\n')

    with pytest.raises(ConfigError) as caught:
        load_main(config)

    assert [p.key for p in caught.value.problems] == ["listener.port", "workers.ingest"]
    assert str(caught.value).splitlines() == rendered(caught.value.problems)


def test_missing_files_and_directories(tmp_path: Path) -> None:
    assert rendered(check_config(tmp_path / "nope.toml")) == [
        f"{tmp_path / 'nope.toml'}: no such file"
    ]

    config = write_config_tree(tmp_path, '[tenants]\ndir = "missing"\n')
    (problem,) = check_config(config)
    assert (problem.file, problem.key) == (config, "tenants.dir")
    assert "does not exist" in problem.message


def test_maildir_path_that_is_a_file(tmp_path: Path) -> None:
    config = write_config_tree(tmp_path, acme=tenant("acme", "inbox"))
    (tmp_path / "tenants" / "maildir").mkdir()
    (tmp_path / "tenants" / "maildir" / "inbox").write_text("not a directory")

    (problem,) = check_config(config)

    assert problem.key == "mailboxes[0].path"
    assert "is not a directory" in problem.message


# --- duplicates and independent tenant files ---------------------------------------------


def test_duplicate_mailbox_ids_across_tenant_files(tmp_path: Path) -> None:
    config = write_config_tree(
        tmp_path, acme=tenant("acme", "support", "sales"), beta=tenant("beta", "billing", "support")
    )

    tenants = load_tenants(load_main(config))

    beta_file = tmp_path / "tenants" / "beta.toml"
    (problem,) = tenants.problems
    assert (problem.file, problem.key) == (beta_file, "mailboxes[1].id")
    assert problem.message.startswith(
        'duplicate mailbox id "support": already used by '
        f'tenant "acme" ({tmp_path / "tenants" / "acme.toml"}'
    )
    assert list(tenants.tenants) == ["acme"]  # the first file (by name) keeps the id


def test_duplicate_tenant_ids_across_files(tmp_path: Path) -> None:
    config = write_config_tree(tmp_path, a=tenant("acme", "one"), b=tenant("acme", "two"))

    tenants = load_tenants(load_main(config))

    (problem,) = tenants.problems
    assert (problem.file.name, problem.key) == ("b.toml", "id")
    assert "already defined in" in problem.message
    assert [m.mailbox_id for m in tenants.tenants["acme"].mailboxes] == ["one"]


def test_a_broken_tenant_file_does_not_hide_the_others(tmp_path: Path) -> None:
    config = write_config_tree(
        tmp_path,
        acme=tenant("acme", "acme-inbox"),
        broken='id = "broken"\n[[mailboxes]]\nid = "b"\nprovider = "maildir"\npath = 3\n',
        unparsable='id = "x"\n[[mailboxes\n',
        zeta=tenant("zeta", "zeta-inbox", "zeta-other"),
    )
    (tmp_path / "tenants" / ".hidden.toml").write_text("not toml at all [")
    (tmp_path / "tenants" / "README.md").write_text("ignored")

    tenants = load_tenants(load_main(config))

    assert isinstance(tenants, TenantSet)
    assert sorted(tenants.tenants) == ["acme", "zeta"]
    assert [m.mailbox_id for m in tenants.mailboxes] == ["acme-inbox", "zeta-inbox", "zeta-other"]
    by_file = tenants.problems_by_file
    assert sorted(p.name for p in by_file) == ["broken.toml", "unparsable.toml"]
    assert [p.key for p in by_file[tmp_path / "tenants" / "broken.toml"]] == ["mailboxes[0].path"]
    assert [f.name for f in tenants.files] == [
        "acme.toml",
        "broken.toml",
        "unparsable.toml",
        "zeta.toml",
    ]


def test_a_reloaded_mailbox_compares_equal_when_unchanged(tmp_path: Path) -> None:
    """SIGHUP restarts only mailboxes whose config changed: equality must be by value."""
    config = write_config_tree(tmp_path, acme=tenant("acme", "inbox"))
    main = load_main(config)
    before = load_tenants(main).tenants["acme"]

    assert load_tenants(main).tenants["acme"] == before
    assert hash(before.mailboxes[0]) == hash(load_tenants(main).tenants["acme"].mailboxes[0])
    (tmp_path / "tenants" / "acme.toml").write_text(
        tenant("acme", "inbox").replace('path = "maildir/inbox"', 'path = "elsewhere"')
    )
    assert load_tenants(main).tenants["acme"].mailboxes[0] != before.mailboxes[0]


# --- secrets never leak ------------------------------------------------------------------


@pytest.mark.slow
def test_check_config_exit_code_and_no_secret_in_output(tmp_path: Path) -> None:
    secret_file = tmp_path / "pw"
    secret_file.write_text(FILE_VALUE + "\n")
    config = write_config_tree(
        tmp_path,
        f'[database]\ndsn = "postgresql://u:{LITERAL}@db/x"\n',
        acme=f"""
            id = "acme"
            api_token = "{LITERAL}"
            [[mailboxes]]
            id = "imap"
            provider = "imap"
            host = "imap.acme.example"
            username = "support"
            password = "file:{secret_file}"
            oauth2_token = "{LITERAL}"
            [[delivery_sources]]
            id = "pm"
            provider = "postmark"
            webhook_secret = "{LITERAL}"
            """,
        good=f'id = "good"\napi_token = "env:ACME_IMAP_PASSWORD"\n'
        f"{MAILDIR_MAILBOX.format(id='local')}",
    )
    env = cli_env(tmp_path / "data", ACME_IMAP_PASSWORD=ENV_VALUE)

    for extra in ((), ("--json",)):
        result = run_cli("check-config", *extra, config, env=env, cwd=REPO)

        assert result.code == 2
        output = result.stdout + result.stderr
        for value in (LITERAL, ENV_VALUE, FILE_VALUE):
            assert value not in output
        lines = result.stderr.splitlines()
        acme = tmp_path / "tenants" / "acme.toml"
        assert lines == [
            f"{config}: database.dsn: contains a literal password (postgresql://u:***@db/x): "
            'use a secret reference, "env:NAME" or "file:/path", or set INBOXD_DSN',
            *(
                f"{acme}: {key}: literal secrets are not allowed in config files: use a secret "
                'reference, "env:NAME" or "file:/path" (the value is not shown)'
                for key in ("api_token", "mailboxes[0].oauth2_token")
            ),
            # both credentials are set: a mistake of its own, beside the literal
            f"{acme}: mailboxes[0].password: set exactly one of password and oauth2_token",
            f"{acme}: delivery_sources[0].webhook_secret: literal secrets are not allowed in "
            'config files: use a secret reference, "env:NAME" or "file:/path" (the value is '
            "not shown)",
            f"inboxd: error: {config}: 5 configuration problems",
        ]
    assert orjson.loads(result.stdout)["status"] == "invalid"
    assert len(orjson.loads(result.stdout)["problems"]) == 5


@pytest.mark.slow
def test_check_config_usage_errors(tmp_path: Path) -> None:
    env = cli_env(tmp_path / "data")

    missing = run_cli("check-config", tmp_path / "nope.toml", env=env, cwd=REPO)
    assert missing.code == 2
    assert f"{tmp_path / 'nope.toml'}: no such file" in missing.stderr

    no_file = run_cli("check-config", env=env, cwd=REPO)
    assert no_file.code == 2
    assert "inboxd: error: check-config needs a config FILE" in no_file.stderr


def test_reprs_never_contain_secret_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret_file = tmp_path / "token"
    secret_file.write_text(f"  {FILE_VALUE}\n")
    monkeypatch.setenv("ACME_TOKEN", ENV_VALUE)
    monkeypatch.setenv("ACME_DSN", f"postgresql://u:{ENV_VALUE}@db/x")
    config = write_config_tree(
        tmp_path,
        '[database]\ndsn = "env:ACME_DSN"\n',
        acme=f"""
        id = "acme"
        api_token = "env:ACME_TOKEN"
        [gmail]
        client_id = "abc.apps.googleusercontent.com"
        client_secret = "env:ACME_TOKEN"
        [[mailboxes]]
        id = "gmail"
        provider = "gmail"
        address = "support@acme.example"
        refresh_token = "file:{secret_file}"
        [[delivery_sources]]
        id = "pm"
        provider = "postmark"
        webhook_secret = "env:ACME_TOKEN"
        """,
    )

    report = inspect_config(config)
    assert report.ok, rendered(report.problems)
    assert report.main is not None and report.tenants is not None
    acme = report.tenants.tenants["acme"]
    token = acme.api_token
    assert token is not None
    refresh = acme.mailboxes[0].settings["refresh_token"]

    # the references resolve to the values ...
    assert token.reveal() == ENV_VALUE
    assert refresh.reveal() == FILE_VALUE
    assert resolve_dsn(None, report.main.raw).dsn == f"postgresql://u:{ENV_VALUE}@db/x"
    # ... which no representation of the config contains
    for obj in (
        token,
        refresh,
        acme,
        acme.mailboxes[0],
        acme.delivery_sources,
        report.tenants,
        report.main,
        report,
        report.tenants.tenants,
    ):
        for text in (repr(obj), str(obj), f"{obj}"):
            assert ENV_VALUE not in text and FILE_VALUE not in text
    assert repr(token) == str(token) == "Secret('env:ACME_TOKEN')"


# --- daemon/config/secrets.py -------------------------------------------------------------------


def test_reveal_reads_at_call_time_and_strips(tmp_path: Path) -> None:
    path = tmp_path / "s"
    path.write_text(" one \n")
    from_file = Secret(f"file:{path}")
    from_env = parse_secret_ref("  env:TOKEN ", "api_token")

    assert from_file.reveal() == "one"
    path.write_text("two\n")  # rotated: the next use sees the new value
    assert from_file.reveal() == "two"
    assert from_env.reveal({"TOKEN": " v \n"}) == "v"
    assert (from_env.kind, from_env.target) == ("env", "TOKEN")


@pytest.mark.parametrize(
    ("ref", "environ", "fragment"),
    [
        ("env:TOKEN", {}, "environment variable TOKEN is not set or empty"),
        ("env:TOKEN", {"TOKEN": "  "}, "environment variable TOKEN is not set or empty"),
        ("file:/nonexistent/inboxd-secret", {}, "cannot read /nonexistent/inboxd-secret"),
    ],
)
def test_reveal_errors(ref: str, environ: dict[str, str], fragment: str) -> None:
    with pytest.raises(SecretError, match=fragment):
        Secret(ref).reveal(environ)


def test_reveal_errors_for_empty_and_binary_files(tmp_path: Path) -> None:
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "binary").write_bytes(b"\xff\xfe" + LITERAL.encode())

    with pytest.raises(SecretError, match="is empty"):
        Secret(f"file:{tmp_path / 'empty'}").reveal()
    with pytest.raises(SecretError, match="is not UTF-8 text") as caught:
        Secret(f"file:{tmp_path / 'binary'}").reveal()
    assert LITERAL not in str(caught.value)


@pytest.mark.parametrize("value", [LITERAL, f"Env:{LITERAL}", "", 42, {"k": LITERAL}])
def test_parse_secret_ref_rejects_literals_without_echoing_them(value: object) -> None:
    with pytest.raises(SecretError) as caught:
        parse_secret_ref(value, "mailboxes[0].password")
    message = str(caught.value)
    assert message.startswith("mailboxes[0].password: ")
    assert LITERAL not in message
    with pytest.raises(SecretError) as caught:
        Secret(LITERAL)  # type: ignore[arg-type]
    assert LITERAL not in str(caught.value)


def test_secret_key_names() -> None:
    for name in (
        "password",
        "token",
        "client_secret",
        "refresh_token",
        "credentials",
        "webhook_secret",
        "smtp_password",
        "api_key",
        "service_account",
    ):
        assert is_secret_key(name), name
    for name in (
        "path",
        "address",
        "client_id",
        "token_uri",
        "topic",
        "bucket",
        "push_service_account",
    ):
        assert not is_secret_key(name), name


def test_an_object_store_that_cannot_be_written_fails_check_config(tmp_path: Path) -> None:
    (tmp_path / "blocker").write_text("a file where the store's directory should be")
    config = write_config_tree(
        tmp_path, '[object_store]\nkind = "local"\npath = "blocker/objects"\n'
    )
    problem = find(check_config(config), config, "object_store.path")
    assert problem.message == f"cannot be written: {tmp_path / 'blocker'} is not a directory"
    # `inboxd run` refuses to start on the same problem (exit 2, the path named)
    result = run_cli("run", "--config", config, env=cli_env(tmp_path / "data"))
    assert result.code == 2 and f"{tmp_path / 'blocker'} is not a directory" in result.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permission bits")
def test_an_object_store_without_permission_fails_check_config(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    config = write_config_tree(
        tmp_path, '[object_store]\nkind = "local"\npath = "locked/objects"\n'
    )
    problem = find(check_config(config), config, "object_store.path")
    assert problem.message == f"cannot be written: {locked}: Permission denied"


def test_a_missing_store_directory_under_a_writable_one_is_fine(tmp_path: Path) -> None:
    config = write_config_tree(tmp_path, '[object_store]\nkind = "local"\npath = "new/objects"\n')
    assert check_config(config) == []
    assert not (tmp_path / "new").exists()  # check-config creates nothing


@pytest.mark.parametrize(
    "tenant_text",
    [
        'id = "acme"\n[gmail]\nclient_id = "c"\nclient_secret = "env:HOME"\n'
        '[[mailboxes]]\nid = "m"\nprovider = "gmail"\naddress = "a@acme.example"\n',
        'id = "acme"\n[outlook]\ndirectory_id = "acme.onmicrosoft.com"\n'
        'client_id = "5f1a2b3c-4d5e-6f70-8192-a3b4c5d6e7f8"\n'
        '[[mailboxes]]\nid = "m"\nprovider = "outlook"\naddress = "a@acme.example"\n',
    ],
    ids=["gmail", "outlook"],
)
def test_a_mailbox_not_connected_yet_is_valid_configuration(
    tmp_path: Path, tenant_text: str
) -> None:
    """The documented onboarding: add the mailbox, then `inboxd connect` it. Until then
    check-config (and ExecStartPre, SIGHUP) accept it; the daemon shows needs_connect."""
    config = write_config_tree(tmp_path, "", acme=tenant_text)
    assert check_config(config) == []


def test_a_literal_imap_password_is_one_problem(tmp_path: Path) -> None:
    """The refused literal is the problem; no second line blaming the same key for a
    missing credential."""
    config = write_config_tree(
        tmp_path,
        "",
        acme='id = "acme"\n[[mailboxes]]\nid = "m"\nprovider = "imap"\naddress = "a@b.c"\n'
        f'host = "imap.example.com"\nusername = "a@b.c"\npassword = "{LITERAL}"\n',
    )
    problems = check_config(config)
    assert [(p.key, p.message.split(":")[0]) for p in problems] == [
        ("mailboxes[0].password", "literal secrets are not allowed in config files")
    ]


def test_an_outlook_certificate_is_a_secret_reference(tmp_path: Path) -> None:
    """`[outlook] certificate = "file:…"` as the guides and the example write it (it
    was refused: "use a secret reference"), and a literal PEM is refused as a secret."""
    pem = tmp_path / "app.pem"
    pem.write_text("-----BEGIN PRIVATE KEY-----\n")
    table = (
        'id = "acme"\n[outlook]\ndirectory_id = "0c9e5a3b-6f2d-4c1e-9b7a-2d4f8e1a3c5b"\n'
        'client_id = "5f1a2b3c-4d5e-6f70-8192-a3b4c5d6e7f8"\ncertificate = "{}"\n'
        '[[mailboxes]]\nid = "o"\nprovider = "outlook"\naddress = "o@acme.example"\n'
    )
    config = write_config_tree(tmp_path, "", acme=table.format(f"file:{pem}"))
    assert check_config(config) == []
    config = write_config_tree(tmp_path, "", acme=table.format("-----BEGIN PRIVATE KEY-----"))
    [problem] = check_config(config)
    assert problem.key == "outlook.certificate"
    assert problem.message.startswith("literal secrets are not allowed")
