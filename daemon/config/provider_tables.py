"""Provider tables of a tenant file (`[gmail]`, `[outlook]`) and the mailboxes that use them.

A door whose mailboxes share a tenant table has its adapter's config classes check
both, called here so that check-config names the file and key (daemon/config/tenant.py
reads the rest of a tenant file). The keys they read are their dataclasses' fields,
checked here first so that an unknown key gets a "did you mean" hint like every other
table. A credential whose reference was already reported stands in as `_REPORTED`, so
the adapter checks the table's other keys instead of reporting it twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass, fields
from typing import Any

from inboxd.adapters.gmail.config import GmailMailbox, GmailSettings
from inboxd.adapters.gmail.errors import GmailConfigError
from inboxd.adapters.outlook.config import OutlookMailbox, OutlookSettings
from inboxd.adapters.outlook.errors import OutlookConfigError
from inboxd.daemon.config.reader import Reader, join_key
from inboxd.daemon.config.secrets import Secret

__all__ = ["TABLE_DOORS", "TableDoor", "parse_tables", "table_mailbox"]


@dataclass(frozen=True)
class TableDoor:
    """A provider whose mailboxes share a tenant table (module docstring)."""

    table: str
    settings: Any  # from_settings(Mapping) -> settings
    mailbox: Any  # from_settings(Mapping, address=) -> mailbox with check_against(settings)
    error: type[ValueError]

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self.settings))

    @property
    def mailbox_keys(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self.mailbox) if f.name != "address")


TABLE_DOORS = {
    "gmail": TableDoor("gmail", GmailSettings, GmailMailbox, GmailConfigError),
    "outlook": TableDoor("outlook", OutlookSettings, OutlookMailbox, OutlookConfigError),
}
# Stands in for a credential whose reference was already reported (freeze keeps None).
_REPORTED = Secret("env:INBOXD_REPORTED_ABOVE")


def parse_tables(r: Reader, raw: dict[str, Any]) -> dict[str, Mapping[str, Any]]:
    """Each provider table present, frozen (secrets as `Secret`) and checked by its
    adapter's settings class."""
    tables: dict[str, Mapping[str, Any]] = {}
    for name, door in TABLE_DOORS.items():
        table = r.table(raw[name], name) if name in raw else None
        if table is None:
            continue
        keys = door.keys
        r.unknown_keys(table, keys, name)
        frozen = r.freeze({k: v for k, v in table.items() if k in keys}, name)
        try:
            door.settings.from_settings(with_stand_ins(frozen))
        except door.error as exc:
            _adapter_problem(r, name, exc)
        tables[name] = frozen
    return tables


def table_mailbox(
    r: Reader,
    door: TableDoor,
    extra: Mapping[str, Any],
    prefix: str,
    address: str,
    table: Mapping[str, Any] | None,
    generic_keys: tuple[str, ...],
) -> Mapping[str, Any]:
    """A mailbox's own keys frozen, checked by its adapter against the tenant table."""
    own_keys = door.mailbox_keys
    r.unknown_keys(extra, generic_keys + own_keys, prefix, what=f'key for provider "{door.table}"')
    frozen = r.freeze({k: v for k, v in extra.items() if k in own_keys}, prefix)
    settings = None
    if table is None:
        r.problem(
            join_key(prefix, "provider"),
            f"{'an' if door.table[0] in 'aeiou' else 'a'} {door.table} mailbox needs"
            f" a [{door.table}] table in its file",
        )
    else:
        with suppress(door.error):  # a bad table is reported with the table
            settings = door.settings.from_settings(with_stand_ins(table))
    # An address without "@" is reported by the generic check already.
    checked_address = (address if "@" in address else "reported@invalid") if address else None
    try:
        mailbox = door.mailbox.from_settings(with_stand_ins(frozen), address=checked_address)
    except door.error as exc:
        _adapter_problem(r, prefix, exc)
        return frozen
    try:
        if settings is not None:
            mailbox.check_against(settings)
    except door.error as exc:
        # The fix may be in the tenant table, but this mailbox is what cannot run: name it.
        key, _, message = str(exc).partition(": ")
        r.problem(join_key(prefix, key if key.isidentifier() else "provider"), message)
    return frozen


def with_stand_ins(frozen: Mapping[str, Any]) -> dict[str, Any]:
    """`frozen` with every credential already reported (None) replaced by `_REPORTED`,
    for an adapter's own checks: one problem per mistake, not a second one about the
    same key ("set exactly one of …") after the literal secret was refused."""
    return {k: _REPORTED if v is None else v for k, v in frozen.items()}


def _adapter_problem(r: Reader, prefix: str, exc: ValueError) -> None:
    """An adapter's config error ("key: message") as a problem at `prefix`.key."""
    key, sep, message = str(exc).partition(": ")
    if sep and key.isidentifier():
        r.problem(join_key(prefix, key), message)
    else:
        r.problem(prefix, str(exc))
