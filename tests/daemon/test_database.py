from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from inboxd.daemon.database import (
    DatabaseUnavailable,
    DsnChoice,
    DsnError,
    connect_pool,
    describe_target,
    dsn_has_password,
    mask_dsn,
    resolve_dsn,
)

CLI = "postgresql://cli@db-cli/inboxd"
ENV = "postgresql://env@db-env/inboxd"
CONF = "postgresql://conf@db-conf/inboxd"
EMBEDDED = "postgresql://inboxd@/inboxd?host=/data/pg&port=5432"


def _embedded() -> str:
    return EMBEDDED


def _no_embedded() -> str:
    raise AssertionError("the embedded server must not be started when a DSN is configured")


def _config(dsn: object) -> dict[str, object]:
    return {"database": {"dsn": dsn}}


# --- precedence ------------------------------------------------------------------------


def test_cli_wins_over_env_and_config() -> None:
    choice = resolve_dsn(CLI, _config(CONF), environ={"INBOXD_DSN": ENV}, embedded=_no_embedded)
    assert choice == DsnChoice(CLI, "cli")


def test_env_wins_over_config() -> None:
    choice = resolve_dsn(None, _config(CONF), environ={"INBOXD_DSN": ENV}, embedded=_no_embedded)
    assert choice == DsnChoice(ENV, "env")


def test_config_used_without_cli_and_env() -> None:
    choice = resolve_dsn(None, _config(CONF), environ={}, embedded=_no_embedded)
    assert choice == DsnChoice(CONF, "config")


@pytest.mark.parametrize(
    "config", [None, {}, {"database": {}}, {"listener": {"port": 8080}}, _config("  ")]
)
def test_embedded_when_nothing_configured(config: dict[str, object] | None) -> None:
    assert resolve_dsn(None, config, environ={}, embedded=_embedded) == DsnChoice(
        EMBEDDED, "embedded"
    )


def test_empty_values_count_as_unset() -> None:
    choice = resolve_dsn("", _config(""), environ={"INBOXD_DSN": " "}, embedded=_embedded)
    assert choice.source == "embedded"


# --- secret references -----------------------------------------------------------------


def test_config_env_reference() -> None:
    secret = "postgresql://inboxd:s3cret@db/inboxd"
    choice = resolve_dsn(None, _config("env:PG_DSN"), environ={"PG_DSN": secret})
    assert choice == DsnChoice(secret, "config")


def test_config_file_reference_strips_trailing_newline(tmp_path: Path) -> None:
    secret = "postgresql://inboxd:s3cret@db/inboxd"
    path = tmp_path / "dsn"
    path.write_text(secret + "\n")
    choice = resolve_dsn(None, _config(f"file:{path}"), environ={})
    assert choice == DsnChoice(secret, "config")


def test_references_also_work_on_cli_and_env(tmp_path: Path) -> None:
    path = tmp_path / "dsn"
    path.write_text(CLI)
    assert resolve_dsn(f"file:{path}", None, environ={}).dsn == CLI
    choice = resolve_dsn(None, None, environ={"INBOXD_DSN": "env:OTHER", "OTHER": ENV})
    assert choice == DsnChoice(ENV, "env")


def test_missing_env_reference_is_an_error() -> None:
    with pytest.raises(DsnError, match="PG_DSN is not set"):
        resolve_dsn(None, _config("env:PG_DSN"), environ={}, embedded=_no_embedded)


def test_missing_file_reference_is_an_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(DsnError, match="cannot read"):
        resolve_dsn(None, _config(f"file:{missing}"), environ={}, embedded=_no_embedded)


def test_empty_file_reference_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "dsn"
    path.write_text("\n")
    with pytest.raises(DsnError, match="is empty"):
        resolve_dsn(None, _config(f"file:{path}"), environ={}, embedded=_no_embedded)


def test_non_string_dsn_is_an_error() -> None:
    with pytest.raises(DsnError, match="must be a string"):
        resolve_dsn(None, _config(5432), environ={}, embedded=_no_embedded)


# --- literal passwords -------------------------------------------------------------------


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://inboxd:hunter2@db/inboxd",
        "postgres://inboxd:hunter2@db:5433/inboxd?sslmode=require",
        "postgresql://inboxd@db/inboxd?password=hunter2",
        "host=db user=inboxd password=hunter2 dbname=inboxd",
        "host=db user=inboxd password='hunter2' dbname=inboxd",
    ],
)
def test_literal_password_in_config_is_rejected(dsn: str) -> None:
    with pytest.raises(DsnError) as info:
        resolve_dsn(None, _config(dsn), environ={}, embedded=_no_embedded)
    message = str(info.value)
    assert "hunter2" not in message
    assert "env:" in message and "file:" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://inboxd@db/inboxd",
        "postgresql://inboxd:@db/inboxd",  # empty password: .pgpass / PGPASSWORD decide
        "postgresql:///inboxd?host=/run/postgresql",
        "host=/run/postgresql dbname=inboxd",
    ],
)
def test_config_dsn_without_password_is_accepted(dsn: str) -> None:
    assert not dsn_has_password(dsn)
    assert resolve_dsn(None, _config(dsn), environ={}).dsn == dsn


def test_literal_password_allowed_outside_config() -> None:
    dsn = "postgresql://inboxd:hunter2@db/inboxd"
    assert resolve_dsn(dsn, None, environ={}).dsn == dsn
    assert resolve_dsn(None, None, environ={"INBOXD_DSN": dsn}).dsn == dsn


# --- masking -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dsn", "masked"),
    [
        ("postgresql://inboxd:hunter2@db/inboxd", "postgresql://inboxd:***@db/inboxd"),
        ("postgresql://u:p%40ss@db:5433/x?ssl=1", "postgresql://u:***@db:5433/x?ssl=1"),
        ("postgresql://u:pa/ss@word@db/x", "postgresql://u:***@db/x"),
        (
            "postgresql://u@db/x?sslmode=require&password=hunter2",
            "postgresql://u@db/x?sslmode=require&password=***",
        ),
        ("host=db password='hun ter2' user=u", "host=db password=*** user=u"),
        ("postgresql://u@db/x", "postgresql://u@db/x"),
    ],
)
def test_mask_dsn(dsn: str, masked: str) -> None:
    assert mask_dsn(dsn) == masked


def test_choice_repr_never_shows_password() -> None:
    choice = DsnChoice("postgresql://inboxd:hunter2@db/inboxd", "env")
    for text in (repr(choice), str(choice), f"{choice}", repr([choice])):
        assert "hunter2" not in text
        assert "***" in text
    assert choice.dsn.endswith("hunter2@db/inboxd")  # the real value is still there to use


# --- connect_pool against servers that do not answer --------------------------------------


@pytest.mark.parametrize(
    ("dsn", "target"),
    [
        ("postgresql://u:pw@db.example:6432/x", "db.example:6432"),
        ("postgresql://u@/x?host=/run/postgresql", "/run/postgresql/.s.PGSQL.5432"),
        ("postgresql://u@/x?host=%2Fsrv%2Fpg&port=5433", "/srv/pg/.s.PGSQL.5433"),
        ("host=db port=5439 user=u", "db:5439"),
    ],
)
def test_describe_target(dsn: str, target: str) -> None:
    assert describe_target(dsn, environ={}) == target


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def silent_server() -> Iterator[int]:
    """Accepts TCP connections (through the kernel backlog) and never says a word."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield sock.getsockname()[1]


async def test_refused_connection_is_unavailable(closed_port: int) -> None:
    with pytest.raises(DatabaseUnavailable) as info:
        await connect_pool(f"postgresql://u:hunter2@127.0.0.1:{closed_port}/x")
    message = str(info.value)
    assert f"127.0.0.1:{closed_port}" in message
    assert "hunter2" not in message and "\n" not in message


async def test_missing_socket_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(DatabaseUnavailable, match=r"\.s\.PGSQL\.5432"):
        await connect_pool(f"postgresql://u@/x?host={tmp_path}")


async def test_silent_server_hits_the_deadline(silent_server: int) -> None:
    with pytest.raises(DatabaseUnavailable, match=r"did not answer within 0\.3 s") as info:
        await connect_pool(
            f"postgresql://u:hunter2@127.0.0.1:{silent_server}/x", connect_timeout_s=0.3
        )
    assert "hunter2" not in str(info.value)
