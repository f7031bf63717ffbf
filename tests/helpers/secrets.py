"""A secret as a door's config receives it (daemon/config/secrets.py `Secret`), for
tests that build a door's settings by hand: `reveal()` gives the value."""

from __future__ import annotations


class PlainSecret:
    """Holds `value`; revealed on demand, like a resolved `env:`/`file:` reference."""

    def __init__(self, value: str) -> None:
        self.value = value

    def reveal(self) -> str:
        return self.value
