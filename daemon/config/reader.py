"""Reading one configuration file's TOML: `Reader` and its typed getters.

A `Reader` belongs to one file. Each getter (`string`, `choice`, `ident`,
`integer`, `number`, `secret`, `freeze`, ...) returns the value when it is good
and otherwise records a `ConfigProblem` naming the file and the key
(`mailboxes[0].poll_interval_s`) and returns a default or None, so that reading
goes on and an operator sees every problem of the file in one round. Values are
quoted in messages by `describe`, never when they may be secrets.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime, time
from pathlib import Path
from types import MappingProxyType
from typing import Any

from inboxd.daemon.config.secrets import Secret, SecretError, is_secret_key, secret_ref_error
from inboxd.pipeline.tenancy import validate_id

__all__ = ["ConfigProblem", "Options", "Reader", "describe", "join_key", "relative_to"]

_DESCRIBE_MAX_CHARS = 40
_TOML_POSITION = re.compile(r"\s*\(at (line \d+, column \d+|end of document)\)$")


@dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with one file. `key` is a path like `listener.port` or
    `mailboxes[0].id`, or a position like `line 3, column 7`, or "" for the whole file."""

    file: Path
    key: str
    message: str

    def __str__(self) -> str:
        if self.key:
            return f"{self.file}: {self.key}: {self.message}"
        return f"{self.file}: {self.message}"


@dataclass(frozen=True)
class Options:
    """How to read: `check_secrets` resolves every secret reference (in `environ`, or
    `os.environ` when None) to report unset variables and missing files."""

    check_secrets: bool
    environ: Mapping[str, str] | None


class Reader:
    """Reads values out of one file's TOML, recording a ConfigProblem for each bad one
    and returning a default (or None) so that reading can go on."""

    def __init__(self, file: Path, options: Options) -> None:
        self.file = file
        self.options = options
        self.problems: list[ConfigProblem] = []

    def problem(self, key: str, message: str) -> None:
        self.problems.append(ConfigProblem(self.file, key, message))

    def read_toml(self) -> dict[str, Any] | None:
        try:
            text = self.file.read_bytes().decode("utf-8")
        except FileNotFoundError:
            self.problem("", "no such file")
            return None
        except OSError as exc:
            self.problem("", f"cannot read: {exc.strerror or exc}")
            return None
        except UnicodeDecodeError:
            self.problem("", "not UTF-8 text (TOML files are UTF-8)")
            return None
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            # tomllib's messages name the position, never the text found there.
            message = str(exc)
            position = _TOML_POSITION.search(message)
            key = position.group(1) if position else ""
            self.problem(key, f"invalid TOML: {_TOML_POSITION.sub('', message)}")
            return None

    def unknown_keys(
        self,
        table: Mapping[str, Any],
        known: Iterable[str],
        prefix: str,
        *,
        elsewhere: Mapping[str, str] | None = None,
        what: str = "key",
        sections: bool = False,
    ) -> None:
        """A problem for each key of `table` not in `known`, with the closest known key
        (or where else the key belongs, `elsewhere`) as a hint."""
        known = list(known)
        for name in table:
            if name in known:
                continue
            if sections:
                what = "section" if isinstance(table[name], dict) else "key"
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            if close:
                hint = f'; did you mean "{close[0]}"?'
            elif elsewhere and name in elsewhere:
                hint = f"; did you mean {elsewhere[name]}?"
            else:
                hint = f" (known: {', '.join(known)})"
            self.problem(join_key(prefix, name), f"unknown {what}{hint}")

    def table(self, value: Any, key: str) -> dict[str, Any] | None:
        if isinstance(value, dict):
            return value
        self.problem(key, f"expected a table, got {describe(value)}")
        return None

    def tables(self, raw: Mapping[str, Any], name: str) -> list[tuple[str, dict[str, Any]]]:
        """(key, table) of an array of tables such as `[[mailboxes]]`; [] when absent."""
        value = raw.get(name, [])
        if not isinstance(value, list):
            self.problem(name, f"expected an array of tables ([[{name}]]), got {describe(value)}")
            return []
        out = []
        for i, item in enumerate(value):
            key = f"{name}[{i}]"
            if isinstance(item, dict):
                out.append((key, item))
            else:
                self.problem(key, f"expected a table, got {describe(item)}")
        return out

    def _missing(self, table: Mapping[str, Any], name: str, prefix: str, required: bool) -> bool:
        if name in table:
            return False
        if required:
            self.problem(join_key(prefix, name), "missing required key")
        return True

    def string(
        self,
        table: Mapping[str, Any],
        name: str,
        prefix: str,
        *,
        default: str | None = None,
        required: bool = False,
        nonempty: bool = False,
    ) -> str | None:
        if self._missing(table, name, prefix, required):
            return default
        value = table[name]
        if not isinstance(value, str):
            self.problem(join_key(prefix, name), f"expected a string, got {describe(value)}")
            return default
        if nonempty and not value.strip():
            self.problem(join_key(prefix, name), "must not be empty")
            return default
        return value

    def choice(
        self,
        table: Mapping[str, Any],
        name: str,
        prefix: str,
        choices: Sequence[str],
        default: str | None,
        *,
        required: bool = False,
        context: str = "",
    ) -> str | None:
        value = self.string(table, name, prefix, required=required)
        if value is None:
            return default
        if value in choices:
            return value
        options = ", ".join(f'"{c}"' for c in choices)
        close = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
        hint = f'; did you mean "{close[0]}"?' if close else ""
        self.problem(
            join_key(prefix, name),
            f"expected one of {options}{context}, got {describe(value)}{hint}",
        )
        return default

    def ident(self, table: Mapping[str, Any], name: str, prefix: str, *, kind: str) -> str | None:
        value = self.string(table, name, prefix, required=True)
        if value is None:
            return None
        try:
            return validate_id(kind, value)
        except ValueError as exc:
            self.problem(join_key(prefix, name), str(exc))
            return None

    def integer(
        self,
        table: Mapping[str, Any],
        name: str,
        prefix: str,
        default: int,
        *,
        minimum: int,
        maximum: int | None = None,
    ) -> int:
        if self._missing(table, name, prefix, False):
            return default
        value = table[name]
        key = join_key(prefix, name)
        if isinstance(value, bool) or not isinstance(value, int):
            self.problem(key, f"expected an integer, got {describe(value)}")
            return default
        if value < minimum or (maximum is not None and value > maximum):
            bounds = (
                f"between {minimum} and {maximum}" if maximum is not None else f"at least {minimum}"
            )
            self.problem(key, f"must be {bounds}, got {value}")
            return default
        return value

    def number(self, table: Mapping[str, Any], name: str, prefix: str, default: float) -> float:
        """A duration or rate: a finite number greater than 0 (integers accepted)."""
        if self._missing(table, name, prefix, False):
            return default
        value = table[name]
        key = join_key(prefix, name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.problem(key, f"expected a number, got {describe(value)}")
            return default
        if not math.isfinite(value) or value <= 0:
            self.problem(key, f"must be a number greater than 0, got {describe(value)}")
            return default
        return float(value)

    def secret(self, value: Any, key: str) -> Secret | None:
        """The Secret for a value that must be a reference; None (and a problem that does
        not quote the value) otherwise. Resolved once when checking secrets."""
        reason = secret_ref_error(value)
        if reason is not None:
            self.problem(key, reason)
            return None
        secret = Secret(str(value).strip())
        if self.options.check_secrets:
            try:
                secret.reveal(self.options.environ)  # the value is dropped at once
            except SecretError as exc:
                self.problem(key, str(exc))
        return secret

    def freeze(self, table: Mapping[str, Any], prefix: str) -> Mapping[str, Any]:
        """A read-only deep copy of free-form provider settings; credentials (by key name,
        `secrets.is_secret_key`) checked and wrapped in `Secret`, literals dropped."""
        out: dict[str, Any] = {}
        for name, value in table.items():
            key = join_key(prefix, name)
            out[name] = (
                self.secret(value, key) if is_secret_key(name) else self._freeze_value(value, key)
            )
        return MappingProxyType(out)

    def _freeze_value(self, value: Any, key: str) -> Any:
        if isinstance(value, dict):
            return self.freeze(value, key)
        if isinstance(value, list):
            return tuple(self._freeze_value(v, f"{key}[{i}]") for i, v in enumerate(value))
        return value


def relative_to(base: Path, text: str) -> Path:
    """`text` as a path, relative to `base` unless absolute; `..` resolved so that
    messages and logs show the directory actually meant."""
    path = Path(text).expanduser()
    if path.is_absolute():
        return path
    joined = base / path
    return joined.resolve() if ".." in path.parts else joined


def join_key(prefix: str, name: str) -> str:
    """The key path of `name` inside the table at `prefix` ("" for the top level)."""
    return f"{prefix}.{name}" if prefix else name


def describe(value: Any) -> str:
    """A value for a message: strings quoted and cut short, containers by kind.
    Never used for a value that may be a secret."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        shown = value if len(value) <= _DESCRIBE_MAX_CHARS else value[:_DESCRIBE_MAX_CHARS] + "…"
        return json.dumps(shown, ensure_ascii=False)
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, datetime | date | time):
        return f"a date/time ({value.isoformat()})"
    return type(value).__name__
